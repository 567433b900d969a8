"""ep over experts held as separate modules (passes/module_experts.py, runtime/expert_modules.py).

Found from data flow only: N >= 2 computations, each with parameters of its own (of one set
of shapes), whose results one op combines (a stack / cat of the pieces, or a sum). Under
dp=2,ep=2 each rank holds only its experts' parameters and runs them on both ranks' inputs;
losses and every gradient equal one process over 3 SGD steps (fp32, rtol 1e-5)."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn

import threefold
from tests.parity import max_rel_diff
from tests.zoo.handwritten_moe_modules import FACTORIES

STEPS = 3


def _compile(w: dict, plan: str = "dp=2,ep=2"):
    from threefold.compiler.api import compile_workload
    return compile_workload(w, plan)


def test_slot_pieces_and_a_dense_sum_are_found_from_data_flow():
    slots = [g for c in _compile(FACTORIES["slot_experts"]()).chunks for g in c.module_experts]
    assert [(g["combine"], g["experts"]) for g in slots] == [("cat", 4)]
    assert all(len(m["inputs"]) == 1 for m in slots[0]["members"])          # its own piece
    assert len({m["inputs"][0] for m in slots[0]["members"]}) == 4
    dense = [g for c in _compile(FACTORIES["dense_mixture"]()).chunks for g in c.module_experts]
    assert [(g["combine"], g["experts"]) for g in dense] == [("add", 4)]
    members = dense[0]["members"]
    shared = set.intersection(*(set(m["inputs"]) for m in members))
    assert len(shared) == 1                                                 # every expert reads the tokens
    # the experts are attributes north/south/east/west: found in the order they are applied
    assert [sorted({f.split(".")[0] for f, e in dense[0]["owned"].items() if e == k}) for k in range(4)] == \
        [["north"], ["south"], ["east"], ["west"]]


def test_without_ep_nothing_is_searched_and_generated_code_calls_the_experts():
    prog = _compile(FACTORIES["slot_experts"](), "dp=2")
    assert all(not c.module_experts for c in prog.chunks)
    from threefold.codegen.artifact import build_sources
    src = next(v for k, v in build_sources(_compile(FACTORIES["dense_mixture"]())).items() if k.endswith(".py"))
    assert src.count("= self.module_experts(") == 2          # forward and model_outputs (pm(x))
    assert "def _mexperts_0_3(" in src and "EXPERT_MODULES = {" in src


def test_inspect_lists_module_experts_per_rank_and_their_all_to_all_bytes():
    from threefold.cli.inspect_experts import expert_report, format_experts
    w = FACTORIES["dense_mixture"]()
    report = expert_report(_compile(w), tuple(w["inputs"]) + (w["target"],))
    [layer] = report["layers"]
    assert layer["held_by_ep_rank"] == [[0, 1], [2, 3]] and layer["separate_modules"]
    tokens = 2 * 8 * 16 * 4                    # one rank's [2, 8, 16] fp32 tokens
    gates = 2 * 8 * 1 * 4                      # each expert's router weight [2, 8, 1]
    # the tokens once to each of 2 ranks, 4 gate slices, 4 results back
    assert layer["all_to_all_bytes"]["forward"] == 2 * tokens + 4 * gates + 4 * tokens
    assert "  4  2  -  " in format_experts(report)


def test_groups_ep_cannot_split_exactly_are_one_line_plan_errors():
    class ReadOutside(nn.Module):   # expert hidden values also feed an extra term
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(32, 16), nn.Linear(16, 32)
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, idx):
            x = self.emb(idx)
            pa = self.a(x)
            return self.head(torch.tanh(pa) + torch.tanh(self.b(x))) * pa.sum(-1, keepdim=True)

    class Dropping(nn.Module):     # a random op inside each expert
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(32, 16), nn.Linear(16, 32)
            self.experts = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5)) for _ in range(2))

        def forward(self, idx):
            x = self.emb(idx)
            return self.head(sum(e(x) for e in self.experts))

    idx = torch.randint(0, 32, (4, 9))
    for model, why in ((ReadOutside(), r"linear \(\w+\) of expert 0 is also read outside it"),
                       (Dropping(), r"of expert 0 draws random numbers")):
        w = {"model": model.train(), "inputs": (idx[:, :-1],), "target": idx[:, 1:],
             "loss_fn": lambda y, t: torch.nn.functional.cross_entropy(y.reshape(-1, 32), t.reshape(-1))}
        with pytest.raises(threefold.PlanError) as err:
            _compile(w)
        msg = str(err.value)
        assert "\n" not in msg and re.search(why, msg) and "drop ep" in msg, msg
    with pytest.raises(threefold.PlanError, match=r"has 3 experts \(separate modules\), which ep does not divide"):
        _compile(_three_experts())
    with pytest.raises(threefold.PlanError, match=r"expert 2 reads or gives tensors of other shapes"):
        _compile(FACTORIES["slot_experts"](experts=3))     # 8 positions in pieces of 3, 3 and 2


def _three_experts() -> dict:
    w = FACTORIES["slot_experts"](experts=3)
    w["inputs"], w["target"] = (w["inputs"][0][:, :6],), w["target"][:, :6]   # three pieces of 2
    return w


# -- multi-rank --------------------------------------------------------------------------
def _rank(names: list[str]) -> list[dict]:
    """dp=2,ep=2: per workload the losses, every gradient this rank holds after each step's
    backward, which expert parameters it keeps, and the bytes its expert all-to-alls moved."""
    from tests.a2a_bytes import counting_all_to_all
    torch.set_num_threads(1)
    with counting_all_to_all() as sent:
        out = []
        for name in names:
            w = FACTORIES[name]()
            pm = threefold.parallelize(w["model"], "dp=2,ep=2", w["inputs"], w["loss_fn"], target=w["target"])
            owned = pm.manifest["expert_modules"]
            held = sorted(f for f, p in pm.named_parameters() if f in owned and p.numel())
            opt = pm.optimizer(torch.optim.SGD, lr=0.1)
            losses, grads, norms = [], [], []
            sent.clear()
            for _ in range(STEPS):
                opt.zero_grad()
                losses.append(pm.step(*w["inputs"], target=w["target"]))
                grads.append({f: p.grad.clone() for f, p in pm.named_parameters()
                              if p.numel() and p.grad is not None})
                norms.append(pm.clip_grad_norm_(1e9))    # counts each expert once, on its rank
                opt.step()
            out.append({"losses": losses, "grads": grads, "norms": norms, "held": held, "owned": owned,
                        "sent": dict(sent)})
        return out


def _reference(name: str):
    w = FACTORIES[name]()
    model = w["model"]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads, norms = [], [], []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = w["loss_fn"](model(*w["inputs"]), w["target"])
        loss.backward()
        losses.append(loss.item())
        grads.append({f: p.grad.clone() for f, p in model.named_parameters()})
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
        opt.step()
    return losses, grads, norms


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_dp2_ep2_module_experts_train_like_one_process_each_rank_holding_half():
    names = ["slot_experts", "dense_mixture"]
    ranks = threefold.launch(_rank, 2, names, timeout=360)
    for k, name in enumerate(names):
        ref_losses, ref_grads, ref_norms = _reference(name)
        a, b = ranks[0][k], ranks[1][k]
        assert a["losses"] == b["losses"], name
        assert max_rel_diff(a["losses"], ref_losses) < 1e-5, (name, a["losses"], ref_losses)
        for r in (a, b):
            assert max_rel_diff(r["norms"], ref_norms) < 1e-5, (name, r["norms"], ref_norms)
        owned = a["owned"]
        assert set(owned) and not set(a["held"]) & set(b["held"]), name       # each expert on one rank
        assert set(a["held"]) | set(b["held"]) == set(owned), name
        assert {owned[f][0] for f in a["held"]} == {0, 1} and {owned[f][0] for f in b["held"]} == {2, 3}, name
        for step in range(STEPS):
            for fqn, ref in ref_grads[step].items():
                got = [r["grads"][step][fqn] for r in (a, b) if fqn in r["grads"][step]]
                assert got, (name, fqn)              # dense on both ranks, an expert's on its own
                for g in got:
                    torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-6, msg=f"{name} {fqn} step {step}")
        # inspect's bytes per layer and microbatch (forward) are what the exchanges moved
        from threefold.cli.inspect_experts import expert_report
        w = FACTORIES[name]()
        report = expert_report(_compile(w), tuple(w["inputs"]) + (w["target"],))
        forward = sum(l["all_to_all_bytes"]["forward"] for l in report["layers"])
        for r in (a, b):
            sent = r["sent"]
            assert sent["expert module inputs"] + sent["expert module outputs"] == STEPS * forward, (name, sent)
            assert sent["expert module inputs gradients"] + sent["expert module outputs gradients"] == \
                STEPS * forward, (name, sent)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_checkpoint_stores_each_module_expert_whole_from_its_rank_and_loads_under_any_plan(tmp_path):
    from tests.parity import adamw_losses, ep_checkpoint_round_trip
    ref = adamw_losses(FACTORIES["dense_mixture"](), 4, 1e-2)
    ranks = threefold.launch(ep_checkpoint_round_trip, 2, FACTORIES["dense_mixture"], str(tmp_path), timeout=360)
    for losses in ranks:
        assert max_rel_diff(losses, ref[2:] * 2) < 1e-5, (losses, ref)


def test_a_top_level_submodule_named_like_a_chunk_method_loads():
    """SlotExperts keeps its experts in `self.experts`, a name ChunkModule's methods use: the
    generated module registers them through _modules and keeps the method."""
    from threefold.codegen.artifact import build_sources
    src = next(v for k, v in build_sources(_compile(FACTORIES["slot_experts"](), "dp=2")).items()
               if k.endswith(".py"))
    scope: dict = {}
    exec(compile(src, "chunk0", "exec"), scope)
    module = next(v for k, v in scope.items() if k.startswith("Chunk") and k != "ChunkModule")()
    assert "experts.0.0.weight" in dict(module.named_parameters()) and callable(module.experts)
