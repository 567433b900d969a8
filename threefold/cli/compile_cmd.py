"""`threefold compile SPEC --plan PLAN --out DIR`: compile a workload and save the artifact.

The artifact directory holds manifest.json, one generated module per chunk (shared by its
tp ranks), the weight shards per (chunk, tp rank) (none for models built on the meta
device); `threefold run` and the runtime load it without the model's source. Progress (the stage and pass running) shows on
stderr while a terminal is attached.
"""
from __future__ import annotations

import time

from threefold.cli.jsonout import dumps
from threefold.plan import Plan
from threefold.workload import load_spec


def register(sub) -> None:
    p = sub.add_parser(
        "compile", help="compile a workload for a plan into an artifact directory",
        description="Trace the workload, run the compiler passes for PLAN, generate one Python "
        "module per pipeline chunk (shared by the chunk's tp ranks: the tp rank is a run-time value) "
        "and write them with manifest.json and the weight shards, one file per (chunk, tp rank) "
        "(safetensors, keyed by the model's parameter names), into DIR. DIR is built in a "
        "temporary sibling and renamed into place; an existing DIR is replaced only if threefold "
        "wrote it (a non-empty directory of other files is refused unless --force, which moves it "
        "aside; nothing is deleted).")
    p.add_argument("spec", metavar="SPEC", help="workload: path/to/file.py:factory or pkg.module:factory")
    p.add_argument("--plan", default="", help="e.g. 'tp=2,pp=4,m=8' (default: one chunk; m left out: 2*pp)")
    p.add_argument("--out", required=True, metavar="DIR", help="artifact directory to write")
    p.add_argument("--force", action="store_true",
                   help="write even if DIR holds files threefold did not write (DIR is moved aside)")
    p.add_argument("--no-weights", action="store_true", help="write code and manifest only")
    p.add_argument("--sign", metavar="KEYFILE", default=None,
                   help="sign the artifact: HMAC-SHA256 of its manifest (which hashes every file) under "
                        "the key in KEYFILE, written as manifest.json.hmac; `run --verify KEYFILE` checks it")
    p.add_argument("--json", action="store_true", help="print one JSON summary object")
    p.set_defaults(func=run)


def run(args) -> int:
    from threefold.outdir import check_out_dir   # lazy: start-up: a command loads outdir only when it runs

    Plan.parse_fields(args.plan)               # a malformed --plan fails before any work
    check_out_dir(args.out, args.force)        # before any work: a bad --out loses nothing
    sign_key = None
    if args.sign is not None:                  # a bad key file fails before any work, too
        # lazy: start-up: a command loads runtime.signing only when it runs
        from threefold.runtime.signing import read_key
        sign_key = read_key(args.sign, "--sign")
    from threefold.dir_lock import dir_lock   # lazy: start-up: a command loads dir_lock only when it runs
    with dir_lock(args.out):                   # one compile (or run) per --out at a time
        return _compile(args, sign_key)


def _compile(args, sign_key) -> int:
    # lazy: start-up: a command loads codegen.artifact only when it runs
    from threefold.codegen.artifact import build_sources, save_artifact
    # lazy: start-up: a command loads compiler.api only when it runs
    from threefold.compiler.api import compile_workload
    timings: dict[str, float] = {}
    with _Progress() as progress:
        start = time.perf_counter()
        progress("load SPEC")
        workload = load_spec(args.spec)
        timings["load"] = time.perf_counter() - start
        # lazy: start-up: a command loads cli.jobs only when it runs
        from threefold.cli.jobs import command_plan, tell
        # lazy: start-up: a command loads plan_defaults only when it runs
        from threefold.plan_defaults import batch_rows
        resolved = command_plan(args.plan, batch=batch_rows(workload.inputs, workload.batch_dims))
        plan = resolved.plan
        prog = compile_workload(workload, plan, progress=progress)
        tell(resolved)
        progress("codegen")
        t = time.perf_counter()
        sources = build_sources(prog)
        timings["codegen"] = time.perf_counter() - t
        progress("write artifact")
        t = time.perf_counter()
        batch = tuple(workload.inputs) + ((workload.target,) if workload.loss_fn is not None else ())
        art = save_artifact(prog, args.out, sources, weights=not args.no_weights, batch=batch,
                            force=args.force, sign_key=sign_key)
        timings["write"] = time.perf_counter() - t
        timings["total"] = time.perf_counter() - start
    for name, seconds in prog.pass_log:
        timings[name] = seconds
    with_weights = art.manifest.has_weights
    summary = {
        "out": art.root, "model": prog.name, "plan": str(plan), "chunks": len(prog.chunks),
        "files": sorted(f for f in art.manifest.files if f.endswith(".py")), "weights": with_weights,
        "signed": sign_key is not None,
        "seconds": {k: round(v, 3) for k, v in timings.items()},
    }
    if args.json:
        print(dumps(summary, indent=2))
        return 0
    why = "" if with_weights else (" (meta model: no weights)" if prog.is_meta else " (--no-weights)")
    print(f"compiled {prog.name} for plan {plan} into {art.root}: {len(prog.chunks)} chunks, "
          f"{len(summary['files'])} modules, weights {'saved' if with_weights else 'not saved'}{why}"
          + (f", signed with {args.sign}" if sign_key is not None else ""))
    passes = "  ".join(f"{name} {seconds:.2f}s" for name, seconds in prog.pass_log)
    print(f"time: total {timings['total']:.2f}s = load {timings['load']:.2f}s  {passes}  "
          f"codegen {timings['codegen']:.2f}s  write {timings['write']:.2f}s")
    return 0


class _Progress:
    """A rich status line on stderr naming the running stage (silent when not a terminal)."""

    def __enter__(self):
        self._status = None
        try:
            from rich.console import Console   # lazy: rich loads only for the progress display
            console = Console(stderr=True)
            if console.is_terminal:
                self._status = console.status("compiling")
                self._status.__enter__()
        except ImportError:
            pass
        return self

    def __call__(self, stage: str) -> None:
        if self._status is not None:
            label = "trace (torch.export)" if stage == "trace" else stage
            self._status.update(f"compiling: {label}")

    def __exit__(self, *exc):
        if self._status is not None:
            self._status.__exit__(*exc)
        return False
