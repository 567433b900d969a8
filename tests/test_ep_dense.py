"""ep over experts computed densely (passes/dense_experts.py, runtime/dense_experts.py): a
batched matmul of stacked [E, in, out] expert weights with [E, tokens, in] slices, one per
expert (Llama 4's experts: every token repeated per expert and scaled by its router score).

Found from structure only (a parameter's leading dim E against the other operand's dim 0).
Under dp=2,ep=2 each rank holds E/2 experts, sends each expert's token slice to its rank and
gets the result slice back; the sum over experts runs on the tokens' rank. Losses and every
gradient equal one process over 3 SGD steps (fp32, rtol 1e-5), and a checkpoint stores the
experts whole (saved at ep=2, loaded at dp=2 and at ep=2 again, AdamW)."""
from __future__ import annotations

import re

import pytest
import torch

import threefold
from tests.ep_dense_models import dense_moe
from tests.parity import max_rel_diff, sgd_losses_and_grads

STEPS = 3


def _compile(w: dict, plan: str = "dp=2,ep=2"):
    from threefold.compiler.api import compile_workload
    return compile_workload(w, plan)


@pytest.mark.parametrize("kw", [{}, {"interleaved": True}, {"matmul": True}], ids=["chunk", "interleaved", "matmul"])
def test_dense_experts_are_found_from_structure_and_called_without_offsets(kw):
    prog = _compile(dense_moe(**kw))
    regions = [r for c in prog.chunks for r in c.experts]
    assert [(r["offs"], r["experts"]) for r in regions] == [(None, 4), (None, 4)]
    assert [sorted(r["params"]) for r in regions] == [["moes.0.down", "moes.0.gate_up"],
                                                      ["moes.1.down", "moes.1.gate_up"]]
    # the [E, T, C] token copies (and the per-expert bias slices [E, 1, F], exchanged with them)
    assert all(len(r["rows"]) == (3 if kw.get("interleaved") else 1) for r in regions)
    if kw.get("interleaved"):                               # the slices w[..., ::2] feed the region
        assert all(len(r["weights"]) == 3 for r in regions)
    from threefold.codegen.artifact import build_sources
    src = next(v for k, v in build_sources(prog).items() if k.endswith(".py"))
    assert re.search(r"= self\.experts\(\s*self\._experts_\d+, 4, None,", src), src
    assert all(not c.experts for c in _compile(dense_moe(**kw), "dp=2").chunks)   # no ep: inline


def test_inspect_lists_dense_experts_per_rank_and_their_all_to_all_bytes():
    from threefold.cli.inspect_experts import expert_report
    w = dense_moe()
    report = expert_report(_compile(w), tuple(w["inputs"]) + (w["target"],))
    assert [l["held_by_ep_rank"] for l in report["layers"]] == [[[0, 1], [2, 3]]] * 2
    for layer in report["layers"]:
        assert layer["rows_per_microbatch"] == 4 * 16                  # every expert, every token
        assert layer["all_to_all_bytes"]["forward"] == 2 * 4 * 16 * 32 * 4   # [E, T, C] there and back
        assert layer["tokens_per_expert"] is None


def _reading_down_outside(layers: tuple) -> dict:
    """The dense MoE with the down weight of `layers` also feeding a term outside the experts."""
    w = dense_moe()
    model, inner = w["model"], w["model"].forward

    def forward(idx):
        return inner(idx) + sum(model.moes[k].down.mean() for k in layers)
    model.forward = forward
    return w


def test_a_dense_expert_weight_read_outside_its_experts_stays_inline_or_is_a_one_line_plan_error():
    regions = [r for c in _compile(_reading_down_outside((0,))).chunks for r in c.experts]
    assert [sorted(r["params"]) for r in regions] == [["moes.1.down", "moes.1.gate_up"]]   # layer 0 inline
    with pytest.raises(threefold.PlanError) as err:
        _compile(_reading_down_outside((0, 1)))
    msg = str(err.value)
    assert "\n" not in msg and "moes.0.down" in msg and "outside its expert matmuls" in msg, msg


