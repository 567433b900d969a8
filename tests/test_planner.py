"""The planner and its performance model: validated against the paper's Table 1 and takeaways.

Narayanan et al., SC'21 (arXiv 2104.04473), Table 1: GPT models with V=51200, s=2048 on
DGX A100 80GB nodes, all with activation recomputation. Each row is (parameters in
billions, heads, hidden, layers, tp, pp, GPUs, global batch, achieved TFLOP/s per GPU).
"""
from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from threefold.cli.main import main
from threefold.errors import PlanError
from threefold.plan import Plan
from threefold.planner.cluster import cluster_from_toml, load_cluster, preset_names
from threefold.planner.constraints import Constraints
from threefold.planner.estimate import Config, estimate
from threefold.planner.gpt_cost import eq3_flops, gpt_model_cost
from threefold.planner.paper_table1 import TABLE1
from threefold.planner.search import best_plan, legal_configs, rank_plans
from threefold.runtime.schedule import make_schedule
from threefold.runtime.simulate import simulate

ROW_IDS = [f"{row[0]}B" for row in TABLE1]
GPT_EXAMPLE = str(Path(__file__).resolve().parent.parent / "examples" / "gpt.py")


@pytest.fixture(scope="module")
def a100():
    return load_cluster("a100-80gb")


def paper_plan(row, cluster):
    """The paper's (tp, pp, dp) with recomputation; b and v left to the planner."""
    _, heads, hidden, layers, tp, pp, gpus, batch, _ = row
    model = gpt_model_cost(layers, hidden, heads)
    plans = rank_plans(model, batch, gpus, cluster, where=Constraints(tp=tp, pp=pp, recompute=True))
    assert plans, "the paper's plan must fit in 80 GB"
    return model, plans[0]


# ---- Table 1 -----------------------------------------------------------------------------
@pytest.mark.parametrize("row", TABLE1, ids=ROW_IDS)
def test_table1_paper_plan_within_15_percent(row, a100):
    model, est = paper_plan(row, a100)
    reported = row[-1]
    assert est.config.dp == row[6] // (row[4] * row[5])
    assert abs(model.params / 1e9 / row[0] - 1) < 0.05                     # the shapes are the paper's
    assert est.tflops_per_gpu == pytest.approx(reported, rel=0.15), (
        f"{row[0]}B: predicted {est.tflops_per_gpu:.1f} TFLOP/s/GPU vs reported {reported}")


@pytest.mark.parametrize("row", TABLE1, ids=ROW_IDS)
def test_table1_best_plan_fits_and_is_at_least_as_fast(row, a100):
    model, paper = paper_plan(row, a100)
    best = best_plan(model, row[7], row[6], a100)
    assert best.fits and best.memory_bytes <= a100.usable_bytes
    assert best.iteration_s <= paper.iteration_s * (1 + 1e-12)
    assert best.config.tp * best.config.pp * best.config.dp == row[6]


def test_compute_follows_eq3(a100):
    """The GEMM FLOPs of the op table are exactly the paper's Eq. 3 (with and without recompute)."""
    for _, heads, hidden, layers, *_ in TABLE1:
        model = gpt_model_cost(layers, hidden, heads)
        per_token = model.layers * model.layer_flops() * 4 + sum(o.flops_split for o in model.post_ops) * 3
        assert per_token * 7 * 2048 == pytest.approx(eq3_flops(7, 2048, layers, hidden, 51200), rel=1e-12)
        per_token = model.layers * model.layer_flops() * 3 + sum(o.flops_split for o in model.post_ops) * 3
        assert per_token * 2048 == pytest.approx(eq3_flops(1, 2048, layers, hidden, 51200, False), rel=1e-12)


def test_memory_model(a100):
    """16 bytes per parameter plus Korthikanti et al.'s sbh(34 + 5as/h) per layer (tp=1, no recompute)."""
    l, h, a, s, V, b = 4, 1024, 16, 512, 1000, 2
    model = gpt_model_cost(l, h, a, V, s)
    est = estimate(model, Config(Plan(), batch=b), a100)
    acts = l * s * b * h * (34 + 5 * a * s / h) + s * b * V * 6
    assert est.memory_bytes == pytest.approx(model.params * 16 + acts, rel=1e-9)
    # Recomputation keeps each layer's input (2sbh) plus one layer's full activations.
    est = estimate(model, Config(Plan(recompute=True), batch=b), a100)
    acts = l * 2 * s * b * h + s * b * h * (34 + 5 * a * s / h) + s * b * V * 6
    assert est.memory_bytes == pytest.approx(model.params * 16 + acts, rel=1e-9)


