"""threefold tensor parallelism against torch.distributed.tensor.parallel, tp=2 on gloo CPU ranks.

The same model (examples/gpt.py, unmodified for threefold, weight tying kept), the same
initial weights, the same batch, run by both systems inside one launched 2-rank job with
their iterations alternating (ABBA order, a barrier on the default group before and after
each timed iteration). Reported:

  * median iteration time (zero_grad + forward + backward + whatever gradient sync each
    needs; no optimizer), threefold / DTensor; goal <= 0.7; also the median of the
    per-iteration ratios ("paired") and the ratio of process CPU time per step;
  * each against the single-process eager step (forward + backward of the whole model on
    the whole batch, one thread): timed in the parent before and after the 2-rank job, and
    on rank 0 as a third contender in the same alternation (rank 1 waits in the barrier),
    which sees the same machine load. Two ranks on two free cores can at best halve it
    (0.5x) where all compute is split; on a shared machine the CPU-time ratio is the one
    that load does not distort;
  * lines of user code each system needs (counted from the functions in the "user code"
    section below, without blank lines, comments and docstrings);
  * communication per transformer layer per microbatch: the all-reduces threefold's
    compiled graph holds (node.meta['tf']['collective']), as ring traffic per rank
    (2n(t-1)/t per all-reduce of n elements), against the paper's 8*b*s*h*(t-1)/t
    (Narayanan et al., SC'21, section 3.5); and both systems' all-reduces counted at run
    time (a dispatch mode that sees c10d and functional collectives);
  * a correctness gate before any timing: both losses equal the single-process loss within
    1e-4 and sampled gradients match it.

    python bench/tp_vs_dtensor.py [--quick | --sweep] [--json] [--profile] [--iters N] [--warmup N]
    python bench/tp_vs_dtensor.py --n-embd 128 --seq 64    # one other size
    --sweep: h = 64, 128, 256 in turn and a summary table; --profile: threefold's time split
    (compute / all-reduce), torch.profiler op table and cProfile of both sides, rank 0

DTensor side: Megatron's split on every block via parallelize_module (attn.c_attn and
mlp.c_fc ColwiseParallel, attn.c_proj and mlp.c_proj RowwiseParallel). The fused QKV
projection needs model edits there: its rows are permuted so each rank's contiguous shard
holds its own q, k and v heads, the head count becomes local (n_head //= tp), and the
attention forward is rewritten with local widths (the original reads C from x.shape and
splits/views with it). Embeddings, ln_f and lm_head stay replicated on the DTensor side
(each rank computes them whole; the tied weight then needs nothing), while threefold splits
them (vocab-parallel embedding and cross-entropy).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import types
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.tp_measure import (CollectiveCounter, code_lines, graph_collectives, op_profile,  # noqa: E402
                              op_table, per_layer_volume, profile)

TP = 2
GOAL = 0.7


@dataclass(frozen=True)
class Config:
    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 4
    vocab_size: int = 96
    seq: int = 128
    batch: int = 8
    warmup: int = 5
    iters: int = 20
    profile: bool = False


QUICK = dict(n_layer=2, n_embd=64, seq=32, batch=4, warmup=3, iters=10)


def build_workload(cfg: Config) -> dict:
    """examples/gpt.py as is (seed 0: every call returns the same weights and batch)."""
    from examples.gpt import workload
    return workload(n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head,
                    vocab_size=cfg.vocab_size, seq=cfg.seq, batch=cfg.batch, seed=0)


# ---- user code: what each system asks of the user (counted) -----------------------------

def threefold_user(model, inputs, loss_fn, target):
    import threefold
    return threefold.parallelize(model, "tp=2", inputs, loss_fn, target=target)


def dtensor_user(model, tp):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (tp,))
    for block in model.h:
        attn = block.attn
        with torch.no_grad():  # rows [q | k | v] -> [q_0 k_0 v_0 | q_1 k_1 v_1]: a shard per rank
            for p in (attn.c_attn.weight, attn.c_attn.bias):
                p.copy_(p.view(3, tp, -1, *p.shape[1:]).transpose(0, 1).reshape(p.shape))
        attn.n_head //= tp
        attn.forward = types.MethodType(dtensor_attention_forward, attn)
        parallelize_module(block, mesh, {
            "attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
            "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()})
    return model


def dtensor_attention_forward(self, x):
    """CausalSelfAttention.forward rewritten for this rank's heads (local widths)."""
    B, T, C = x.shape
    q, k, v = self.c_attn(x).chunk(3, dim=2)           # 3 x (B, T, C/tp): this rank's heads
    hs = q.shape[2] // self.n_head
    q = q.view(B, T, self.n_head, hs).transpose(1, 2)
    k = k.view(B, T, self.n_head, hs).transpose(1, 2)
    v = v.view(B, T, self.n_head, hs).transpose(1, 2)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
    att = att.masked_fill(~self.mask[:, :, :T, :T], float("-inf"))
    att = self.attn_dropout(F.softmax(att, dim=-1))
    y = (att @ v).transpose(1, 2).contiguous().view(B, T, -1)
    return self.resid_dropout(self.c_proj(y))


