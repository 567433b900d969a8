"""`threefold check SPEC --plan PLAN`: parallel training must equal single-process training."""
from __future__ import annotations

import math
import os
import sys
import tempfile

import torch

from threefold.cli.jsonout import dumps
from threefold.errors import PlanError
from threefold.model_loss import check_trainable, workload_loss
from threefold.plan import Plan
from threefold.workload import load_spec

TOLERANCE = 1e-5


def register(sub) -> None:
    p = sub.add_parser(
        "check", help="run a plan on local ranks and the unsplit model; compare losses",
        description="Train the workload for N plain-SGD steps twice: with PLAN on local gloo "
        "ranks (or under torchrun), and unsplit in this process, from the same weights and batch. "
        "Prints both loss columns and the largest relative difference. Exit 0 when all agree "
        f"within {TOLERANCE:g} (fp32), 1 when they do not, 2 for bad input.")
    p.add_argument("spec", metavar="SPEC", help="workload: path/to/file.py:factory or pkg.module:factory")
    p.add_argument("--plan", required=True, help="e.g. 'pp=2,dp=2,m=4' (keys: README's 'Use it' and docs/design.md; "
                   "m defaults to 2*pp, dp under torchrun to its ranks / (tp*pp))")
    p.add_argument("--steps", type=int, default=3, help="SGD steps (default 3)")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default 0.1)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    # lazy: start-up: a command loads cli.dry_run_cmd only when it runs
    from threefold.cli.dry_run_cmd import add_flags
    add_flags(p)   # --dry-run --world N (cli/dry_run_cmd.py)
    p.set_defaults(func=run)


def _rank_losses(spec: str, plan: Plan, state_file: str, steps: int, lr: float) -> list[float]:
    import threefold
    torch.set_num_threads(1)
    saved = torch.load(state_file, weights_only=True)
    w = load_spec(spec)
    w.model.load_state_dict(saved["state"])
    target = saved["target"] if w.loss_fn is not None else None   # no loss_fn: the model's own loss
    pm = threefold.parallelize(w.model, plan, saved["inputs"], w.loss_fn, target=target,
                               batch_dims=w.batch_dims)
    opt = pm.optimizer(torch.optim.SGD, lr=lr)   # plain SGD, or its zero=1 / fp16 form
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        losses.append(pm.step(*saved["inputs"], target=target))
        opt.step()
    return losses


