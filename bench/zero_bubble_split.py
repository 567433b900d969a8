"""What the zero-bubble B/W split costs against the fused backward (issue 25 item 3).

    python bench/zero_bubble_split.py [--iters N] [--layers L] [--json]

One process, one thread, CPU time of this thread (time.thread_time: steadier than wall time
on a shared machine). Two tables, each side by side in one run, the contenders alternating:

  * per op (256 rows x 256 features, fp32): forward and backward of the op fused, split
    with the written-out rules (runtime/weight_grad_ops.py) and split on the generic path
    (the op's local autograd graph differentiated twice, as every op but linear was before);
  * per chunk: the bench model of bench/pipeline_bubbles.py (GPT, n_embd 256, seq 128,
    global batch 16, m=8) as one chunk, per microbatch: F, B, W and B+W / fused backward,
    for 1f1b (fused), zb-h1 (written out) and zb-h1 with only linear written out (before).

Goal: B + W no more than the fused backward.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

from threefold.runtime import weight_grad  # noqa: E402

aten = torch.ops.aten
ROWS, H, V = 256, 256, 256


@contextlib.contextmanager
def written_out_only(ops):
    """Restrict the written-out rules to `ops` (None: all); the rest take the generic path."""
    real = weight_grad.written_out
    if ops is not None:
        weight_grad.written_out = lambda op, *a: real(op, *a) if op in ops else None
    try:
        yield
    finally:
        weight_grad.written_out = real


class _Holder:
    weight_stash = None


def _op_cases():
    def ln():
        x = torch.randn(ROWS, H, requires_grad=True)
        w, b = torch.nn.Parameter(torch.ones(H)), torch.nn.Parameter(torch.zeros(H))
        return aten.layer_norm.default, (x, [H], w, b, 1e-5), (2, 3), (w, b)

    def emb():
        w = torch.nn.Parameter(torch.randn(V, H))
        return aten.embedding.default, (w, torch.randint(0, V, (ROWS,))), (0,), (w,)

    def mul():
        w = torch.nn.Parameter(torch.randn(H))
        return aten.mul.Tensor, (w, torch.randn(ROWS, H, requires_grad=True)), (0,), (w,)

    def lin():
        x = torch.randn(ROWS, H, requires_grad=True)
        w, b = torch.nn.Parameter(torch.randn(4 * H, H)), torch.nn.Parameter(torch.zeros(4 * H))
        return aten.linear.default, (x, w, b), (1, 2), (w, b)

    def addmm():
        x = torch.randn(ROWS, H, requires_grad=True)
        w, b = torch.nn.Parameter(torch.randn(H, 4 * H)), torch.nn.Parameter(torch.zeros(4 * H))
        return aten.addmm.default, (b, x, w), (0, 2), (b, w)
    return {"layer_norm": ln, "embedding": emb, "mul": mul, "linear": lin, "addmm": addmm}


def op_table(iters: int) -> dict:
    modes = {"fused": ("fused", None), "written out": ("split", None), "generic": ("split", ())}
    out = {}
    for name, make in _op_cases().items():
        res = {m: [] for m in modes}
        for it in range(iters + 5):
            for mode, (kind, ops) in (modes.items() if it % 2 else reversed(modes.items())):
                op, args, weights, params = make()
                h = _Holder()
                h.weight_stash = [] if kind == "split" else None
                with written_out_only(ops):
                    t0 = time.thread_time()
                    y = weight_grad.deferred(h, op, args, weights=weights, params=params)
                    t1 = time.thread_time()
                    y.backward(torch.ones_like(y))
                    if h.weight_stash is not None:
                        weight_grad.run_deferred(h.weight_stash)
                    t2 = time.thread_time()
                if it >= 5:
                    res[mode].append((t1 - t0, t2 - t1))
        row = {m: {"fwd_us": statistics.median(v[0] for v in r) * 1e6, "bwd_us": statistics.median(v[1] for v in r) * 1e6}
               for m, r in res.items()}
        for m in ("written out", "generic"):
            row[m]["bwd_vs_fused"] = row[m]["bwd_us"] / row["fused"]["bwd_us"]
        out[name] = row
    return out


def chunk_table(iters: int, layers: int) -> dict:
    import threefold
    from pipeline_bubbles import Config
    from pipeline_vs_torch import build_workload
    cfg = Config(n_layer=layers, n_embd=256, seq=128, batch=16)
    m = 8
    contenders = {"fused (1f1b)": ("1f1b", None), "split, written out (zb-h1)": ("zb-h1", None),
                  "split, linear only written out (before)": ("zb-h1", (aten.linear.default,))}
    pms = {}
    for name, (sched, _) in contenders.items():
        w = build_workload(cfg)
        pms[name] = (threefold.parallelize(w["model"], f"m={m},schedule={sched}", w["inputs"], w["loss_fn"],
                                           target=w["target"]), w)
    res = {n: {"F": [], "B": [], "W": []} for n in contenders}
    names = list(contenders)
    for it in range(iters + 2):
        order = names[it % len(names):] + names[:it % len(names)]
        for name in order:
            pm, w = pms[name]
            spans = []
            eng = pm.engine
            for attr, label in (("_forward", "F"), ("_backward_action", "B"), ("_weight_action", "W")):
                fn = getattr(eng, attr)

                def timed(*a, fn=fn, label=label):
                    t = time.thread_time()
                    r = fn(*a)
                    spans.append((label, time.thread_time() - t))
                    return r
                setattr(eng, attr, timed)
            try:
                with written_out_only(contenders[name][1]):
                    pm.zero_grad()
                    pm.step(*w["inputs"], target=w["target"])
            finally:
                for attr in ("_forward", "_backward_action", "_weight_action"):
                    eng.__dict__.pop(attr, None)
            if it >= 2:
                for lab in "FBW":
                    res[name][lab].append(sum(s for l, s in spans if l == lab) / m)
    out = {n: {k: statistics.median(v) * 1e3 if v else 0.0 for k, v in r.items()} for n, r in res.items()}
    fused = out["fused (1f1b)"]["B"]
    for n, row in out.items():
        row["B+W / fused"] = (row["B"] + row["W"]) / fused
    return {"config": f"GPT {layers} layers x 256, seq 128, microbatch 2 (batch 16, m=8), one chunk", "rows": out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--skip-chunk", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    load0 = os.getloadavg()[0]
    res = {"ops": op_table(args.iters)}
    if not args.skip_chunk:
        res["chunk"] = chunk_table(max(3, args.iters // 5), args.layers)
    res["loadavg"] = [load0, os.getloadavg()[0]]
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print(f"CPU time of one thread, medians; load average {load0:.1f} -> {res['loadavg'][1]:.1f}")
    print(f"{'op':<12} {'fused fwd':>9} {'bwd':>7} | {'written out fwd':>15} {'B+W':>7} {'/fused':>6} | "
          f"{'generic fwd':>11} {'B+W':>7} {'/fused':>6}   (us)")
    for name, r in res["ops"].items():
        f, w, g = r["fused"], r["written out"], r["generic"]
        print(f"{name:<12} {f['fwd_us']:>9.0f} {f['bwd_us']:>7.0f} | {w['fwd_us']:>15.0f} {w['bwd_us']:>7.0f} "
              f"{w['bwd_vs_fused']:>6.2f} | {g['fwd_us']:>11.0f} {g['bwd_us']:>7.0f} {g['bwd_vs_fused']:>6.2f}")
    if "chunk" in res:
        print(f"\nper microbatch, ms: {res['chunk']['config']}")
        for n, r in res["chunk"]["rows"].items():
            print(f"  {n:<42} F {r['F']:6.2f}  B {r['B']:6.2f}  W {r['W']:6.2f}  B+W / fused {r['B+W / fused']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
