"""Expert parallelism (plan ep=N): experts found from the graph, tokens moved by all-to-all.

Quick tier: the plan key and mesh, the regions passes/experts.py finds in tiny Mixtral and
a hand-written top-2 MoE, the generated code, and the one-line errors. Slow tier: one
launched 2-rank job that trains tiny Mixtral and the hand-written MoE at dp=2,ep=2 against
one process (3 SGD steps, rtol 1e-5), checks each rank holds half the experts, and that a
rank's all-to-all bytes are the routed rows' (tokens x top-k x hidden, there and back).
The zoo tier runs every MoE config at ep=2, ep=4 and with tp/pp/dp (tests/zoo/matrix.py).
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

import threefold
from threefold.plan import Plan
from tests.parity import max_rel_diff, sgd_losses


def _compile(arch: str, plan: str):
    from tests.zoo import ZOO
    from threefold.compiler.api import compile_workload
    return compile_workload(ZOO[arch](), plan)


def test_plan_key_ep_round_trips_and_sits_inside_dp():
    plan = Plan.parse("tp=2,dp=4,ep=2")
    assert Plan.parse(str(plan)) == plan and plan.world_size == 8
    mesh = plan.mesh
    assert [n for n, _ in mesh.axes] == ["pp", "dp_replicate", "dp_shard", "ep", "tp"]
    assert mesh.group(0, "ep") == [0, 2] and mesh.group(0, "edp") == [0, 4]
    assert mesh.group(0, "dp") == [0, 2, 4, 6]          # the batch is still split over all of dp
    assert [n for n, _ in Plan.parse("dp=2").mesh.axes] == ["pp", "dp_replicate", "dp_shard", "tp"]
    with pytest.raises(threefold.PlanError, match="ep must divide dp"):
        Plan.parse("dp=2,ep=4")
    assert Plan.parse("dp=4,ep=2,zero=3").mesh.dp_shard == 2    # ZeRO shards over edp (tests/test_ep_fsdp.py)


def test_mixtral_expert_regions_are_found_from_the_graph():
    prog = _compile("mixtral", "dp=2,ep=2")
    regions = [r for c in prog.chunks for r in c.experts]
    assert len(regions) == 2                                 # one per MoE layer
    r = regions[0]
    assert r["experts"] == 4 and len(r["rows"]) == 1 and r["others"] == []
    assert set(r["params"]) == {"model.model.layers.0.mlp.experts.gate_up_proj",
                                "model.model.layers.0.mlp.experts.down_proj"}
    from threefold.codegen.artifact import build_sources
    src = next(v for k, v in build_sources(prog).items() if k.endswith(".py"))
    forward, outputs = src.split("def model_outputs(")          # pm(x)'s method runs them too
    assert forward.count("= self.experts(") == 2 and outputs.count("= self.experts(") == 2
    assert "def _experts_0(" in src and "EXPERTS = {" in src


def test_hand_written_top2_moe_is_recognised_without_names():
    prog = _compile("hw_moe_top2", "dp=2,ep=2")
    regions = [r for c in prog.chunks for r in c.experts]
    assert [sorted(r["params"]) for r in regions] == [["moes.0.w_in", "moes.0.w_out"],
                                                      ["moes.1.w_in", "moes.1.w_out"]]


def test_ep_without_experts_or_with_an_indivisible_count_is_a_plan_error():
    with pytest.raises(threefold.PlanError, match="no expert computation found"):
        _compile("llama", "dp=2,ep=2")
    from tests.zoo.handwritten_moe import top2_moe
    from threefold.compiler.api import compile_workload
    with pytest.raises(threefold.PlanError, match="has 3 experts"):
        compile_workload(top2_moe(experts=3), "dp=2,ep=2")


# -- multi-rank --------------------------------------------------------------------------
STEPS = 3


def _rank(archs: list[str]) -> list[dict]:
    """On each rank: dp=2,ep=2 training of each workload; losses, the expert rows this
    rank holds, and the bytes its all-to-alls sent."""
    from tests.zoo import ZOO
    from tests.a2a_bytes import counting_all_to_all
    torch.set_num_threads(1)
    with counting_all_to_all() as sent:
        out = []
        for arch in archs:
            torch.manual_seed(1234)
            w = ZOO[arch]()
            full = {n: p.shape[0] for n, p in w["model"].named_parameters()}
            pm = threefold.parallelize(w["model"], "dp=2,ep=2", w["inputs"], w["loss_fn"], target=w["target"])
            experts = pm.manifest["experts"]
            held = {f: p.shape[0] for f, p in pm.named_parameters() if f in experts}
            logits = pm(*w["inputs"])           # forward only: the model's outputs, this rank's rows
            opt = pm.optimizer(torch.optim.SGD, lr=0.1)
            sent.clear()
            losses, norms = [], []
            for _ in range(STEPS):
                opt.zero_grad()
                losses.append(pm.step(*w["inputs"], target=w["target"]))
                norms.append(pm.clip_grad_norm_(1e9))   # counts each expert once
                opt.step()
            out.append({"losses": losses, "norm": norms[0], "held": held, "full": {f: full[f] for f in held}, "logits": logits,
                        "logits_dim": pm.manifest["output_batch_dims"][0],
                        "sent": dict(sent)})
        return out


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ep2_trains_like_one_process_with_half_the_experts_per_rank():
    from tests.zoo import ZOO
    archs = ["mixtral", "hw_moe_top2"]
    refs, eager, norms = [], [], []
    for arch in archs:
        torch.manual_seed(1234)
        w = ZOO[arch]()
        with torch.no_grad():
            eager.append(w["model"](*w["inputs"]))
        w["loss_fn"](w["model"](*w["inputs"]), w["target"]).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(w["model"].parameters(), 1e9)))
        w["model"].zero_grad()
        refs.append(sgd_losses(w, STEPS))
    ranks = threefold.launch(_rank, 2, archs, timeout=360)
    for k, arch in enumerate(archs):
        a, b = ranks[0][k], ranks[1][k]
        assert a["losses"] == b["losses"], arch
        assert max_rel_diff(a["losses"], refs[k]) < 1e-5, (arch, a["losses"], refs[k])
        whole = torch.cat([a["logits"], b["logits"]], dim=a["logits_dim"])   # pm(x) under ep
        torch.testing.assert_close(whole, eager[k], rtol=1e-5, atol=1e-5)
        assert abs(a["norm"] - norms[k]) / norms[k] < 1e-5, (arch, a["norm"], norms[k])
        assert a["held"] and all(a["held"][f] * 2 == a["full"][f] for f in a["held"]), arch
        # a rank's dispatch sends its routed rows (its tokens x top-2 x hidden, fp32; the
        # all_to_all_single input includes the rows for its own experts), every layer and
        # step; over both ranks, the combine and the two backward exchanges move as much
        tokens, hidden, layers = 4 * 8 // 2, 32, 2
        dispatch = STEPS * layers * tokens * 2 * hidden * 4
        assert a["sent"]["expert tokens"] == b["sent"]["expert tokens"] == dispatch, (arch, a["sent"])
        for what in ("expert outputs", "expert outputs gradients", "expert tokens gradients"):
            assert a["sent"][what] + b["sent"][what] == 2 * dispatch, (arch, what)


def test_inspect_reports_experts_per_rank_tokens_per_expert_and_all_to_all_bytes():
    from tests.zoo import ZOO
    from threefold.cli.inspect_experts import expert_report
    from threefold.compiler.api import compile_workload
    w = ZOO["hw_moe_top2"]()
    report = expert_report(compile_workload(w, "dp=2,ep=2"), tuple(w["inputs"]) + (w["target"],))
    assert report["ep"] == 2 and len(report["layers"]) == 2
    layer = report["layers"][0]
    assert layer["held_by_ep_rank"] == [[0, 1], [2, 3]]
    tokens, top_k, hidden = 4 * 8, 2, 32
    assert sum(layer["tokens_per_expert"]) == tokens * top_k       # the whole example batch
    rows = tokens // 2 * top_k                                       # one rank's microbatch (m=1)
    assert layer["rows_per_microbatch"] == rows
    assert layer["all_to_all_bytes"]["forward"] == 2 * rows * hidden * 4   # there and back, fp32


# -- zoo tier: every MoE config under every ep plan family --------------------------------
ZOO_ARCHS = ["mixtral", "qwen2_moe", "olmoe", "deepseek_v3", "hw_moe_top2", "hw_moe_interleaved", "gpt_oss",
             "qwen3_moe", "granitemoe", "glm4_moe", "ernie4_5_moe", "hunyuan_v1_moe", "deepseek_v2", "flex_olmo",
             # experts held as separate modules (tests/test_ep_modules.py): a dense mixture, Soft MoE
             "hw_moe_softmax",
             # dense experts written as einsum (tests/test_ep_einsum.py): experts on dim 1, Soft MoE slots
             "hw_moe_einsum", "hw_moe_einsum_soft"] + (["soft_moe"] if importlib.util.find_spec("soft_moe_pytorch") else [])
ZOO_PLANS = ["dp=2,ep=2", "dp=4,ep=4", "dp=4,ep=2", "tp=2,dp=2,ep=2", "pp=2,dp=2,ep=2,m=2"]
_cells: dict = {}


@pytest.mark.zoo
@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("plan", ZOO_PLANS)
@pytest.mark.parametrize("arch", ZOO_ARCHS)
def test_moe_zoo_under_ep_matches_single_process(arch, plan):
    from tests.zoo.matrix import run_matrix
    if not _cells:
        _cells.update(run_matrix(ZOO_ARCHS, ZOO_PLANS, log=lambda s: None)["cells"])
    assert _cells[(arch, plan)]["verdict"] == "pass", _cells[(arch, plan)]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ep_checkpoint_holds_experts_as_rows_of_the_full_tensors_and_loads_under_any_plan(tmp_path):
    from tests.parity import adamw_losses, ep_checkpoint_round_trip
    from tests.zoo import ZOO
    torch.manual_seed(1234)
    ref = adamw_losses(ZOO["hw_moe_top2"](), 4, 1e-2)
    ranks = threefold.launch(ep_checkpoint_round_trip, 2, ZOO["hw_moe_top2"], str(tmp_path), timeout=360)
    for losses in ranks:
        assert max_rel_diff(losses, ref[2:] * 2) < 1e-5, (losses, ref)


def test_performance_model_ep_moves_k_over_n_of_tp_bytes_and_has_a_crossover_in_experts():
    from threefold.planner.cluster import load_cluster
    from threefold.planner.moe import MoeShape, crossover_experts
    cluster = load_cluster("h100-80gb")
    shape = MoeShape(tokens=4096, hidden=4096, ffn=1408, experts=64, top_k=2)
    assert crossover_experts(shape, 4, cluster) == 4          # k < n: fewer bytes, fewer kernels
    wide = MoeShape(tokens=4096, hidden=4096, ffn=1408, experts=64, top_k=8)
    e = crossover_experts(wide, 4, cluster)                    # k > n: ep pays in bytes ...
    assert e is not None and e > 4                             # ... until tp's thin experts cost more


def test_data_dependent_expert_loop_is_one_line_plan_error():
    from tests.zoo.handwritten_moe import loop_moe
    from threefold.compiler.api import compile_workload
    with pytest.raises(threefold.PlanError, match=r"where in 1 makes a tensor whose size depends on the data"):
        compile_workload(loop_moe(), "dp=2,ep=2")


def test_module_list_experts_combined_by_no_stack_cat_or_sum_are_refused_in_one_line_naming_the_loop():
    """Experts held as a ModuleList, each applied to its piece of the slots, but combined by
    an elementwise maximum: ep splits such experts only when one stack, cat or sum combines
    them (tests/test_ep_modules.py); the refusal names the loop and the rewrite."""
    import re

    import torch.nn as nn
    import threefold
    from threefold.compiler.api import compile_workload

    class SlotExperts(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(32, 16), nn.Linear(16, 32)
            self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

        def forward(self, idx):
            x = self.emb(idx)                                          # [b, 8 slots, 16]
            pieces = x.chunk(4, dim=1)                                 # 2 slots per expert
            outs = [e(p) for e, p in zip(self.experts, pieces)]
            y = outs[0]
            for o in outs[1:]:
                y = torch.maximum(y, o)                                # [b, 2, 16]
            return self.head(y.repeat(1, 4, 1))

    idx = torch.randint(0, 32, (4, 9))
    w = {"model": SlotExperts(), "inputs": (idx[:, :-1],), "target": idx[:, 1:],
         "loss_fn": lambda y, t: torch.nn.functional.cross_entropy(y.reshape(-1, 32), t.reshape(-1))}
    with pytest.raises(threefold.PlanError) as err:
        compile_workload(w, "dp=2,ep=2")
    msg = str(err.value)
    assert "\n" not in msg and re.search(r"4 separate modules applied one by one .*weight \[16, 16\]", msg), msg
    assert "not combined by one stack, cat or sum" in msg and "stacked [experts, in, out] parameter" in msg
