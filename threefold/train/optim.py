"""AdamW with weight decay on matrices only, decided from the graph, not from names.

A parameter's role is what the traced graph does with it, following it through ops that
only change its view or dtype (t, transpose, view, _to_copy, ...):
  * "matmul": a matrix operand of a matmul-like op (linear's and conv's weight, either side
    of mm/bmm/matmul/einsum, addmm's two factors): decayed, as in GPT-2/nanoGPT/Megatron;
  * "embedding": the table of an embedding lookup (also when it is tied to an LM head that
    multiplies with it): not decayed unless asked (`decay_embeddings`);
  * "other": everything else (norm scales and shifts, biases, even addmm's bias, gates,
    position tables read by indexing): never decayed.
The roles are decided at compile time (compiler/param_roles.py) and read from the
manifest, so every rank, and an artifact run, groups its shards the same way; a manifest
without them (an old artifact) falls back to "2-D or more is a matrix".
"""
from __future__ import annotations

import torch

from threefold.roles import EMBEDDING, MATMUL, OTHER


def param_roles(pm) -> dict[str, str]:
    """Roles of this rank's parameters, as the compiler decided them (the manifest's)."""
    roles = dict(pm.manifest.param_roles)
    if not roles:
        return {fqn: MATMUL if p.dim() >= 2 else OTHER for fqn, p in pm.named_parameters()}
    return roles


def decay_split(named_params, roles: dict[str, str], decay_embeddings: bool = False):
    """(decayed, not decayed) parameter lists: matrices fed to matmuls (and embedding tables
    when asked); a parameter the roles do not know falls back to its number of dims."""
    decayed, kept = [], []
    wanted = {MATMUL, EMBEDDING} if decay_embeddings else {MATMUL}
    for fqn, p in named_params:
        role = roles.get(fqn, MATMUL if p.dim() >= 2 else OTHER)
        (decayed if role in wanted and p.dim() >= 2 else kept).append(p)
    return decayed, kept


def adamw(pm, lr: float, weight_decay: float, betas=(0.9, 0.95), decay_embeddings: bool = False,
          roles: dict[str, str] | None = None):
    """AdamW over this rank's shards: two groups (decayed, not), always both, so every rank
    and every plan has the same groups (checkpoints resume under any plan). Built by
    `pm.optimizer`, so zero=1 shards it over dp and fp16 wraps it in loss scaling."""
    roles = param_roles(pm) if roles is None else roles
    decayed, kept = decay_split(pm.named_parameters(), roles, decay_embeddings)
    groups = [{"params": decayed, "weight_decay": weight_decay}, {"params": kept, "weight_decay": 0.0}]
    # fused where torch offers it (runtime/fused_optimizer.py: tried, unfused with a note if
    # refused): one kernel over all parameters instead of a dozen ops per parameter, on CPU
    # 4x faster for the embedded GPT's 50 tensors (0.5 ms against 2.3 ms a step); the same
    # AdamW update, its state dict is the per-parameter one
    kwargs = {"lr": lr, "betas": tuple(betas)}
    if hasattr(pm, "optimizer"):
        return pm.optimizer(torch.optim.AdamW, groups, prefer_fused=True, **kwargs)
    # lazy: start-up: runtime.fused_optimizer loads only on this path
    from threefold.runtime import fused_optimizer
    return fused_optimizer.build(lambda **kw: torch.optim.AdamW(groups, **kw), torch.optim.AdamW, kwargs,
                                 "none", prefer=True)
