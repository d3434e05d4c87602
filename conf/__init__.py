"""Cuboid's Hydra configuration tree, shipped as package data (``pkg://cuboid.conf``)."""