USER_CODE = {"threefold": [threefold_user], "dtensor": [dtensor_user, dtensor_attention_forward]}


# ---- one rank of the launched job --------------------------------------------------------

def rank_job(cfg: Config, ref: dict) -> dict:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    w = build_workload(cfg)
    t0 = time.perf_counter()
    pm = threefold_user(w["model"], w["inputs"], w["loss_fn"], w["target"])
    compile_s = time.perf_counter() - t0
    dw = build_workload(cfg)
    dmodel = dtensor_user(dw["model"], TP)
    idx, target, loss_fn = w["inputs"][0], w["target"], w["loss_fn"]

    def ours():
        pm.zero_grad()
        return pm.step(idx, target=target)

    def theirs():
        dmodel.zero_grad(set_to_none=True)
        loss = loss_fn(dmodel(idx), target)
        loss.backward()
        return loss.item()

    out = {"rank": rank, "compile_s": compile_s}
    out["check"] = check(ours, theirs, pm, dmodel, ref, rank)
    if not out["check"]["ok"]:
        return out

    counts = {}
    for name, fn in (("threefold", ours), ("dtensor", theirs)):
        dist.barrier()
        with CollectiveCounter() as cc:
            fn()
        counts[name] = cc.summary()
    out["runtime_collectives"] = counts
    if rank == 0:
        out["graph_collectives"] = graph_collectives(pm.program)

    ew = build_workload(cfg) if rank == 0 else None

    def eager():   # the whole batch in one process, one thread (rank 0; rank 1 waits)
        if ew is not None:
            ew["model"].zero_grad(set_to_none=True)
            ew["loss_fn"](ew["model"](*ew["inputs"]), ew["target"]).backward()

    times = {k: [] for k in ("threefold", "dtensor", "eager")}
    cpu = {k: [] for k in times}
    for it in range(cfg.warmup + cfg.iters):
        order = [("threefold", ours), ("dtensor", theirs)]
        if it % 2:
            order.reverse()
        order.insert(it % 3, ("eager", eager))
        for name, fn in order:
            dist.barrier()
            t, c = time.perf_counter(), time.process_time()
            fn()
            c = time.process_time() - c   # this process's CPU (its gloo threads included)
            dist.barrier()
            if it >= cfg.warmup:
                times[name].append(time.perf_counter() - t)
                cpu[name].append(c)
    out["times"], out["cpu"] = times, cpu
    if cfg.profile:
        out["profile"] = {name: profile(fn) for name, fn in (("threefold", ours), ("dtensor", theirs))}
        out["breakdown"] = breakdown(cfg, ours, counts["threefold"])
        out["ops"] = {"threefold": op_profile(ours), "dtensor": op_profile(theirs)}
        if ew is not None:
            out["ops"]["eager"] = op_profile(eager, sync=False)
        dist.barrier()
    return out


