"""Fused Triton kernels against unfused eager ATen and torch.compile, on one CUDA GPU.

Every kernel kind the fusion pass makes, at Megatron sizes (8192 tokens, hidden 4096 and
8192, bf16; attention at sequence 2048 with 128-wide heads; the MLP at 4h). For each, the
regions are traced from small modules exactly as the compiler does, kernels.py is generated
and imported from a temporary directory, and three implementations run on the same
inputs: the generated kernel, the region's eager ATen ops (what runs without fusion), and
torch.compile of those same ops. Reported per kernel, forward and backward separately:

  * time (median of triton.testing.do_bench);
  * achieved bandwidth: the bytes a fused kernel must move (forward: read the inputs, write
    the outputs; backward: read the inputs and the output gradients, write the input
    gradients) over its time, and that as a share of the device's peak bandwidth;
  * speed-up over eager and over torch.compile.

A correctness gate runs first (fused vs eager, bf16 tolerance). The goal from the issue:
at least 70% of peak bandwidth and 1.5x over eager for bias-GeLU, bias-dropout-add and
softmax (forward). Without a GPU the script says so and exits with status 2.

    python bench/fused_kernels.py [--hidden 4096 8192] [--tokens 8192] [--no-compile] [--json]
                            [--peak-gbps N] [--markdown]
    python bench/fused_kernels.py --dry-run     # tiny sizes on CPU under Triton's interpreter
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

if "--dry-run" in sys.argv:            # must precede the first import of triton
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["THREEFOLD_KERNELS"] = "triton"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from threefold.codegen.triton import kernels_source  # noqa: E402
from threefold.compiler.trace import trace  # noqa: E402
from threefold.passes.fusion import fuse_graph  # noqa: E402

# Peak memory bandwidth from the spec sheets (GB/s), by device name; otherwise computed from
# the memory clock and bus width the driver reports.
PEAK_GBPS = {"H200": 4800, "H100 80GB HBM3": 3350, "H100 SXM": 3350, "H100 PCIe": 2000, "H100 NVL": 3900,
             "A100-SXM4-80GB": 2039, "A100 80GB PCIe": 1935, "A100-SXM4-40GB": 1555, "A100-PCIE-40GB": 1555,
             "L40S": 864, "A10": 600}
GOALS = ("bias_gelu", "bias_dropout_add", "softmax")


# ---- the regions, as small modules ------------------------------------------------------------
class BiasAct(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.act = act

    def forward(self, y, b):
        return self.act(y + b)


class BiasDropoutAdd(nn.Module):
    def forward(self, y, b, residual):
        return residual + F.dropout(y + b, p=0.1, training=True)


class CausalSoftmax(nn.Module):
    def forward(self, scores):
        t, s = scores.shape[-2:]
        keep = torch.ones(t, s, dtype=torch.bool, device=scores.device).tril()
        return (scores * 0.08838834764831845).masked_fill(~keep, float("-inf")).softmax(-1)


class MaskSoftmax(nn.Module):
    def forward(self, scores, mask):
        return (scores * 0.08838834764831845).masked_fill(mask, float("-inf")).softmax(-1)


class Rotary(nn.Module):
    def forward(self, x, cos, sin):
        h = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


class SwiGLU(nn.Module):
    def forward(self, gate, up):
        return F.silu(gate) * up


def cases(tokens: int, hidden: int, seq: int):
    """(label, module, input shapes and dtypes, needs_grad flags) at Megatron sizes."""
    bf = torch.bfloat16
    heads, batch, ffn = hidden // 128, max(1, tokens // seq), 4 * hidden
    att = (batch, heads, seq, seq)
    yield "bias_gelu_erf", BiasAct(F.gelu), [((tokens, ffn), bf), ((ffn,), bf)]
    yield "bias_gelu_tanh", BiasAct(lambda v: F.gelu(v, approximate="tanh")), [((tokens, ffn), bf), ((ffn,), bf)]
    yield "bias_dropout_add", BiasDropoutAdd(), [((tokens, hidden), bf), ((hidden,), bf), ((tokens, hidden), bf)]
    yield "causal_softmax", CausalSoftmax(), [(att, bf)]
    yield "mask_softmax", MaskSoftmax(), [(att, bf), ((1, 1, seq, seq), torch.bool)]
    yield "layer_norm", nn.LayerNorm(hidden, dtype=bf), [((tokens, hidden), bf)]
    yield "rms_norm", nn.RMSNorm(hidden, eps=1e-6, dtype=bf), [((tokens, hidden), bf)]
    yield "swiglu", SwiGLU(), [((tokens, ffn), bf), ((tokens, ffn), bf)]
    yield "rotary", Rotary(), [((batch, heads, seq, 128), bf), ((seq, 128), bf), ((seq, 128), bf)]


def region_of(module: nn.Module, specs):
    """Trace on the meta device (no memory) and return the one region and its parameters."""
    example = tuple(torch.empty(s, dtype=d, device="meta") for s, d in specs)
    prog = trace(module.to("meta"), example)
    (region,) = fuse_graph(prog.gm)
    params = [n.meta["tf"]["fqn"] for n in prog.gm.graph.nodes
              if n.op == "placeholder" and n.meta["tf"]["kind"] == "param"]
    return region, params


def make_inputs(region, device):
    xs = []
    for inp in region.inputs:
        if inp.dtype == torch.bool:
            t, s = inp.shape[-2:]
            xs.append((~torch.ones(t, s, dtype=torch.bool, device=device).tril()).expand(inp.shape).contiguous())
        else:
            xs.append(torch.randn(inp.shape, device=device, dtype=torch.float32).to(inp.dtype))
    return xs


# ---- timing -----------------------------------------------------------------------------------
def timer(device: str):
    if device == "cuda":
        from triton.testing import do_bench

        def cuda_ms(fn):
            return do_bench(fn, warmup=25, rep=100, return_mode="median")
        return cuda_ms

    def cpu_ms(fn):
        fn()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    return cpu_ms


def backward_call(fn, xs):
    """A closure running the backward of fn(*xs) again and again (the graph is retained)."""
    leaves = [x.detach().requires_grad_(x.is_floating_point()) for x in xs]
    y = fn(*leaves)
    g = torch.randn_like(y)
    wanted = [x for x in leaves if x.requires_grad]
    return lambda: torch.autograd.grad(y, wanted, g, retain_graph=True)


def nbytes(t) -> int:
    return t.numel() * t.element_size()


def peak_gbps(override):
    if override:
        return float(override), "given"
    props = torch.cuda.get_device_properties(0)
    for name, gbps in PEAK_GBPS.items():
        if name in props.name:
            return float(gbps), f"spec sheet ({name})"
    clock, bus = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if clock and bus:
        return 2 * clock * 1e3 * bus / 8 / 1e9, "memory clock x bus width"
    return float("nan"), "unknown"


# ---- one kernel -------------------------------------------------------------------------------
def bench_one(label, module, specs, hidden, device, ms, compile_eager, workdir):
    region, _ = region_of(module, specs)
    name = region.kernel_name
    path = os.path.join(workdir, f"k_{label}_{hidden}.py")
    with open(path, "w") as f:
        f.write(kernels_source([region]))
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"bench_kernels_{label}_{hidden}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fused, eager = getattr(mod, name), getattr(mod, name + "_eager")
    xs = make_inputs(region, device)

    # Correctness gate (dropout: compare where both kept the element).
    y_f, y_e = fused(*xs).float(), eager(*xs).float()
    if region.kind == "bias_dropout_add":
        both = (y_f != xs[2].float()) & (y_e != xs[2].float())
        y_f, y_e = y_f[both], y_e[both]
    err = (y_f - y_e).abs().max().item() if y_f.numel() else 0.0
    ok = err <= 0.05 * max(1.0, y_e.abs().max().item() if y_e.numel() else 1.0)

    impls = {"fused": fused, "eager": eager}
    if compile_eager:
        impls["compile"] = torch.compile(eager, dynamic=False)
    rec = {"kernel": name, "case": label, "hidden": hidden, "kind": region.kind, "ok": ok, "max_err": err,
           "shape": list(region.inputs[0].shape)}
    out = fused(*xs)
    fwd_bytes = sum(nbytes(x) for x in xs) + nbytes(out)
    grads_bytes = sum(nbytes(x) for x in xs if x.is_floating_point())
    bwd_bytes = sum(nbytes(x) for x in xs) + nbytes(out) + grads_bytes
    for what, nb in (("fwd", fwd_bytes), ("bwd", bwd_bytes)):
        for impl, fn in impls.items():
            call = (lambda fn=fn: fn(*xs)) if what == "fwd" else backward_call(fn, xs)
            rec[f"{what}_{impl}_ms"] = ms(call)
        rec[f"{what}_gbps"] = nb / (rec[f"{what}_fused_ms"] * 1e-3) / 1e9
        rec[f"{what}_x_eager"] = rec[f"{what}_eager_ms"] / rec[f"{what}_fused_ms"]
        if compile_eager:
            rec[f"{what}_x_compile"] = rec[f"{what}_compile_ms"] / rec[f"{what}_fused_ms"]
    return rec


def table(recs, peak, markdown: bool) -> str:
    head = ["kernel", "hidden", "fwd ms", "fwd GB/s", "% peak", "x eager", "x compile",
            "bwd ms", "bwd GB/s", "% peak", "x eager", "x compile", "ok"]
    rows = []
    for r in recs:
        row = [r["kernel"], str(r["hidden"])]
        for what in ("fwd", "bwd"):
            row += [f"{r[f'{what}_fused_ms']:.3f}", f"{r[f'{what}_gbps']:.0f}",
                    f"{100 * r[f'{what}_gbps'] / peak:.0f}%", f"{r[f'{what}_x_eager']:.2f}x",
                    f"{r[f'{what}_x_compile']:.2f}x" if f"{what}_x_compile" in r else "-"]
        rows.append(row + ["yes" if r["ok"] else f"NO ({r['max_err']:.3g})"])
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*head)] + [fmt.format(*r) for r in rows])


def goals(recs, peak) -> list[str]:
    lines = []
    for r in recs:
        if r["kind"] in GOALS:
            bw, sx = 100 * r["fwd_gbps"] / peak, r["fwd_x_eager"]
            verdict = "met" if bw >= 70 and sx >= 1.5 else "NOT met"
            lines.append(f"goal {verdict}: {r['kernel']} h={r['hidden']}: {bw:.0f}% of peak (>= 70%), "
                         f"{sx:.2f}x eager (>= 1.5x)")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--only", nargs="*", help="case labels to run (default: all)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    ap.add_argument("--peak-gbps", type=float, help="the device's peak memory bandwidth, GB/s")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown (BENCHMARKS.md)")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU under Triton's interpreter")
    args = ap.parse_args(argv)

    if args.dry_run:
        device, args.hidden, args.tokens, args.seq, args.no_compile = "cpu", [256], 64, 16, True
        peak, peak_src, gpu = float("nan"), "dry run", "cpu (interpreter)"
    else:
        if not torch.cuda.is_available():
            print("bench/fused_kernels.py needs a CUDA GPU and none is present: nothing was measured "
                  "(use --dry-run to exercise the script on CPU).", file=sys.stderr)
            return 2
        device = "cuda"
        peak, peak_src = peak_gbps(args.peak_gbps)
        gpu = torch.cuda.get_device_name(0)
    torch.manual_seed(0)
    ms = timer(device)
    recs = []
    with tempfile.TemporaryDirectory() as workdir:
        for hidden in args.hidden:
            for label, module, specs in cases(args.tokens, hidden, args.seq):
                if args.only and label not in args.only:
                    continue
                print(f"[{label} h={hidden}]", file=sys.stderr, flush=True)
                recs.append(bench_one(label, module, specs, hidden, device, ms, not args.no_compile, workdir))
                if device == "cuda":
                    torch.cuda.empty_cache()
    if args.json:
        print(json.dumps({"gpu": gpu, "peak_gbps": peak, "peak_source": peak_src, "results": recs}))
    else:
        print(f"{gpu}; peak {peak:.0f} GB/s ({peak_src}); bf16; tokens={args.tokens}, seq={args.seq}")
        print(table(recs, peak, args.markdown))
        for line in goals(recs, peak):
            print(line)
    return 0 if all(r["ok"] for r in recs) else 1


if __name__ == "__main__":
    sys.exit(main())
