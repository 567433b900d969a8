"""`threefold run DIR`: train a saved artifact, without the compiler or the model's source."""
from __future__ import annotations

import contextlib
import math
import os
import sys
import types

import torch

from threefold.cli.jsonout import dumps
from threefold.errors import PlanError


def register(sub) -> None:
    p = sub.add_parser(
        "run", help="train a compiled artifact on local ranks or under torchrun",
        description="Load the per-rank modules and weight shards of an artifact made by "
        "`threefold compile` and train them with plain SGD on the artifact's saved batch. "
        "Needs only the runtime: the model's source is not imported. Under torchrun "
        "(`torchrun --nproc-per-node=N -m threefold run DIR`) each process is one rank.")
    p.add_argument("dir", metavar="DIR", help="artifact directory (threefold compile --out DIR)")
    p.add_argument("--steps", type=int, default=3, help="SGD steps (default 3)")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default 0.1)")
    p.add_argument("--json", action="store_true", help="print {'plan', 'losses'} as JSON")
    p.add_argument("--skip-nonfinite", action="store_true",
                   help="skip a step whose loss or gradients are not finite (default: stop, exit 1)")
    p.add_argument("--trust", action="store_true",
                   help="skip the sha256 check of the artifact's files (paths are still checked) and the "
                        "list of modules it imports; only for artifacts you made yourself")
    p.add_argument("--verify", metavar="KEYFILE", default=None,
                   help="refuse the artifact unless its manifest carries a signature under the key in "
                        "KEYFILE (compile --sign KEYFILE): a tampered and re-hashed artifact is refused")
    p.add_argument("--save-every", type=int, default=0, metavar="N",
                   help="write a sharded checkpoint every N steps to --ckpt-dir (keeps the last 2)")
    p.add_argument("--ckpt-dir", default=None, help="checkpoint directory (default: DIR.ckpt)")
    p.add_argument("--resume", nargs="?", const="", default=None, metavar="CKPT",
                   help="continue from the newest checkpoint in CKPT (default: --ckpt-dir)")
    p.add_argument("--trace", nargs="?", const="", default=None, metavar="OUT",
                   help="record what every rank ran in the --trace-steps into OUT/trace.json (Chrome "
                        "trace-event format: Perfetto, chrome://tracing) and OUT/trace.html, and print the "
                        "measured bubble next to the simulator's (default OUT: DIR.trace)")
    p.add_argument("--trace-steps", default="3", metavar="N[,N...]",
                   help="steps --trace records, 1-based (default 3)")
    p.set_defaults(func=run)


def _run_rank(root: str, steps: int, lr: float, trust: bool = False, skip_nonfinite: bool = False,
              save_every: int = 0, ckpt_dir: str | None = None, resume: str | None = None,
              trace_steps: list[int] | None = None, verify_key: bytes | None = None) -> dict:
    # lazy: start-up: a command loads runtime.assemble only when it runs
    from threefold.runtime.assemble import assemble_rank
    # lazy: start-up: a command loads runtime.loader only when it runs
    from threefold.runtime.loader import ArtifactSource, load_batch, open_artifact
    torch.set_num_threads(1)
    art = open_artifact(root, trust=trust, verify_key=verify_key)   # each rank re-reads: re-checked
    engine = assemble_rank(art.manifest, ArtifactSource(art))
    batch = load_batch(art)
    # lazy: start-up: a command loads runtime.optimizers only when it runs
    from threefold.runtime.optimizers import make_optimizer   # plain SGD, or its zero=1 / fp16 form
    opt = make_optimizer(engine, torch.optim.SGD, lr=lr)
    # lazy: start-up: a command loads cli.divergence only when it runs
    from threefold.cli.divergence import nonfinite
    losses, skipped, start = [], [], 1
    # what threefold.save/load read from a ParallelModule (no compiler import here)
    pm = types.SimpleNamespace(engine=engine, manifest=art.manifest, plan=art.plan)
    if resume is not None:
        import threefold.checkpoint as ckpt   # lazy: start-up: a command loads checkpoint only when it runs
        info = ckpt.load(pm, opt, resume)
        done = info["extra"] or {}
        losses, skipped, start = list(done.get("losses", [])), list(done.get("skipped", [])), int(info["step"]) + 1
        # lazy: start-up: a command loads cli.jobs only when it runs
        from threefold.cli.jobs import is_main_rank
        if is_main_rank():
            print(f"threefold run: resumed from {info['path']} at step {start - 1}", file=sys.stderr)
    # lazy: start-up: a command loads runtime.trace only when it runs
    from threefold.runtime.trace import NoTracer, StepTracer
    tracer = StepTracer(engine, trace_steps, {"workload": root}) if trace_steps else NoTracer()
    for step in range(start, steps + 1):
        with tracer.step(step):     # --trace: this step's actions, timed (runtime/trace.py)
            opt.zero_grad()
            losses.append(engine.step(batch))
            # fp16: an overflowing (scaled) gradient is the loss scaler's to skip, not a divergence
            bad = nonfinite(losses[-1], [] if hasattr(opt, "scaler") else engine.parameters())
            if bad is None:
                with tracer.span("optimizer step"):
                    opt.step()
        if bad is not None and skip_nonfinite:
            skipped.append(step)
        elif bad is not None:
            return {"losses": losses, "skipped": skipped, "stopped": (step, bad), "trace": tracer.finish()}
        if save_every and step % save_every == 0:
            # lazy: start-up: a command loads checkpoint only when it runs
            import threefold.checkpoint as ckpt
            ckpt.save(pm, opt, ckpt_dir, step=step, keep=2, extra={"losses": losses, "skipped": skipped})
    return {"losses": losses, "skipped": skipped, "stopped": None, "trace": tracer.finish()}