@pytest.mark.parametrize("pp,m,v", [(4, 8, 1), (4, 8, 2), (4, 16, 4), (8, 16, 2), (3, 9, 3), (4, 2, 1),
                                    (4, 6, 1), (4, 6, 2), (3, 7, 3)])
def test_bubble_formula_matches_simulated_schedule(pp, m, v):
    """The model's (m + (p-1)/v) * t_stage is what the runtime's schedule gives when simulated,
    also when m is not a multiple of pp (the interleaved legality the search uses: m >= pp)."""
    f, b = 1.0, 2.0
    schedule = make_schedule("interleaved" if v > 1 else "1f1b", pp, m, v)
    sim = simulate(schedule, {c: (f / v, b / v) for c in range(pp * v)})
    assert sim.makespan == pytest.approx((m + (pp - 1) / v) * (f + b))


# ---- takeaways ----------------------------------------------------------------------------
def test_tp_stays_within_a_node(a100):
    """Takeaway 1: allowed to span nodes, tp still stops at the node size (paper's Fig. 13:
    a 162B model on 64 GPUs, t*p = 64), and the Table-1 rows keep tp <= 8."""
    model = gpt_model_cost(32, 20480, 128)
    speed = {}
    for tp in (2, 4, 8, 16, 32):
        plans = rank_plans(model, 128, 64, a100, tp_across_nodes=True,
                           where=Constraints(tp=tp, pp=64 // tp, recompute=True))
        # the model's own speed: the shown figure is held at the best measured efficiency
        speed[tp] = plans[0].flops_per_iteration / plans[0].model_s
    assert max(speed, key=speed.get) == a100.gpus_per_node
    assert speed[16] < 0.95 * speed[8] and speed[32] < speed[16]
    for row in TABLE1[3:]:
        model = gpt_model_cost(row[3], row[2], row[1])
        best = best_plan(model, row[7], row[6], a100, tp_across_nodes=True, where=Constraints(recompute=True))
        assert best.config.tp <= a100.gpus_per_node


def test_pipeline_only_as_needed_and_data_parallel_takes_the_rest(a100):
    """Takeaway 2: with the paper's recomputation, the model-parallel size t*p is the smallest
    that fits (within 2x where layer counts force a coarser split) and never above the paper's;
    dp takes the remaining GPUs. Models that fit without pipelining are not pipelined. (The
    paper keeps the whole optimizer state on every rank: zero=0.)"""
    for row in TABLE1:
        model = gpt_model_cost(row[3], row[2], row[1])
        plans = rank_plans(model, row[7], row[6], a100, where=Constraints(recompute=True, zero=0))
        smallest = min(e.config.tp * e.config.pp for e in plans)
        best = plans[0].config
        assert best.tp * best.pp <= min(2 * smallest, row[4] * row[5])
        assert best.dp == row[6] // (best.tp * best.pp)
    for row in TABLE1[:3]:   # the paper's runs keep the whole optimizer state on every rank (no ZeRO)
        model = gpt_model_cost(row[3], row[2], row[1])
        assert best_plan(model, row[7], row[6], a100, where=Constraints(zero=0)).config.pp == 1


def test_more_pipeline_stages_cost_throughput(a100):
    """Paper Fig. 14 (5.9B model, 64 GPUs, t=1): throughput falls as p grows, at every batch."""
    model = gpt_model_cost(32, 3840, 32)
    for batch in (32, 128, 512):
        # the paper's 1F1B: zero-bubble schedules (tests/test_zero_bubble_planner.py) shrink the
        # bubble that makes deeper pipelines slower
        speed = [rank_plans(model, batch, 64, a100, where=Constraints(tp=1, pp=p, schedule="1f1b"))[0].tflops_per_gpu
                 for p in (2, 4, 8, 16, 32)]
        assert speed == sorted(speed, reverse=True)


def test_interleaving_helps_most_at_small_batch(a100):
    """Paper Fig. 12 (175B, 96 GPUs, t=8, p=12): the interleaved schedule's gain shrinks with batch."""
    model = gpt_model_cost(96, 12288, 96)
    gains = []
    for batch in (12, 48, 192, 768):
        plain = rank_plans(model, batch, 96, a100, where=Constraints(tp=8, pp=12, interleave=1, recompute=True))
        best = rank_plans(model, batch, 96, a100, where=Constraints(tp=8, pp=12, recompute=True))
        gains.append(plain[0].iteration_s / best[0].iteration_s)
    assert gains == sorted(gains, reverse=True)
    assert gains[0] > 1.2 and gains[-1] < 1.02


# ---- inputs and errors -------------------------------------------------------------------
def test_presets_load():
    assert {"a100-80gb", "h100-80gb", "h200"} <= set(preset_names())
    a100, h100, h200 = (load_cluster(n) for n in ("a100-80gb", "h100-80gb", "h200"))
    assert a100.peak("bf16") == 312e12 and a100.gpus_per_node == 8
    assert a100.intra_node_bandwidth == 300e9 and a100.inter_node_bandwidth == 25e9
    assert h100.peak("bf16") > a100.peak("bf16") and h200.hbm_bytes > h100.hbm_bytes
    with pytest.raises(PlanError, match="dtype 'fp64'"):
        a100.peak("fp64")


GOOD_TOML = """
gpus_per_node = 4
hbm_bytes = 40e9
hbm_bandwidth = 1.5e12
intra_node_bandwidth = 100e9
inter_node_bandwidth = 10e9
matmul_fraction = 0.6
[peak_flops]
bf16 = 100e12
"""


def test_cluster_toml(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(GOOD_TOML)
    c = load_cluster(str(path))
    assert c.gpus_per_node == 4 and c.peak("bf16") == 100e12 and c.kernel_launch_s > 0
    with pytest.raises(PlanError, match="not valid TOML"):
        cluster_from_toml("gpus_per_node = = 4")
    with pytest.raises(PlanError, match="missing hbm_bandwidth"):
        cluster_from_toml(GOOD_TOML.replace("hbm_bandwidth = 1.5e12", ""))
    with pytest.raises(PlanError, match="missing peak_flops"):
        cluster_from_toml(GOOD_TOML.split("[peak_flops]")[0])
    with pytest.raises(PlanError, match="matmul_fraction"):
        cluster_from_toml(GOOD_TOML.replace("0.6", "1.5"))
    with pytest.raises(PlanError, match="hbm_bytes"):
        cluster_from_toml(GOOD_TOML.replace("40e9", '"big"'))
    with pytest.raises(PlanError, match="unknown key"):
        cluster_from_toml(GOOD_TOML.replace("gpus_per_node", "nvlink_gbps = 1\ngpus_per_node"))
    with pytest.raises(PlanError, match="unknown"):
        load_cluster("a100-40gb")
    with pytest.raises(PlanError, match="does not exist"):
        load_cluster(str(tmp_path / "missing.toml"))


def test_bad_inputs(a100):
    model = gpt_model_cost(24, 2304, 24)
    with pytest.raises(PlanError, match="gpus=12"):
        rank_plans(model, 512, 12, a100)
    with pytest.raises(PlanError, match="hidden=100"):
        gpt_model_cost(2, 100, 3)
    with pytest.raises(PlanError, match="no legal plan"):
        rank_plans(model, 7, 16, a100, where=Constraints(tp=1, pp=1))
    with pytest.raises(PlanError, match="fits"):
        best_plan(gpt_model_cost(128, 25600, 160), 8, 8, a100)
    with pytest.raises(PlanError, match="tp\\*pp"):
        rank_plans(model, 512, 32, a100, where=Constraints(tp=8, pp=3))
    for bad in ("tp=0", "sp=true", "tp", "recompute=maybe", "schedule=gpipe"):
        with pytest.raises(PlanError):
            Constraints.parse(bad)


def test_legal_configs_respect_divisibility(a100):
    model = gpt_model_cost(30, 3072, 24)  # 24 heads: tp in {1, 2, 4, 8}
    configs = list(legal_configs(model, 96, 64, a100))
    assert configs and all(24 % c.tp == 0 and c.tp <= 8 and 96 % c.dp == 0 for c in configs)
    assert all(c.interleave == 1 or (30 % (c.pp * c.interleave) == 0 and c.microbatches >= c.pp)
               for c in configs)
    assert any(c.interleave > 1 for c in configs)


def test_plan_round_trip(a100):
    best = best_plan(gpt_model_cost(48, 8192, 64), 1536, 512, a100)
    plan = best.config.plan
    assert isinstance(plan, Plan) and Plan.parse(str(plan)) == plan and plan.world_size == 512
    again = rank_plans(gpt_model_cost(48, 8192, 64), 1536, 512, a100, where=Constraints.parse(str(plan)))
    assert again[0].config == best.config


# ---- the command --------------------------------------------------------------------------
SHAPE = ["--layers", "48", "--hidden", "8192", "--heads", "64", "--batch", "1536", "--gpus", "512"]
KEYS = {"tp", "pp", "dp", "microbatch_size", "interleave", "recompute", "predicted_tflops_per_gpu",
        "memory_per_gpu_bytes", "bubble_fraction", "fits"}


def test_cli_json(capsys):
    assert main(["plan", *SHAPE, "--json", "--top", "5"]) == 0
    data = json.loads(capsys.readouterr().out)
    plans = data["plans"]
    assert len(plans) == 5 and all(KEYS <= set(p) for p in plans)
    assert all(p["fits"] is True and p["tp"] * p["pp"] * p["dp"] == 512 for p in plans)
    assert [p["iteration_s"] for p in plans] == sorted(p["iteration_s"] for p in plans)
    types = {"tp": int, "microbatch_size": int, "recompute": bool, "predicted_tflops_per_gpu": float,
             "memory_per_gpu_bytes": int, "bubble_fraction": float, "fits": bool}
    assert all(isinstance(plans[0][k], t) for k, t in types.items())


def test_cli_evaluate(capsys):
    assert main(["plan", *SHAPE, "--json", "--top", "0", "--evaluate", "tp=8,pp=2"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert plans and all(p["tp"] == 8 and p["pp"] == 2 and p["dp"] == 32 for p in plans)
    fitting = [p for p in plans if p["fits"]]
    assert plans[: len(fitting)] == fitting
    assert [p["iteration_s"] for p in fitting] == sorted(p["iteration_s"] for p in fitting)
    # Nothing matching fits: the check runs and fails (exit 1). (With ZeRO-3 over all 512 GPUs
    # even tp=1,pp=1 would fit: 16/512 bytes of state per parameter.)
    assert main(["plan", *SHAPE, "--evaluate", "tp=1,pp=1,zero=0"]) == 1
    capsys.readouterr()


def test_cli_table_and_svg(tmp_path, capsys):
    svg = tmp_path / "best.svg"
    assert main(["plan", "--layers", "8", "--hidden", "1024", "--heads", "16", "--seq", "1024",
                 "--batch", "32", "--gpus", "16", "--evaluate", "pp=4,v=2,tp=1,b=1", "--svg", str(svg)]) == 0
    out = capsys.readouterr().out
    assert "TFLOP/s/GPU" in out and "best: tp=1,pp=4" in out and "why:" in out
    root = ET.parse(svg).getroot()
    boxes = [e for e in root.iter() if e.tag.endswith("title") and e.text[0] in "FB"]
    assert len(boxes) == 2 * 4 * 2 * 8   # F and B per (stage, chunk, microbatch)


@pytest.mark.parametrize("v", [1, 2])
def test_plan_picture_is_the_runtime_simulation_when_m_is_not_a_multiple_of_pp(v, a100):
    """pp=4, m=6: the picture and its bubble are the runtime simulator's (the copied order the
    planner used to draw differed here: 27.5 vs 22.5 units for v=2)."""
    from threefold.planner.timeline import plan_simulation, timeline_svg
    model = gpt_model_cost(8, 1024, 16, seq=1024)
    megatron = "interleaved" if v > 1 else "1f1b"   # zero bubble's pictures: test_zero_bubble_planner.py
    est = rank_plans(model, 24, 16, a100, where=Constraints(tp=1, pp=4, dp=4, microbatches=6, interleave=v,
                                                            schedule=megatron),
                     include_unfit=True)[0]
    assert (est.config.pp, est.config.microbatches, est.config.interleave) == (4, 6, v)
    plan = est.config.plan
    schedule = make_schedule(plan.schedule, 4, 6, v)
    stage = est.stage_times
    expected = simulate(schedule, lambda a: 1e3 * (stage[schedule.stage_of(a.chunk)][a.kind.value == "B"]
                                                   if a.is_compute else est.transfer_s if a.is_send else 0.0))
    sim = plan_simulation(est)
    assert sim.schedule.actions == schedule.actions
    assert sim.start == expected.start and sim.end == expected.end
    assert sim.bubble_fraction == expected.bubble_fraction
    svg = timeline_svg(est)
    assert f"bubble {expected.bubble_fraction:.1%}" in svg
    boxes = [e for e in ET.fromstring(svg).iter() if e.tag.endswith("title") and e.text[0] in "FB"]
    assert len(boxes) == 2 * 4 * v * 6
    # With equal stages and no transfer the simulated makespan is the model's pipeline formula.
    unit = simulate(schedule, {c: (1.0 / v, 2.0 / v) for c in range(4 * v)})
    assert unit.makespan == pytest.approx((6 + 3 / v) * 3)


SHAPE_1T = ["--layers", "128", "--hidden", "25600", "--heads", "160", "--batch", "3072"]


@pytest.mark.parametrize("argv,message", [
    ([*SHAPE, "--cluster", "tpu-v9"], "tpu-v9"),
    ([*SHAPE_1T, "--gpus", "12"], "gpus=12"),
    ([*SHAPE, "--evaluate", "zz=3"], "zz"),
    ([*SHAPE, "--cluster", "nowhere/cluster.toml"], "does not exist"),
    ([f"{GPT_EXAMPLE}:workload", *SHAPE], "not both"),
    ([*SHAPE_1T, "--gpus", "8"], "fits"),
    ([*SHAPE, "--top", "-1"], "--top"),
])
def test_cli_bad_input_exit_2(argv, message, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_cli_malformed_cluster_file(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text("gpus_per_node = [\n")
    assert main(["plan", *SHAPE, "--cluster", str(path)]) == 2
    assert "not valid TOML" in capsys.readouterr().err


def test_cli_needs_a_model(capsys):
    assert main(["plan", "--batch", "8", "--gpus", "8"]) == 2
    assert "--layers" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--layers", "2", "--hidden", "64", "--heads", "4", "--gpus", "8"])   # no --batch
    assert exc.value.code == 2
    capsys.readouterr()


def test_cli_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--batch", "--gpus", "--cluster", "--evaluate", "--json", "--svg", "--tp-across-nodes",
                 "a100-80gb", "h200"):
        assert flag in text


# ---- models from a SPEC -------------------------------------------------------------------
def test_spec_model_cost_matches_gpt_shape(a100):
    from threefold.planner.spec_cost import model_cost_from_spec
    spec = model_cost_from_spec(f"{GPT_EXAMPLE}:workload(n_layer=3,n_embd=64,n_head=4,vocab_size=96,seq=16)")
    shape = gpt_model_cost(3, 64, 4, 96, 16)
    assert spec.layers == 3 and spec.seq_len == 16 and spec.tied_embedding
    assert spec.layer_flops() == pytest.approx(shape.layer_flops(), rel=0.02)   # + bias adds
    assert spec.layer_params == shape.layer_params
    assert spec.tp_allreduce_bytes == shape.tp_allreduce_bytes and spec.boundary_bytes == shape.boundary_bytes
    assert 4 in spec.tp_divides
    best = best_plan(spec, 64, 8, a100)
    assert best.fits and 4 % best.config.tp == 0


def test_spec_without_tracer_is_a_plan_error(monkeypatch):
    from threefold.planner.spec_cost import model_cost_from_spec
    monkeypatch.setitem(sys.modules, "threefold.compiler.trace", None)
    with pytest.raises(PlanError, match="SPEC models need the tracer"):
        model_cost_from_spec(f"{GPT_EXAMPLE}:workload")


class _SquareBlock(torch.nn.Module):
    """A residual MLP whose two projections are both square (hidden -> hidden): from shapes
    alone both look like row-parallel projections into the residual stream; the compiler makes
    `up` column-parallel and `down` row-parallel."""

    def __init__(self, h):
        super().__init__()
        self.norm = torch.nn.LayerNorm(h)
        self.up = torch.nn.Linear(h, h)
        self.down = torch.nn.Linear(h, h)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class _SquareMLP(torch.nn.Module):
    def __init__(self, vocab=64, h=32, layers=3):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, h)
        self.blocks = torch.nn.ModuleList(_SquareBlock(h) for _ in range(layers))
        self.head = torch.nn.Linear(h, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _lm_loss(logits, target):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def test_spec_cost_reads_the_compilers_tensor_parallel_decisions():
    from threefold.compiler.trace import trace
    from threefold.passes.tensor_parallel import tensor_parallel
    from threefold.planner.model_cost import ACT_BYTES
    from threefold.planner.spec_cost import model_cost_from_program
    torch.manual_seed(0)
    h, ids = 32, torch.randint(0, 64, (4, 9))
    inputs, target = (ids[:, :-1],), ids[:, 1:]
    traced = trace(_SquareMLP(h=h), inputs, target, _lm_loss)
    cost = model_cost_from_program(traced, inputs, "square-mlp")
    compiled = tensor_parallel(trace(_SquareMLP(h=h), inputs, target, _lm_loss, Plan(tp=2)))
    sharded = set(compiled.shard_fns)
    assert {"blocks.0.up.weight", "blocks.0.up.bias", "blocks.0.down.weight"} <= sharded
    assert "blocks.0.down.bias" not in sharded and "blocks.0.norm.weight" not in sharded
    # One all-reduce per layer (after `down`), not one per hidden-sized matmul output (2).
    assert cost.tp_allreduces_per_layer == 1 and cost.tp_allreduce_bytes == h * ACT_BYTES
    # Replicated parameters are those the pass does not cut: the norm and down's bias (3h, not 4h).
    assert cost.layer_params_repl == 3 * h
    block0 = [f for f in traced.state if f.startswith("blocks.0.")]
    assert cost.layer_params_repl == sum(traced.state[f].numel() for f in block0 if f not in sharded)
    # The GELU between the projections runs on shards although its last dim is the hidden size;
    # it is priced as the fusion pass's kernel (with up's bias add), as a GPU run executes it.
    gelu = next(op for op in cost.layer_ops if "gelu" in op.name)
    assert gelu.name.startswith("fused_")
    assert gelu.bytes_split > 0 and gelu.bytes_repl == 0 and gelu.flops_repl == 0
    norm = next(op for op in cost.layer_ops if op.name.endswith("layer_norm"))
    assert norm.bytes_split == 0 and norm.flops_split == 0
    # tp must divide the sizes the pass split (the hidden size here), so tp=64 is not legal.
    assert h in cost.tp_divides


def test_compiler_and_runtime_import_nothing_from_the_planner():
    """The planner reads the compiler and the runtime, never the other way; nothing but the
    CLI imports it (the manifest carries what training needs: roles, model FLOPs)."""
    import subprocess
    code = ("import sys, pkgutil, importlib\n"
            "for pkg in ('compiler', 'passes', 'codegen', 'runtime', 'train', 'checkpoint', 'dataset'):\n"
            "    p = importlib.import_module('threefold.' + pkg)\n"
            "    for m in pkgutil.iter_modules(p.__path__): importlib.import_module(f'threefold.{pkg}.{m.name}')\n"
            "bad = [m for m in sys.modules if m.startswith('threefold.planner')]\n"
            "assert not bad, bad\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_training_reads_no_compiler_ir():
    """After compile, the training loop and checkpoints read the manifest, not the compiler."""
    import subprocess
    code = ("import sys, pkgutil, importlib\n"
            "for pkg in ('train', 'checkpoint', 'runtime'):\n"
            "    p = importlib.import_module('threefold.' + pkg)\n"
            "    for m in pkgutil.iter_modules(p.__path__): importlib.import_module(f'threefold.{pkg}.{m.name}')\n"
            "bad = [m for m in sys.modules if m.startswith(('threefold.compiler', 'threefold.passes'))]\n"
            "assert not bad, bad\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_evaluate_reads_plans_in_plans_grammar():
    """--evaluate is a partial threefold.Plan (its keys, aliases and values) plus b."""
    plan = Plan(tp=8, pp=4, dp=2, microbatches=8, interleave=2, schedule="interleaved", recompute=True)
    where = Constraints.parse(str(plan))
    assert (where.tp, where.pp, where.dp, where.microbatches, where.interleave, where.schedule,
            where.recompute) == (8, 4, 2, 8, 2, "interleaved", True)
    assert where.admits(plan, microbatch_size=1) and not where.admits(plan.replace(tp=4), 1)
    partial = Constraints.parse("v=2,b=2,sp=false")   # free pp and schedule: Plan's whole-plan checks wait
    assert (partial.interleave, partial.microbatch_size, partial.pp) == (2, 2, None)
    assert str(partial) == "v=2,b=2"
    for bad, message in (("m=0", "m=0"), ("scatter_gather=false", "scatter_gather"), ("b=x", "b='x'"),
                         ("tp=8,tp", "malformed")):
        with pytest.raises(PlanError, match=message):
            Constraints.parse(bad)
