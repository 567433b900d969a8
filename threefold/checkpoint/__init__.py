"""Checkpoints: sharded save and load (reshardable across plans) over torch.distributed.checkpoint,
and one source of initial weights (agree.py)."""
from threefold.checkpoint.load import load
from threefold.checkpoint.save import save

__all__ = ["load", "save"]
