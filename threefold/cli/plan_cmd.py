"""`threefold plan`: choose tp, pp, dp, microbatch size, interleaving and recomputation.

Prints the best plans for a model, a global batch and a cluster, ranked by predicted
throughput, with what each costs (see threefold/planner/estimate.py for the model).
"""
from __future__ import annotations

import argparse
import sys

from threefold.cli.jsonout import dumps
from threefold.errors import PlanError
from threefold.planner.cluster import REQUIRED, load_cluster, preset_names
from threefold.planner.constraints import Constraints
from threefold.planner.estimate import MEASURED_BEST_PEAK_FRACTION
from threefold.planner.gpt_cost import gpt_model_cost
from threefold.planner.record import plan_record
from threefold.planner.search import rank_plans

SHARES = ("compute", "bubble", "tp", "pp", "dp", "optimizer")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", help="choose tp/pp/dp, microbatch size, interleaving and recompute for a cluster",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Enumerate every legal (tp, pp, dp, microbatch size b, interleave v, recompute) for a\n"
        "model on a cluster; estimate memory per GPU (weights, grads, Adam states, the schedule's\n"
        "in-flight activations) and time per iteration with the performance model of Narayanan et\n"
        "al. (SC'21): compute (Eq. 3 FLOPs on a roofline), pipeline bubble, tensor-parallel\n"
        "all-reduces, pipeline sends with scatter/gather, data-parallel all-reduce. Plans that do\n"
        "not fit are dropped; the rest are ranked by predicted time per iteration (throughput).\n"
        "TFLOP/s count the FLOPs a plan executes (Eq. 3: recomputation adds a forward pass).",
        epilog="model: give a SPEC (path/file.py:factory, costs from the traced program) or a GPT shape "
        "(--layers --hidden --heads [--vocab --seq --kv-heads --ffn --mlp swiglu --no-tied]).\n"
        f"cluster: a preset ({', '.join(preset_names())}) or a TOML file with keys "
        f"{', '.join(REQUIRED)} (optional: kernel_launch_s, intra_node_latency_s, inter_node_latency_s, "
        "reserved_bytes).\n"
        "examples:\n"
        "  threefold plan --layers 128 --hidden 25600 --heads 160 --batch 3072 --gpus 3072\n"
        "  threefold plan --layers 96 --hidden 12288 --heads 96 --batch 1536 --gpus 1024 --evaluate tp=8,pp=16\n"
        "  threefold plan --layers 80 --hidden 8192 --heads 64 --kv-heads 8 --ffn 28672 --mlp swiglu --no-tied \\\n"
        "      --vocab 128256 --seq 4096 --batch 512 --gpus 64 --cluster h100-80gb   # Llama-3-70B\n"
        "  threefold plan examples/gpt.py:workload --batch 64 --gpus 8 --cluster h100-80gb --json")
    p.add_argument("spec", nargs="?", metavar="SPEC",
                   help="workload path/file.py:factory (model costs from the traced program)")
    shape = p.add_argument_group("GPT shape (instead of a SPEC)")
    shape.add_argument("--layers", type=int, help="transformer layers l")
    shape.add_argument("--hidden", type=int, help="hidden size h")
    shape.add_argument("--heads", type=int, help="attention heads a (tp must divide it)")
    shape.add_argument("--vocab", type=int, default=51200, help="vocabulary size V (default 51200)")
    shape.add_argument("--seq", type=int, default=2048, help="sequence length s (default 2048; from "
                       "16384 on the search includes context parallelism cp)")
    shape.add_argument("--kv-heads", type=int, help="key/value heads (grouped-query attention; default --heads)")
    shape.add_argument("--ffn", type=int, help="MLP intermediate size (default 4h; Llama-3-70B: 28672)")
    shape.add_argument("--mlp", choices=("gelu", "swiglu"), default="gelu",
                       help="gelu: GPT's fc1, GeLU, fc2 (default); swiglu: Llama's gate, up, down (and rotary positions, "
                       "no dropout; with --experts the rest of a Mixtral)")
    shape.add_argument("--attention", choices=("eager", "flash"), default=None,
                       help="eager: s x s scores in memory (the paper's GPT; default with gelu); flash: one fused "
                       "kernel (default with swiglu)")
    shape.add_argument("--tied", action=argparse.BooleanOptionalAction, default=True,
                       help="input and output embeddings share one matrix (default; --no-tied: Llama-3)")
    shape.add_argument("--experts", type=int, help="MoE: experts E per layer (each MLP becomes a top-k "
                       "mixture of SwiGLU experts; the search then includes ep)")
    shape.add_argument("--top-k", type=int, default=2, help="MoE: experts per token k (default 2)")
    shape.add_argument("--expert-ffn", type=int, help="MoE: one expert's intermediate size (default --ffn, else 4h/k)")
    p.add_argument("--batch", type=int, required=True, help="global batch size in sequences B")
    p.add_argument("--gpus", type=int, required=True, help="GPUs to use (tp*cp*pp*dp)")
    p.add_argument("--cluster", default="a100-80gb",
                   help="preset name or cluster TOML file (default a100-80gb, the paper's DGX A100 cluster)")
    p.add_argument("--dtype", default="bf16", help="compute dtype for peak FLOP/s (default bf16)")
    p.add_argument("--tp-across-nodes", action="store_true",
                   help="also consider tensor parallelism spanning nodes (over InfiniBand)")
    p.add_argument("--evaluate", metavar="PLAN",
                   help="score only plans matching a partial plan, e.g. tp=8,pp=64 (keys tp, pp, dp, m, "
                        "b, v, schedule, recompute); plans that do not fit are listed too")
    # lazy: start-up: a command loads cli.plan_verify only when it runs
    from threefold.cli.plan_verify import add_flag
    add_flag(p)   # --verify K (cli/plan_verify.py)
    p.add_argument("--top", type=int, default=10, help="plans to show (default 10; 0 = all)")
    p.add_argument("--json", action="store_true",
                   help='print only JSON: {"plans": [{tp, pp, dp, microbatch_size, interleave, recompute, '
                        'predicted_tflops_per_gpu, memory_per_gpu_bytes, bubble_fraction, fits, ...}]}, best first')
    p.add_argument("--svg", metavar="FILE", help="draw the best plan's pipeline timeline to FILE")
    p.set_defaults(func=run)