def check(ours, theirs, pm, dmodel, ref: dict, rank: int) -> dict:
    """One step of each: losses and sampled gradients against the single-process reference."""
    res = {"loss_eager": ref["loss"]}
    res["loss_threefold"] = ours()
    res["loss_dtensor"] = theirs()
    ours_p = dict(pm.named_parameters())
    theirs_p = dict(dmodel.named_parameters())
    errs = {}
    for fqn, g_ref in ref["grads"].items():
        for side, params in (("threefold", ours_p), ("dtensor", theirs_p)):
            g = params[fqn].grad
            g = g.to_local() if hasattr(g, "to_local") else g
            want = g_ref
            if g.shape != g_ref.shape:       # a column/row shard of this rank
                dim = next(d for d in range(g.dim()) if g.shape[d] != g_ref.shape[d])
                want = g_ref.chunk(TP, dim)[rank]
            errs[f"{side}:{fqn}"] = float((g - want).abs().max() / want.abs().max().clamp_min(1e-12))
    res["grad_rel_err"] = errs
    res["ok"] = (abs(res["loss_threefold"] - ref["loss"]) <= 1e-4 and abs(res["loss_dtensor"] - ref["loss"]) <= 1e-4
                 and max(errs.values()) <= 1e-3)
    return res


def breakdown(cfg: Config, ours, counted: dict, iters: int = 10) -> dict:
    """Where threefold's step goes: CPU of the step, of the same step with every tp all-reduce
    replaced by the copy it makes anyway (compute only, wrong numbers, same work; the small
    cross-entropy and loss all-reduces stay), and of as many bare gloo all-reduces of b*s*h
    floats as the step makes."""
    from threefold.runtime import tp_ops
    real = tp_ops._all_reduce
    n = cfg.batch * cfg.seq * cfg.n_embd
    calls = counted.get("all_reduce", {}).get("sizes", {}).get(str(n), 0)
    buf = torch.randn(n)

    def compute_only():
        tp_ops._all_reduce = lambda x, group: x.contiguous().clone()
        try:
            ours()
        finally:
            tp_ops._all_reduce = real

    def bare():
        for _ in range(calls):
            dist.all_reduce(buf.clone())

    out = {}
    for name, fn in (("step", ours), ("compute_only", compute_only), ("bare_all_reduces", bare)):
        wall, cpu = [], []
        for _ in range(iters):
            dist.barrier()
            t, c = time.perf_counter(), time.process_time()
            fn()
            cpu.append(time.process_time() - c)
            dist.barrier()
            wall.append(time.perf_counter() - t)
        out[name] = {"wall_s": statistics.median(wall), "cpu_s": statistics.median(cpu)}
    out["all_reduce_calls"] = calls
    return out


# ---- parent: eager baseline, reference, report --------------------------------------------

def eager_reference(cfg: Config) -> tuple[dict, callable]:
    w = build_workload(cfg)
    model = w["model"]

    def step():
        model.zero_grad(set_to_none=True)
        loss = w["loss_fn"](model(*w["inputs"]), w["target"])
        loss.backward()
        return loss.item()

    loss = step()
    names = ["wpe.weight", "h.0.ln_1.weight", "h.0.mlp.c_fc.weight", f"h.{cfg.n_layer - 1}.mlp.c_proj.weight"]
    params = dict(model.named_parameters())
    return {"loss": loss, "grads": {n: params[n].grad.detach().clone() for n in names}}, step


def time_eager(step, warmup: int, iters: int) -> dict:
    out = {"wall": [], "cpu": []}
    for i in range(warmup + iters):
        t, c = time.perf_counter(), time.process_time()
        step()
        if i >= warmup:
            out["cpu"].append(time.process_time() - c)
            out["wall"].append(time.perf_counter() - t)
    return out


def _med(xs):
    return statistics.median(xs)


