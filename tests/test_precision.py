"""Mixed precision (plan dtype=bf16|fp16) and ZeRO-1 (plan zero=1).

Parity at fp32 under zero=1: the losses of several AdamW (and SGD-momentum) steps equal the
single-process optimizer's at rtol 1e-5. Parity at bf16: the parallel run against the
single-process torch.autocast(bfloat16) run within 4 * sqrt(2) * sigma, sigma the bf16
rounding noise of this model's loss measured per step (tests/precision_runs.rounding_noise):
the two runs are two draws of that noise, so their difference has standard deviation
sqrt(2) * sigma, and 4 of those bound it with ~1e-4 probability of a false failure.
"""
import math

import pytest
import torch

from threefold import Plan, PlanError
from threefold.runtime.launch import launch
from tests.precision_runs import parallel, reference, rounding_noise

GPT = {"n_layer": 4, "n_embd": 64, "n_head": 4, "seq": 16, "batch": 8}
STEPS = 4


# -- quick tier ---------------------------------------------------------------------------
def test_plan_keys_round_trip_and_reject_bad_values():
    p = Plan.parse("tp=2,dp=2,dtype=bf16,zero=1")
    assert (p.dtype, p.zero) == ("bf16", 1) and Plan.parse(str(p)) == p
    assert Plan.parse("dtype=bfloat16").dtype == "bf16" and "dtype" not in str(Plan())
    for bad in ("dtype=int8", "zero=4", "zero=yes"):
        with pytest.raises(PlanError):
            Plan.parse(bad)


def test_loss_scaler_backs_off_on_overflow_and_grows_after_good_steps():
    from threefold.runtime.mixed_precision import LossScaler
    s = LossScaler(init_scale=8.0, growth_interval=2)
    assert not s.unscale_and_check([torch.tensor([1.0, float("inf")])], torch.device("cpu"))
    s.update(False)
    assert s.scale == 4.0 and s.skipped == 1
    g = torch.tensor([8.0])
    assert s.unscale_and_check([g], torch.device("cpu")) and g.item() == 2.0   # unscaled by 4
    s.update(True)
    s.update(True)
    assert s.scale == 8.0


def test_zero_rows_cover_each_parameter_once():
    from threefold.runtime.zero import split_rows
    for shape in ((7, 3), (2,), (), (1, 5), (9,)):
        p = torch.nn.Parameter(torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape))
        for d in (2, 4):
            shards = [split_rows("w", p, d, r) for r in range(d)]
            assert sum(s.count for s in shards) == (shape[0] if shape else 1)
            got = torch.cat([s.shard.detach().reshape(-1) for s in shards])
            assert torch.equal(got, p.detach().reshape(-1))
            assert shards[0].shard.data_ptr() == p.data_ptr()   # a view: updates land in p


def test_zero_state_pieces_of_a_row_parallel_shard():
    """Rows of a tp shard split along dim 1: one chunk at (row start, column start)."""
    from threefold.checkpoint.layout import Piece, Sharded
    from threefold.checkpoint.zero_state import RowsOf
    param = Sharded(torch.zeros(6, 4), 1, [Piece(0, 4, 4)], (6, 8))   # tp rank 1 of 2 on dim 1
    rows = RowsOf(param, 3, 3, torch.ones(3, 4))
    (chunk,) = rows.__create_chunk_list__()
    assert list(chunk.offsets) == [3, 4] and list(chunk.sizes) == [3, 4]
    col = Sharded(torch.zeros(6, 4), 0, [Piece(0, 2, 0), Piece(2, 2, 6)], (12, 4))   # fused blocks
    pieces = RowsOf(col, 1, 2, torch.ones(2, 4)).__create_chunk_list__()
    assert [(list(c.offsets), list(c.sizes)) for c in pieces] == [([1, 0], [1, 4]), ([6, 0], [1, 4])]


# -- multi-rank ---------------------------------------------------------------------------
def _check_zero(world, plans, optimizer):
    ref = reference("gpt", GPT, STEPS, optimizer)
    results = launch(parallel, world, plans, "gpt", GPT, STEPS, optimizer, timeout=500)
    for rank_result in results:
        for r in rank_result:
            rel = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref))
            assert rel < 1e-5, (r["plan"], r["losses"], ref)
            b = r["bytes"]   # AdamW: 2 fp32 moments of 1/d of the rows (+ 4-byte step counters)
            if optimizer == "adamw":
                d = Plan.parse(r["plan"]).dp
                assert abs(b["optimizer"] / b["elements"] - 8 / d) < 0.05 * 8 / d, (r["plan"], b)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("optimizer", ["adamw", "momentum"])
