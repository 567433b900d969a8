"""Token shifts along the sequence under cp: found by data flow (passes/cp_shifts.py) and run
as a halo exchange (runtime/cp_shift.py), exact forward and backward."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import threefold
from threefold.codegen.artifact import build_sources
from threefold.compiler.api import compile_workload
from threefold.runtime.launch import launch
from tests.cp_shift_jobs import ShiftMix, halo_checks, reference_trace, shift_parity, shift_workload


def _forward_code(w, plan="cp=2,strict=true") -> str:
    return build_sources(compile_workload(w, plan))["chunk00.py"].split("def model_outputs")[0]


def test_token_shifts_become_halo_exchanges():
    """Before: ZeroPad2d((0, 0, 1, -1)) and F.pad of a slice were all-gathered (a PlanError
    under strict=true) and cat([zeros, x[:, :-1]]) refused; now each is one shift_seq."""
    code = _forward_code(shift_workload())
    shifts = [line.split("(")[1].split(",")[1:3] for line in code.splitlines() if "cp_shift.shift_seq(" in line]
    assert sorted((int(k), int(d)) for k, d in shifts) == [(-1, 1), (1, 1), (1, 1), (2, 1)]
    assert "constant_pad_nd" not in code and "aten.cat" not in code and "aten.slice" not in code


class _Leaky(ShiftMix):
    """x[:, :-1] is read twice: by the shift and by a sum over it (which mixes positions)."""

    def forward(self, idx):
        x = self.emb(idx)
        head = x[:, :-1]
        return self.head(x + torch.cat([torch.zeros_like(x[:, :1]), head], 1) + head.sum(1, keepdim=True))


class _Masked(ShiftMix):
    """cat([zeros(2), x[:, 1:-1]]): not one shift (position 1 reads nothing, position 2 reads x[1])."""

    def forward(self, idx):
        x = self.emb(idx)
        return self.head(x + torch.cat([torch.zeros_like(x[:, :2]), x[:, 1:-1]], 1))


@pytest.mark.parametrize("model", [_Leaky, _Masked])
def test_what_is_not_a_whole_shift_stays_refused(model):
    w = shift_workload()
    w["model"] = model()
    with pytest.raises(threefold.PlanError, match="along the sequence") as err:
        compile_workload(w, "cp=2,strict=true")
    assert "\n" not in str(err.value)


def test_a_shift_past_a_block_is_not_a_halo():
    """A shift by 5 at cp=2 of 16 (blocks of 4) reaches two blocks back: no halo (the
    gather fallback, refused under strict=true)."""
    w = shift_workload()
    w["model"].forward = lambda idx, m=w["model"]: m.head(F.pad(m.emb(idx)[:, :-5], (0, 0, 5, 0)))
    with pytest.raises(threefold.PlanError, match="cp=2"):
        compile_workload(w, "cp=2,strict=true")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("cp", [2, 4])
def test_shift_seq_equals_the_whole_shift_forward_and_backward(cp):
    for rank in launch(halo_checks, cp, cp, timeout=550):
        for c in rank:   # float64: a copy, exact
            assert c["forward"] == 0 and c["backward"] == 0, c


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("cp", [2, 4])
def test_token_shift_model_matches_one_process(cp):
    """Losses and every gradient over 3 SGD steps, cp ranks against one process."""
    ref = reference_trace(3)
    for rank in launch(shift_parity, cp, cp, 3, timeout=850):
        for (loss, grads), (ref_loss, ref_grads) in zip(rank, ref):
            assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
            assert grads.keys() == ref_grads.keys()
            for k, g in grads.items():
                assert torch.allclose(g, ref_grads[k], rtol=1e-5, atol=1e-6), k


class _Recurrence(ShiftMix):
    """A recurrence written as a Python loop over time steps (RWKV's WKV on CPU): unrolled."""

    def forward(self, idx):
        x, state, outs = self.emb(idx), None, []
        for t in range(x.shape[1]):
            state = x[:, t] if state is None else 0.5 * state + x[:, t]
            outs.append(state)
        return self.head(torch.stack(outs, 1))


def test_a_recurrence_over_time_steps_is_named_in_one_line():
    w = shift_workload()
    w["model"] = _Recurrence()
    with pytest.raises(threefold.PlanError, match=r"select at t = 0\.\.7, 8 of 8 local positions\): a recurrence "
                                                  "over time steps") as err:
        compile_workload(w, "cp=2")
    assert "\n" not in str(err.value)


class _FirstPosition(ShiftMix):
    """HF's packed-sequence check: position_ids[:, :1] - 1 prepended to a diff of the positions."""

    def forward(self, idx):
        x = self.emb(idx)
        pos = torch.arange(x.shape[1]).unsqueeze(0).expand(x.shape[0], -1)
        starts = (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1).cumsum(-1)
        return self.head(x + starts[..., None].to(x.dtype))


def test_a_slice_of_positions_made_in_the_model_is_computed_whole():
    """Before: "slices along the sequence (... a shift such as x[:, :-1] ...)", which it is not;
    then "slices positions made from arange over the sequence"; now the positions, their first
    one, diff and cumsum are computed whole on every rank (passes/cp_free_whole.py), nothing
    gathered, and cut to this rank's blocks where they meet the tokens."""
    w = shift_workload()
    w["model"] = _FirstPosition()
    prog = compile_workload(w, "cp=2")
    assert not [n for n in prog.notes if n.startswith("cp fallback:")], prog.notes