def summarize(cfg: Config, ranks: list[dict], before: dict, after: dict) -> dict:
    r0 = ranks[0]
    s = {"config": asdict(cfg), "tp": TP, "goal_ratio": GOAL, "cores": os.cpu_count(),
         "check": {r["rank"]: r["check"] for r in ranks},
         "compile_s": max(r["compile_s"] for r in ranks)}
    s["lines_of_user_code"] = {side: sum(code_lines(f) for f in fns) for side, fns in USER_CODE.items()}
    s["lines_of_user_code_detail"] = {f.__name__: code_lines(f) for fns in USER_CODE.values() for f in fns}
    if not all(r["check"]["ok"] for r in ranks):
        return s
    tw, cw = r0["times"], r0["cpu"]
    ours, theirs = _med(tw["threefold"]), _med(tw["dtensor"])
    eager_parent = _med(before["wall"] + after["wall"])
    eager_job = _med(tw["eager"])
    cpu_ours = max(_med(r["cpu"]["threefold"]) for r in ranks)    # the busier rank
    cpu_theirs = max(_med(r["cpu"]["dtensor"]) for r in ranks)
    cpu_eager = _med(before["cpu"] + after["cpu"] + cw["eager"])
    s["timing"] = {
        "threefold_s": ours, "dtensor_s": theirs, "ratio": ours / theirs,
        "paired_ratio": _med(a / b for a, b in zip(tw["threefold"], tw["dtensor"])),
        "rank1_ratio": _med(ranks[1]["times"]["threefold"]) / _med(ranks[1]["times"]["dtensor"]),
        "threefold_min_s": min(tw["threefold"]), "dtensor_min_s": min(tw["dtensor"]),
        "eager_parent_s": eager_parent, "eager_parent_before_s": _med(before["wall"]),
        "eager_parent_after_s": _med(after["wall"]), "eager_in_job_s": eager_job,
        "threefold_vs_eager": ours / eager_parent, "dtensor_vs_eager": theirs / eager_parent,
        "threefold_vs_eager_in_job": ours / eager_job, "dtensor_vs_eager_in_job": theirs / eager_job,
        "cpu_threefold_s": cpu_ours, "cpu_dtensor_s": cpu_theirs, "cpu_eager_s": cpu_eager,
        "cpu_ratio": cpu_ours / cpu_theirs,
        "cpu_threefold_vs_eager": cpu_ours / cpu_eager, "cpu_dtensor_vs_eager": cpu_theirs / cpu_eager,
    }
    b, sq, h, t = cfg.batch, cfg.seq, cfg.n_embd, TP
    formula = 8 * b * sq * h * (t - 1) / t
    layers = per_layer_volume(r0["graph_collectives"], cfg.n_layer, t)
    s["comm"] = {
        "microbatch": b, "formula_elements": formula, "formula_bytes_fp32": 4 * formula,
        "per_layer": layers,
        "layer_ratio_to_formula": [row["ring_elements_per_rank"] / formula for row in layers],
        "outside_layers": [c for c in r0["graph_collectives"] if not c["module"].startswith("h.")],
        "runtime": r0["runtime_collectives"],
    }
    rt = r0["runtime_collectives"]
    graph_total = sum(c["elements"] * c.get("count", 1) for c in r0["graph_collectives"] if c["kind"] == "all_reduce")
    s["comm"]["runtime_matches_graph"] = {  # the step adds one all-reduce of the loss (1 element)
        "graph_all_reduce_elements": graph_total,
        "runtime_all_reduce_elements": rt["threefold"].get("all_reduce", {}).get("elements", 0)}
    s["comm"]["dtensor_per_layer_elements"] = rt["dtensor"].get("all_reduce", {}).get("elements", 0) / cfg.n_layer
    if cfg.profile:
        s["profile"] = r0["profile"]
        s["breakdown"] = {r["rank"]: r["breakdown"] for r in ranks}
        s["ops"] = r0["ops"]
    return s


