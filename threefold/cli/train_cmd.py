"""`threefold train [SPEC] --plan PLAN --steps N`: the main job.

Without a SPEC it trains the embedded small GPT (threefold/models/gpt.py) on the embedded
character corpus (threefold/data/corpus.txt), a fresh random window batch each step. With a
SPEC it trains that workload on its own batch. Runs on local gloo ranks, or under torchrun.
"""
from __future__ import annotations

import os
import sys
import time

import torch

from threefold.cli.jsonout import dumps
from threefold.errors import PlanError
from threefold.plan import Plan

DEFAULT_PLAN = "pp=2,m=4"


def register(sub) -> None:
    p = sub.add_parser(
        "train", help="train a model with a plan (default: a small GPT on the embedded corpus)",
        description="Train with tensor/pipeline/data parallelism. Without SPEC: a 4-layer GPT on "
        "the character corpus that ships with threefold. Shows a progress bar with loss and "
        "tokens/s, prints a summary, and writes OUT/loss.png and OUT/losses.json.")
    p.add_argument("spec", metavar="SPEC", nargs="?", default=None,
                   help="workload path/to/file.py:factory (default: the embedded GPT and corpus)")
    p.add_argument("--plan", default=DEFAULT_PLAN, help=f"parallel plan (default {DEFAULT_PLAN!r})")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    p.add_argument("--batch", type=int, default=16, help="global batch, sequences (embedded job)")
    p.add_argument("--seq", type=int, default=64, help="sequence length (embedded job)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and batches")
    p.add_argument("--out", default="runs/train", help="directory for loss.png and losses.json "
                   "(checked before training; replaced only if threefold wrote it)")
    p.add_argument("--force", action="store_true",
                   help="write --out even if it holds other files (they are moved aside, not deleted)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--skip-nonfinite", action="store_true",
                   help="skip a step whose loss or gradients are not finite (default: stop, exit 1)")
    p.add_argument("--save-every", type=int, default=0, metavar="N",
                   help="write a sharded checkpoint every N steps to --ckpt-dir (keeps the last 2)")
    p.add_argument("--ckpt-dir", default=None, help="checkpoint directory (default: OUT.ckpt)")
    p.add_argument("--resume", nargs="?", const="", default=None, metavar="DIR",
                   help="continue from the newest checkpoint in DIR (default: --ckpt-dir); any plan")
    p.set_defaults(func=run)


def _embedded(batch: int, seq: int, seed: int):
    from threefold.corpus import CharCorpus
    from threefold.models.gpt import GPT, GPTConfig, lm_loss
    corpus = CharCorpus()
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=corpus.vocab_size, block_size=seq, n_layer=4, n_head=4, n_embd=64))
    return model, lm_loss, lambda step: corpus.batch(batch, seq, step, seed)


def _train_rank(spec, plan, steps, lr, batch, seq, seed, show, skip_nonfinite=False,
                save_every=0, ckpt_dir=None, resume=None):
    import threefold
    from threefold.cli.jobs import is_main_rank
    torch.set_num_threads(1)
    if spec is None:
        model, loss_fn, data = _embedded(batch, seq, seed)
        batch_dims = None
    else:
        from threefold.workload import load_spec
        w = load_spec(spec)
        if w.loss_fn is None or w.target is None:
            raise PlanError(f"SPEC {spec!r} has no loss_fn/target; training needs both")
        model, loss_fn, batch_dims = w.model, w.loss_fn, w.batch_dims
        from threefold.checkpoint.agree import batch_as_rank0
        fixed = batch_as_rank0((*w.inputs, w.target))   # one batch: rank 0's
        data = lambda step: fixed  # noqa: E731
    example = data(0)
    pm = threefold.parallelize(model, plan, example[:-1], loss_fn, target=example[-1], batch_dims=batch_dims)
    opt = torch.optim.AdamW(pm.parameters(), lr=lr)
    tokens_per_step = example[0].numel()
    from threefold.cli.divergence import nonfinite
    losses, seconds, skipped, stopped = [], [], [], None
    start = 0
    if resume is not None:   # the batch of step k is data(k): the data position is the step
        info = threefold.load(pm, opt, resume)
        start, done = int(info["step"]), info["extra"] or {}
        losses, seconds, skipped = list(done.get("losses", [])), list(done.get("seconds", [])), list(done.get("skipped", []))
        if is_main_rank():
            print(f"threefold train: resumed from {info['path']} at step {start}", file=sys.stderr)
    progress = _Progress(steps, enabled=show and is_main_rank())
    with progress:
        for step in range(start, steps):
            *inputs, target = data(step)
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = pm.step(*inputs, target=target)
            bad = nonfinite(loss, pm.parameters())
            if bad is None:
                opt.step()
            seconds.append(time.perf_counter() - t0)
            losses.append(loss)
            progress.update(loss, tokens_per_step / seconds[-1])
            if bad is not None:
                if not skip_nonfinite:
                    stopped = (step + 1, bad)
                    break
                skipped.append(step + 1)
            if save_every and (step + 1) % save_every == 0:
                threefold.save(pm, opt, ckpt_dir, step=step + 1, keep=2,
                               extra={"losses": losses, "seconds": seconds, "skipped": skipped})
    return {"losses": losses, "seconds": seconds, "tokens_per_step": tokens_per_step,
            "skipped": skipped, "stopped": stopped}


