"""`threefold train [SPEC] --plan PLAN --steps N`: the main job.

Without a SPEC it trains the embedded small GPT (threefold/models/gpt.py) on --data (default:
the embedded corpus, threefold/data/python_reference.txt) through threefold.dataset. Settings
come from threefold.config: embedded defaults < --config FILE < flags. With a SPEC it trains
that workload on its own batch. Runs on local gloo ranks, or under torchrun.
"""
from __future__ import annotations

import os
import sys
import time

import torch

from threefold.cli.jsonout import dumps
from threefold.errors import PlanError
from threefold.plan import Plan


def register(sub) -> None:
    p = sub.add_parser(
        "train", help="train a model with a plan (default: a small GPT on the embedded corpus)",
        description="Train with tensor/pipeline/data parallelism. Without SPEC: a small GPT on "
        "--data (default: the corpus that ships with threefold). Settings: embedded defaults < "
        "--config FILE < flags (--print-config shows them). Shows a progress bar with loss and "
        "tokens/s, prints a summary, and writes OUT/loss.png and OUT/losses.json.")
    p.add_argument("spec", metavar="SPEC", nargs="?", default=None,
                   help="workload path/to/file.py:factory (default: the embedded GPT and corpus)")
    from threefold.config import add_arguments
    add_arguments(p)      # --config, --print-config and one flag per TrainConfig field
    p.set_defaults(func=run)


def _embedded(cfg):
    """The embedded job: the GPT of cfg's [model] shape over cfg's data (threefold.dataset.Data)."""
    from threefold.dataset import load_data
    from threefold.models.gpt import GPT, GPTConfig, lm_loss
    data = load_data(cfg)
    torch.manual_seed(cfg.seed)
    model = GPT(GPTConfig(vocab_size=data.vocab_size, block_size=cfg.seq, n_layer=cfg.n_layer,
                          n_head=cfg.n_head, n_embd=cfg.n_embd, dropout=cfg.dropout))
    return model, lm_loss, data


def _train_rank(cfg, show, ckpt_dir=None, resume=None):
    import threefold
    from threefold.cli.jobs import is_main_rank
    torch.set_num_threads(1)
    spec, plan, steps, lr, skip_nonfinite, save_every = (cfg.spec, cfg.plan, cfg.steps, cfg.lr,
                                                         cfg.skip_nonfinite, cfg.save_every)
    sampler = None
    if spec is None:
        model, loss_fn, dataset = _embedded(cfg)
        sampler = dataset.sampler(cfg)   # its position goes into every checkpoint (extra["data"])
        data = lambda step: sampler.next()  # noqa: E731
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
    example = sampler.peek() if sampler is not None else data(0)
    pm = threefold.parallelize(model, plan, example[:-1], loss_fn, target=example[-1], batch_dims=batch_dims)
    opt = torch.optim.AdamW(pm.parameters(), lr=lr)
    tokens_per_step = example[0].numel()
    from threefold.cli.divergence import nonfinite
    losses, seconds, skipped, stopped = [], [], [], None
    start = 0
    if resume is not None:
        info = threefold.load(pm, opt, resume)
        start, done = int(info["step"]), info["extra"] or {}
        if sampler is not None:   # continue where the saved run's data stopped
            sampler.load_state_dict(done.get("data") or {"position": start * cfg.batch})
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
                               extra={"losses": losses, "seconds": seconds, "skipped": skipped,
                                      "data": sampler.state_dict() if sampler is not None else None})
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


def validate_in_parent(cfg, plan: Plan) -> None:
    """Build the workload and compile it here, once, so a plan that cannot work for this
    model (heads vs tp, layers vs chunks, batch vs dp*m) fails before any rank starts."""
    from threefold.compiler.api import compile_workload
    from threefold.workload import Workload, load_spec
    spec = cfg.spec
    if spec is None:    # reads and checks the data too: bad --data fails here, before any rank
        model, loss_fn, data = _embedded(cfg)
        *inputs, target = data.sampler(cfg).peek()
        data.val_batches(cfg)
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
    from threefold.config import from_args
    cfg = from_args(args)     # embedded defaults < --config FILE < flags; ranges checked
    if args.print_config:
        print(cfg.to_toml(), end="")
        return 0
    args = cfg                # the resolved values under the flags' names
    plan = Plan.parse(cfg.plan)
    check_out_dir(cfg.out, cfg.force)     # a bad --out must fail before training, not after
    ckpt_dir = cfg.ckpt_dir or os.path.abspath(cfg.out).rstrip("/") + ".ckpt"
    resume = None if cfg.resume is None else (cfg.resume or ckpt_dir)
    if resume is not None:
        from threefold.checkpoint.files import resolve
        resolve(resume)   # not a checkpoint: one line here, before any rank starts
    from threefold.cli.jobs import check_local_capacity, under_torchrun
    check_local_capacity(plan.world_size)
    if not under_torchrun():     # under torchrun every process is a rank: no parent to check in
        validate_in_parent(cfg, plan)
    result = run_on_ranks(_train_rank, plan.world_size, cfg, not cfg.json, ckpt_dir, resume)[0]
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
