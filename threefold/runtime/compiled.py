"""Plan key `compile=inductor`: run each generated chunk through torch.compile/Inductor.

Where it plugs in: the engine calls a chunk module (`ChunkModule.__call__` -> `forward`) for
every forward action, and autograd runs the matching backward. `install` replaces the
instance's `forward` (and `model_outputs`) with a torch.compile'd copy, so Dynamo captures the
chunk's aten ops, AOTAutograd derives the backward graph and Inductor generates C++ (CPU) or
Triton (GPU) for both; the engine's backward call then runs the compiled backward.

Collectives stay correct in one of two ways. Tensor parallelism's (runtime/tp_ops.py's
TRACEABLE functions: f, g, scatter, gather, the vocab-parallel embedding and loss...) are
traced into the graph as functional collectives, so a tp chunk is one graph rather than a
piece between every two collectives (a default GPT at tp=2: 19 graph breaks per forward
before). Every other runtime helper the generated code calls (cp_ops, weight_grad,
random_ops, all_gather_seq, the artifact's fused `kernels` module...) and every ChunkModule
method that talks to other ranks or reads per-microbatch state (rng_seed, step_start, unit,
needs_whole, recompute, experts) is wrapped in torch.compiler.disable, so Dynamo breaks the
graph there and compiles the pieces between them. Either way every rank issues the same
collectives in the same order (the graphs are the same on every rank, and Inductor keeps a
graph's collectives in program order). The wrapping is done on copies of the generated
functions (their globals swapped), so eager chunks in the same process and the
`compile=none` path are untouched and never import torch._dynamo.

Inductor's settings: CPU graphs are compiled with its C++ wrapper (`config_patches`), GPU
graphs with its defaults. Before Inductor sees a CPU graph, materialised attention
(softmax(mask(Q K^T)) V) over 512 keys or more becomes one scaled_dot_product_attention
call (runtime/sdpa_rewrite.py), which Inductor runs as torch's flash kernels. The optimizer
step is the other half of the plan key, built by pm.optimizer (runtime/fused_optimizer.py).

Recomputed regions (plan recompute=...) are compiled too: `recompute` stays an eager
torch.utils.checkpoint call and the region function it reruns is itself compiled.

Falling back: if Inductor cannot compile a graph, forward or backward (an op it does not
lower), that graph runs as the eager FX graph Dynamo captured, with a one-line note; if
Dynamo itself fails on a chunk, the chunk runs eagerly from then on, with a one-line note.
Never a crash.

Caching across steps and runs: within a run Dynamo keeps the compiled code per chunk (the
guards hold across microbatches and steps); across runs Inductor's FX graph cache and
AOTAutograd's cache are on (torch's defaults) in TORCHINDUCTOR_CACHE_DIR, which threefold
points at the user's cache, `$XDG_CACHE_HOME/threefold/inductor` (default
`~/.cache/threefold/inductor`), unless the user set it.
"""
from __future__ import annotations

import copy
import functools
import math
import os
import sys
import types
from datetime import timedelta

import torch
import torch.distributed as dist

from threefold.errors import PlanError
from threefold.runtime.comm import MAX_TIMEOUT_S, default_timeout, in_graph_failure, wait_grace
from threefold.runtime.module import ChunkModule

# ChunkModule methods that communicate or read per-microbatch Python state: eager always.
_EAGER_METHODS = ("rng_seed", "step_start", "unit", "needs_whole", "experts", "module_experts")


def cache_dir() -> str:
    """Where Inductor's caches live across runs (set for this process if the user did not)."""
    # lazy: torch's compiler stack loads only for compile=inductor
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    # torch.export (the compiler) already asks Inductor for its cache dir, which writes torch's
    # default (a temp dir) into the environment: that value counts as unset
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not current or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, "threefold", "inductor")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def install(modules: dict[int, ChunkModule], mode: str) -> None:
    """Compile every chunk module of this rank (plan key `compile`; "none" leaves them eager)."""
    if mode == "none":
        return
    cache_dir()
    # lazy: torch's compiler stack loads only for compile=inductor
    import torch._inductor.config as inductor_config
    # compile in this process: no pool of compile workers per rank (2 ranks on 2 cores would
    # each start one), and nothing outlives a rank the launcher stops
    inductor_config.compile_threads = 1
    for chunk, mod in modules.items():
        _compile_chunk(mod, chunk)


