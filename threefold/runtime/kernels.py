"""Run-time side of the generated fused kernels (the artifact's `kernels.py` imports this).

Every fused kernel works on its output viewed as a matrix [M, N] (N = the last dim) cut
into tiles of [BLOCK_M, BLOCK_N]; "row" kernels (softmax, norms, rotary) need whole rows,
so BLOCK_N >= N. Each operand reaches the kernel in one of five patterns against the
output shape, fixed at compile time and checked again here at run time:

  full     same shape as the output              offset = row * N + col
  col      varies only along the last dim (bias) offset = col
  row      varies only along leading dims        offset = row
  scalar   one element                           offset = 0
  general  any other broadcast                   offset from per-dim strides (0 = broadcast)

Whether a call runs Triton or the eager ATen ops: CUDA tensors run Triton; CPU tensors run
eager, unless THREEFOLD_KERNELS=triton and TRITON_INTERPRET=1 (Triton's interpreter, used by
the tests). THREEFOLD_KERNELS=eager forces eager everywhere. A call whose shapes or dtypes
do not match what the kernel was generated for also runs eager.

This module must not import threefold.compiler, threefold.passes or threefold.codegen.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass, field

import torch

# The eager path and the compiler work without Triton. Only asked whether it is installed:
# importing it costs ~70 MB per process, paid only where a generated kernel is launched.
HAVE_TRITON = importlib.util.find_spec("triton") is not None

MAX_ROW = 32768          # widest row a row kernel keeps in registers; wider runs eager
ROW_TILE = 4096          # elements per tile for row kernels (BLOCK_M * BLOCK_N, at least one row)
EW_TILE = 4096           # elements per tile for elementwise kernels
EW_MAX_BLOCK_N = 512     # widest column block of an elementwise tile

launches = {"triton": 0}   # how many Triton launches were prepared (tests check the path taken)


# ---- dispatch ---------------------------------------------------------------------
def kernels_mode() -> str:
    """THREEFOLD_KERNELS: 'auto' (default), 'triton' or 'eager'."""
    return os.environ.get("THREEFOLD_KERNELS", "auto").strip().lower() or "auto"


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip() == "1"


def use_triton(kernel, *tensors) -> bool:
    """True when this call should launch `kernel` (a @triton.jit function) rather than run
    the eager ops."""
    mode = kernels_mode()
    if mode == "eager" or not HAVE_TRITON:
        return False
    ts = [t for t in tensors if isinstance(t, torch.Tensor)]
    if not ts or any(t.is_meta for t in ts):
        return False
    if all(t.is_cuda for t in ts):
        return True
    if any(t.is_cuda for t in ts):
        return False                      # mixed devices: let eager raise its usual error
    if mode == "triton" and interpreting() and type(kernel).__name__ == "InterpretedFunction":
        _interpret_triton_library()     # (a kernels.py imported before TRITON_INTERPRET=1 was
        return True                     # set holds compiled kernels: those run eager on CPU)
    return False


_INTERPRETED: dict = {}


def _interpret_triton_library() -> None:
    """Let an interpreted kernel call Triton's own library (tl.sum, tl.rand, tl.cdiv, ...).

    `triton.jit` picks compiled or interpreted when it runs, so the library is fixed when
    triton is first imported (torch.export imports it). A kernels.py imported later with
    TRITON_INTERPRET=1 is interpreted, but its calls into the compiled library would raise.
    Calling a compiled JITFunction from Python is otherwise always an error, so while
    TRITON_INTERPRET=1 we run such calls through the interpreter instead.
    """
    from triton.runtime.interpreter import InterpretedFunction   # lazy: triton loads only for fused kernels
    from triton.runtime.jit import JITFunction   # lazy: triton loads only for fused kernels
    if getattr(JITFunction, "_threefold_interpretable", False):
        return
    compiled_call = JITFunction.__call__

    def call(self, *args, **kwargs):
        if not interpreting():
            return compiled_call(self, *args, **kwargs)
        fn = _INTERPRETED.get(self.fn)
        if fn is None:
            fn = _INTERPRETED[self.fn] = InterpretedFunction(self.fn)
        return fn(*args, **kwargs)

    JITFunction.__call__ = call
    JITFunction._threefold_interpretable = True


def or_else(tensor, fallback):
    """A pointer for a gradient the kernel will not write (its NEED flag is False)."""
    return fallback if tensor is None else tensor


def new_seed() -> int:
    """A dropout seed drawn from torch's CPU generator (so torch.manual_seed governs it)."""
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