def model_from_args(args):
    shape = [args.layers, args.hidden, args.heads]
    if args.spec and any(v is not None for v in shape):
        raise PlanError("plan takes a SPEC or a GPT shape (--layers --hidden --heads), not both: drop one")
    if args.spec:
        # lazy: start-up: a command loads cli.phases only when it runs
        from threefold.cli.phases import Phases
        # lazy: start-up: a command loads planner.spec_cost only when it runs
        from threefold.planner.spec_cost import model_cost_from_spec
        with Phases("plan", enabled=not args.json, what="costing the SPEC") as progress:
            return model_cost_from_spec(args.spec, progress=progress)
    if any(v is None for v in shape):
        missing = [n for n, v in zip(("--layers", "--hidden", "--heads"), shape) if v is None]
        raise PlanError(f"plan needs a model: give a SPEC, or {', '.join(missing)} for a GPT shape")
    if args.experts is not None:
        # lazy: start-up: a command loads planner.moe only when it runs
        from threefold.planner.moe import moe_model_cost
        if args.ffn is not None and args.expert_ffn is not None and args.ffn != args.expert_ffn:
            raise PlanError(f"--ffn {args.ffn} and --expert-ffn {args.expert_ffn} disagree: with --experts "
                            "every MLP is an expert, so give its width once (--expert-ffn)")
        # with --experts every MLP is an expert: --ffn is its width (Mixtral's intermediate_size)
        ffn = args.expert_ffn or args.ffn or 4 * args.hidden // max(1, args.top_k)
        return moe_model_cost(args.layers, args.hidden, args.heads, args.experts, args.top_k, ffn,
                              args.vocab, args.seq, kv_heads=args.kv_heads, tied=args.tied, mlp=args.mlp,
                              attention=args.attention or ("flash" if args.kv_heads or not args.tied else None))
    return gpt_model_cost(args.layers, args.hidden, args.heads, args.vocab, args.seq, ffn=args.ffn,
                          kv_heads=args.kv_heads, mlp=args.mlp, tied=args.tied,
                          attention=args.attention)


