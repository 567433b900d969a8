"""threefold: tensor, pipeline, data (ZeRO/HSDP), context and expert parallelism for unmodified
PyTorch models, by compiling them (six mesh axes: pp, dp_replicate, dp_shard, ep, cp, tp)."""
__version__ = "0.1.0"

from threefold.errors import PlanError
from threefold.markers import pipe_split
from threefold.plan import Plan
from threefold.workload import Workload

__all__ = ["Plan", "PlanError", "Workload", "pipe_split", "__version__"]


def __getattr__(name):
    # Heavier entry points load on first use so `import threefold` stays quick.
    if name in ("parallelize", "ParallelModule"):
        from threefold import api   # lazy: `import threefold` stays quick
        return getattr(api, name)
    if name in ("save", "load"):
        from threefold import checkpoint   # lazy: `import threefold` stays quick
        return getattr(checkpoint, name)
    if name == "Sharded":       # the values of pm.state_dict()
        from threefold.checkpoint.layout import Sharded   # lazy: `import threefold` stays quick
        return Sharded
    if name == "launch":
        from threefold.runtime.launch import launch   # lazy: `import threefold` stays quick
        return launch
    if name == "compile":
        from threefold import api   # lazy: as for parallelize
        return api.compile
    raise AttributeError(f"module 'threefold' has no attribute {name!r}")
