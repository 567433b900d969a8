"""`threefold train [SPEC] --plan PLAN --steps N`: the main job.

Without a SPEC it trains the embedded small GPT (threefold/models/gpt.py) on --data (default:
the embedded corpus, threefold/data/python_reference.txt) through threefold.dataset. Settings
come from threefold.config: embedded defaults < --config FILE < flags. With a SPEC it trains
that workload on its data source (`batches` in its dict) or its one batch. The loop itself
(AdamW, warmup+cosine, clipping, evaluation, metrics, sample) is threefold/train/loop.py.
Runs on local gloo ranks, or under torchrun.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import sys
import tempfile

import torch

from threefold.cli.jsonout import dumps
from threefold.errors import PlanError
from threefold.plan import Plan
from threefold.workload import Workload, load_spec


def register(sub) -> None:
    p = sub.add_parser(
        "train", help="train a model with a plan (default: a small GPT on the embedded corpus)",
        description="Train with tensor/pipeline/data parallelism. Without SPEC: a small GPT on "
        "--data (default: the corpus that ships with threefold). Settings: embedded defaults < "
        "--config FILE < flags (--print-config shows them). Shows a progress bar with loss and "
        "tokens/s, prints a summary, and writes OUT/loss.png and OUT/losses.json.")
    p.add_argument("spec", metavar="SPEC", nargs="?", default=None,
                   help="workload path/to/file.py:factory (default: the embedded GPT and corpus)")
    from threefold.config import add_arguments   # lazy: start-up: a command loads config only when it runs
    add_arguments(p)      # --config, --print-config and one flag per TrainConfig field
    p.set_defaults(func=run)


# The embedded job's batches are [batch, seq] token ids and targets (threefold.dataset's
# sampler): said, not inferred. Inference runs the model on probe rows, which a model built on
# the meta device (--weights: parameters come from the file) cannot do; batch == seq is ambiguous too.
EMBEDDED_BATCH_DIMS = 0


def _embedded(cfg):
    """The embedded job: the GPT of cfg's [model] shape over cfg's data (threefold.dataset.Data)."""
    from threefold.dataset import load_data   # lazy: start-up: a command loads dataset only when it runs
    # lazy: start-up: a command loads models.gpt only when it runs
    from threefold.models.gpt import GPT, GPTConfig, lm_loss
    data = load_data(cfg)
    _check_model_fits(cfg, data.vocab_size)
    torch.manual_seed(cfg.seed)
    with _model_building(cfg):
        model = GPT(GPTConfig(vocab_size=data.vocab_size, block_size=cfg.seq, n_layer=cfg.n_layer,
                              n_head=cfg.n_head, n_embd=cfg.n_embd, dropout=cfg.dropout))
    return model, lm_loss, data


def _check_model_fits(cfg, vocab: int) -> None:
    """The embedded GPT of this shape must fit this machine's memory (the parent builds the
    whole model once to compile it): a clear error, not the OOM killer."""
    # lazy: start-up: a command loads cli.jobs only when it runs
    from threefold.cli.jobs import _available_memory
    params = cfg.n_layer * 12 * cfg.n_embd ** 2 + (vocab + cfg.seq) * cfg.n_embd
    available = _available_memory()
    if available is not None and cfg.weights is None and params * 4 > available:
        raise PlanError(f"the embedded GPT with n_layer={cfg.n_layer}, n_embd={cfg.n_embd} has {params:.3g} "
                        f"parameters ({params * 4 / 2**30:.1f} GiB in fp32), more than the {available / 2**30:.1f} "
                        "GiB of memory available: lower --n-embd or --n-layer")


def _train_rank(cfg, show, ckpt_dir=None, resume=None, live_dir=None, run_record=None, restart=None):
    """One rank: build the workload and its data source, then the loop (threefold/train/loop.py)."""
    # lazy: start-up: a command loads train.loop only when it runs
    from threefold.train.loop import train_loop
    # lazy: start-up: a command loads train.source only when it runs
    from threefold.train.source import data_source, given_sizes, spec_source
    torch.set_num_threads(1)
    if cfg.spec is None:
        model, loss_fn, dataset = _embedded(cfg)
        source = data_source(cfg, dataset, model.cfg)   # its position goes into every checkpoint
        batch_dims = EMBEDDED_BATCH_DIMS
    else:
        w = _training_spec(cfg)
        model, loss_fn, batch_dims = w.model, w.loss_fn, w.batch_dims
        source = spec_source(w, cfg, cfg.spec, given_sizes(cfg))
    return train_loop(cfg, model, loss_fn, source, batch_dims=batch_dims, show=show, live_dir=live_dir,
                      ckpt_dir=ckpt_dir, resume=resume, run=run_record, restart=restart)


def _training_spec(cfg):
    """The SPEC's workload, with --batch/--seq passed to its factory where it takes them."""
    # lazy: start-up: a command loads train.source only when it runs
    from threefold.train.source import given_sizes
    with _model_building(cfg):
        w = load_spec(cfg.spec, given_sizes(cfg))
    # lazy: start-up: a command loads model_loss only when it runs
    from threefold.model_loss import check_trainable
    check_trainable(w, f"SPEC {cfg.spec!r}")   # a loss_fn and target, or the model's own loss
    return w