def _compile_chunk(mod: ChunkModule, chunk: int) -> None:
    cls = type(mod)
    globals_ = _eager_helpers(cls.forward.__globals__)
    for name in _EAGER_METHODS:
        setattr(mod, name, torch.compiler.disable(getattr(mod, name), recursive=True))
    # the generated class's own methods (forward, model_outputs, recomputed regions, expert
    # bodies), rebound to the globals whose runtime helpers are eager
    for name, fn in vars(cls).items():
        if isinstance(fn, types.FunctionType) and fn.__globals__ is cls.forward.__globals__:
            copy = types.FunctionType(fn.__code__, globals_, fn.__name__, fn.__defaults__, fn.__closure__)
            copy.__kwdefaults__ = fn.__kwdefaults__
            setattr(mod, name, copy.__get__(mod))
    for name in ("forward", "model_outputs"):
        if name in vars(cls):
            setattr(mod, name, CompiledFn(getattr(mod, name), f"chunk {chunk} {name}"))
    regions: dict = {}

    def recompute(fn, *args):
        # the checkpoint call stays eager; the region it runs (and reruns in backward) is compiled
        key = getattr(fn, "__name__", id(fn))
        if key not in regions:
            regions[key] = CompiledFn(fn, f"chunk {chunk} {key}")
        return ChunkModule.recompute(mod, regions[key], *args)
    mod.recompute = torch.compiler.disable(recompute, recursive=False)


def _eager_helpers(globals_: dict) -> dict:
    """A copy of a generated module's globals where every module of threefold's (the runtime's
    helpers, the artifact's fused kernels) is a namespace of torch.compiler.disable'd callables."""
    out = dict(globals_)
    for name, value in globals_.items():
        if isinstance(value, types.ModuleType) and not value.__name__.split(".")[0] in ("torch", "math"):
            out[name] = _EagerNamespace(value)
    return out


class _EagerNamespace:
    """Attribute access to a module, each callable wrapped so Dynamo leaves it eager, but
    the names in the module's TRACEABLE (tp_ops: collectives Dynamo traces as functional ones).

    The wrappers are made here, before any tracing: a torch.compiler.disable call made
    while Dynamo traces the chunk is itself a graph break Dynamo cannot resume from, and the
    chunk's frame then ran uncompiled (tp chunks, whose first helper call is a collective,
    compiled no graph at all: Dynamo's counters, 0 unique graphs)."""

    def __init__(self, module: types.ModuleType):
        self._module = module
        self._wrapped: dict = {}
        traceable = set(getattr(module, "TRACEABLE", ()))
        for name, value in vars(module).items():
            if callable(value) and not isinstance(value, type) and not name.startswith("__"):
                traced = name in traceable
                self._wrapped[name] = value if traced else torch.compiler.disable(value, recursive=True)
                setattr(self, name, self._wrapped[name])

    def __getattr__(self, name: str):   # only names the module gained after install
        value = getattr(self._module, name)
        if not callable(value) or isinstance(value, type):
            return value
        if name not in self._wrapped:
            self._wrapped[name] = torch.compiler.disable(value, recursive=True)
        return self._wrapped[name]