def run(args) -> int:
    from threefold.cli.jobs import run_on_ranks   # lazy: start-up: a command loads cli.jobs only when it runs
    # lazy: start-up: a command loads runtime.loader only when it runs
    from threefold.runtime.loader import BATCH_FILE, open_artifact
    if args.steps < 1:
        raise PlanError(f"--steps {args.steps} is invalid: use 1 or more")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise PlanError(f"--lr {args.lr} is invalid: use a positive finite learning rate")
    verify_key = None
    if args.verify is not None:
        if args.trust:
            raise PlanError("--verify and --trust contradict each other: --verify checks the signature and "
                            "every file's sha256, --trust skips the sha256 checks; pass one")
        # lazy: start-up: a command loads runtime.signing only when it runs
        from threefold.runtime.signing import read_key
        verify_key = read_key(args.verify, "--verify")
    art = open_artifact(args.dir, trust=args.trust, verify_key=verify_key)
    art.verify()        # every file against its sha256, before any rank imports or reads one
    # lazy: start-up: a command loads runtime.op_modules only when it runs
    from threefold.runtime.op_modules import check_op_modules
    check_op_modules(art.manifest.op_modules, art.root, args.trust)   # and the custom ops' modules
    if not args.trust:
        _tell_imports(art, args.verify, sys.stderr if args.json else sys.stdout)
    if not art.manifest.has_weights:
        raise PlanError(f"artifact {args.dir!r} has no weights (compiled on the meta device?); "
                        "compile a model with real weights to run it")
    if BATCH_FILE not in art.manifest.files:
        raise PlanError(f"artifact {args.dir!r} has no saved batch ({BATCH_FILE}); "
                        "recompile it with `threefold compile`")
    if not art.manifest.has_loss:
        raise PlanError(f"artifact {args.dir!r} was compiled without a loss: run trains, so compile with loss_fn")
    if args.save_every < 0:
        raise PlanError(f"--save-every {args.save_every} is invalid: use a positive step count (0: never)")
    ckpt_dir = args.ckpt_dir or os.path.abspath(art.root).rstrip("/") + ".ckpt"
    resume = None if args.resume is None else (args.resume or ckpt_dir)
    checked = None
    if resume is not None:
        # lazy: start-up: a command loads checkpoint.reader only when it runs
        from threefold.checkpoint.reader import read_checkpoint
        checked = read_checkpoint(resume)   # every field checked: one line here, before any rank starts
    trace_steps, trace_out = None, None
    if args.trace is not None:
        # lazy: start-up: a command loads outdir only when it runs
        from threefold.outdir import check_out_dir
        # lazy: start-up: a command loads runtime.trace only when it runs
        from threefold.runtime.trace import parse_steps
        trace_steps = parse_steps(args.trace_steps)
        if trace_steps[-1] > args.steps:
            raise PlanError(f"--trace-steps {args.trace_steps} goes past --steps {args.steps}: "
                            "trace steps the run reaches")
        trace_out = args.trace or os.path.abspath(art.root).rstrip("/") + ".trace"
        check_out_dir(trace_out, flag="--trace")
    from threefold.dir_lock import dir_lock   # lazy: start-up: a command loads dir_lock only when it runs
    with contextlib.ExitStack() as held:    # the checkpoints written and resumed, one run at a time
        if os.environ.get("RANK", "0") == "0":
            if args.save_every:
                held.enter_context(dir_lock(ckpt_dir, "--ckpt-dir"))
            if checked is not None:
                held.enter_context(dir_lock(os.path.dirname(os.path.abspath(checked.path)), "--resume"))
        result = run_on_ranks(_run_rank, art.manifest.mesh.world_size, art.root, args.steps, args.lr, args.trust,
                              args.skip_nonfinite, args.save_every, ckpt_dir, resume, trace_steps,
                              verify_key)[0]
    from threefold.cli.jobs import is_main_rank   # lazy: start-up: a command loads cli.jobs only when it runs
    losses, stopped = result["losses"], result["stopped"]
    if not is_main_rank():
        return 1 if stopped else 0
    if args.json:
        out = {"plan": str(art.plan), "losses": losses, "skipped_steps": result["skipped"]}
        if stopped:
            out.update(stopped_at_step=stopped[0], reason=f"non-finite {stopped[1]}")
        print(dumps(out))
    else:
        for i, loss in enumerate(losses, start=1):
            print(f"step {i}: loss {loss:.6f}" + (" (skipped: not finite)" if i in result["skipped"] else ""))
    if result.get("trace"):
        _write_trace(trace_out, result["trace"], args.json)
    if stopped:
        # lazy: start-up: a command loads cli.divergence only when it runs
        from threefold.cli.divergence import stop_message
        print(stop_message("run", *stopped), file=sys.stderr)
        return 1
    return 0