def _model_building(cfg):
    """With --weights the model is built on the meta device (parameters from the file, slice
    by slice on each rank: no process ever holds the full model); otherwise as written."""
    if cfg.weights is None:
        return contextlib.nullcontext()
    # lazy: start-up: a command loads checkpoint.weights only when it runs
    from threefold.checkpoint.weights import empty_weights
    return empty_weights()


def validate_in_parent(cfg) -> Plan:
    """Build the workload and compile it here, once, so a plan that cannot work for this
    model (heads vs tp, layers vs chunks, batch vs dp*m) fails before any rank starts.
    Returns the plan, with what --plan leaves out filled in for this batch."""
    # lazy: start-up: a command loads compiler.api only when it runs
    from threefold.compiler.api import compile_workload
    spec = cfg.spec
    if spec is None:    # reads and checks the data too: bad --data fails here, before any rank
        model, loss_fn, data = _embedded(cfg)
        *inputs, target = data.sampler(cfg).peek()
        data.val_batches(cfg)
        _check_prompt(cfg, data.tokenizer, f"tokenizer {data.tokenizer.name!r}")
        workload = Workload(model, tuple(inputs), target, loss_fn, batch_dims=EMBEDDED_BATCH_DIMS)
    else:
        workload = _training_spec(cfg)
        _check_prompt(cfg, workload.tokenizer, f"SPEC {spec!r}'s tokenizer")
        if cfg.weights is None and any(p.is_meta for p in workload.model.parameters()):
            raise PlanError(f"SPEC {spec!r} builds its model on the meta device: training needs real weights "
                            "(pass --weights PATH, a safetensors file or Hugging Face directory)")
    # lazy: start-up: a command loads checkpoint.weights only when it runs
    from threefold.checkpoint.weights import WeightSource, traceable
    if cfg.weights is not None:     # a missing or foreign file fails here, before any rank starts
        WeightSource(cfg.weights, workload.model).check_shapes()
    # lazy: start-up: a command loads cli.jobs only when it runs
    from threefold.cli.jobs import command_plan, tell
    # lazy: start-up: a command loads plan_defaults only when it runs
    from threefold.plan_defaults import batch_rows
    resolved = command_plan(cfg.plan, batch=batch_rows(workload.inputs, workload.batch_dims))
    from threefold.cli.phases import Phases   # lazy: start-up: a command loads cli.phases only when it runs
    with traceable(workload.model), Phases("train", enabled=not cfg.json and not _on_terminal()) as progress:
        prog = compile_workload(workload, resolved.plan, progress=progress, own_loss=True)
    tell(resolved)
    # lazy: start-up: a command loads fallbacks only when it runs
    from threefold.fallbacks import show_fallbacks
    show_fallbacks(prog, f"threefold inspect {spec or 'SPEC'} --plan '{resolved.plan}'", mark=True)
    if cfg.weights is None:   # rank 0 takes this compile instead of repeating it (compile_cache.py)
        # lazy: start-up: a command loads compile_cache only when it runs
        from threefold.compile_cache import hand_to_ranks, workload_key
        hand_to_ranks(prog, workload_key(workload.model, workload.inputs, workload.target, workload.loss_fn,
                                         resolved.plan, workload.batch_dims))
    return resolved.plan