def test_zero1_matches_single_process_optimizer_dp2(optimizer):
    _check_zero(2, ["dp=2,zero=1", "dp=2,m=2,zero=1"], optimizer)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_zero1_matches_adamw_with_tp_and_pp():
    _check_zero(4, ["dp=2,tp=2,zero=1", "dp=2,pp=2,m=2,zero=1", "dp=2,tp=2,sp=true,zero=1",
                    "dp=2,pp=2,m=2,v=2,schedule=interleaved,zero=1"], "adamw")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bf16_matches_single_process_autocast_within_rounding_noise():
    plans = ["dp=2,dtype=bf16", "tp=2,dtype=bf16", "pp=2,m=2,dtype=bf16", "dp=2,zero=1,dtype=bf16",
             "dp=2,zero=3,dtype=bf16"]   # zero=3: 16-bit all-gathers of the parameters
    ref = reference("gpt", GPT, STEPS, "sgd", torch.bfloat16)
    fp32 = reference("gpt", GPT, STEPS, "sgd")
    sigma = rounding_noise("gpt", GPT, STEPS, "sgd", torch.bfloat16, draws=6)
    tol = [4 * math.sqrt(2) * s for s in sigma]
    results = launch(parallel, 2, plans, "gpt", GPT, STEPS, "sgd", timeout=600)
    for r in results[0]:
        diffs = [abs(a - b) for a, b in zip(r["losses"], ref)]
        assert all(d <= t for d, t in zip(diffs, tol)), (r["plan"], diffs, tol)
        assert r["losses"] != fp32, r["plan"]   # it really computed in bf16


def _fp16_overflow(plan):
    import threefold
    from tests.parity import load_workload
    from threefold.runtime.mixed_precision import LossScaler
    torch.set_num_threads(1)
    w = load_workload("gpt", **GPT)
    pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"])
    out = {}
    try:
        pm.step(*w["inputs"], target=w["target"])
    except PlanError as exc:
        out["plain_error"] = str(exc)
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-2, loss_scaler=LossScaler(init_scale=2.0 ** 120))
    before = [p.detach().clone() for p in pm.parameters()]
    losses, applied = [], []
    for _ in range(3):
        opt.zero_grad()
        losses.append(pm.step(*w["inputs"], target=w["target"]))
        applied.append(opt.step())
        if not applied[-1]:
            out.setdefault("unchanged", all(torch.equal(a, p) for a, p in zip(before, pm.parameters())))
    out.update(losses=losses, applied=applied, scale=opt.scaler.scale)
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fp16_skips_overflowing_steps_on_every_rank_and_backs_off():
    results = launch(_fp16_overflow, 2, "dp=2,zero=1,dtype=fp16", timeout=250)
    for r in results:
        assert "pm.optimizer" in r["plain_error"]
        # 2^120 * grads overflows fp16's range (65504): skipped, halved each time, params kept
        assert r["applied"][0] is False and r["unchanged"] is True
        assert r["scale"] <= 2.0 ** 118
    assert len({tuple(r["applied"]) for r in results}) == 1