def run(args) -> int:
    if args.top < 0:
        raise PlanError(f"--top {args.top} is invalid: give a count, or 0 for all plans")
    if args.svg:
        # lazy: start-up: a command loads outdir only when it runs
        from threefold.outdir import check_out_file
        check_out_file(args.svg, "--svg")     # before the search, not after it
    model = model_from_args(args)
    cluster = load_cluster(args.cluster)
    where = Constraints.parse(args.evaluate) if args.evaluate else Constraints()
    plans = rank_plans(model, args.batch, args.gpus, cluster, args.dtype, args.tp_across_nodes,
                       where, include_unfit=bool(args.evaluate))
    if not plans:
        raise PlanError(f"no plan for {model.name} fits in {cluster.usable_bytes / 2**30:.1f} GiB per GPU "
                        f"on {args.gpus} GPUs of {cluster.name}: add GPUs, lower --batch, allow "
                        "--tp-across-nodes, or use a larger-memory cluster")
    if getattr(args, "verify", 0):
        # lazy: start-up: a command loads cli.plan_verify only when it runs
        from threefold.cli.plan_verify import verify_plans
        plans = verify_plans(args, plans)
        if not plans:
            raise PlanError(f"every plan dry-run with --verify {args.verify} failed (see above) and none is left")
    shown = plans if args.top == 0 else plans[: args.top]
    if args.svg:
        if plans[0].fits:
            # lazy: start-up: a command loads planner.timeline only when it runs
            from threefold.planner.timeline import timeline_svg
            try:
                with open(args.svg, "w") as f:
                    f.write(timeline_svg(plans[0]))
            except OSError as exc:
                raise PlanError(f"--svg {args.svg!r} cannot be written ({exc.strerror}): give a writable path") from None
        else:
            print(f"threefold plan: no timeline written to {args.svg}: no matching plan fits", file=sys.stderr)
    if args.json:
        peak = cluster.peak(args.dtype)
        print(dumps({"model": model.name, "params": model.params, "cluster": cluster.name,
                          "gpus": args.gpus, "batch": args.batch, "dtype": args.dtype,
                          "ceiling": {"device": cluster.device_name, "peak_fraction": cluster.measured_best_fraction,
                                      "tflops_per_gpu": round(cluster.measured_best_fraction * peak / 1e12, 3),
                                      "source": cluster.measured_best_source},
                          "plans": [plan_record(e) for e in shown]}, indent=2))
    else:
        _print_report(model, cluster, args, plans, shown, where)
    if args.evaluate and not plans[0].fits:
        return 1   # a check that ran and failed: nothing matching the plan fits
    return 0


def _row(rank: int, e) -> list[str]:
    c = e.config
    shares = "/".join(f"{100 * e.shares[k]:.0f}" for k in SHARES)
    return [str(rank), f"tp{c.tp}" + (f" cp{c.plan.cp}" if c.plan.cp > 1 else "")
            + f" pp{c.pp} dp{c.dp} b{c.microbatch_size} v{c.interleave}"
            + (" rc" if c.recompute else " sel" if c.plan.recompute == "selective" else "")
            + (f" z{c.plan.zero}" if c.plan.zero else "") + (f" ep{c.plan.ep}" if c.plan.ep > 1 else ""),
            c.plan.schedule,
            f"{e.tflops_per_gpu:.1f} ({e.peak_fraction:.0%})" + ("*" if e.capped else ""),
            f"{e.memory_bytes / 2**30:.1f}" + ("" if e.fits else " !"), f"{e.bubble_fraction:.1%}",
            f"{e.iteration_s:.3g}", shares]


# Two-line headers keep the terminal table within 80 columns; plain text joins the lines.
HEADERS = ["#", "plan", "schedule", "TFLOP/s/GPU\n(% peak)", "GiB\n/GPU", "bubble", "iter\ns", "time\nshares %"]
LEGEND = ("rc = recompute=full, sel = recompute=selective, zN = zero=N (ZeRO stage), epN = ep=N; time shares % = " + "/".join(SHARES)
          + "; ranked by predicted time per iteration; TFLOP/s count executed FLOPs (Eq. 3: "
          "recompute adds a forward)")