# ---- operand patterns -------------------------------------------------------------
def pattern_of(shape, out_shape) -> str:
    """How an operand of `shape` broadcasts against the output `out_shape` (see the docstring)."""
    shape, out_shape = tuple(int(s) for s in shape), tuple(int(s) for s in out_shape)
    n = len(out_shape)
    if len(shape) > n:
        return "invalid"
    padded = (1,) * (n - len(shape)) + shape
    numel = 1
    for s in padded:
        numel *= s
    if n == 0 or numel == 1:
        return "scalar"
    if padded == out_shape:
        return "full"
    if all(s == 1 for s in padded[:-1]) and padded[-1] == out_shape[-1]:
        return "col"
    if padded[-1] == 1 and padded[:-1] == out_shape[:-1]:
        return "row"
    if all(s in (1, o) for s, o in zip(padded, out_shape)):
        return "general"
    return "invalid"


# ---- launches -------------------------------------------------------------------------
@dataclass(frozen=True)
class KernelSpec:
    """What a generated kernel was built for; written into kernels.py next to the kernel."""
    name: str
    patterns: tuple[str, ...]          # per input
    in_dtypes: tuple[torch.dtype, ...]  # per input
    out_dtypes: tuple[torch.dtype, ...]
    ndim: int                          # rank of the output
    row: bool = False                  # needs whole rows in a tile
    pow2_row: bool = False             # needs N to be a power of two (rotate_half)
    dims: bool = False                 # kernel takes the leading dims D0..D{ndim-2}
    seed: bool = False                 # kernel takes a dropout seed
    grad_is_gout: tuple = ()           # per input: index of the output grad that is its grad, or None


@dataclass
class Launch:
    """One call's geometry and integer arguments (no tensors: ctx keeps it for backward)."""
    spec: KernelSpec
    shape: tuple[int, ...]
    in_shapes: tuple[tuple[int, ...], ...]
    args: list = field(default_factory=list)   # M, N, dims..., strides of general operands..., seed
    block_m: int = 1
    block_n: int = 1
    num_warps: int = 4
    grid: tuple = (1, 1)
    bwd_grid: tuple = (1, 1)

    @property
    def meta(self) -> dict:
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "num_warps": self.num_warps}

    def outputs(self, device) -> list[torch.Tensor]:
        return [torch.empty(self.shape, dtype=d, device=device) for d in self.spec.out_dtypes]

    def grad_buffers(self, xs, need) -> list:
        """Per input: the tensor the backward kernel writes its gradient to (or None)."""
        bufs = []
        rows = self.bwd_grid[0]
        n = self.shape[-1] if self.shape else 1
        for k, (x, pat) in enumerate(zip(xs, self.spec.patterns)):
            if not need[k] or not x.is_floating_point() or self._from_gout(k) is not None:
                bufs.append(None)
            elif pat == "full":
                bufs.append(torch.empty(self.shape, dtype=x.dtype, device=x.device))
            elif pat == "col":
                bufs.append(torch.empty((rows, n), dtype=torch.float32, device=x.device))
            else:
                bufs.append(torch.empty(self.shape, dtype=torch.float32, device=x.device))
        return bufs

    def finish_grads(self, bufs, xs, gouts, need) -> list:
        """Turn what the backward kernel wrote into one gradient per input."""
        grads = []
        for k, (buf, x, pat) in enumerate(zip(bufs, xs, self.spec.patterns)):
            src = self._from_gout(k)
            if not need[k] or not x.is_floating_point():
                grads.append(None)
            elif src is not None:
                grads.append(gouts[src].to(x.dtype).view(self.in_shapes[k]))
            elif pat == "full":
                grads.append(buf.view(self.in_shapes[k]))
            elif pat == "col":
                grads.append(buf.sum(0).to(x.dtype).view(self.in_shapes[k]))
            else:
                grads.append(buf.sum_to_size(self.in_shapes[k]).to(x.dtype))
        return grads

    def _from_gout(self, k: int):
        g = self.spec.grad_is_gout
        return g[k] if k < len(g) else None