# -- multi-rank --------------------------------------------------------------------------
def _workload(name: str) -> dict:
    if name == "llama4_text":
        from tests.zoo import ZOO
        return ZOO[name]()
    return dense_moe(**{name: True})


def _rank(names: list[str]) -> list[dict]:
    """dp=2,ep=2: per workload the losses, every gradient this rank holds after each step's
    backward, the expert rows it keeps, and the bytes its expert all-to-alls moved."""
    from tests.a2a_bytes import counting_all_to_all
    torch.set_num_threads(1)
    with counting_all_to_all() as sent:
        out = []
        for name in names:
            torch.manual_seed(1234)
            w = _workload(name)
            full = {f: tuple(p.shape) for f, p in w["model"].named_parameters()}
            pm = threefold.parallelize(w["model"], "dp=2,ep=2", w["inputs"], w["loss_fn"], target=w["target"])
            experts = pm.manifest["experts"]
            held = {f: (tuple(p.shape), full[f]) for f, p in pm.named_parameters() if f in experts}
            opt = pm.optimizer(torch.optim.SGD, lr=0.1)
            losses, grads = [], []
            sent.clear()
            for _ in range(STEPS):
                opt.zero_grad()
                losses.append(pm.step(*w["inputs"], target=w["target"]))
                grads.append({f: p.grad.clone() for f, p in pm.named_parameters() if p.grad is not None})
                opt.step()
            out.append({"losses": losses, "grads": grads, "held": held, "sent": dict(sent)})
        return out


def _reference(name: str):
    torch.manual_seed(1234)
    return sgd_losses_and_grads(_workload(name), STEPS)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dp2_ep2_dense_experts_train_like_one_process_each_rank_holding_half():
    names = ["interleaved", "matmul", "llama4_text"]
    ranks = threefold.launch(_rank, 2, names, timeout=840)
    for k, name in enumerate(names):
        ref_losses, ref_grads = _reference(name)
        a, b = ranks[0][k], ranks[1][k]
        assert a["losses"] == b["losses"], name
        assert max_rel_diff(a["losses"], ref_losses) < 1e-5, (name, a["losses"], ref_losses)
        assert a["held"] and set(a["held"]) == set(b["held"]), name
        for shape, full in list(a["held"].values()) + list(b["held"].values()):
            assert shape[0] * 2 == full[0] and shape[1:] == full[1:], (name, shape, full)   # half the experts
        for step in range(STEPS):
            for fqn, ref in ref_grads[step].items():
                for r, rank in ((a, 0), (b, 1)):
                    got = r["grads"][step][fqn]
                    want = ref[rank * got.shape[0]:(rank + 1) * got.shape[0]] if fqn in r["held"] else ref
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6,
                                               msg=f"{name} {fqn} step {step} rank {rank}")
        # each exchange moves a rank's [E, T, C] slices whole (its own experts' included):
        # E=4 experts x 16 tokens x hidden 32 x 4 B per layer, 2 layers, every step, both ways;
        # the interleaved form's two [E, 1, 24] bias slices go along with the tokens
        slices = STEPS * 2 * 4 * 16 * 32 * 4
        bias = STEPS * 2 * 2 * 4 * 24 * 4 if name == "interleaved" else 0
        for r in (a, b):
            sent = r["sent"]
            assert sent["expert outputs"] == sent["expert outputs gradients"] == slices, (name, sent)
            assert sent["expert tokens"] == sent["expert tokens gradients"] == slices + bias, (name, sent)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_checkpoint_stores_dense_experts_whole_and_loads_under_any_plan(tmp_path):
    import functools
    from tests.parity import adamw_losses, ep_checkpoint_round_trip
    ref = adamw_losses(dense_moe(interleaved=True), 4, 1e-2)
    make = functools.partial(dense_moe, interleaved=True)
    ranks = threefold.launch(ep_checkpoint_round_trip, 2, make, str(tmp_path), timeout=540)
    for losses in ranks:
        assert max_rel_diff(losses, ref[2:] * 2) < 1e-5, (losses, ref)
