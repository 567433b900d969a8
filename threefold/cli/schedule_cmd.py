"""`threefold schedule`: build a pipeline schedule, verify it, show its step x rank grid.

    threefold schedule --pp 4 -m 8 [-v 2] [--schedule gpipe|1f1b|interleaved|zb-h1|zbv|forward]
                       [--json] [--svg FILE]

Times are the simulator's unit costs: forward 1, backward 2 per chunk, free communication;
zero-bubble schedules (zb-h1, zbv) split the backward into B 1 and W 1 (T_F = T_B = T_W).
Exit 0 when the schedule verifies, 1 when the verifier rejects it, 2 for bad input.
"""
from __future__ import annotations

import sys

from threefold.cli.jsonout import dumps
from threefold.errors import PlanError
from threefold.runtime.schedule import KINDS, Kind, ScheduleError, make_schedule
from threefold.runtime.simulate import Report, verify

BUBBLE_NOTE = ("bubble fraction = idle / (pp * makespan), the share of rank-time spent idle; "
               "bubble ratio = idle / busy, the paper's (p-1)/(v*m)")


def register(subparsers) -> None:
    p = subparsers.add_parser("schedule", help="show and verify a pipeline schedule (step x rank grid)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, required=True, help="pipeline stages")
    p.add_argument("-m", "--microbatches", type=int, required=True, help="microbatches per iteration")
    p.add_argument("-v", "--interleave", type=int, default=None,
                   help="model chunks per stage (interleaved; zbv is always 2)")
    p.add_argument("--schedule", default="1f1b", metavar="KIND", help=f"one of {', '.join(KINDS)} (default 1f1b)")
    p.add_argument("--forward-only", action="store_true", help="same as --schedule forward (inference)")
    p.add_argument("--json", action="store_true", help="print the verifier's report as JSON")
    p.add_argument("--svg", metavar="FILE", help="write the timeline as an SVG picture")
    p.set_defaults(func=run)


MAX_ACTIONS = 100_000    # compute actions (pp * v * m * 2); the verifier and grid stay quick
MAX_GRID_ACTIONS = 4_000  # the text grid is for people; bigger schedules print --json only


def run(args) -> int:
    kind = "forward" if args.forward_only else args.schedule
    if args.interleave is None:   # zbv runs two chunks per stage in a V; others default to one
        args.interleave = 2 if str(kind).lower().replace("_", "-") in ("zbv", "zb-v") else 1
    for flag, value in (("--pp", args.pp), ("-m", args.microbatches), ("-v", args.interleave)):
        if value < 1:
            raise PlanError(f"{flag} {value} is invalid: use 1 or more")
    split = str(kind).lower().replace("_", "-") in ("zb-h1", "zbh1", "zbv", "zb-v")
    actions = args.pp * args.interleave * args.microbatches * (3 if split else 2)   # F, B (and W)
    if actions > MAX_ACTIONS:
        raise PlanError(f"schedule --pp {args.pp} -m {args.microbatches} -v {args.interleave} has {actions} "
                        f"compute actions, more than {MAX_ACTIONS} this command simulates; use fewer stages "
                        "or microbatches")
    if actions > MAX_GRID_ACTIONS and not args.json:
        raise PlanError(f"schedule with {actions} compute actions is too big to draw as a grid: add --json "
                        f"(or keep pp*v*m*2 at most {MAX_GRID_ACTIONS})")
    if args.svg:
        # lazy: start-up: a command loads outdir only when it runs
        from threefold.outdir import check_out_file
        check_out_file(args.svg, "--svg")
    schedule = make_schedule(kind, args.pp, args.microbatches, args.interleave)   # PlanError -> exit 2
    try:
        report = verify(schedule)
    except ScheduleError as exc:
        print(f"threefold schedule: check failed: {exc}", file=sys.stderr)
        return 1
    if args.svg:
        # lazy: start-up: a command loads runtime.timeline_svg only when it runs
        from threefold.runtime.timeline_svg import render_svg
        # lazy: start-up: a command loads outdir only when it runs
        from threefold.outdir import write_file_atomically
        write_file_atomically(args.svg, render_svg(report.simulation))
    if args.json:
        print(dumps(report.to_json(), indent=2))
    else:
        _print_text(report)
        if args.svg:
            print(f"timeline written to {args.svg}")
    return 0


def grid_cells(report: Report) -> list[list[tuple[str, str]]]:
    """Per rank, one (text, role) per unit time step; role is F, B, W, cont-F, cont-B, cont-W
    or idle."""
    sim = report.simulation
    steps = int(round(sim.makespan))
    rows = []
    for r, acts in enumerate(report.schedule.actions):
        row = [("", "idle")] * steps
        for a, t0, t1 in zip(acts, sim.start[r], sim.end[r]):
            if a.is_compute:
                role = a.kind.value   # F, B or W
                for t in range(int(t0), int(t1)):
                    row[t] = (f"{role}{a.chunk}.{a.mb}", role) if t == int(t0) else ("", "cont-" + role)
        rows.append(row)
    return rows


def _print_text(report: Report) -> None:
    s = report.schedule
    rows = grid_cells(report)
    width = max([4] + [len(text) for row in rows for text, _ in row])
    try:
        from rich.console import Console   # lazy: rich loads only for the progress display
        from rich.text import Text   # lazy: rich loads only for the progress display
        console = Console(highlight=False)
    except ImportError:   # plain fallback
        console = Text = None
    styles = {"F": "bold white on blue", "cont-F": "on blue", "B": "bold white on green",
              "cont-B": "on green", "W": "bold white on dark_orange", "cont-W": "on dark_orange",
              "idle": "dim"}
    plain = {"cont-F": "-" * width, "cont-B": "-" * width, "cont-W": "-" * width, "idle": ".".center(width)}

    def emit(parts: list[tuple[str, str]]) -> None:
        if console is None:
            print(" ".join(plain.get(role, text.ljust(width)) if role != "label" else text
                           for text, role in parts))
            return
        line = Text()
        for i, (text, role) in enumerate(parts):
            if i:
                line.append(" ")
            if role == "label":
                line.append(text)
            else:
                cell = text.ljust(width) if role in ("F", "B", "W") else (" " * width if role.startswith("cont")
                                                                     else ".".center(width))
                line.append(cell, style=styles[role])
        console.print(line, soft_wrap=True)

    label_w = len(f"rank {s.pp - 1}")
    costs = ("B (input grads) 1, W (weight grads) 1" if s.splits_backward else "backward 2")
    print(f"{s.name} schedule: pp={s.pp} m={s.m} v={s.v}  (step = 1 forward; {costs}; cells chunk.microbatch)")
    header = [("step".ljust(label_w), "label")] + [(str(t).rjust(width), "label") for t in range(len(rows[0]))]
    emit(header)
    for r, row in enumerate(rows):
        emit([(f"rank {r}".ljust(label_w), "label")] + list(row))
    print(f"makespan            {report.makespan:g} steps "
          f"({report.rendezvous_makespan:g} if every send blocks until its receive is posted)")
    print(f"bubble fraction     {report.bubble_fraction:.4f}   idle / (pp * makespan)")
    formula = {"zb-h1": "(p-1)/(3m)", "zbv": "(p-1)/(6m)"}.get(s.name, "(p-1)/(v*m)")
    print(f"bubble ratio        {report.bubble_ratio:.4f}   idle / busy; paper formula "
          f"{formula} = {report.formula_bubble_ratio:.4f}")
    bound = "" if report.inflight_bound is None else f"   (bound {report.inflight_bound})"
    print(f"max in-flight       {report.max_inflight}   activations held per rank{bound}")
    if report.simulation.max_weight_inflight is not None:
        print(f"kept for W          {report.simulation.max_weight_inflight}   microbatches whose W has not run, per rank")
    print("verified            no deadlock (even with blocking sends), sends match receives in order, "
          "forward before backward")
