"""threefold's pipeline runtime against torch.distributed.pipelining, on 4 local gloo ranks.

The same model (an untied examples/gpt.py GPT), the same layer-aligned split, the same
schedule and microbatches, run by both systems inside one launched 4-rank job with their
iterations alternating (ABBA order, a barrier on the default group before and after each
timed iteration, the same barrier for both). Reported:

  * median iteration time, threefold / torch, for 1F1B (pp=4, v=1) and interleaved 1F1B
    (pp=4, v=2); goal <= 0.9;
  * each against the single-process eager step (forward + backward, no optimizer) of the
    same model on the whole batch, single-threaded, run on rank 0 as a third contender in
    the same alternation (the other ranks wait in the barrier), so all three see the same
    machine load. With 4 ranks on 2 cores the best a pipeline can do is about half of
    that time (0.5x);
  * the simulated bubble of each schedule against the paper's (p-1)/(v*m);
  * peak live activations per stage: threefold's own counter (`pm.stats.peak_inflight`),
    an independent count from autograd's saved-tensor hooks (forwards whose saved tensors
    are still alive) for both systems, and the bound `schedule.inflight_bound`;
  * a loss check: both systems compute the same loss on the same weights.

    python bench/pipeline_vs_torch.py [--quick] [--json] [--iters N] [--warmup N]
    python bench/pipeline_vs_torch.py --profile    # adds threefold per-action times (rank 1)

Both systems split at the same block boundaries: threefold through `split=h.k+...` in the
plan, torch through hand-built `PipelineStage`s holding the same blocks (the first stage
also holds the embeddings, the last ln_f and lm_head; torch applies the loss outside the
stage, threefold inside its last chunk). lm_head is untied from wte because torch's
pipelining cannot share one parameter between stages.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

PP = 4  # pipeline ranks (the whole job; dp = tp = 1)


@dataclass(frozen=True)
class Config:
    n_layer: int = 8
    n_embd: int = 256
    n_head: int = 4
    vocab_size: int = 96
    seq: int = 128
    batch: int = 16
    microbatches: int = 8
    warmup: int = 4
    iters: int = 12
    profile: bool = False

    @property
    def schedules(self) -> list[tuple[str, int]]:
        return [("1f1b", 1), ("interleaved", 2)]


QUICK = dict(n_embd=64, seq=32, batch=8, warmup=2, iters=4)


# ---- the model, as both systems get it --------------------------------------------------

def build_workload(cfg: Config) -> dict:
    """The example GPT with lm_head untied from wte (same seed, so every call is identical)."""
    from examples.gpt import workload
    w = workload(n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head,
                 vocab_size=cfg.vocab_size, seq=cfg.seq, batch=cfg.batch, seed=0)
    model = w["model"]
    model.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())
    return w


def layer_splits(cfg: Config, v: int) -> list[int]:
    """First block index of every chunk after the first: equal blocks per chunk."""
    k = PP * v
    if cfg.n_layer % k:
        raise SystemExit(f"n_layer={cfg.n_layer} must be a multiple of pp*v={k} for layer-aligned splits")
    per = cfg.n_layer // k
    return [per * i for i in range(1, k)]


def threefold_plan(cfg: Config, kind: str, v: int) -> str:
    split = "+".join(f"h.{i}" for i in layer_splits(cfg, v))
    extra = f",v={v}" if v > 1 else ""
    return f"pp={PP},m={cfg.microbatches},schedule={kind}{extra},split={split}"


class TorchStage(nn.Module):
    """Blocks [lo, hi) of the GPT; the first stage embeds, the last applies ln_f and lm_head."""

    def __init__(self, model: nn.Module, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        self.blocks = nn.ModuleList(model.h[lo:hi])
        if last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x):
        if self.first:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.wte(x) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        if self.last:
            x = self.lm_head(self.ln_f(x))
        return x


def torch_schedule(cfg: Config, w: dict, kind: str, v: int, rank: int, group):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B
    bounds = [0] + layer_splits(cfg, v) + [cfg.n_layer]
    k = PP * v
    stages, mods = [], []
    for s in range(rank, k, PP):          # loop placement: stage s on rank s % pp (as threefold)
        mod = TorchStage(w["model"], bounds[s], bounds[s + 1], s == 0, s == k - 1)
        mods.append(mod)
        stages.append(PipelineStage(mod, s, k, torch.device("cpu"), group=group))
    if kind == "1f1b":
        sched = Schedule1F1B(stages[0], cfg.microbatches, loss_fn=w["loss_fn"])
    else:
        sched = ScheduleInterleaved1F1B(stages, cfg.microbatches, loss_fn=w["loss_fn"])
    return sched, stages, mods


# ---- saved-activation accounting (independent of either runtime's bookkeeping) -----------

class ActivationMeter:
    """Counts forwards whose autograd-saved tensors are still alive, and their bytes.

    Each chunk/stage forward opens a record; tensors autograd saves while it runs (and,
    for torch, the loss computed right after the last stage) are charged to it. A record
    is live until every tensor saved for it has been released by backward.
    """

    def __init__(self, params):
        self.param_ptrs = {p.data_ptr() for p in params}
        self.current = None
        self.live = self.peak = 0
        self.bytes = self.peak_bytes = 0

    def wrap(self, module: nn.Module) -> None:
        inner = module.forward
        meter = self

        def forward(*args, **kwargs):
            meter.current = _Record(meter)
            return inner(*args, **kwargs)
        module.forward = forward

    def unwrap(self, module: nn.Module) -> None:
        module.__dict__.pop("forward", None)

    def pack(self, t: torch.Tensor):
        rec = self.current
        if rec is None or t.data_ptr() in self.param_ptrs:
            return t
        return _Saved(t, rec)

    @staticmethod
    def unpack(obj):
        return obj.t if isinstance(obj, _Saved) else obj

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Record:
    def __init__(self, meter: ActivationMeter):
        self.meter, self.refs, self.storages = meter, 0, set()

    def add(self, t: torch.Tensor) -> int:
        if self.refs == 0:
            m = self.meter
            m.live += 1
            m.peak = max(m.peak, m.live)
        self.refs += 1
        key = t.untyped_storage().data_ptr()
        if key in self.storages:
            return 0
        self.storages.add(key)
        n = t.untyped_storage().nbytes()
        self.meter.bytes += n
        self.meter.peak_bytes = max(self.meter.peak_bytes, self.meter.bytes)
        return n

    def drop(self, n: int) -> None:
        self.refs -= 1
        self.meter.bytes -= n
        if self.refs == 0:
            self.meter.live -= 1


class _Saved:
    __slots__ = ("t", "rec", "n")

    def __init__(self, t, rec):
        self.t, self.rec = t, rec
        self.n = rec.add(t)

    def __del__(self):
        self.rec.drop(self.n)


def measure_activations(step, modules, params) -> tuple[int, int]:
    meter = ActivationMeter(params)
    for m in modules:
        meter.wrap(m)
    try:
        with meter.hooks():
            step()
    finally:
        for m in modules:
            meter.unwrap(m)
    return meter.peak, meter.peak_bytes


# ---- one rank of the launched job --------------------------------------------------------

def rank_job(cfg: Config) -> dict:
    import threefold
    torch.set_num_threads(1)
    rank = dist.get_rank()
    torch_group = dist.new_group(list(range(PP)))   # torch's p2p on its own gloo context
    out = {"rank": rank, "schedules": {}}
    for kind, v in cfg.schedules:
        plan = threefold_plan(cfg, kind, v)
        w = build_workload(cfg)
        t0 = time.perf_counter()
        pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"])
        compile_s = time.perf_counter() - t0
        tw = build_workload(cfg)
        sched, stages, mods = torch_schedule(cfg, tw, kind, v, rank, torch_group)
        first = rank == 0
        last = (PP * v - 1) % PP == rank
        idx, target = tw["inputs"][0], tw["target"]

        def ours():
            pm.zero_grad()
            return pm.step(*w["inputs"], target=w["target"])

        def theirs():
            for m in mods:
                m.zero_grad(set_to_none=True)
            losses = [] if last else None
            args = (idx,) if first else ()
            sched.step(*args, target=target if last else None, losses=losses, return_outputs=False)
            return float(torch.stack(losses).detach().mean()) if last else None

        ew = build_workload(cfg) if rank == 0 else None

        def eager():   # the whole batch in one process, one thread (rank 0 only)
            if ew is None:
                return None
            ew["model"].zero_grad(set_to_none=True)
            loss = ew["loss_fn"](ew["model"](*ew["inputs"]), ew["target"])
            loss.backward()
            return float(loss.detach())

        times = {"threefold": [], "torch": [], "eager": []}
        losses = {"threefold": None, "torch": None, "eager": None}
        for it in range(cfg.warmup + cfg.iters):
            order = [("threefold", ours), ("torch", theirs)]
            if it % 2:
                order.reverse()
            order.insert(it % 3, ("eager", eager))
            for name, fn in order:
                dist.barrier()
                t = time.perf_counter()
                loss = fn()
                dist.barrier()
                dt = time.perf_counter() - t
                if it >= cfg.warmup:
                    times[name].append(dt)
                losses[name] = loss
        # Activations: one extra, untimed, instrumented iteration of each.
        ours_mods = [pm.engine.modules[c] for c in sorted(pm.engine.modules)]
        peak_ours, bytes_ours = measure_activations(ours, ours_mods, pm.parameters())
        dist.barrier()
        peak_theirs, bytes_theirs = measure_activations(
            theirs, mods, [p for m in mods for p in m.parameters()])
        dist.barrier()
        res = {"plan": plan, "compile_s": compile_s, "times": times,
               "loss_threefold": losses["threefold"], "loss_torch": losses["torch"],
               "loss_eager": losses["eager"],
               "engine_peak_inflight": pm.stats.peak_inflight,
               "saved_peak_threefold": peak_ours, "saved_bytes_threefold": bytes_ours,
               "saved_peak_torch": peak_theirs, "saved_bytes_torch": bytes_theirs}
        if cfg.profile:
            res["profile"] = profile_sides(pm, ours, sched, stages, theirs)
        out["schedules"][kind] = res
        del pm, sched, stages, mods
        dist.barrier()
    return out


def profile_sides(pm, ours, sched, stages, theirs, iters: int = 3) -> dict:
    """Per step on this rank: wall time and the time inside each kind of action, for both.

    threefold: its chunk forwards (the last one includes the loss), backwards, blocking
    receives, posted sends and the loss all-reduce. torch: its stages' forward_one_chunk,
    backward_one_chunk and loss. What is left is waiting for peers and Python overhead.
    """
    from threefold.runtime import comm, engine as eng
    E = eng.PipelineEngine
    ours_patch = [(comm, "recv", "recv (blocking)"), (comm, "send", "isend (post)"),
                  (E, "_backward", "backward"), (E, "_global_loss", "loss all-reduce")]
    ours_patch += [(mod, "forward", "forward") for mod in pm.engine.modules.values()]
    theirs_patch = [(st, "forward_one_chunk", "forward") for st in stages]
    theirs_patch += [(st, "backward_one_chunk", "backward") for st in stages]
    theirs_patch += [(sched, "_compute_loss", "loss")]
    out = {}
    for name, step, patch in (("threefold", ours, ours_patch), ("torch", theirs, theirs_patch)):
        totals: dict[str, float] = {}
        saved = [(obj, attr, obj.__dict__.get(attr, _MISSING)) for obj, attr, _ in patch]

        def timed(label, fn):
            def inner(*a, **k):
                t = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    totals[label] = totals.get(label, 0.0) + time.perf_counter() - t
            return inner
        for obj, attr, label in patch:
            setattr(obj, attr, timed(label, getattr(obj, attr)))
        wall = 0.0
        try:
            for _ in range(iters):
                dist.barrier()
                t = time.perf_counter()
                step()
                wall += time.perf_counter() - t
        finally:
            for obj, attr, old in saved:
                if old is _MISSING:
                    delattr(obj, attr)
                else:
                    setattr(obj, attr, old)
        per = {k: v / iters for k, v in totals.items()}
        per["step"] = wall / iters
        per["rest"] = per["step"] - sum(v for k, v in per.items() if k != "step")
        out[name] = per
        dist.barrier()
    return out


_MISSING = object()


# ---- parent: eager baseline, simulator, report ------------------------------------------

def simulated(cfg: Config) -> dict:
    from threefold.runtime.schedule import inflight_bound, make_schedule
    from threefold.runtime.simulate import verify
    out = {}
    for kind, v in cfg.schedules:
        rep = verify(make_schedule(kind, PP, cfg.microbatches, v))
        out[kind] = {"bubble_ratio": rep.bubble_ratio, "formula": rep.formula_bubble_ratio,
                     "bubble_fraction": rep.bubble_fraction,
                     "sim_peak_inflight": rep.max_inflight,
                     "bound": inflight_bound(kind, PP, cfg.microbatches, v)}
    return out


def summarize(cfg: Config, ranks: list[dict], sim: dict) -> dict:
    rows = {}
    all_eager = []
    for kind, v in cfg.schedules:
        per = [r["schedules"][kind] for r in ranks]
        r0 = per[0]
        ours = statistics.median(r0["times"]["threefold"])
        theirs = statistics.median(r0["times"]["torch"])
        eager1 = statistics.median(r0["times"]["eager"])
        all_eager += r0["times"]["eager"]
        lt = next(p["loss_torch"] for p in per if p["loss_torch"] is not None)
        rows[kind] = {
            "plan": r0["plan"], "v": v,
            "threefold_s": ours, "torch_s": theirs, "eager_s": eager1, "ratio": ours / theirs,
            "paired_ratio": statistics.median(a / b for a, b in zip(r0["times"]["threefold"],
                                                                    r0["times"]["torch"])),
            "threefold_vs_eager": ours / eager1, "torch_vs_eager": theirs / eager1,
            "threefold_min_s": min(r0["times"]["threefold"]), "torch_min_s": min(r0["times"]["torch"]),
            "loss_threefold": r0["loss_threefold"], "loss_torch": lt, "loss_eager": r0["loss_eager"],
            "compile_s": max(p["compile_s"] for p in per),
            "engine_peak_inflight": [p["engine_peak_inflight"] for p in per],
            "saved_peak_threefold": [p["saved_peak_threefold"] for p in per],
            "saved_peak_torch": [p["saved_peak_torch"] for p in per],
            "saved_mib_threefold": [p["saved_bytes_threefold"] / 2**20 for p in per],
            "saved_mib_torch": [p["saved_bytes_torch"] / 2**20 for p in per],
            **sim[kind],
        }
        if cfg.profile:
            rows[kind]["profile"] = {r: p["profile"] for r, p in enumerate(per)}
    return {"config": asdict(cfg), "ranks": PP, "eager_1thread_s": statistics.median(all_eager),
            "goal_ratio": 0.9, "schedules": rows}


def report(s: dict) -> str:
    c = s["config"]
    lines = [f"GPT n_layer={c['n_layer']} n_embd={c['n_embd']} n_head={c['n_head']} vocab={c['vocab_size']} "
             f"seq={c['seq']} batch={c['batch']} m={c['microbatches']}, {s['ranks']} gloo ranks x 1 thread, "
             f"{os.cpu_count()} cores; medians of {c['iters']} alternating iterations after {c['warmup']} warm-up",
             f"eager single-process step (fwd+bwd, whole batch, 1 thread, alternated with the pipelines "
             f"on rank 0 while the others wait): {s['eager_1thread_s']*1e3:.0f} ms; "
             f"load average before/after {s['loadavg'][0]:.1f}/{s['loadavg'][1]:.1f}",
             "",
             f"{'schedule':<15} {'threefold ms':>12} {'torch ms':>9} {'eager ms':>9} {'ours/theirs':>11} {'paired':>6} "
             f"{'ours/eager':>10} {'theirs/eager':>12} {'loss ours':>10} {'loss torch':>10} {'loss eager':>10}"]
    for kind, r in s["schedules"].items():
        lines.append(f"{kind + ' v=' + str(r['v']):<15} {r['threefold_s']*1e3:>12.0f} {r['torch_s']*1e3:>9.0f} "
                     f"{r['eager_s']*1e3:>9.0f} {r['ratio']:>11.3f} {r['paired_ratio']:>6.3f} {r['threefold_vs_eager']:>10.3f} "
                     f"{r['torch_vs_eager']:>12.3f} {r['loss_threefold']:>10.5f} {r['loss_torch']:>10.5f} "
                     f"{r['loss_eager']:>10.5f}")
    lines += ["", f"{'schedule':<15} {'sim bubble':>10} {'(p-1)/(vm)':>10}   peak live activations per stage "
              "(engine counter | saved-tensor count threefold | torch | bound)"]
    for kind, r in s["schedules"].items():
        lines.append(f"{kind + ' v=' + str(r['v']):<15} {r['bubble_ratio']:>10.4f} {r['formula']:>10.4f}   "
                     f"{r['engine_peak_inflight']} | {r['saved_peak_threefold']} | {r['saved_peak_torch']} | "
                     f"{r['bound']}")
    lines.append("")
    lines.append("saved activation MiB at peak per stage (threefold | torch):")
    for kind, r in s["schedules"].items():
        lines.append(f"  {kind:<12} {[round(x, 1) for x in r['saved_mib_threefold']]} | "
                     f"{[round(x, 1) for x in r['saved_mib_torch']]}")
    for kind, r in s["schedules"].items():
        for rank, prof in sorted(r.get("profile", {}).items()):
            for side, per in prof.items():
                lines.append(f"profile {kind} rank {rank} {side:<9}: " + ", ".join(
                    f"{k} {v*1e3:.0f}" for k, v in per.items()) + " (ms per step)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small model, few iterations (< 1 minute)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("--profile", action="store_true", help="add threefold per-action times per rank")
    for f in ("n_layer", "n_embd", "n_head", "seq", "batch", "microbatches", "warmup", "iters"):
        ap.add_argument("--" + f.replace("_", "-"), type=int, dest=f)
    args = ap.parse_args(argv)
    over = dict(QUICK) if args.quick else {}
    over.update({k: v for k, v in vars(args).items()
                 if k in Config.__dataclass_fields__ and v is not None})
    over["profile"] = args.profile
    cfg = Config(**over)
    if cfg.batch % cfg.microbatches:
        raise SystemExit(f"batch={cfg.batch} must be a multiple of m={cfg.microbatches}")

    from threefold.runtime.launch import launch
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    ranks = launch(rank_job, PP, cfg, threads=1, timeout=1800)
    s = summarize(cfg, ranks, simulated(cfg))
    s["loadavg"] = [load0, os.getloadavg()[0]]
    s["bench_wall_s"] = time.perf_counter() - t0
    print(json.dumps(s, indent=2) if args.json else report(s) + f"\n(bench wall {s['bench_wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
