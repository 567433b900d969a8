"""Jobs run on every rank of a launched cp group for tests/test_cp_attention_bias.py."""
from __future__ import annotations

import torch
import torch.distributed as dist


def ring_bias_vs_full(cp: int, causal: bool, seed: int = 0) -> dict:
    """Ring attention with a learned relative-position bias evaluated per ring step at global
    positions (pbias) and a key padding bias (kbias), vs dense attention over the whole
    sequence: max abs differences of the output, dq, dk, dv on this rank's rows, and of the
    bias table's gradient summed over the ranks."""
    from threefold.runtime.cp_bias import ring_positions
    from threefold.runtime.cp_ops import local_blocks, ring_attention
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(seed)
    s_len, heads = 8 * cp, 3
    q, k, v, dout = (torch.randn(2, heads, s_len, 5, generator=g, dtype=torch.float64) for _ in range(4))
    table = torch.randn(2 * s_len - 1, heads, generator=g, dtype=torch.float64)
    kbias = torch.zeros(2, 1, 1, s_len, dtype=torch.float64)
    kbias[1, ..., s_len - 3:] = float("-inf")

    def bias(qpos, kpos, t):   # any function of (query, key) positions and a parameter
        return t[kpos[None, :] - qpos[:, None] + s_len - 1].permute(2, 0, 1).unsqueeze(0)

    r = dist.get_rank()
    group = dist.new_group(list(range(cp)))
    full = [x.clone().requires_grad_() for x in (q, k, v, table)]
    pos = torch.arange(s_len)
    s = full[0] @ full[1].transpose(-2, -1) * 0.4 + bias(pos, pos, full[3]) + kbias
    if causal:
        s = s.masked_fill(~torch.tril(torch.ones(s_len, s_len, dtype=torch.bool)), float("-inf"))
    ref = torch.softmax(s, -1) @ full[2]
    ref.backward(dout)
    local = [local_blocks(x, 2, cp, r).clone().requires_grad_() for x in (q, k, v)]
    mine = table.clone().requires_grad_()
    n = s_len // cp
    blocks = [bias(ring_positions(n, 0, group), ring_positions(n, step, group), mine) for step in range(cp)]
    out = ring_attention(*local, 0.4, causal, group, ranks=cp, kbias=local_blocks(kbias, 3, cp, r), pbias=blocks)
    out.backward(local_blocks(dout, 2, cp, r))
    diffs = {"out": (out - local_blocks(ref, 2, cp, r)).abs().max().item()}
    for name, a, b in zip("qkv", local, full):
        diffs["d" + name] = (a.grad - local_blocks(b.grad, 2, cp, r)).abs().max().item()
    dtable = mine.grad.clone()
    dist.all_reduce(dtable, group=group)   # each rank holds its queries' share of the table's gradient
    diffs["dtable"] = (dtable - full[3].grad).abs().max().item()
    diffs["dtable_norm"] = full[3].grad.abs().max().item()
    return diffs


def relbias_parity(modes: list, plan: str, steps: int = 3) -> list:
    """Each tests/cp_bias_models.RelBiasLM mode under `plan`: (losses, grads by name) of
    `steps` SGD steps."""
    import threefold
    from tests.cp_bias_models import relbias_workload, sgd_losses_and_grads
    torch.set_num_threads(1)
    out = []
    for mode in modes:
        w = relbias_workload(mode)
        pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"])
        out.append(sgd_losses_and_grads(lambda: pm.step(*w["inputs"], target=w["target"]),
                                        pm.named_parameters(), steps))
    return out