class CompiledFn:
    """`fn` through torch.compile with Inductor, or eager once compiling it has failed."""

    def __init__(self, fn, label: str):
        self.eager = fn
        self.label = label
        self.failed = False
        self.__name__ = getattr(fn, "__name__", label)
        self.compiled = torch.compile(fn, backend=_inductor_or_eager(label))

    def __call__(self, *args):
        if self.failed:
            return self.eager(*args)
        # lazy: torch's compiler stack loads only for compile=inductor
        import torch._dynamo.exc as dynamo_exc
        try:
            return self.compiled(*args)
        except dynamo_exc.TorchDynamoException as exc:
            # Dynamo fails while tracing, before the frame it traces runs: running it eagerly
            # now does every op (and collective) once
            note(f"{self.label} runs eagerly: torch.compile failed on it ({_first_line(exc)})")
            self.failed = True
            return self.eager(*args)
        except RuntimeError as exc:
            failure = in_graph_failure(exc, self.label)
            if failure is None:
                raise
            raise failure from None


def _inductor_or_eager(label: str):
    """A Dynamo backend: Inductor, or the captured FX graph as is where Inductor fails.

    The backward graph is compiled here too, not lazily at the first backward as
    AOTAutograd would (`force_non_lazy_backward_lowering`): a backward Inductor cannot
    compile then falls back like a forward, where lazily it raised inside the engine's
    backward call, past any fallback (the tp=2+sp graphs' all-gathers under the C++ wrapper did)."""
    def backend(gm: torch.fx.GraphModule, example_inputs):
        # lazy: torch's compiler stack loads only for compile=inductor
        import torch._functorch.config as functorch_config
        # lazy: torch's compiler stack loads only for compile=inductor
        from torch._inductor.compile_fx import compile_fx
        gm = _attention_as_sdpa(gm, example_inputs, label)
        try:
            with functorch_config.patch(force_non_lazy_backward_lowering=True):
                return compile_fx(gm, example_inputs, config_patches=config_patches(example_inputs, gm))
        except Exception as exc:   # any lowering failure, forward or backward: keep the graph, eager
            note(f"{label}: a graph runs eagerly: Inductor cannot compile it ({_first_line(exc)})")
            return gm.forward
    return backend


def _attention_as_sdpa(gm: torch.fx.GraphModule, example_inputs, label: str) -> torch.fx.GraphModule:
    """gm with its materialised attention chains as SDPA calls (runtime/sdpa_rewrite.py), on
    CPU graphs: there torch's flash kernel (forward and backward) replaces the two bmm's,
    the [B, H, T, S] scores Inductor writes and saves, and its softmax kernels. Measured
    (one thread, causal mask, BENCHMARKS.md "Wave 10"): the h=256 chunk's F+B 1.02x at 512
    keys, 1.05x at 1024 (the attention alone 1.17x, 1.31x), and no T x T tensor kept for
    backward; at 128 and 256 keys level or slower, so chains with fewer than
    sdpa_rewrite.MIN_KEYS (512) keys stay as written.
    GPU graphs: not measured, left as captured.
    `THREEFOLD_SDPA_REWRITE=0` turns it off (to measure one against the other). The
    rewrite edits a copy of the graph, so a failure leaves the captured graph whole."""
    if not _on_cpu(example_inputs) or os.environ.get("THREEFOLD_SDPA_REWRITE", "1") == "0":
        return gm
    # lazy: start-up: runtime.sdpa_rewrite loads only on this path
    from threefold.runtime import sdpa_rewrite
    try:
        out = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
        return out if sdpa_rewrite.rewrite(out) else gm
    except Exception as exc:   # a chain the rule misread: the graph as captured, with a note
        note(f"{label}: attention left as written: rewriting it to SDPA failed ({_first_line(exc)})")
        return gm


def _on_cpu(example_inputs) -> bool:
    devices = {t.device.type for t in example_inputs if isinstance(t, torch.Tensor)}
    return bool(devices) and devices <= {"cpu"}


