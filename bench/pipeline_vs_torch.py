"""threefold's pipeline runtime against torch.distributed.pipelining, on 4 local gloo ranks.

The same model (an untied examples/gpt.py GPT), the same layer-aligned split, the same
schedule and microbatches, run by both systems inside one launched 4-rank job, their
iterations interleaved (the order rotates every iteration, so each contender takes each
position equally often; a barrier on the default group before and after every timed
iteration, the same barrier for all). Reported:

  * median iteration time (rank 0, barrier to barrier), threefold / torch, for 1F1B
    (pp=4, v=1) and interleaved 1F1B (pp=4, v=2), also as the median and quartiles of
    the ratios of adjacent pairs; goal <= 0.9;
  * each against the single-process eager step (forward + backward, no optimizer) of the
    same model on the whole batch, one thread, run on rank 0 as one more contender in the
    same rotation (the other ranks wait in the barrier), so all see the same machine
    load. 4 single-threaded ranks on 2 cores can at best take about half its time;
  * CPU time per iteration summed over the ranks (process time: compute, communication
    threads, Python), which unlike wall time barely moves with other jobs' load;
  * the simulated bubble of each schedule against the paper's (p-1)/(v*m);
  * peak live activations per stage: threefold's own counter (`pm.stats.peak_inflight`),
    an independent count from autograd's saved-tensor hooks (forwards whose saved tensors
    are still alive) for both systems, and the bound `schedule.inflight_bound`;
  * the loss of each contender (all equal: same weights, same batch).

    python bench/pipeline_vs_torch.py [--quick] [--json] [--iters N] [--warmup N]
    python bench/pipeline_vs_torch.py --profile     # per-action wall/CPU per rank, both
                                                    # systems; generated chunk vs torch
                                                    # stage in one process; microbatching cost
    python bench/pipeline_vs_torch.py --ablations   # + threefold with blocking receives (the
                                                    # engine before issue 13)
    python bench/pipeline_vs_torch.py --p2p-gloo     # + threefold with THREEFOLD_LOCAL_P2P=0:
                                                    # its pipeline messages through gloo, not
                                                    # shared memory (runtime/local_p2p.py)
    python bench/pipeline_vs_torch.py --compile inductor
        # threefold with plan compile=inductor against torch's stages eager ("torch") and
        # torch.compile'd ("torch compiled": each stage module compiled with threefold's
        # Inductor settings before PipelineStage wraps it), all in one rotation; the first
        # iterations compile (every group's timeout is raised to THREEFOLD_TIMEOUT=1800)

Both systems split at the same block boundaries: threefold through `split=h.k+...` in the
plan, torch through hand-built `PipelineStage`s holding the same blocks (the first stage
also holds the embeddings, the last ln_f and lm_head; torch applies the loss outside the
stage, threefold inside its last chunk). lm_head is untied from wte because torch's
pipelining cannot share one parameter between stages. torch's p2p runs on its own gloo
group so the two systems' messages never meet.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from activation_meter import measure_activations  # noqa: E402
from pipeline_vs_torch_report import report, summarize  # noqa: E402

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
    ablations: bool = False     # also time threefold with blocking receives (before issue 13)
    only: str = ""              # "1f1b" or "interleaved": run just that schedule
    p2p_gloo: bool = False      # also time threefold with its pipeline messages through gloo
    compile: str = "none"       # "inductor": threefold with compile=inductor against torch's
                                # stages eager and torch.compile'd (both in the same rotation)

    @property
    def schedules(self) -> list[tuple[str, int]]:
        both = [("1f1b", 1), ("interleaved", 2)]
        return [s for s in both if s[0] == self.only] if self.only else both


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
    extra += f",compile={cfg.compile}" if cfg.compile != "none" else ""
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


def torch_schedule(cfg: Config, w: dict, kind: str, v: int, rank: int, group, compiled: bool = False):
    """torch's schedule over this rank's stages; `compiled`: each stage module goes through
    torch.compile (Inductor, with the same settings as threefold's compile=inductor: the C++
    wrapper on CPU) before PipelineStage wraps it, so torch's schedule runs compiled forwards
    and their AOTAutograd backwards."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B
    bounds = [0] + layer_splits(cfg, v) + [cfg.n_layer]
    k = PP * v
    stages, mods = [], []
    for s in range(rank, k, PP):          # loop placement: stage s on rank s % pp (as threefold)
        mod = TorchStage(w["model"], bounds[s], bounds[s + 1], s == 0, s == k - 1)
        mods.append(mod)
        if compiled:
            from threefold.runtime.compiled import cache_dir, config_patches
            cache_dir()
            mod = torch.compile(mod, options=config_patches([torch.zeros(1)]))
        stages.append(PipelineStage(mod, s, k, torch.device("cpu"), group=group))
    if kind == "1f1b":
        sched = Schedule1F1B(stages[0], cfg.microbatches, loss_fn=w["loss_fn"])
    else:
        sched = ScheduleInterleaved1F1B(stages, cfg.microbatches, loss_fn=w["loss_fn"])
    return sched, stages, mods