def report(s: dict) -> str:
    c = s["config"]
    loc = s["lines_of_user_code"]
    lines = [f"GPT n_layer={c['n_layer']} n_embd={c['n_embd']} n_head={c['n_head']} vocab={c['vocab_size']} "
             f"seq={c['seq']} batch={c['batch']}, tp={s['tp']} on {s['tp']} gloo ranks x 1 thread, {s['cores']} cores",
             ""]
    for rank, ch in sorted(s["check"].items()):
        worst = max(ch["grad_rel_err"].values())
        lines.append(f"check rank {rank}: loss eager {ch['loss_eager']:.6f}  threefold {ch['loss_threefold']:.6f}  "
                     f"dtensor {ch['loss_dtensor']:.6f}  worst sampled grad rel err {worst:.1e}  "
                     f"{'ok' if ch['ok'] else 'FAILED'}")
    lines.append(f"lines of user code: threefold {loc['threefold']}, DTensor {loc['dtensor']} "
                 f"({', '.join(f'{k} {v}' for k, v in s['lines_of_user_code_detail'].items())})")
    if "timing" not in s:
        lines.append("correctness check failed: no timing")
        return "\n".join(lines)
    t = s["timing"]
    ms = lambda x: f"{x * 1e3:.1f}"
    lines += ["", f"medians of {c['iters']} alternating iterations after {c['warmup']} warm-up, rank 0 wall clock; "
              f"load average before/after {s['loadavg'][0]:.1f}/{s['loadavg'][1]:.1f} on {s['cores']} cores",
              f"{'':<14} {'threefold':>10} {'DTensor':>10} {'ours/DTensor':>12} {'paired':>7} {'eager':>9} "
              f"{'ours/eager':>10} {'DTensor/eager':>13}",
              f"{'wall ms':<14} {ms(t['threefold_s']):>10} {ms(t['dtensor_s']):>10} {t['ratio']:>12.3f} "
              f"{t['paired_ratio']:>7.3f} {ms(t['eager_parent_s']):>9} {t['threefold_vs_eager']:>10.3f} "
              f"{t['dtensor_vs_eager']:>13.3f}   (eager in the parent, 1 thread)",
              f"{'':<14} {'':>10} {'':>10} {'':>12} {'':>7} {ms(t['eager_in_job_s']):>9} "
              f"{t['threefold_vs_eager_in_job']:>10.3f} {t['dtensor_vs_eager_in_job']:>13.3f}   "
              "(eager on rank 0, alternated with the two)",
              f"{'CPU ms/rank':<14} {ms(t['cpu_threefold_s']):>10} {ms(t['cpu_dtensor_s']):>10} {t['cpu_ratio']:>12.3f} "
              f"{'':>7} {ms(t['cpu_eager_s']):>9} {t['cpu_threefold_vs_eager']:>10.3f} {t['cpu_dtensor_vs_eager']:>13.3f}"
              "   (process CPU time, busier rank)",
              f"goal ours/DTensor <= {s['goal_ratio']}: {'met' if t['ratio'] <= s['goal_ratio'] else 'NOT met'} "
              f"(min ms: threefold {ms(t['threefold_min_s'])}, DTensor {ms(t['dtensor_min_s'])}; rank 1 ratio "
              f"{t['rank1_ratio']:.3f}; eager in the parent before/after {ms(t['eager_parent_before_s'])}/"
              f"{ms(t['eager_parent_after_s'])}; threefold compile {s['compile_s']:.1f} s)"]
    cm = s["comm"]
    lines += ["", f"communication per transformer layer per microbatch (b={cm['microbatch']}, s={c['seq']}, "
              f"h={c['n_embd']}, t={s['tp']}), threefold's compiled graph:",
              f"{'layer':>5} {'all-reduces':>11} {'fwd elems':>10} {'bwd elems':>10} {'ring elems/rank':>15} "
              f"{'8bsh(t-1)/t':>12} {'ratio':>6}"]
    for row, ratio in zip(cm["per_layer"], cm["layer_ratio_to_formula"]):
        lines.append(f"h.{row['layer']:<3} {row['all_reduces']:>11} {row['forward_elements']:>10} "
                     f"{row['backward_elements']:>10} {row['ring_elements_per_rank']:>15.0f} "
                     f"{cm['formula_elements']:>12.0f} {ratio:>6.3f}")
    lines.append(f"  = {cm['formula_bytes_fp32'] / 2**20:.2f} MiB fp32 per layer per rank; outside the layers: " +
                 ", ".join(f"{o['module'] or 'loss'} {o['kind']} {o['phase']} {o['elements']}"
                           f"{' x' + str(o['count']) if o.get('count') else ''}" for o in cm["outside_layers"]))
    rt = cm["runtime"]
    for side in ("threefold", "dtensor"):
        lines.append(f"run-time collectives per step, {side}: " + "; ".join(
            f"{k} {v['calls']} calls, {v['elements']} elements (sizes {v['sizes']})" for k, v in rt[side].items()))
    m = cm["runtime_matches_graph"]
    lines.append(f"threefold graph all-reduce elements {m['graph_all_reduce_elements']} vs run time "
                 f"{m['runtime_all_reduce_elements']} (+1: the loss); DTensor all-reduce elements per layer "
                 f"{cm['dtensor_per_layer_elements']:.0f}")
    for rank, bd in sorted(s.get("breakdown", {}).items()):
        lines.append(f"threefold breakdown rank {rank} (median of 10, ms wall/CPU): step "
                     f"{ms(bd['step']['wall_s'])}/{ms(bd['step']['cpu_s'])}, compute only (all-reduces made copies) "
                     f"{ms(bd['compute_only']['wall_s'])}/{ms(bd['compute_only']['cpu_s'])}, "
                     f"{bd['all_reduce_calls']} bare gloo all-reduces of b*s*h {ms(bd['bare_all_reduces']['wall_s'])}/"
                     f"{ms(bd['bare_all_reduces']['cpu_s'])}")
    if "ops" in s:
        lines += ["", "torch.profiler, rank 0, 5 steps each:", op_table(s["ops"])]
    for side, text in s.get("profile", {}).items():
        lines += ["", f"cProfile rank 0, 5 steps, {side} (own time):", text.rstrip()]
    return "\n".join(lines)


