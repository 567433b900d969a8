"""`ChunkModule`: the base class of every generated per-rank module.

Parameters and buffers are registered under their original FQNs (as a tree of plain
submodules), so `named_parameters()` reads like the user's model and optimizer state and
checkpoints line up. Generated code reads them as locals at the top of forward.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint


class ChunkModule(torch.nn.Module):
    # Filled in by each generated subclass:
    PARAMS: dict[str, tuple[list[int], str]] = {}    # FQN -> (shape, dtype)
    BUFFERS: dict[str, tuple[list[int], str]] = {}
    INPUTS: list[str] = []       # boundary values received, in forward's argument order
    USER_INPUTS: list[int] = []  # batch entries read directly (model inputs, then target)
    OUTPUTS: list[str] = []      # values returned (boundary values sent on, or the loss)
    FROZEN: list[str] = []       # parameters with requires_grad=False in the model
    # last chunk of a model compiled with a loss: batch entries its `model_outputs` method
    # reads (pm(x) returns the model's outputs; codegen/model_outputs.py)
    MODEL_OUTPUT_INPUTS: list[int] = []
    # forward all-gathers sequence shards: run it so that autograd keeps the shards
    # (runtime/saved_shards.py)
    SAVES_SHARDS: bool = False
    # expert parameters (passes/experts.py): FQN -> number of experts along dim 0; under
    # ep=N the runtime keeps this rank's E/N of them (runtime/experts.keep_local_experts)
    EXPERTS: dict[str, int] = {}
    # parameters of experts held as separate modules (passes/module_experts.py): FQN ->
    # [expert, experts]; under ep=N only the expert's rank keeps it (runtime/expert_modules.py)
    EXPERT_MODULES: dict[str, list[int]] = {}
    tp_group = None              # tensor-parallel process group, set by the runtime
    ep_group = None              # expert-parallel process group (None: ep=1), set by the runtime
    cp_group = None              # context-parallel process group (ring attention), set by the runtime
    # (base seed, step, global microbatch): set by the engine before each forward
    rng_key: tuple[int, int, int] = (0, 0, 0)
    # this dp rank's microbatch index in the step, set by the engine before each forward
    microbatch: int = 0
    # zero=3: (the engine's runtime/fsdp.ShardedParams, this chunk's index), set by the engine
    shard_units = None

    def __init__(self, device: torch.device | str = "cpu"):
        super().__init__()
        device = torch.device(device)
        for fqn, (shape, dtype) in self.PARAMS.items():
            t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            param = torch.nn.Parameter(t, requires_grad=fqn not in self.FROZEN)
            self._owner(fqn).register_parameter(fqn.rsplit(".", 1)[-1], param)
        for fqn, (shape, dtype) in self.BUFFERS.items():
            t = torch.zeros(shape, dtype=getattr(torch, dtype), device=device)
            self._owner(fqn).register_buffer(fqn.rsplit(".", 1)[-1], t)
        self._state_cache: dict[str, torch.Tensor] | None = None
        self._step_values: dict[str, torch.Tensor] = {}

    def __call__(self, *args, **kwargs):
        if self.SAVES_SHARDS and torch.is_grad_enabled() and self.tp_group is not None:
            # lazy: start-up: runtime.saved_shards loads only on this path
            from threefold.runtime.saved_shards import keep_shards
            with keep_shards():
                return super().__call__(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    def _owner(self, fqn: str) -> torch.nn.Module:
        module: torch.nn.Module = self
        for part in fqn.split(".")[:-1]:
            # through _modules, not attributes: a model's top-level submodule may share a name
            # with a ChunkModule method (`experts`, `unit`), which keeps the method's name
            if not isinstance(module._modules.get(part), torch.nn.Module):
                module._modules[part] = torch.nn.Module()
            module = module._modules[part]
        return module

    def p(self, fqn: str) -> torch.Tensor:
        """A parameter or buffer by FQN (what generated forward code calls)."""
        cache = self._state_cache
        if cache is None:
            cache = dict(self.named_parameters(remove_duplicate=False))
            cache.update(self.named_buffers(remove_duplicate=False))
            self._state_cache = cache
        return cache[fqn]

    def step_start(self, fqn: str, buf: torch.Tensor) -> torch.Tensor:
        """A buffer forward writes from no batch data (a step counter): the step's first
        microbatch keeps its value and every later one starts from that value again, so
        all compute the same update and it lands once per step, as in one process
        (passes/batch_coupling.py)."""
        if self.microbatch == 0:
            self._step_values[fqn] = buf.detach().clone()
        else:
            with torch.no_grad():
                buf.copy_(self._step_values[fqn])
        return buf

    def unit(self, k: int) -> None:
        """zero=3: layer unit k's parameters are needed now (generated code calls this before
        the layer's first op): wait for their all-gather, prefetch the next layer's."""
        if self.shard_units is not None:
            sharded, chunk = self.shard_units
            sharded.enter(chunk, k)

    def needs_whole(self, param: torch.Tensor) -> None:
        """zero=3: a parameter held outside autograd's saved tensors is about to be read."""
        if self.shard_units is not None:
            self.shard_units[0].ensure_whole(param)

    def rng_seed(self, index: int, per_tp_rank: bool) -> int:
        """The seed of random op `index` for this step and microbatch (runtime/random_ops.py)."""
        # lazy: start-up: runtime.random_ops loads only on this path
        from threefold.runtime.random_ops import mix_seed
        tp_rank = -1
        if per_tp_rank and self.tp_group is not None:
            tp_rank = dist.get_rank(self.tp_group)
        return mix_seed(*self.rng_key, index, tp_rank)

    def recompute(self, fn, *args):
        """Run `fn(*args)` keeping only its inputs for backward, which runs it again
        (activation recomputation, passes/recompute.py). torch.utils.checkpoint restores the
        global RNG state for the rerun; our random ops draw from seeds of (step, microbatch,
        op), and by backward time the engine has moved rng_key on to later microbatches, so
        the rerun is given this forward's key back: dropout draws the same mask."""
        if not torch.is_grad_enabled():
            return fn(*args)
        # lazy: start-up: runtime.memory loads only on this path
        from threefold.runtime.memory import note_held
        note_held(args)   # checkpoint keeps these by reference, not through saved-tensor hooks
        key = self.rng_key

        def replay(*inputs):
            current, self.rng_key = self.rng_key, key
            try:
                return fn(*inputs)
            finally:
                self.rng_key = current
        return checkpoint(replay, *args, use_reentrant=False)

    def experts(self, fn, num_experts: int, offs, rows, weights, others, dims=None):
        """An expert region (generated method `fn`): its rows computed by the ranks that hold
        their experts, moved there and back with all-to-all (runtime/experts.py). `dims`: the
        experts' dim of each row input and output of a dense region, where not all 0."""
        if offs is None:   # experts computed densely, one token slice each (passes/dense_experts.py)
            # lazy: start-up: runtime.dense_experts loads only on this path
            from threefold.runtime.dense_experts import run_dense_experts
            return run_dense_experts(fn, num_experts, rows, weights, others, self.ep_group, dims)
        # lazy: start-up: runtime.experts loads only on this path
        from threefold.runtime.experts import run_experts
        return run_experts(fn, num_experts, offs, rows, weights, others, self.ep_group)

    def module_experts(self, fns, inputs, params):
        """Experts held as separate modules (generated methods `fns`, one per expert): each
        run on the rank holding it, inputs and results moved by all-to-all (runtime/expert_modules.py)."""
        # lazy: start-up: runtime.expert_modules loads only on this path
        from threefold.runtime.expert_modules import run_module_experts
        return run_module_experts(fns, inputs, params, self.ep_group)

    @property
    def device(self) -> torch.device:
        for t in self.parameters():
            return t.device
        for t in self.buffers():
            return t.device
        return torch.device("cpu")

    def _apply(self, fn, recurse=True):
        self._state_cache = None  # .to() / .cuda() replace tensors
        return super()._apply(fn, recurse)

    def load_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy values in by FQN; every parameter and buffer must be given exactly."""
        missing = [k for k in list(self.PARAMS) + list(self.BUFFERS) if k not in tensors]
        if missing:
            raise KeyError(f"{type(self).__name__}: no values for {missing[:5]}")
        with torch.no_grad():
            for fqn in list(self.PARAMS) + list(self.BUFFERS):
                dst, src = self.p(fqn), tensors[fqn]
                if tuple(dst.shape) != tuple(src.shape):
                    raise ValueError(f"{type(self).__name__}: {fqn} has shape {tuple(src.shape)}, "
                                     f"expected {tuple(dst.shape)}")
                dst.copy_(src)