def _on_terminal() -> bool:
    """On a terminal train's own spinner (compiling_status) shows the compile already."""
    return sys.stderr.isatty()


def _check_prompt(cfg, tokenizer, which: str) -> None:
    """The end-of-run sample's prompt must give at least one id (checked now, not after training)."""
    if tokenizer is None or cfg.sample_tokens <= 0:
        return
    try:
        ids = tokenizer.encode(cfg.sample_prompt)
    except Exception as exc:   # a SPEC's own tokenizer may raise anything
        raise PlanError(f"--sample-prompt {cfg.sample_prompt!r} cannot be encoded by {which} "
                        f"({type(exc).__name__}: {exc}): give other text, or --sample-tokens 0") from None
    if len(ids) == 0:
        raise PlanError(f"--sample-prompt {cfg.sample_prompt!r} is no tokens for {which} (read at the end of "
                        "training): give other text, or --sample-tokens 0")


def run(args) -> int:
    from threefold.outdir import check_out_dir   # lazy: start-up: a command loads outdir only when it runs
    from threefold.config import from_args   # lazy: start-up: a command loads config only when it runs
    cfg = from_args(args)     # embedded defaults < --config FILE < flags; ranges checked
    if args.print_config:
        print(cfg.to_toml(), end="")
        return 0
    from threefold.cli.jobs import command_plan   # lazy: start-up: a command loads cli.jobs only when it runs
    plan = command_plan(cfg.plan).plan     # its ranks; m is settled below, with the batch
    check_out_dir(cfg.out, cfg.force)     # a bad --out must fail before training, not after
    ckpt_dir = cfg.ckpt_dir or os.path.abspath(cfg.out).rstrip("/") + ".ckpt"
    check_ckpt_dir(cfg, ckpt_dir)
    resume = None if cfg.resume is None else (cfg.resume or ckpt_dir)
    checked = None
    restart = None
    # lazy: start-up: a command loads cli.jobs only when it runs
    from threefold.cli.jobs import under_torchrun
    if under_torchrun():   # restarted by torchrun's elastic agent: the newest checkpoint, maybe fewer ranks
        # lazy: start-up: a command loads train.elastic only when it runs
        from threefold.train.elastic import torchrun_resume
        cfg, again, note, restart = torchrun_resume(cfg, ckpt_dir)
        if again is not None:
            resume = again
            plan = command_plan(cfg.plan).plan
            if note and os.environ.get("RANK", "0") == "0":
                print(f"threefold train: restarted by torchrun: {note}", file=sys.stderr)
    if cfg.min_world > plan.world_size:
        raise PlanError(f"--min-world {cfg.min_world} is more than the plan's {plan.world_size} ranks: "
                        f"use at most {plan.world_size}")
    if resume is not None:
        # lazy: start-up: a command loads checkpoint.reader only when it runs
        from threefold.checkpoint.reader import read_checkpoint
        checked = read_checkpoint(resume)   # every field checked: one line here, before any rank starts
    # lazy: start-up: a command loads cli.jobs only when it runs
    from threefold.cli.jobs import check_local_capacity
    check_local_capacity(plan.world_size)
    with _held(cfg, ckpt_dir, checked):     # one run at a time per --out and checkpoint directory
        run_record = _own_checkpoints(cfg, ckpt_dir, checked)
        return _train(cfg, plan, ckpt_dir, resume, run_record, restart)


def _own_checkpoints(cfg, ckpt_dir: str, checked) -> dict:
    """This run's record (checkpoint/ownership.py), after the checks that keep it to its own
    checkpoints: --resume of another run's checkpoint, a --ckpt-dir of a user's files or of
    an earlier run's checkpoints (without --force) are refused here, under the locks."""
    # lazy: start-up: a command loads checkpoint.ownership only when it runs
    from threefold.checkpoint import ownership
    if checked is not None:   # read again under the lock: a run that held it may have moved latest
        # lazy: start-up: a command loads checkpoint.reader only when it runs
        from threefold.checkpoint.reader import read_checkpoint
        checked = read_checkpoint(checked.path)
    record = ownership.run_record(cfg, checked.index if checked is not None else None)
    if checked is not None:
        ownership.check_same_run(checked.path, checked.index, record)
    if os.environ.get("RANK", "0") == "0" and cfg.save_every:
        resumed_root = os.path.dirname(os.path.abspath(checked.path)) if checked is not None else None
        moved = ownership.check_ckpt_dir(ckpt_dir, cfg.force, resumed_root, record)
        if moved:
            print(f"threefold train: moved the user's {ckpt_dir}/latest aside to {moved} (--force)", file=sys.stderr)
    return record


