"""`threefold.pipe_split()`: a marker a model's forward can call to pin a pipeline cut.

It is a no-op at run time; in the traced graph it becomes a `threefold::pipe_split` node,
and the pipeline split pass starts a new chunk there.
"""
import torch
import torch.fx

_lib = torch.library.Library("threefold", "DEF")
_lib.define("pipe_split() -> ()")


def _pipe_split_impl():
    return None


for _key in ("CompositeExplicitAutograd", "Meta"):
    _lib.impl("pipe_split", _pipe_split_impl, _key)

PIPE_SPLIT_OP = torch.ops.threefold.pipe_split.default
torch.fx.node.has_side_effect(PIPE_SPLIT_OP)


def pipe_split() -> None:
    """Start a new pipeline chunk here (call inside forward)."""
    torch.ops.threefold.pipe_split()
