"""cp=2 over the zoo, compile only: per arch pass / all-gather fallbacks used / refused (with the
one-line reason). Compile decides every cp refusal; parity of what compiles is the tests' job.

    python bench/cp_zoo_survey.py [arch ...] [--rows N] [--seq N] [--plan cp=4] [--json out.json]

The zoo's own token batches (tests/zoo/common.token_batch: 4 rows of 8 tokens, so cp=2's local
length equals the batch and a sliding window of 4) unless `--rows` / `--seq` say otherwise
(`--seq 7`: a length 2*cp does not divide, padded to 2cp blocks, passes/cp_padding.py; the
padding each pass adds is printed: extra positions over real ones).
"""
from __future__ import annotations

import json
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]   # bench/kernels.py shadows `kernels`
sys.path.insert(0, os.path.dirname(_HERE))


def survey(archs: list, plan: str = "cp=2", rows: int | None = None, seq: int | None = None) -> dict:
    import torch
    from threefold.compiler.api import compile_workload
    from threefold.errors import PlanError
    from tests.zoo import ZOO, common
    torch.set_num_threads(1)
    vocab, batch, length, seed = common.token_batch.__defaults__
    common.token_batch.__defaults__ = (vocab, rows or batch, seq or length, seed)
    out = {}
    for a in archs or list(ZOO):
        try:
            prog = compile_workload(ZOO[a](), plan)
            falls = [n.split(" mixes")[0].removeprefix("cp fallback: ") for n in prog.notes
                     if n.startswith("cp fallback:")]
            out[a] = {"verdict": "fallback" if falls else "pass", "fallbacks": falls}
            if getattr(prog, "seq_tail", 0):   # positions added per sequence / real ones
                whole = prog.seq_len * prog.plan.cp
                out[a]["padding"] = f"{whole - prog.seq_tail}->{whole} (+{prog.seq_tail / (whole - prog.seq_tail):.1%})"
        except PlanError as exc:
            out[a] = {"verdict": "refused", "msg": str(exc)[:300]}
        except Exception as exc:   # a crash is a bug, counted apart
            out[a] = {"verdict": "crash", "msg": f"{type(exc).__name__}: {str(exc)[:300]}"}
        print(f"{a:<26} {out[a]['verdict']:<9} {out[a].get('msg', '') or ', '.join(out[a]['fallbacks'])}"
              f"{'  padded ' + out[a]['padding'] if out[a].get('padding') else ''}", flush=True)
    return out


def main(argv: list) -> None:
    import argparse
    parser = argparse.ArgumentParser(description="cp over the zoo, compile only: per architecture pass / "
                                     "all-gather fallbacks used / refused (one line) / crash, then the counts.")
    parser.add_argument("archs", nargs="*", help="zoo architectures (default: all of tests/zoo)")
    parser.add_argument("--plan", default="cp=2", help="the plan to compile (default cp=2)")
    parser.add_argument("--rows", type=int, help="rows per token batch (default: the zoo's 4)")
    parser.add_argument("--seq", type=int, help="tokens per row (default: the zoo's 8; 7 pads under cp=2)")
    parser.add_argument("--json", dest="dest", help="also write the verdicts to this JSON file")
    args = parser.parse_args(argv)
    res = survey(args.archs, args.plan, rows=args.rows, seq=args.seq)
    counts = {}
    for r in res.values():
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    print(counts)
    if args.dest:
        with open(args.dest, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
