"""Loops over time steps under cp (passes/cp_recurrence.py, runtime/cp_recur.py): small models
whose loops cp cannot hand rank to rank (each must be a one-line PlanError naming why), and
the job the multi-rank tests run on local gloo ranks."""
from __future__ import annotations

import torch

from tests.cp_shift_jobs import ShiftMix


class FinalState(ShiftMix):
    """h_t = 0.5 h_{t-1} + x_t from zeros, outputs stacked, and the final state read after the
    loop (added to every position): on a rank, the loop's last step is not the sequence's."""

    def forward(self, idx):
        x = self.emb(idx)
        h, ys = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            h = 0.5 * h + x[:, t]
            ys.append(h)
        return self.head(torch.stack(ys, 1) + h.unsqueeze(1))


class LookAhead(ShiftMix):
    """Each step also reads the next position (x[:, t + 1]): a position the block may not hold."""

    def forward(self, idx):
        x = self.emb(idx)
        h, ys = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            nxt = x[:, t + 1] if t + 1 < x.shape[1] else torch.zeros_like(x[:, 0])
            h = 0.5 * h + x[:, t] + nxt
            ys.append(h)
        return self.head(torch.stack(ys, 1))


class StepCounter(ShiftMix):
    """A decay that depends on the step's number (0.9 ** t): the steps are not one body."""

    def forward(self, idx):
        x = self.emb(idx)
        h, ys = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            h = (0.9 ** t) * h + x[:, t]
            ys.append(h)
        return self.head(torch.stack(ys, 1))


class FirstToken(ShiftMix):
    """CLS pooling: only position 0 is read (no loop)."""

    def forward(self, idx):
        x = self.emb(idx)
        return self.head(x + x[:, 0].unsqueeze(1))


def loop_parity(archs: list, plan: str, steps: int = 3) -> dict:
    """Run on every rank: each zoo arch (2 rows of 8 tokens) under `plan`: (losses, grads)."""
    from tests.cp_factory_models import zoo_grads_parity
    return zoo_grads_parity(archs, plan, steps)


def hf_mamba(seed: int = 0, seq: int = 16) -> dict:
    """Hugging Face's Mamba, tiny, on CPU (its selective scan's recurrent form: a loop over time
    steps, `ssm_state = dA[:, :, t] * ssm_state + dBu[:, :, t]`, outputs stacked on the last dim),
    2 rows of `seq` tokens."""
    import transformers
    from tests.zoo.hf_share import Logits
    from tests.zoo.common import lm_loss, workload
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    cfg = transformers.MambaConfig(vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=2,
                                   intermediate_size=64, conv_kernel=4, use_cache=False)
    model = Logits(transformers.MambaForCausalLM(cfg)).train()
    ids = torch.randint(1, 64, (2, seq + 1), generator=torch.Generator().manual_seed(seed + 1))
    return workload(model, (ids[:, :-1],), ids[:, 1:], lm_loss)


def mamba_parity(plan: str, seq: int, steps: int = 3):
    """Run on every rank: hf_mamba (`seq` tokens) under `plan`, (losses, grads)."""
    from tests.cp_factory_models import parallel
    torch.set_num_threads(1)
    return parallel(hf_mamba(seq=seq), plan, steps)