def _zero_checkpoint_round_trip(root):
    """Train 2 steps under zero=1, save, train 2 more; then a fresh ParallelModule (zero=1,
    and zero=0) loads the checkpoint and trains the same 2 steps."""
    import threefold
    from tests.parity import load_workload
    torch.set_num_threads(1)

    def build(plan):
        w = load_workload("gpt", **GPT)
        pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"])
        return w, pm, pm.optimizer(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)

    def train(w, pm, opt, n):
        out = []
        for _ in range(n):
            opt.zero_grad()
            out.append(pm.step(*w["inputs"], target=w["target"]))
            opt.step()
        return out
    w, pm, opt = build("dp=2,zero=1")
    train(w, pm, opt, 2)
    threefold.save(pm, opt, root, step=2)
    expected = train(w, pm, opt, 2)
    out = {"expected": expected}
    for plan in ("dp=2,zero=1", "dp=2", "dp=2,tp=1,m=2,zero=1"):
        w2, pm2, opt2 = build(plan)
        threefold.load(pm2, opt2, root)
        out[plan] = train(w2, pm2, opt2, 2)
    # fp16: the loss scale reached (here grown every step) is saved and restored
    from threefold.runtime.mixed_precision import LossScaler
    scaled = []
    for _ in range(2):
        w3 = load_workload("gpt", **GPT)
        pm3 = threefold.parallelize(w3["model"], "dp=2,zero=1,dtype=fp16", w3["inputs"], w3["loss_fn"],
                                    target=w3["target"])
        scaled.append((w3, pm3, pm3.optimizer(torch.optim.AdamW, lr=1e-2,
                                              loss_scaler=LossScaler(init_scale=256.0, growth_interval=1))))
    train(*scaled[0], 2)
    threefold.save(scaled[0][1], scaled[0][2], root + "-fp16", step=2)
    threefold.load(scaled[1][1], scaled[1][2], root + "-fp16")
    out["scales"] = (scaled[0][2].scaler.scale, scaled[1][2].scaler.scale, scaled[1][1].engine.loss_scale)
    return out


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_zero1_checkpoint_round_trips_and_loads_under_zero0(tmp_path):
    results = launch(_zero_checkpoint_round_trip, 2, str(tmp_path / "ckpt"), timeout=350)
    for r in results:
        assert r["dp=2,zero=1"] == r["expected"]                  # same plan: bitwise
        for plan in ("dp=2", "dp=2,tp=1,m=2,zero=1"):            # other layouts: fp32 parity
            assert max(abs(a - b) / b for a, b in zip(r[plan], r["expected"])) < 1e-5, (plan, r)
        assert r["scales"] == (1024.0, 1024.0, 1024.0), r["scales"]   # 256 doubled twice, restored


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fp16_matches_single_process_autocast_with_grad_scaler_within_rounding_noise():
    """fp16 with dynamic loss scaling against torch.autocast(float16) + torch.amp.GradScaler
    (same initial scale 2^16 and growth rule), tolerance as for bf16 with fp16's 2^-11."""
    plans = ["dp=2,dtype=fp16", "pp=2,m=2,dtype=fp16", "dp=2,zero=1,dtype=fp16"]
    ref = reference("gpt", GPT, STEPS, "sgd", torch.float16)
    sigma = rounding_noise("gpt", GPT, STEPS, "sgd", torch.float16, draws=6, rel=2.0 ** -11)
    tol = [4 * math.sqrt(2) * s for s in sigma]
    results = launch(parallel, 2, plans, "gpt", GPT, STEPS, "sgd", timeout=600)
    for r in results[0]:
        diffs = [abs(a - b) for a, b in zip(r["losses"], ref)]
        assert all(d <= t for d, t in zip(diffs, tol)), (r["plan"], diffs, tol)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_check_cli_compares_a_bf16_zero1_plan_with_autocast():
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-m", "threefold", "check", "examples/gpt.py:workload",
                          "--plan", "dp=2,zero=1,dtype=bf16", "--steps", "2", "--json"],
                         cwd=root, capture_output=True, text=True, timeout=550)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["ok"] and report["compares"] == "rounding noise"
    assert report["reference"] == "torch.autocast(bf16)" and len(report["tolerance"]) == 2


def _zero_tp_checkpoint(root):
    """zero=1 under tp=2: optimizer state rows of column-, row-parallel and fused q/k/v
    shards; saved, then loaded under zero=0 and under a pipelined zero=1 plan."""
    import threefold
    from tests.parity import load_workload
    torch.set_num_threads(1)

    def build(plan):
        w = load_workload("gpt", **GPT)
        pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"])
        return w, pm, pm.optimizer(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)

    def train(w, pm, opt, n):
        out = []
        for _ in range(n):
            opt.zero_grad()
            out.append(pm.step(*w["inputs"], target=w["target"]))
            opt.step()
        return out
    w, pm, opt = build("dp=2,tp=2,zero=1")
    train(w, pm, opt, 2)
    threefold.save(pm, opt, root, step=2)
    out = {"expected": train(w, pm, opt, 2)}
    for plan in ("dp=2,tp=2", "pp=2,dp=2,m=2,zero=1"):
        w2, pm2, opt2 = build(plan)
        threefold.load(pm2, opt2, root)
        out[plan] = train(w2, pm2, opt2, 2)
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_zero1_tp2_checkpoint_loads_under_other_plans(tmp_path):
    results = launch(_zero_tp_checkpoint, 4, str(tmp_path / "ckpt"), timeout=550)
    for r in results:
        for plan in ("dp=2,tp=2", "pp=2,dp=2,m=2,zero=1"):
            assert max(abs(a - b) / b for a, b in zip(r[plan], r["expected"])) < 1e-5, (plan, r)
