"""Jobs the context-parallel tests launch on every rank (importable by spawned ranks)."""
from __future__ import annotations

import torch
import torch.distributed as dist


def ring_vs_full(cp: int, causal: bool, seed: int = 0, masked: bool = False) -> dict:
    """Ring attention on this rank's blocks vs full attention on the whole sequence:
    the max abs difference of the output and of dq, dk, dv on this rank's rows. `masked`:
    with a window + ALiBi bias (rel) and a key-side padding bias (kbias) as well."""
    from threefold.runtime.cp_ops import local_blocks, relative_bias, ring_attention
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(seed)
    s_len = 8 * cp
    q, k, v = (torch.randn(2, 3, s_len, 5, generator=g, dtype=torch.float64) for _ in range(3))
    dout = torch.randn(2, 3, s_len, 5, generator=g, dtype=torch.float64)
    r = dist.get_rank()
    group = dist.new_group(list(range(cp)))
    rel = (-5, 0 if causal else 3, [0.5, 0.25, 0.125], [0.0, 0.1, 0.0], (3,)) if masked else None
    kbias = torch.zeros(2, 1, 1, s_len, dtype=torch.float64)
    kbias[1, ..., s_len - 3:] = float("-inf")            # row 1: its last 3 keys are padding
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    s = full[0] @ full[1].transpose(-2, -1) * 0.3
    if masked:
        pos = torch.arange(s_len)
        s = s + relative_bias(pos, pos, rel, torch.float64) + kbias
    if causal:
        s = s.masked_fill(~torch.tril(torch.ones(s_len, s_len, dtype=torch.bool)), float("-inf"))
    ref = torch.softmax(s, -1) @ full[2]
    ref.backward(dout)
    local = [local_blocks(t, 2, cp, r).clone().requires_grad_() for t in (q, k, v)]
    extra = {"rel": rel, "kbias": local_blocks(kbias, 3, cp, r)} if masked else {}
    out = ring_attention(*local, 0.3, causal, group, ranks=cp, **extra)
    out.backward(local_blocks(dout, 2, cp, r))
    diffs = {"out": (out - local_blocks(ref, 2, cp, r)).abs().max().item()}
    for name, a, b in zip("qkv", local, full):
        diffs["d" + name] = (a.grad - local_blocks(b.grad, 2, cp, r)).abs().max().item()
    return diffs


def ring_checks(cp: int) -> list[dict]:
    """ring_vs_full, causal and not, plain and masked (window + ALiBi + key padding)."""
    return [ring_vs_full(cp, True), ring_vs_full(cp, False, seed=1),
            ring_vs_full(cp, True, seed=2, masked=True), ring_vs_full(cp, False, seed=3, masked=True)]


def parity_cases(cases: list, steps: int) -> list[list[float]]:
    """Each (factory, kwargs, plan): the losses of `steps` SGD steps of the parallel run."""
    import threefold
    from tests.parity import load_workload, parallel_sgd_losses
    torch.set_num_threads(1)
    out = []
    for factory, kwargs, plan in cases:
        w = load_workload(factory, **kwargs)
        pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"])
        out.append(parallel_sgd_losses(pm, w, steps))
    return out


def dropout_seeds(plan: str) -> list:
    """The per-microbatch random-op keys each chunk of this rank used in one step (GPT, dropout
    0.1 outside attention)."""
    import threefold
    from examples.gpt import GPT, GPTConfig, lm_loss
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=16, dropout=0.1))
    model.h[0].attn.attn_dropout.p = 0.0   # ring attention has no dropout (a PlanError); the rest keep 0.1
    idx = torch.randint(0, 32, (2, 17), generator=torch.Generator().manual_seed(1))
    pm = threefold.parallelize(model, plan, (idx[:, :-1],), lm_loss, target=idx[:, 1:])
    pm.step(idx[:, :-1], target=idx[:, 1:])
    return [list(m.rng_key) for m in pm.engine.modules.values()]


def conv_parity(cp: int, steps: int = 3) -> list[float]:
    """A causal-conv1d model (Mamba-style) at cp: SGD losses."""
    import threefold
    from tests.parity import parallel_sgd_losses
    from tests.test_context_parallel import causal_conv_workload
    torch.set_num_threads(1)
    w = causal_conv_workload()
    pm = threefold.parallelize(w["model"], f"cp={cp}", w["inputs"], w["loss_fn"], target=w["target"])
    return parallel_sgd_losses(pm, w, steps)