def run(args) -> int:
    if getattr(args, "dry_run", False):
        # lazy: start-up: a command loads cli.dry_run_cmd only when it runs
        from threefold.cli import dry_run_cmd
        return dry_run_cmd.run(args)
    for flag in ("world", "cluster"):
        if getattr(args, flag, None) is not None:
            raise PlanError(f"--{flag} is a --dry-run option: add --dry-run, or leave --{flag} out")
    from threefold.cli.jobs import run_on_ranks   # lazy: start-up: a command loads cli.jobs only when it runs
    if args.steps < 1:
        raise PlanError(f"--steps {args.steps} is invalid: use 1 or more")
    w = load_spec(args.spec)
    check_trainable(w, f"SPEC {args.spec!r}")   # check trains: a loss_fn and target, or the model's own loss
    if any(p.is_meta for p in w.model.parameters()):
        raise PlanError(f"SPEC {args.spec!r} builds its model on the meta device: check needs real weights")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise PlanError(f"--lr {args.lr} is invalid: use a positive finite learning rate")
    # lazy: start-up: a command loads cli.jobs only when it runs
    from threefold.cli.jobs import check_local_capacity, command_plan, tell, under_torchrun
    # lazy: start-up: a command loads plan_defaults only when it runs
    from threefold.plan_defaults import batch_rows
    resolved = command_plan(args.plan, batch=batch_rows(w.inputs, w.batch_dims))   # dp, m filled in
    plan = resolved.plan
    check_local_capacity(plan.world_size)
    random_ops = False
    if not under_torchrun():
        # lazy: start-up: a command loads compiler.api only when it runs
        from threefold.compiler.api import compile_workload
        # lazy: start-up: a command loads cli.phases only when it runs
        from threefold.cli.phases import Phases
        with Phases("check", enabled=not args.json) as progress:
            prog = compile_workload(w, plan, progress=progress, own_loss=True)  # a plan that cannot work fails here, before any rank
        random_ops = _has_random_ops(prog)
        # lazy: start-up: a command loads fallbacks only when it runs
        from threefold.fallbacks import show_fallbacks
        show_fallbacks(prog, f"threefold inspect {args.spec} --plan '{plan}'", mark=True)
        # lazy: start-up: a command loads compile_cache only when it runs
        from threefold.compile_cache import hand_to_ranks, workload_key
        hand_to_ranks(prog, workload_key(w.model, tuple(w.inputs), w.target, w.loss_fn, plan, w.batch_dims))
    tell(resolved)
    with tempfile.TemporaryDirectory(prefix="threefold-check-") as tmp:
        state_file = os.path.join(tmp, "state.pt")
        torch.save({"state": w.model.state_dict(), "inputs": tuple(w.inputs), "target": w.target}, state_file)
        # With random ops (dropout p > 0) the two runs cannot draw the same masks (one process
        # draws one mask over the whole batch), so check compares distributions: a step agrees
        # when the difference is within 4 standard deviations of the difference of two
        # independent draws of the loss, times sqrt(step) (docs/design.md, "What threefold check compares").
        noise = _loss_noise(w) if random_ops else 0.0
        reference = _reference(w, args.steps, args.lr)
        tolerance16 = sigma16 = None
        if plan.dtype != "fp32":   # 16 bits: against torch.autocast, within its rounding noise
            # lazy: start-up: a command loads cli.check_precision only when it runs
            from threefold.cli.check_precision import autocast_reference
            reference, tolerance16, sigma16 = autocast_reference(args.spec, state_file, plan.dtype,
                                                                 args.steps, args.lr)
        # the Plan value itself (parsed once, above), not its text
        parallel = run_on_ranks(_rank_losses, plan.world_size, args.spec, plan, state_file,
                                args.steps, args.lr)[0]
    diverged = next((i for i, b in enumerate(reference, start=1) if not math.isfinite(b)), None)
    diffs = [_rel_diff(a, b) for a, b in zip(parallel, reference)]
    worst = max(diffs)
    ok = worst <= TOLERANCE and diverged is None
    if tolerance16 is not None:
        ok = diverged is None and all(abs(a - b) <= t for a, b, t in zip(parallel, reference, tolerance16))
    if random_ops:
        # the runs' weights drift apart step by step like a random walk: sqrt(step)
        ok = diverged is None and all(abs(a - b) <= 4 * noise * math.sqrt(2 * i) + TOLERANCE * abs(b)
                                      for i, (a, b) in enumerate(zip(parallel, reference), start=1))
    if args.json:
        out = {"plan": str(plan), "losses_parallel": parallel, "losses_reference": reference,
               "max_rel_diff": worst, "ok": ok,
               "compares": "distribution" if random_ops else "exact", "loss_noise_std": noise}
        if tolerance16 is not None:
            out.update(compares="rounding noise", reference=f"torch.autocast({plan.dtype})",
                       rounding_noise_std=sigma16, tolerance=tolerance16)
        if diverged is not None:
            out["diverged_at_step"] = diverged
        print(dumps(out))
    else:
        _print_table(plan, parallel, reference, diffs, worst, ok and diverged is None)
        if tolerance16 is not None:
            print(f"dtype={plan.dtype}: compared with the single process under torch.autocast({plan.dtype}); "
                  "step k agrees within 4 sqrt(2) sigma_k of the measured rounding noise: "
                  + ", ".join(f"{t:.2e}" for t in tolerance16) + " (the rel-diff tolerance above is fp32's)")
        if random_ops:
            print(f"the model has random ops (dropout p > 0): compared in distribution, step k within "
                  f"4 sigma * sqrt(k) of two independent draws (loss std {noise:.3g}); set p=0 for an exact check")
    if diverged is not None:   # NaN == NaN is no agreement, and no mismatch either
        agree = "both runs" if not math.isfinite(parallel[diverged - 1]) else "the single-process run"
        print(f"threefold check: error: {agree} diverged (non-finite loss at step {diverged}), so nothing "
              "can be compared; lower --lr or fix the workload", file=sys.stderr)
    return 0 if ok else 1


def _has_random_ops(prog) -> bool:
    # lazy: start-up: a command loads runtime.random_ops only when it runs
    from threefold.runtime import random_ops as rt
    for chunk in prog.chunks:
        for node in chunk.gm.graph.nodes:
            if node.target is rt.seeded or (node.target is rt.dropout and float(node.args[1]) > 0):
                return True
    return False


def _loss_noise(w, draws: int = 8) -> float:
    """Standard deviation of the train-mode loss over fresh random draws, same weights."""
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(12345)
        losses = [float(workload_loss(w.model, w.inputs, w.target, w.loss_fn)) for _ in range(draws)]
    mean = sum(losses) / draws
    return math.sqrt(sum((x - mean) ** 2 for x in losses) / (draws - 1))


def _rel_diff(a: float, b: float) -> float:
    if not (math.isfinite(a) and math.isfinite(b)):
        return 0.0 if (a == b) else float("inf")   # equal infinities agree; NaN never does
    return abs(a - b) / max(abs(b), 1e-12)


def _reference(w, steps: int, lr: float) -> list[float]:
    opt = torch.optim.SGD(w.model.parameters(), lr=lr)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        loss = workload_loss(w.model, w.inputs, w.target, w.loss_fn)
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def _print_table(plan, parallel, reference, diffs, worst, ok) -> None:
    from rich.console import Console   # lazy: rich loads only for the progress display
    from rich.table import Table   # lazy: rich loads only for the progress display
    table = Table(title=f"check  plan {plan}")
    for col in ("step", "parallel loss", "reference loss", "rel diff"):
        table.add_column(col, justify="right")
    for i, (a, b, d) in enumerate(zip(parallel, reference, diffs), start=1):
        table.add_row(str(i), f"{a:.8f}", f"{b:.8f}", f"{d:.2e}")
    console = Console()
    console.print(table)
    verdict = "[green]OK[/green]" if ok else ("[red]DIVERGED[/red]" if not math.isfinite(worst) or any(
        not math.isfinite(b) for b in reference) else "[red]MISMATCH[/red]")
    console.print(f"max relative difference {worst:.2e} (tolerance {TOLERANCE:g}): {verdict}")