_PLANS: dict = {}   # (spec, operand shapes/strides/dtypes, device type) -> Launch, or None for eager


def prepare(spec: KernelSpec, xs) -> "tuple[Launch, list[torch.Tensor]] | None":
    """Check the call against `spec` and lay out its operands; None means: run eager.
    The checks and tile choices are cached per operand layout (calls repeat every step)."""
    if len(xs) != len(spec.patterns) or not all(isinstance(x, torch.Tensor) for x in xs):
        return None
    key = (spec, tuple((tuple(x.shape), x.stride(), x.dtype) for x in xs), xs[0].device.type)
    if key not in _PLANS:
        if len(_PLANS) > 4096:
            _PLANS.clear()
        _PLANS[key] = _plan(spec, xs)
    launch = _PLANS[key]
    if launch is None:
        return None
    ops = [x if pat == "general" else x.contiguous() for x, pat in zip(xs, spec.patterns)]
    if spec.seed:   # a fresh dropout mask each call; backward reuses this launch's seed
        launch = dataclasses.replace(launch, args=launch.args + [new_seed()])
    launches["triton"] += 1
    return launch, ops


def _plan(spec: KernelSpec, xs) -> "Launch | None":
    if tuple(x.dtype for x in xs) != spec.in_dtypes:
        return None
    try:
        shape = tuple(torch.broadcast_shapes(*[x.shape for x in xs]))
    except RuntimeError:
        return None
    if len(shape) != spec.ndim or len(shape) == 0:
        return None
    n = shape[-1]
    m = 1
    for s in shape[:-1]:
        m *= s
    if m * n == 0:
        return None
    if spec.row and (n > MAX_ROW or (spec.pow2_row and n != _next_pow2(n))):
        return None
    strides = []
    for x, pat in zip(xs, spec.patterns):
        if pattern_of(x.shape, shape) != pat:
            return None
        if pat == "general":
            strides.extend(int(s) for s in x.expand(shape).stride())
    launch = Launch(spec=spec, shape=shape, in_shapes=tuple(tuple(x.shape) for x in xs))
    launch.args = [m, n] + (list(shape[:-1]) if spec.dims else []) + strides
    _choose_tiles(launch, m, n, xs[0].is_cuda)
    return launch


def _choose_tiles(launch: Launch, m: int, n: int, cuda: bool) -> None:
    if launch.spec.row:
        bn = _next_pow2(n)
        bm = max(1, min(_next_pow2(m), ROW_TILE // bn))
    else:
        bn = min(_next_pow2(n), EW_MAX_BLOCK_N)
        bm = max(1, min(_next_pow2(m), EW_TILE // bn))
    tiles_m, tiles_n = _cdiv(m, bm), _cdiv(n, bn)
    launch.block_m, launch.block_n = bm, bn
    launch.num_warps = 8 if bm * bn >= 4096 else 4
    if bn >= 16384:
        launch.num_warps = 16
    launch.grid = (tiles_m, tiles_n)
    # Backward kernels that sum bias-like gradients keep one partial row per program:
    # a bounded number of programs, each looping over row tiles.
    progs = 4 * _sm_count() if cuda else 4
    launch.bwd_grid = (max(1, min(tiles_m, progs)), tiles_n)


def _sm_count() -> int:
    try:
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    except Exception:  # pragma: no cover - no CUDA
        return 32


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---- eager forms of the synthetic ops fused regions may contain -------------------------
def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """cat(-x[..., h:], x[..., :h]) with the ATen ops the model's own code traces to."""
    aten = torch.ops.aten
    h = x.shape[-1] // 2
    return aten.cat.default([aten.neg.default(aten.slice.Tensor(x, -1, h, 9223372036854775807)),
                             aten.slice.Tensor(x, -1, 0, h)], -1)


def causal_mask(ref: torch.Tensor, form: str, diagonal: int, negate: bool) -> torch.Tensor:
    """The bool mask tril(ones)/triu(ones) of ref's last two dims (negated if asked)."""
    t, s = ref.shape[-2], ref.shape[-1]
    ones = torch.ones((t, s), dtype=torch.bool, device=ref.device)
    mask = torch.tril(ones, diagonal) if form == "tril" else torch.triu(ones, diagonal)
    return ~mask if negate else mask