def check_ckpt_dir(cfg, ckpt_dir: str) -> None:
    """The checkpoint directory cannot be --out (swapped whole at the end of the run) or
    inside it, nor hold it; and it must be a directory if it exists."""
    if not cfg.save_every and cfg.resume is None:
        return
    out, ck = (os.path.realpath(os.path.abspath(p)) for p in (cfg.out, ckpt_dir))
    inside = lambda a, b: a == b or a.startswith(b.rstrip(os.sep) + os.sep)   # noqa: E731
    if inside(ck, out) or inside(out, ck):
        raise PlanError(f"--ckpt-dir {ckpt_dir!r} is --out {cfg.out!r} or inside it (or holds it): --out is "
                        "replaced at the end of the run; give a separate directory (default: OUT.ckpt)")
    if cfg.save_every and os.path.exists(ckpt_dir) and not os.path.isdir(ckpt_dir):
        raise PlanError(f"--ckpt-dir {ckpt_dir!r} is a file, not a directory: give a directory for checkpoints")


def _held(cfg, ckpt_dir: str, checked):
    """Locks on --out, the checkpoint directory written, and the one resumed from (its root:
    where its writer holds the lock), each keyed by its resolved path; taken by the process
    that is or starts rank 0 (under torchrun the other processes write none of them)."""
    from threefold.dir_lock import dir_lock   # lazy: start-up: a command loads dir_lock only when it runs
    stack = contextlib.ExitStack()
    if os.environ.get("RANK", "0") != "0":
        return stack
    try:
        stack.enter_context(dir_lock(cfg.out, "--out"))
        if cfg.save_every:
            stack.enter_context(dir_lock(ckpt_dir, "--ckpt-dir"))
        if checked is not None:
            stack.enter_context(dir_lock(os.path.dirname(os.path.abspath(checked.path)), "--resume"))
    except BaseException:
        stack.close()      # the --out lock taken before a refused checkpoint lock
        raise
    return stack