# ---- one rank of the launched job --------------------------------------------------------

def blocking_receives(pm) -> None:
    """Make this engine receive as it did before issue 13: each receive posted and waited
    for at its place in the action list (a blocking recv), the loss all-reduced at the end."""
    from threefold.runtime.receives import blocking_plan
    eng = pm.engine
    eng._plan_cache = (eng.schedule, blocking_plan(eng.schedule.actions[eng.stage]), None)


def with_gloo_p2p(step) -> None:
    """Run `step` (a threefold contender's first step: it sets up the pipeline channels,
    collectively) with THREEFOLD_LOCAL_P2P=0, so that contender's messages go through gloo."""
    from threefold.runtime.local_p2p import ENV
    old = os.environ.get(ENV)
    os.environ[ENV] = "0"
    try:
        step()
    finally:
        if old is None:
            os.environ.pop(ENV)
        else:
            os.environ[ENV] = old


def run_rotation(contenders, warmup: int, iters: int, faults: dict | None = None):
    """Time each contender `iters` times after `warmup` rounds, interleaved: every contender
    takes every position equally often, forwards and backwards. Per contender: wall times
    (barrier to barrier), this process's CPU times, and the last loss it returned; and in
    `faults`, when given, this process's minor page faults per iteration (ru_minflt)."""
    import resource
    times = {name: [] for name, _ in contenders}
    cpu = {name: [] for name, _ in contenders}
    losses = {name: None for name, _ in contenders}
    n = len(contenders)
    for it in range(warmup + iters):
        order = contenders[it % n:] + contenders[:it % n]
        if (it // n) % 2:
            order.reverse()
        for name, fn in order:
            dist.barrier()
            t, c = time.perf_counter(), time.process_time()
            f = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            loss = fn()
            c = time.process_time() - c
            f = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f
            dist.barrier()
            dt = time.perf_counter() - t
            if it >= warmup:
                times[name].append(dt)
                cpu[name].append(c)
                if faults is not None:
                    faults.setdefault(name, []).append(f)
            losses[name] = loss
    return times, cpu, losses


def rank_job(cfg: Config) -> dict:
    import threefold
    torch.set_num_threads(1)
    rank = dist.get_rank()
    torch_group = dist.new_group(list(range(PP)))   # torch's p2p on its own gloo context
    compiled_group = dist.new_group(list(range(PP))) if cfg.compile != "none" else None
    if compiled_group is not None:
        import torch._inductor.config as inductor_config
        inductor_config.compile_threads = 1     # as threefold's compile=inductor: no worker pool
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

        def ours(pm=pm, w=w):
            pm.zero_grad()
            return pm.step(*w["inputs"], target=w["target"])

        def torch_step(sched, mods):
            def theirs():
                for m in mods:
                    m.zero_grad(set_to_none=True)
                losses = [] if last else None
                args = (idx,) if first else ()
                sched.step(*args, target=target if last else None, losses=losses, return_outputs=False)
                return float(torch.stack(losses).detach().mean()) if last else None
            return theirs
        theirs = torch_step(sched, mods)

        ew = build_workload(cfg) if rank == 0 else None

        def eager():   # the whole batch in one process, one thread (rank 0 only)
            if ew is None:
                return None
            ew["model"].zero_grad(set_to_none=True)
            loss = ew["loss_fn"](ew["model"](*ew["inputs"]), ew["target"])
            loss.backward()
            return float(loss.detach())

        contenders = [("threefold", ours), ("torch", theirs), ("eager", eager)]
        if compiled_group is not None:
            cw = build_workload(cfg)
            csched, _, cmods = torch_schedule(cfg, cw, kind, v, rank, compiled_group, compiled=True)
            contenders[2:2] = [("torch compiled", torch_step(csched, cmods))]
        if cfg.ablations:
            bw = build_workload(cfg)
            old = threefold.parallelize(bw["model"], plan, bw["inputs"], bw["loss_fn"], target=bw["target"])
            blocking_receives(old)
            contenders[1:1] = [("threefold blocking recv", lambda: ours(old, bw))]
        if cfg.p2p_gloo:
            gw = build_workload(cfg)
            gpm = threefold.parallelize(gw["model"], plan, gw["inputs"], gw["loss_fn"], target=gw["target"])
            with_gloo_p2p(lambda: ours(gpm, gw))
            contenders[1:1] = [("threefold gloo p2p", lambda: ours(gpm, gw))]
        times, cpu, losses = run_rotation(contenders, cfg.warmup, cfg.iters)
        # Activations: one extra, untimed, instrumented iteration of each.
        ours_mods = [pm.engine.modules[c] for c in sorted(pm.engine.modules)]
        peak_ours, bytes_ours = measure_activations(ours, ours_mods, pm.parameters())
        dist.barrier()
        peak_theirs, bytes_theirs = measure_activations(
            theirs, mods, [p for m in mods for p in m.parameters()])
        dist.barrier()
        res = {"plan": plan, "compile_s": compile_s, "times": times, "cpu": cpu,
               "losses": losses,
               "engine_peak_inflight": pm.stats.peak_inflight,
               "saved_peak_threefold": peak_ours, "saved_bytes_threefold": bytes_ours,
               "saved_peak_torch": peak_theirs, "saved_bytes_torch": bytes_theirs}
        if cfg.profile:
            res["profile"] = profile_sides(pm, ours, sched, stages, theirs)
        out["schedules"][kind] = res
        dist.barrier()
    return out


def profile_sides(pm, ours, sched, stages, theirs, iters: int = 4) -> dict:
    """Per step on this rank, both systems alternating: wall and CPU (this thread) time
    inside each kind of action, and for the whole step.

    threefold: its chunk forwards (the last one includes the loss), backwards, posting
    receives (irecv), waiting for them before the compute that reads them, posting sends
    and the loss all-reduce. torch: its stages' forward_one_chunk,
    backward_one_chunk and loss. "rest" is the step's wall time outside those: waiting for
    peers inside torch's schedule, and Python overhead in both.
    """
    from threefold.runtime import comm, engine as eng
    E = eng.PipelineEngine
    patches = {
        "threefold": [(comm, "post_recv", "irecv post"), (comm.PendingRecv, "wait", "recv wait"),
                      (comm, "send", "isend"), (E, "_backward", "backward"),
                      (E, "_global_loss", "loss all-reduce")]
        + [(mod, "forward", "forward") for mod in pm.engine.modules.values()],
        "torch": [(st, "forward_one_chunk", "forward") for st in stages]
        + [(st, "backward_one_chunk", "backward") for st in stages] + [(sched, "_compute_loss", "loss")],
    }
    steps = {"threefold": ours, "torch": theirs}
    wall = {n: {} for n in steps}
    cpu = {n: {} for n in steps}

    def timed(side, label, fn):
        def inner(*a, **k):
            t, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                wall[side][label] = wall[side].get(label, 0.0) + time.perf_counter() - t
                cpu[side][label] = cpu[side].get(label, 0.0) + time.thread_time() - c
        return inner

    for i in range(iters):
        for side in (["threefold", "torch"] if i % 2 == 0 else ["torch", "threefold"]):
            patch = patches[side]
            saved = [(obj, attr, obj.__dict__.get(attr, _MISSING)) for obj, attr, _ in patch]
            for obj, attr, label in patch:
                setattr(obj, attr, timed(side, label, getattr(obj, attr)))
            try:
                dist.barrier()
                t, c = time.perf_counter(), time.process_time()
                steps[side]()
                wall[side]["step"] = wall[side].get("step", 0.0) + time.perf_counter() - t
                cpu[side]["step"] = cpu[side].get("step", 0.0) + time.process_time() - c
            finally:
                for obj, attr, old in saved:
                    if old is _MISSING:
                        delattr(obj, attr)
                    else:
                        setattr(obj, attr, old)
    out = {}
    for side in steps:
        per = {k: [wall[side][k] / iters, cpu[side][k] / iters] for k in wall[side]}
        per["rest"] = [per["step"][0] - sum(v[0] for k, v in per.items() if k != "step"), None]
        out[side] = per
    dist.barrier()
    return out


_MISSING = object()


# ---- parent: compute-only check, simulator, report ---------------------------------------

def chunk_check(cfg: Config, reps: int = 30) -> dict:
    """One process, one thread, no communication: a middle chunk as threefold generates it
    against the torch stage holding the same blocks, forward+backward on one microbatch,
    alternating. Separates generated-code speed from the runtime's."""
    import tempfile
    from threefold.codegen.artifact import build_sources, chunk_state
    from threefold.compiler.api import compile_workload
    from threefold.plan import Plan
    from threefold.runtime.loader import import_file
    from threefold.workload import Workload
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        w = build_workload(cfg)
        prog = compile_workload(Workload(w["model"], w["inputs"], w["target"], w["loss_fn"]),
                                Plan.parse(threefold_plan(cfg, "1f1b", 1)))
        root = tempfile.mkdtemp(prefix="threefold-bench-")
        for name, text in build_sources(prog).items():
            with open(os.path.join(root, name), "w") as f:
                f.write(text)
        entry = prog.chunks[1]
        cls = getattr(import_file(os.path.join(root, "chunk01.py")), "Chunk1")
        ours = cls()
        ours.load_state(chunk_state(prog, entry, 0))
        lo, hi = layer_splits(cfg, 1)[:2]
        theirs = TorchStage(build_workload(cfg)["model"], lo, hi, False, False)
        mb = cfg.batch // cfg.microbatches
        x = torch.randn(mb, cfg.seq, cfg.n_embd)
        g = torch.randn(mb, cfg.seq, cfg.n_embd)

        def run(fn):
            xi = x.clone().requires_grad_(True)
            out = fn(xi)
            torch.autograd.backward(out[0] if isinstance(out, (tuple, list)) else out, g)

        times = {"threefold": [], "torch": []}
        for i in range(reps + 3):
            for name, mod in (("threefold", ours), ("torch", theirs))[:: 1 if i % 2 else -1]:
                t = time.perf_counter()
                run(mod)
                if i >= 3:
                    times[name].append(time.perf_counter() - t)
        a, b = statistics.median(times["threefold"]), statistics.median(times["torch"])
        # What microbatching alone costs: the whole model, the whole batch at once against
        # m microbatches one after another (gradients accumulated), CPU time.
        model, loss_fn = w["model"], w["loss_fn"]
        idx, target = w["inputs"][0], w["target"]

        def whole():
            loss_fn(model(idx), target).backward()

        def micro():
            for xi, ti in zip(idx.chunk(cfg.microbatches), target.chunk(cfg.microbatches)):
                (loss_fn(model(xi), ti) / cfg.microbatches).backward()
        cpu = {"whole": [], "micro": []}
        for i in range(6):
            for name, fn in (("whole", whole), ("micro", micro))[:: 1 if i % 2 else -1]:
                model.zero_grad(set_to_none=True)
                c = time.process_time()
                fn()
                if i:
                    cpu[name].append(time.process_time() - c)
        cw, cm = statistics.median(cpu["whole"]), statistics.median(cpu["micro"])
        return {"blocks": f"h.{lo}..h.{hi - 1}", "microbatch": mb, "threefold_ms": a * 1e3, "torch_ms": b * 1e3,
                "ratio": a / b, "threefold_min_ms": min(times["threefold"]) * 1e3,
                "torch_min_ms": min(times["torch"]) * 1e3,
                "eager_whole_cpu_ms": cw * 1e3, "eager_microbatched_cpu_ms": cm * 1e3,
                "microbatching_cost": cm / cw}
    finally:
        torch.set_num_threads(old)


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small model, few iterations (< 1 minute)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("--profile", action="store_true", help="add per-action times per rank, both systems")
    ap.add_argument("--ablations", action="store_true",
                    help="also time threefold with blocking receives at their place in the list "
                         "(the engine before issue 13)")
    ap.add_argument("--p2p-gloo", action="store_true",
                    help="also time threefold with THREEFOLD_LOCAL_P2P=0 (pipeline messages through gloo)")
    ap.add_argument("--only", choices=["1f1b", "interleaved"], default="", help="run just one schedule")
    ap.add_argument("--compile", choices=["none", "inductor"], default="none",
                    help="inductor: threefold with compile=inductor, against torch's stages eager "
                         "('torch') and torch.compile'd ('torch compiled') in the same rotation")
    for f in ("n_layer", "n_embd", "n_head", "vocab_size", "seq", "batch", "microbatches", "warmup", "iters"):
        ap.add_argument("--" + f.replace("_", "-"), type=int, dest=f)
    args = ap.parse_args(argv)
    over = dict(QUICK) if args.quick else {}
    over.update({k: v for k, v in vars(args).items()
                 if k in Config.__dataclass_fields__ and v is not None})
    over["profile"] = args.profile
    over["ablations"] = args.ablations
    over["p2p_gloo"] = args.p2p_gloo
    over["only"] = args.only
    over["compile"] = args.compile
    cfg = Config(**over)
    if cfg.batch % cfg.microbatches:
        raise SystemExit(f"batch={cfg.batch} must be a multiple of m={cfg.microbatches}")

    from threefold.runtime.launch import launch
    if cfg.compile != "none":
        # the first iterations compile (minutes on a loaded machine) while peers wait in
        # torch's receives and the barriers: every group's timeout must outlast that
        os.environ.setdefault("THREEFOLD_TIMEOUT", "1800")
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    ranks = launch(rank_job, PP, cfg, threads=1, timeout=1800)
    s = summarize(cfg, ranks, simulated(cfg))
    if cfg.profile:
        s["chunk_check"] = chunk_check(cfg)
    s["loadavg"] = [load0, os.getloadavg()[0]]
    s["bench_wall_s"] = time.perf_counter() - t0
    print(json.dumps(s, indent=2) if args.json else report(s) + f"\n(bench wall {s['bench_wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
