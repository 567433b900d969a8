"""Workloads whose batch size equals another dim of the inputs (for tests/test_batch_dims_flow.py):
the batch must still be split where the rows are, and the target with them."""
from __future__ import annotations

import torch

from tests.zoo.common import lm_loss, token_batch, workload
from tests.zoo.handwritten_attention import HEADS, NanoGPTAttention, TinyDecoder
from tests.zoo.torch_nn import SeqFirstEncoder


def seq_first_batch_eq_seq(seed: int = 0):
    """[T, B] inputs and targets (nn.TransformerEncoder, batch_first=False) with B == T == 8."""
    torch.manual_seed(seed)
    x, y = token_batch(batch=8, seq=8, seed=seed)
    return workload(SeqFirstEncoder().train(), (x.t().contiguous(),), y.t().contiguous())


def nanogpt_batch(batch: int, seed: int = 0):
    torch.manual_seed(seed)
    x, y = token_batch(batch=batch, seq=8, seed=seed)
    return workload(TinyDecoder(NanoGPTAttention).train(), (x,), y, lm_loss)


FACTORIES = {"seq_first_b8_t8": seq_first_batch_eq_seq,
             "nanogpt_b8_t8": lambda seed=0: nanogpt_batch(8, seed),          # batch == seq
             "nanogpt_b4_h4": lambda seed=0: nanogpt_batch(HEADS, seed)}      # batch == heads


def run(cases: list[tuple[str, str]], steps: int) -> list[dict]:
    """On every rank: each (factory, plan) trained `steps` SGD steps; losses and batch dims."""
    import threefold
    from tests.parity import parallel_sgd_losses
    torch.set_num_threads(1)
    out = []
    for name, plan in cases:
        w = FACTORIES[name]()
        pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"])
        out.append({"losses": parallel_sgd_losses(pm, w, steps), "batch_dims": pm.manifest.get("batch_dims")})
    return out