def _train(cfg, plan, ckpt_dir: str, resume: str | None, run_record: dict | None = None,
           restart: dict | None = None) -> int:
    # lazy: start-up: a command loads cli.jobs only when it runs
    from threefold.cli.jobs import command_plan, run_on_ranks, tell, under_torchrun
    if not under_torchrun():     # under torchrun every process is a rank: no parent to check in
        # lazy: start-up: a command loads runtime.launch only when it runs
        from threefold.runtime.launch import prestart
        # lazy: start-up: a command loads train.progress only when it runs
        from threefold.train.progress import compiling_status
        prestart()               # the ranks' forkserver imports torch while this process compiles
        with compiling_status(f"compiling for plan {plan} (checking it before starting "
                              f"{plan.world_size} ranks)", enabled=not cfg.json):
            plan = validate_in_parent(cfg)
    elif cfg.spec is None:       # the embedded job's batch is --batch
        resolved = command_plan(cfg.plan, batch=cfg.batch)
        tell(resolved)
        plan = resolved.plan
    if not under_torchrun() or cfg.spec is None:    # the ranks train the plan checked here
        cfg = dataclasses.replace(cfg, plan=str(plan))
    live = _live_dir(cfg.out)
    # lazy: start-up: threefold.checkpoint.staging loads 3 more modules only when this runs
    from threefold.checkpoint.staging import drop_all, settle
    if not under_torchrun():
        drop_all(ckpt_dir)       # what a job killed whole staged (never committed: another run's state)
    try:
        if cfg.max_restarts and not under_torchrun():    # under torchrun its agent restarts us
            result = _elastic(cfg, plan, ckpt_dir, resume, live, run_record)
            plan = Plan.parse(result["plan"])
        else:
            result = run_on_ranks(_train_rank, plan.world_size, cfg, not cfg.json, ckpt_dir, resume, live,
                                  run_record, restart)[0]
    except BaseException:
        if not under_torchrun():
            settle(ckpt_dir)     # a save the failure interrupted: committed if every rank staged it whole
        _keep_or_drop(live, ckpt_dir)
        raise
    if not under_torchrun():
        drop_all(ckpt_dir)
    from threefold.cli.jobs import is_main_rank   # lazy: start-up: a command loads cli.jobs only when it runs
    if not is_main_rank():
        return 1 if result["stopped"] else 0
    losses = result["losses"]
    if result["stopped"]:
        # lazy: start-up: a command loads cli.divergence only when it runs
        from threefold.cli.divergence import stop_message
        step, what = result["stopped"]
        if cfg.json:
            print(dumps({"plan": str(plan), "steps": len(losses), "losses": losses, "stopped_at_step": step,
                         "reason": f"non-finite {what}", "ok": False}))
        print(stop_message("train", step, what), file=sys.stderr)
        if live:
            print(f"threefold train: the metrics of the steps run are in {live}", file=sys.stderr)
        return 1
    # lazy: start-up: a command loads train.report only when it runs
    from threefold.train.report import summarize, write_losses, write_run
    summary = summarize(result, plan, os.path.abspath(cfg.out))
    if live:
        try:   # the record survives even if --out cannot be written below
            write_losses(live, result, plan)
        except OSError:
            pass
    from threefold.outdir import write_out_dir   # lazy: start-up: a command loads outdir only when it runs
    try:
        moved = write_out_dir(cfg.out, lambda tmp: write_run(tmp, result, plan, live), kind="train",
                              force=cfg.force)
    except (PlanError, OSError) as exc:
        raise PlanError(f"{exc if isinstance(exc, PlanError) else _os_error(cfg.out, exc)}; the run finished: "
                        f"{_kept(live, ckpt_dir, cfg)}") from None
    if moved:
        print(f"threefold train: moved the previous {cfg.out} aside to {moved}", file=sys.stderr)
    if live:
        shutil.rmtree(live, ignore_errors=True)   # our own staging directory, now copied into --out
    if cfg.json:
        print(dumps(summary))
    else:
        print(summary_text(summary))
    return 0


def _elastic(cfg, plan, ckpt_dir: str, resume: str | None, live: str | None, run_record: dict | None) -> dict:
    """The local job under --max-restarts (threefold/train/elastic.py); its result names the
    plan it finished on."""

    # lazy: start-up: a command loads cli.jobs only when it runs
    from threefold.cli.jobs import check_local_capacity
    # lazy: start-up: a command loads runtime.launch only when it runs
    from threefold.runtime.launch import LaunchError, launch
    # lazy: start-up: a command loads train.elastic only when it runs
    from threefold.train.elastic import run_elastic

    def start(cfg, plan, resume, restart):
        check_local_capacity(plan.world_size)
        result = launch(_train_rank, plan.world_size, cfg, not cfg.json, ckpt_dir, resume, live, run_record,
                        restart)[0]
        return {**result, "plan": str(plan)}

    def check_plan(trial):
        return validate_in_parent(trial)
    try:
        return run_elastic(dataclasses.replace(cfg, plan=str(plan)), plan, resume, live, ckpt_dir, start,
                           check_plan)
    except LaunchError as exc:   # out of restarts: as run_on_ranks reports it
        plan_errors = [m for m in exc.errors.values() if m.startswith("PlanError: ")]
        if plan_errors:
            raise PlanError(plan_errors[0].splitlines()[0][len("PlanError: "):]) from None
        raise SystemExit(f"threefold: {exc}") from None


def _os_error(out: str, exc: OSError) -> str:
    return f"--out {out!r} could not be written ({exc.strerror or exc})"


def _kept(live: str | None, ckpt_dir: str, cfg) -> str:
    """Where a run whose --out could not be written left its record."""
    parts = [f"its losses and metrics are in {live}"] if live else []
    if cfg.save_every and os.path.isdir(ckpt_dir):
        parts.append(f"its checkpoints in {ckpt_dir}")
    return " and ".join(parts) or "nothing else was kept"


