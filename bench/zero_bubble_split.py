"""What the zero-bubble B/W split costs against the fused backward (issue 25 item 3).

    python bench/zero_bubble_split.py [--iters N] [--layers L] [--embd H ...] [--json]

One process, one thread, CPU time of this thread (time.thread_time: steadier than wall time
on a shared machine). Two tables, each side by side in one run, the contenders alternating:

  * per op (256 rows x H features, fp32, two microbatches so W also adds into an existing
    .grad): forward and backward of the op fused; split on the hooked path (autograd's own
    node on detached weights computes B, a pre-hook hands W the output gradient:
    runtime/weight_grad_ops.py); split with one autograd.Function per op (the path taken
    under saved-tensor hooks: sp, zero=3, memory counters); split on the generic path (the
    op's local autograd graph differentiated twice);
  * per chunk: the bench model of bench/pipeline_bubbles.py (GPT, n_embd H, seq 128, global
    batch 16, m=8) as one chunk, per microbatch: F, B, W and B+W / fused backward, for 1f1b
    (fused), a second fused instance (the control: the noise floor), zb-h1 (hooked path) and
    zb-h1 with a Function per op; the ratio is the median
    over rounds of each round's (B+W) / fused B (paired), and the ratio of the medians; the
    same for F; and the ratio of the fastest microbatch's B+W (F) over all rounds to the
    fused schedule's fastest (the least disturbed sample on a shared machine).

Goal: B + W no more than the fused backward, and the split's forward no slower than the fused
schedule's (F / fused F, also paired per round).
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

from threefold.runtime import weight_grad, weight_grad_ops  # noqa: E402

aten = torch.ops.aten
ROWS, V = 256, 256
H = 256


@contextlib.contextmanager
def path(kind):
    """'hooked' (the default), 'function' (one autograd.Function per op, as under saved-tensor
    hooks), 'generic' (no written-out rule: the op's local graph differentiated twice)."""
    real_w, real_h, real_d = weight_grad.written_out, weight_grad_ops._hooks_free, weight_grad._hooks_default
    if kind == "generic":
        weight_grad.written_out = lambda *a: None
        weight_grad._hooks_default = lambda _: object()    # the straight-line entries defer too
    elif kind == "function":
        weight_grad_ops._hooks_free = lambda: False
        weight_grad._hooks_default = lambda _: object()    # as if saved-tensor hooks were active
    try:
        yield
    finally:
        weight_grad.written_out, weight_grad_ops._hooks_free, weight_grad._hooks_default = real_w, real_h, real_d


class _Holder:
    weight_stash = None


def _op_cases():
    """name -> make(params): the op, its args for one microbatch, weight positions, params;
    `params` (a dict) keeps the parameters across a case's microbatches."""
    def P(params, key, make):
        if key not in params:
            params[key] = torch.nn.Parameter(make())
        return params[key]

    def ln(ps):
        x = torch.randn(ROWS, H, requires_grad=True)
        w, b = P(ps, "w", lambda: torch.ones(H)), P(ps, "b", lambda: torch.zeros(H))
        return aten.layer_norm.default, (x, [H], w, b, 1e-5), (2, 3), (w, b)

    def emb(ps):
        w = P(ps, "w", lambda: torch.randn(V, H))
        return aten.embedding.default, (w, torch.randint(0, V, (ROWS,))), (0,), (w,)

    def mul(ps):
        w = P(ps, "w", lambda: torch.randn(H))
        return aten.mul.Tensor, (w, torch.randn(ROWS, H, requires_grad=True)), (0,), (w,)

    def pos_add(ps):     # GPT's wte + wpe: the weight operand is computed from a parameter
        e = P(ps, "e", lambda: torch.randn(ROWS, H))
        wpe = aten.embedding.default(e, torch.arange(ROWS))
        return aten.add.Tensor, (torch.randn(2, ROWS, H, requires_grad=True), wpe), (1,), (e,)

    def lin(ps):
        x = torch.randn(ROWS, H, requires_grad=True)
        w, b = P(ps, "w", lambda: torch.randn(4 * H, H)), P(ps, "b", lambda: torch.zeros(4 * H))
        return aten.linear.default, (x, w, b), (1, 2), (w, b)

    def addmm(ps):
        x = torch.randn(ROWS, H, requires_grad=True)
        w, b = P(ps, "w", lambda: torch.randn(H, 4 * H)), P(ps, "b", lambda: torch.zeros(4 * H))
        return aten.addmm.default, (b, x, w), (0, 2), (b, w)
    return {"layer_norm": ln, "embedding": emb, "mul": mul, "add (wpe)": pos_add, "linear": lin, "addmm": addmm}


def op_table(iters: int) -> dict:
    modes = {"fused": None, "hooked": "hooked", "function": "function", "generic": "generic"}
    out = {}
    for name, make in _op_cases().items():
        res = {m: [] for m in modes}
        for it in range(iters + 5):
            for mode, kind in (modes.items() if it % 2 else reversed(modes.items())):
                fwd = bwd = 0.0
                ps = {}
                for _ in range(2):             # two microbatches: the second W accumulates
                    op, args, weights, params = make(ps)
                    h = _Holder()
                    h.weight_stash = [] if kind else None
                    with path(kind or "hooked"):
                        t0 = time.thread_time()
                        y = weight_grad.deferred(h, op, args, weights=weights, params=params)
                        t1 = time.thread_time()
                        y.backward(torch.ones_like(y))
                        if h.weight_stash is not None:
                            weight_grad.run_deferred(h.weight_stash)
                        t2 = time.thread_time()
                    fwd, bwd = fwd + t1 - t0, bwd + t2 - t1
                if it >= 5:
                    res[mode].append((fwd / 2, bwd / 2))
        row = {m: {"fwd_us": statistics.median(v[0] for v in r) * 1e6, "bwd_us": statistics.median(v[1] for v in r) * 1e6}
               for m, r in res.items()}
        for m in ("hooked", "function", "generic"):
            row[m]["bwd_vs_fused"] = row[m]["bwd_us"] / row["fused"]["bwd_us"]
        out[name] = row
    return out


def _timed_step(pm, w, kind: str) -> list:
    """One training step of `pm` on the given path; (phase, thread CPU seconds) per action."""
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
        with path(kind):
            pm.zero_grad()
            pm.step(*w["inputs"], target=w["target"])
    finally:
        for attr in ("_forward", "_backward_action", "_weight_action"):
            eng.__dict__.pop(attr, None)
    return spans


def chunk_table(iters: int, layers: int, instances: int = 1) -> dict:
    import threefold
    from pipeline_bubbles import Config
    from pipeline_vs_torch import build_workload
    cfg = Config(n_layer=layers, n_embd=H, seq=128, batch=16)
    m = 8
    # the control: a second, identical fused instance (its own parameters and buffers at
    # other addresses); how far it lands from the first is what placement and the machine
    # do to two identical runs, the noise floor of every other row
    contenders = {"fused (1f1b)": ("1f1b", "hooked"), "fused again (control)": ("1f1b", "hooked"),
                  "split, hooked (zb-h1)": ("zb-h1", "hooked"),
                  "split, a Function per op (zb-h1)": ("zb-h1", "function")}
    # `instances` copies of each contender, built interleaved so that no contender gets all
    # the lucky (or unlucky) addresses; each round runs every copy, a row is their mean
    pms = {name: [] for name in contenders}
    for _ in range(instances):
        for name, (sched, _) in contenders.items():
            w = build_workload(cfg)
            pms[name].append((threefold.parallelize(w["model"], f"m={m},schedule={sched}", w["inputs"],
                                                    w["loss_fn"], target=w["target"]), w))
    res = {n: {"F": [], "B": [], "W": []} for n in contenders}
    per_mb = {n: {"F": [], "BW": []} for n in contenders}   # one sample per microbatch
    names = list(contenders)
    for it in range(iters + 2):
        order = names[it % len(names):] + names[:it % len(names)]
        for name in order:
            step_means = {lab: [] for lab in "FBW"}
            for pm, w in pms[name]:
                spans = _timed_step(pm, w, contenders[name][1])
                for lab in "FBW":
                    step_means[lab].append(sum(s for l, s in spans if l == lab) / m)
                if it >= 2:
                    # the k-th B and the k-th W are microbatch k's (one stage: W follows its B)
                    bs, ws = [s for l, s in spans if l == "B"], [s for l, s in spans if l == "W"]
                    per_mb[name]["F"] += [s for l, s in spans if l == "F"]
                    per_mb[name]["BW"] += [b + w for b, w in zip(bs, ws + [0.0] * (len(bs) - len(ws)))]
            if it >= 2:
                for lab in "FBW":
                    res[name][lab].append(statistics.fmean(step_means[lab]))
    out = {n: {k: statistics.median(v) * 1e3 if v else 0.0 for k, v in r.items()} for n, r in res.items()}
    fused, fused_f = out["fused (1f1b)"]["B"], out["fused (1f1b)"]["F"]
    fused_rounds, fused_f_rounds = res["fused (1f1b)"]["B"], res["fused (1f1b)"]["F"]
    for n, row in out.items():
        row["B+W / fused"] = (row["B"] + row["W"]) / fused
        row["paired"] = statistics.median((b + w) / f for b, w, f in zip(res[n]["B"], res[n]["W"], fused_rounds))
        # the split's forward (matching, detached weights, the pre-hooks) against the fused one's
        row["F / fused F"] = row["F"] / fused_f
        row["F paired"] = statistics.median(f / g for f, g in zip(res[n]["F"], fused_f_rounds))
        # the least disturbed microbatch of each (other sessions share the cores and caches):
        # min over all microbatches of all rounds
        row["B+W min / fused min"] = min(per_mb[n]["BW"]) / min(per_mb["fused (1f1b)"]["BW"])
        row["F min / fused min"] = min(per_mb[n]["F"]) / min(per_mb["fused (1f1b)"]["F"])
    return {"config": f"GPT {layers} layers x {H}, seq 128, microbatch 2 (batch 16, m=8), one chunk"
                      + (f", {instances} instances per row" if instances > 1 else ""), "rows": out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--embd", type=int, nargs="+", default=[256], help="hidden sizes H (one table each)")
    ap.add_argument("--chunk-iters", type=int, default=None, help="rounds per chunk table (default iters/2)")
    ap.add_argument("--instances", type=int, default=1,
                    help="copies of each chunk-table contender, their mean per round (placement noise)")
    ap.add_argument("--skip-chunk", action="store_true")
    ap.add_argument("--skip-ops", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    global H
    load0 = os.getloadavg()[0]
    res = {"ops": {}, "chunk": {}}
    for h in args.embd:
        H = h
        if not args.skip_ops:
            res["ops"][h] = op_table(args.iters)
        if not args.skip_chunk:
            res["chunk"][h] = chunk_table(args.chunk_iters or max(3, args.iters // 2), args.layers, args.instances)
    res["loadavg"] = [load0, os.getloadavg()[0]]
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print(f"CPU time of one thread, medians; load average {load0:.1f} -> {res['loadavg'][1]:.1f}")
    for h, ops in res["ops"].items():
        print(f"\nper op, {ROWS} rows x {h}, us per microbatch (fwd, B+W, B+W / fused backward)")
        print(f"{'op':<12} {'fused':>12} | {'hooked':>19} | {'Function per op':>19} | {'generic':>19}")
        for name, r in ops.items():
            cells = [f"{r['fused']['fwd_us']:>5.0f} {r['fused']['bwd_us']:>6.0f}"]
            for m in ("hooked", "function", "generic"):
                cells.append(f"{r[m]['fwd_us']:>5.0f} {r[m]['bwd_us']:>6.0f} {r[m]['bwd_vs_fused']:>6.2f}")
            print(f"{name:<12} " + " | ".join(cells))
    for h, chunk in res["chunk"].items():
        print(f"\nper microbatch, ms: {chunk['config']}")
        for n, r in chunk["rows"].items():
            print(f"  {n:<34} F {r['F']:7.2f}  B {r['B']:7.2f}  W {r['W']:7.2f}  "
                  f"B+W / fused {r['B+W / fused']:.3f} (paired {r['paired']:.3f})  "
                  f"F / fused F {r['F / fused F']:.3f} (paired {r['F paired']:.3f})  "
                  f"min per microbatch: B+W {r['B+W min / fused min']:.3f}, F {r['F min / fused min']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