def run(cfg: Config) -> dict:
    """The parent's part for one model size: reference, eager timing, the 2-rank job."""
    from threefold.runtime.launch import launch
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    load0 = os.getloadavg()[0]
    ref, eager_step = eager_reference(cfg)
    before = time_eager(eager_step, cfg.warmup, cfg.iters)
    ranks = launch(rank_job, TP, cfg, ref, threads=1, timeout=1800)
    after = time_eager(eager_step, 2, cfg.iters)
    torch.set_num_threads(threads)
    s = summarize(cfg, ranks, before, after)
    s["loadavg"] = [load0, os.getloadavg()[0]]
    s["bench_wall_s"] = time.perf_counter() - t0
    return s


def sweep_table(runs: list[dict]) -> str:
    lines = [f"{'model (L, h, s, b)':<20} {'ours/DTensor':>12} {'paired':>7} {'CPU ratio':>9} "
             f"{'ours/eager':>10} {'DTensor/eager':>13} {'CPU ours/eager':>14} {'CPU DT/eager':>12} {'load':>9}"]
    for s in runs:
        c = s["config"]
        name = f"{c['n_layer']}, {c['n_embd']}, {c['seq']}, {c['batch']}"
        t = s.get("timing")
        if t is None:
            lines.append(f"{name:<20} correctness check failed")
            continue
        lines.append(f"{name:<20} {t['ratio']:>12.3f} {t['paired_ratio']:>7.3f} {t['cpu_ratio']:>9.3f} "
                     f"{t['threefold_vs_eager_in_job']:>10.3f} {t['dtensor_vs_eager_in_job']:>13.3f} "
                     f"{t['cpu_threefold_vs_eager']:>14.3f} {t['cpu_dtensor_vs_eager']:>12.3f} "
                     f"{s['loadavg'][0]:>4.1f}/{s['loadavg'][1]:<4.1f}")
    lines.append("(wall ratios: rank 0 medians; vs eager: eager on rank 0 in the same alternation; "
                 "CPU: process CPU time per step, busier rank)")
    return "\n".join(lines)


SWEEP = [dict(n_embd=64, seq=32, batch=4), dict(n_embd=128, seq=64, batch=8), dict(n_embd=256, seq=128, batch=8)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small model, few iterations (< 1 minute)")
    ap.add_argument("--sweep", action="store_true",
                    help="three model sizes (h=64, 128, 256) and a summary table (about 2 minutes)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("--profile", action="store_true",
                    help="add a cProfile of 5 steps of each side and threefold's time breakdown")
    for f in ("n_layer", "n_embd", "n_head", "seq", "batch", "warmup", "iters"):
        ap.add_argument("--" + f.replace("_", "-"), type=int, dest=f)
    args = ap.parse_args(argv)
    over = dict(QUICK) if args.quick else {}
    over.update({k: v for k, v in vars(args).items() if k in Config.__dataclass_fields__ and v is not None})
    over["profile"] = args.profile
    sizes = [{**over, **size} for size in SWEEP] if args.sweep else [over]
    runs = []
    for size in sizes:
        cfg = Config(**size)
        if cfg.n_head % TP:
            raise SystemExit(f"n_head={cfg.n_head} must be divisible by tp={TP}")
        s = run(cfg)
        runs.append(s)
        if not args.json:
            print(report(s) + f"\n(bench wall {s['bench_wall_s']:.0f} s)\n", flush=True)
    if args.json:
        print(json.dumps(runs if args.sweep else runs[0], indent=2))
    elif args.sweep:
        print(sweep_table(runs))
    return 0 if all("timing" in s for s in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