def _live_dir(out: str) -> str | None:
    """A fresh directory next to --out where rank 0 writes metrics.jsonl (and TensorBoard
    events) while training; the finished run copies them into --out. Only the process that
    will be rank 0 makes one (under torchrun every process runs this)."""
    if os.environ.get("RANK", "0") != "0":
        return None
    full = os.path.abspath(out)
    parent, base = os.path.split(full)
    os.makedirs(parent, exist_ok=True)
    live = tempfile.mkdtemp(prefix=f".{base}.live-", dir=parent)
    # lazy: start-up: a command loads file_modes only when it runs
    from threefold.file_modes import as_if_created_plainly
    as_if_created_plainly(live, directory=True)   # kept for the user when a run fails
    return live


def _keep_or_drop(live: str | None, ckpt_dir: str | None = None) -> None:
    """A failed run: keep the staging directory if it holds steps (and say where, with the
    checkpoints if any were written), else drop it."""
    if not live:
        return
    log = os.path.join(live, "metrics.jsonl")
    if os.path.isfile(log) and os.path.getsize(log) > 0:
        # lazy: start-up: a command loads checkpoint.files only when it runs
        from threefold.checkpoint.files import list_steps
        saved = f"; checkpoints in {ckpt_dir}" if ckpt_dir and list_steps(ckpt_dir) else ""
        print(f"threefold train: the metrics of the steps run are in {live}{saved}", file=sys.stderr)
    else:
        shutil.rmtree(live, ignore_errors=True)   # ours, and empty of results


def printable(text: str) -> str:
    """Model output for a terminal: control characters (an untrained byte model emits escape
    sequences too) shown as U+FFFD; newlines and tabs kept. sample.txt keeps the raw text."""
    return "".join(c if c.isprintable() or c in "\n\t" else "\ufffd" for c in text)


def summary_text(summary: dict) -> str:
    val = ""
    if summary.get("first_val_loss") is not None:
        val = f", val loss {summary['first_val_loss']:.4f} -> {summary['final_val_loss']:.4f}"
    lines = [f"trained {summary['steps']} steps with plan {summary['plan']}: loss {summary['first_loss']:.4f} -> "
             f"{summary['final_loss']:.4f}{val}, {summary['tokens_per_second']:,.0f} tokens/s, "
             f"{summary['model_flops_per_second'] / 1e9:.2f} model GFLOP/s, {summary['seconds']:.1f} s"]
    skipped = summary.get("skipped_steps") or []
    if skipped:
        shown = ", ".join(f"{s['step']} ({s['reason']})" for s in skipped[:5])
        more = f" and {len(skipped) - 5} more" if len(skipped) > 5 else ""
        lines.append(f"skipped {len(skipped)} update(s), weights unchanged at step {shown}{more} "
                     "(also in losses.json)")
    if summary.get("sample") is not None:
        lines.append("sample:\n" + printable(summary["sample"]))
    lines.append(f"loss curve: {summary['plot']} (also lr.png, tokens_per_second.png, metrics.jsonl)")
    if summary.get("trace"):
        lines += trace_lines(summary["trace"])
    return "\n".join(lines)


def trace_lines(t: dict) -> list[str]:
    """The --trace part of the summary: the measured bubble next to the simulator's."""
    steps = ", ".join(map(str, t["steps"]))
    if "measured_bubble_fraction" not in t:
        return [f"trace: {t['file']} (no traced step ran)"]
    ms = lambda x: f"{x * 1e3:.1f}"   # noqa: E731
    return [f"trace of step {steps}: {t['file']} (Perfetto, chrome://tracing; drawn in {t['html']})",
            f"  bubble: measured {t['measured_bubble_fraction']:.1%} of rank-time, simulated "
            f"{t['simulated_bubble_fraction']:.1%} (this schedule fed the measured action times); "
            f"pipeline window {ms(t['window_s'])} ms, simulated {ms(t['simulated_makespan_s'])} ms",
            f"  idle per rank (ms): {', '.join(ms(x) for x in t['idle_s_per_rank'])}; simulated per stage: "
            f"{', '.join(ms(x) for x in t['simulated_idle_s_per_stage'])}",
            f"  tracing cost: ~{t['tracing_ns_per_step'] / 1e6:.2f} ms per traced step "
            f"({t['tracing_share_of_step']:.2%} of it, worst rank)"]