def _print_report(model, cluster, args, plans, shown, where) -> None:
    peak = cluster.peak(args.dtype)
    best = plans[0]
    lines = [f"model {model.name}: {model.params / 1e9:.2f}B parameters; batch {args.batch} on "
             f"{args.gpus} GPUs of {cluster.name} ({peak / 1e12:.0f} TFLOP/s {args.dtype} peak, "
             f"{cluster.usable_bytes / 2**30:.1f} GiB usable)"]
    if where != Constraints():
        lines.append(f"evaluating plans matching {where}; '!' marks plans that do not fit")
    rows = [_row(i + 1, e) for i, e in enumerate(shown)]
    why = explain(plans, where) if best.fits else []
    footer = [LEGEND, f"best: {best.config.plan} (microbatch size {best.config.microbatch_size})"] + why
    if any(e.capped for e in shown):
        footer.append(ceiling_note(cluster, args.dtype))
    if sys.stdout.isatty():
        from rich.console import Console   # lazy: rich loads only for the progress display
        from rich.table import Table   # lazy: rich loads only for the progress display
        console = Console()
        for line in lines:
            console.print(line, highlight=False)
        from rich import box   # lazy: rich loads only for the progress display
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
        for header in HEADERS:
            table.add_column(header, no_wrap=True)
        for r in rows:
            table.add_row(*r)
        console.print(table)
        for line in footer:
            console.print(line, highlight=False)
        return
    headers = [h.replace("\n/", "/").replace("\n", " ") for h in HEADERS]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print("\n".join(lines))
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip())
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    print("\n".join(footer))


def ceiling_note(cluster, dtype: str) -> str:
    """The footnote of a plan held at the measured ceiling: the cap as a fraction of this
    cluster's device peak, naming the device and who measured it."""
    peak, frac = cluster.peak(dtype), cluster.measured_best_fraction
    return (f"* held at {frac:.0%} of the {cluster.device_name}'s {peak / 1e12:.0f} TFLOP/s {dtype} peak "
            f"({frac * peak / 1e12:.0f} TFLOP/s per GPU), the best measured for this training on it "
            f"({cluster.measured_best_source}); the model's own sum was higher")


def explain(plans, where: Constraints = Constraints()) -> list[str]:
    """Why the best plan: for each knob, the fastest fitting plan that sets it differently."""
    best = plans[0]
    out = []
    for key, label in _KNOBS:
        if key == "ep" and all(e.config.plan.ep == 1 for e in plans):
            continue   # a dense model: ep is no choice (and golden outputs stay as they were)
        mine = _knob(best.config, key)
        if getattr(where, key) is not None:
            out.append(f"  {label}={_fmt(mine)}: fixed by --evaluate")
            continue
        other = next((e for e in plans if e.fits and _knob(e.config, key) != mine), None)
        if other is None:
            out.append(f"  {label}={_fmt(mine)}: the only value that fits")
            continue
        slower = (other.model_s or other.iteration_s) / (best.model_s or best.iteration_s) - 1   # the model's own times
        verdict = f"is {slower:.1%} slower" if slower >= 0.0005 else "is as fast (a tie)"
        out.append(f"  {label}={_fmt(mine)}: the best plan with {label}={_fmt(_knob(other.config, key))} "
                   f"({other.config.plan}, b={other.config.microbatch_size}) {verdict}")
    return ["why:"] + out


# (Constraints field, label): the knobs `why` explains, spelt as the best plan's text spells them
_KNOBS = (("tp", "tp"), ("pp", "pp"), ("microbatch_size", "b"), ("interleave", "v"),
          ("schedule", "schedule"), ("recompute", "recompute"), ("zero", "zero"), ("ep", "ep"))


def _knob(config, key: str):
    """A knob's value as the plan says it (recompute: none/selective/full, not full-or-not)."""
    if key in ("schedule", "recompute", "zero", "ep"):
        return getattr(config.plan, key)
    return getattr(config, key)


def _fmt(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
