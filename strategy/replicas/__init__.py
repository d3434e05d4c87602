"""Fault-tolerant replica groups (torchft): data-parallel replicas as separate jobs that keep training when one
dies, and a restarted one heals from a live peer."""

from cuboid.replicas.groups import FaultTolerance, ReplicaGroups

__all__ = ["FaultTolerance", "ReplicaGroups"]
