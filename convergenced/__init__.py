"""convergenced: agree on the checkpoint every node can restore, without stopping training."""

__version__ = "0.1.0"