def ignore_index_workload():
    """GPT whose targets ignore (-100) positions 4-10 and one more: the cp ranks hold
    different numbers of counted tokens, so only a global count gives the right mean."""
    import torch.nn.functional as F
    from examples.gpt import workload
    w = workload(n_layer=2, n_embd=32, n_head=2, seq=16, batch=4)
    target = w["target"].clone()
    target[:, 4:11] = -100   # all in cp rank 1's blocks (positions 4-11) at cp=2
    target[0, 2] = -100
    w["target"] = target
    w["loss_fn"] = lambda logits, t: F.cross_entropy(logits.reshape(-1, logits.size(-1)), t.reshape(-1),
                                                     ignore_index=-100)
    return w


def ignore_index_parity(plan: str, steps: int = 3) -> list[float]:
    import threefold
    from tests.parity import parallel_sgd_losses
    torch.set_num_threads(1)
    w = ignore_index_workload()
    pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"])
    return parallel_sgd_losses(pm, w, steps)


def mask_parity(modes: list, plan: str, steps: int = 3) -> list[list[float]]:
    """Each masked-attention model (tests/cp_mask_models.py; "hf_eager" / "hf_sdpa": HF Llama
    with a padding attention_mask) under `plan`: SGD losses."""
    import threefold
    from tests.cp_mask_models import hf_llama_padded, masked_workload
    from tests.parity import parallel_sgd_losses
    torch.set_num_threads(1)
    out = []
    for mode in modes:
        w = hf_llama_padded(mode[len("hf_"):]) if mode.startswith("hf_") else masked_workload(mode)
        pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"])
        out.append(parallel_sgd_losses(pm, w, steps))
    return out


def mixing_parity(modes: list, plan: str, steps: int = 3) -> list[list[float]]:
    """Each all-gather-fallback model (tests/cp_mask_models.Mixing) under `plan`: SGD losses."""
    import threefold
    from tests.cp_mask_models import mixing_workload
    from tests.parity import parallel_sgd_losses
    torch.set_num_threads(1)
    out = []
    for mode in modes:
        w = mixing_workload(mode)
        pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"])
        out.append(parallel_sgd_losses(pm, w, steps))
    return out


def position_parity(modes: list, plan: str, steps: int = 3) -> list[list[float]]:
    """Each position-table model (tests/cp_mask_models.PositionTables) under `plan`: SGD losses."""
    import threefold
    from tests.cp_mask_models import position_workload
    from tests.parity import parallel_sgd_losses
    torch.set_num_threads(1)
    out = []
    for mode in modes:
        w = position_workload(mode)
        pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"])
        out.append(parallel_sgd_losses(pm, w, steps))
    return out


def zoo_batch2(arch: str, seq: int | None = None, rows: int = 2) -> dict:
    """A zoo workload with `rows` rows per batch (2: the batch differs from cp=2's local
    length 8/2) and `seq` positions where given."""
    from tests.zoo import ZOO, common
    vocab, batch, length, seed = common.token_batch.__defaults__
    common.token_batch.__defaults__ = (vocab, rows, seq or length, seed)
    try:
        return ZOO[arch]()
    finally:
        common.token_batch.__defaults__ = (vocab, batch, length, seed)


def zoo_parity(archs: list, plan: str, steps: int = 3, seq: int | None = None, rows: int = 2) -> dict:
    """Each zoo arch (`rows` rows, `seq` positions where given) under `plan`: its SGD losses, or
    the PlanError it met."""
    import threefold
    from tests.parity import parallel_sgd_losses
    torch.set_num_threads(1)
    out = {}
    for arch in archs:
        w = zoo_batch2(arch, seq, rows)
        try:
            pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"])
            out[arch] = parallel_sgd_losses(pm, w, steps)
        except threefold.PlanError as exc:
            out[arch] = f"PlanError: {str(exc)[:200]}"
    return out


def grad_norm_after_one_step(factory: str, kwargs: dict, plan: str) -> float:
    """The global gradient norm after one step (cp ranks must not count their shared
    parameters twice)."""
    import threefold
    from tests.parity import load_workload
    torch.set_num_threads(1)
    w = load_workload(factory, **kwargs)
    pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"])
    pm.step(*w["inputs"], target=w["target"])
    return pm.clip_grad_norm_()


def input_seq_dims(prog) -> list:
    """Each user input's sequence dim in a compiled program (its cp placement), None: not split."""
    from threefold.ir.program import tf
    from threefold.placement import on_mesh_of
    return [on_mesh_of(n).dim("cp") for n in prog.chunks[0].gm.graph.nodes
            if n.op == "placeholder" and tf(n).get("kind") == "input"]