class _Progress:
    def __init__(self, total: int, enabled: bool):
        self.enabled = enabled
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
            self.bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("loss {task.fields[loss]:.4f}"),
                                TextColumn("{task.fields[tps]:,.0f} tok/s"), TimeRemainingColumn())
            self.task = self.bar.add_task("train", total=total, loss=float("nan"), tps=0.0)

    def __enter__(self):
        if self.enabled:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self.enabled:
            self.bar.__exit__(*exc)

    def update(self, loss: float, tps: float) -> None:
        if self.enabled:
            self.bar.update(self.task, advance=1, loss=loss, tps=tps)


EMBEDDED_MAX_SEQ = 1024     # the embedded GPT's position table limit (GPT-2's n_positions)
EMBEDDED_MAX_BATCH = 4096


def check_numbers(args) -> None:
    import math
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise PlanError(f"--lr {args.lr} is invalid: use a positive finite learning rate")
    if args.spec is None:
        if not 1 <= args.seq <= EMBEDDED_MAX_SEQ:
            raise PlanError(f"--seq {args.seq} is invalid: the embedded GPT takes 1..{EMBEDDED_MAX_SEQ} tokens")
        if not 1 <= args.batch <= EMBEDDED_MAX_BATCH:
            raise PlanError(f"--batch {args.batch} is invalid: use 1..{EMBEDDED_MAX_BATCH} sequences")


def validate_in_parent(spec, plan: Plan, batch: int, seq: int, seed: int) -> None:
    """Build the workload and compile it here, once, so a plan that cannot work for this
    model (heads vs tp, layers vs chunks, batch vs dp*m) fails before any rank starts."""
    from threefold.compiler.api import compile_workload
    from threefold.workload import Workload, load_spec
    if spec is None:
        model, loss_fn, data = _embedded(batch, seq, seed)
        *inputs, target = data(0)
        workload = Workload(model, tuple(inputs), target, loss_fn)
    else:
        workload = load_spec(spec)
        if workload.loss_fn is None or workload.target is None:
            raise PlanError(f"SPEC {spec!r} has no loss_fn/target; training needs both")
        if any(p.is_meta for p in workload.model.parameters()):
            raise PlanError(f"SPEC {spec!r} builds its model on the meta device: training needs real weights")
    compile_workload(workload, plan)


def run(args) -> int:
    from threefold.cli.jobs import run_on_ranks
    from threefold.outdir import check_out_dir
    plan = Plan.parse(args.plan)
    if args.steps < 1:
        raise PlanError(f"--steps {args.steps} is invalid: use 1 or more")
    check_out_dir(args.out, args.force)     # a bad --out must fail before training, not after
    check_numbers(args)
    if args.save_every < 0:
        raise PlanError(f"--save-every {args.save_every} is invalid: use a positive step count (0: never)")
    ckpt_dir = args.ckpt_dir or os.path.abspath(args.out).rstrip("/") + ".ckpt"
    resume = None if args.resume is None else (args.resume or ckpt_dir)
    if resume is not None:
        from threefold.checkpoint.files import resolve
        resolve(resume)   # not a checkpoint: one line here, before any rank starts
    from threefold.cli.jobs import check_local_capacity, under_torchrun
    check_local_capacity(plan.world_size)
    if not under_torchrun():     # under torchrun every process is a rank: no parent to check in
        validate_in_parent(args.spec, plan, args.batch, args.seq, args.seed)
    result = run_on_ranks(_train_rank, plan.world_size, args.spec, str(plan), args.steps, args.lr,
                          args.batch, args.seq, args.seed, not args.json, args.skip_nonfinite,
                          args.save_every, ckpt_dir, resume)[0]
    from threefold.cli.jobs import is_main_rank
    if not is_main_rank():
        return 1 if result["stopped"] else 0
    losses, seconds = result["losses"], result["seconds"]
    if result["stopped"]:
        from threefold.cli.divergence import stop_message
        step, what = result["stopped"]
        if args.json:
            print(dumps({"plan": str(plan), "steps": len(losses), "losses": losses, "stopped_at_step": step,
                         "reason": f"non-finite {what}", "ok": False}))
        print(stop_message("train", step, what), file=sys.stderr)
        return 1
    steady = seconds[1:] or seconds
    summary = {
        "plan": str(plan), "steps": len(losses), "first_loss": losses[0], "final_loss": losses[-1],
        "tokens_per_second": result["tokens_per_step"] * len(steady) / sum(steady),
        "seconds": sum(seconds), "out": os.path.abspath(args.out),
        "skipped_steps": result["skipped"],
    }
    from threefold.outdir import write_out_dir

    def fill(tmp: str) -> None:
        with open(os.path.join(tmp, "losses.json"), "w") as f:
            f.write(dumps({"plan": str(plan), "losses": losses, "seconds": seconds}))
        _plot(losses, plan, os.path.join(tmp, "loss.png"))

    moved = write_out_dir(args.out, fill, kind="train", force=args.force)
    if moved:
        print(f"threefold train: moved the previous {args.out} aside to {moved}", file=sys.stderr)
    summary["plot"] = os.path.join(os.path.abspath(args.out), "loss.png")
    if args.json:
        print(dumps(summary))
    else:
        print(f"trained {summary['steps']} steps with plan {plan}: loss {summary['first_loss']:.4f} -> "
              f"{summary['final_loss']:.4f}, {summary['tokens_per_second']:,.0f} tokens/s, "
              f"{summary['seconds']:.1f} s")
        print(f"loss curve: {summary['plot']}")
    return 0


def _plot(losses: list[float], plan: Plan, path: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
    ax.plot(range(1, len(losses) + 1), losses, color="#2463eb", linewidth=1.4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"threefold train  ({plan})", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return os.path.abspath(path)
