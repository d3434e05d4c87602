"""``python -m cuboid.export``: a checkpoint's weights to safetensors or a Hugging Face directory
(:mod:`cuboid.checkpoint.export`)."""

from cuboid.checkpoint import export_main as main
from cuboid.checkpoint import read_model_weights

__all__ = ["main", "read_model_weights"]

if __name__ == "__main__":
    main()