def config_patches(example_inputs, gm: torch.fx.GraphModule | None = None) -> dict:
    """Inductor settings for one graph. On CPU: the C++ wrapper (`cpp_wrapper`), which calls
    the graph's kernels and extern BLAS ops from one compiled C++ function instead of a
    Python wrapper issuing them one by one; at our sizes that Python cost ~1.7 ms per
    microbatch (forward + backward call, profiled; default model, 1 thread: median CPU
    ms/step 40.9 -> 39.8, best block 36.5 -> 32.8; BENCHMARKS.md "Wave 8"), unless the
    graph holds a functional collective the C++ wrapper cannot call. GPU graphs keep
    Inductor's defaults."""
    if _on_cpu(example_inputs) and (gm is None or _cpp_wrapper_calls_its_collectives(gm)):
        return {"cpp_wrapper": True}
    return {}


# The functional collectives Inductor's C++ wrapper calls (torch 2.13, tried): a tp chunk's
# all-reduces. Any other one (all_gather_into_tensor: "arg type Any is not yet supported by
# custom_op_wrapper") keeps its graph on the Python wrapper.
_CPP_WRAPPER_COLLECTIVES = {"all_reduce", "wait_tensor"}


def _cpp_wrapper_calls_its_collectives(gm: torch.fx.GraphModule) -> bool:
    """No functional collective outside _CPP_WRAPPER_COLLECTIVES in gm or its subgraphs
    (an autograd.Function's forward and backward are subgraphs of Dynamo's graph)."""
    for mod in gm.modules():
        graph = getattr(mod, "graph", None)
        for node in graph.nodes if isinstance(graph, torch.fx.Graph) else ():
            ns, _, rest = str(node.target).partition(".") if node.op == "call_function" else ("", "", "")
            if ns == "_c10d_functional" and rest.split(".")[0] not in _CPP_WRAPPER_COLLECTIVES:
                return False
    return True


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


def note(text: str) -> None:
    print(f"threefold: compile=inductor: {text}", file=sys.stderr, flush=True)


def compile_timeout() -> timedelta:
    """THREEFOLD_COMPILE_TIMEOUT seconds (default 1800): how long a rank waits for a peer
    during a step that may compile (a first compile on a loaded CPU takes minutes)."""
    text = os.environ.get("THREEFOLD_COMPILE_TIMEOUT", "1800")
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (0 < seconds <= MAX_TIMEOUT_S):
        raise PlanError(f"THREEFOLD_COMPILE_TIMEOUT={text!r} is invalid: give seconds above 0 and at most "
                        f"{MAX_TIMEOUT_S:.0f}, e.g. 1800")
    return max(timedelta(seconds=seconds), default_timeout())


def with_compile_grace(step, groups):
    """engine.step, where a step that may compile waits compile_timeout() for peers.

    Compiling happens inside the first step of each kind (train or forward-only, and the
    batch's shapes), while peers wait on receives and collectives bounded by the process
    group timeout (THREEFOLD_TIMEOUT, 60 s): one rank compiling for longer would read as a
    dead rank. So the first two steps of each kind (Dynamo may recompile once, marking a
    size dynamic) run with every group's timeout raised, and later steps with the usual one."""
    seen: dict = {}
    pgs = [None] + [g for g in list(groups.by_axes.values()) + list(groups.ties.values()) if g is not None]

    def set_timeout(timeout: timedelta | None) -> None:
        wait_grace[:] = [timeout] if timeout is not None else []
        timeout = timeout or default_timeout()
        if not dist.is_initialized():
            return
        done = set()
        for g in pgs:
            pg = g if g is not None else dist.distributed_c10d._get_default_group()
            if id(pg) not in done:
                done.add(id(pg))
                dist.distributed_c10d._set_pg_timeout(timeout, pg)

    @functools.wraps(step)
    def run(batch, train: bool = True, schedule=None, model_outputs: bool = False):
        key = (train, model_outputs, schedule is None,
               tuple(tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in batch))
        seen[key] = seen.get(key, 0) + 1
        if seen[key] > 2:
            return step(batch, train, schedule, model_outputs)
        set_timeout(compile_timeout())
        try:
            return step(batch, train, schedule, model_outputs)
        finally:
            set_timeout(None)
    return run