def _tell_imports(art, key_file: str | None, stream) -> None:
    """An artifact is code: say which of its modules this run imports, with the sha256 each
    was checked against (once per job, before any rank starts; --trust leaves it out). On
    stdout before the losses, or on stderr under --json (stdout is then the JSON alone)."""
    if os.environ.get("RANK", "0") != "0":
        return
    modules = sorted(f for f in art.manifest.files if f.endswith(".py"))
    who = (f"its signature under {key_file} verified" if key_file else
           "unsigned: run only artifacts from a source you trust (compile --sign / run --verify KEYFILE)")
    lines = [f"threefold run: {art.root} is code; importing {len(modules)} modules ({who}):"]
    lines += [f"  {m}  sha256 {art.manifest.files[m]}" for m in modules]
    print("\n".join(lines), file=stream, flush=True)


def _write_trace(out: str, trace: dict, quiet: bool) -> None:
    """OUT/trace.json and OUT/trace.html (built aside and renamed, as every --out), and the
    summary's trace lines on stderr (stdout stays the losses or the JSON)."""
    # lazy: start-up: a command loads cli.train_cmd only when it runs
    from threefold.cli.train_cmd import trace_lines
    from threefold.outdir import write_out_dir   # lazy: start-up: a command loads outdir only when it runs
    # lazy: start-up: a command loads report.trace_page only when it runs
    from threefold.report.trace_page import trace_html
    # lazy: start-up: a command loads train.report only when it runs
    from threefold.train.report import trace_summary

    def fill(tmp: str) -> None:
        with open(os.path.join(tmp, "trace.json"), "w") as f:
            f.write(dumps(trace))
        with open(os.path.join(tmp, "trace.html"), "w", encoding="utf-8") as f:
            f.write(trace_html(trace))
    write_out_dir(out, fill, kind="trace", flag="--trace")
    if not quiet:
        print("\n".join(trace_lines(trace_summary(trace, os.path.abspath(out)))), file=sys.stderr)
