"""One generated chunk, forward + backward, eager against Inductor: where the compiled time goes.

    python bench/compile_chunk.py [--setups gpt256,llama512] [--reps 30] [--no-profile]

One process, one thread, no communication (what a pipeline rank's compute is made of):

  gpt256    bench/pipeline_vs_torch.py's middle chunk at --n-embd 256 (GPT blocks h.2-h.3,
            microbatch 2 x 128 tokens: pp=4, m=8 of batch 16)
  gpt256:S  the same chunk at sequence length S > 128, one sequence per microbatch (pp=4,
            m=8 of batch 8): where attention's T x T work grows
  llama512  bench/compile_backend.py's llama512 as one chunk (4 layers, h=512, loss
            included), one microbatch of its m=4 (2 x 128 tokens)

Contenders, built in one process and timed in alternating order (`--reps` rounds, CPU ms
per forward + backward; median, best and worst): `compile=none`, `compile=inductor` as
shipped, and `compile=inductor` without the attention rewrite (THREEFOLD_SDPA_REWRITE=0,
runtime/sdpa_rewrite.py; the same as shipped below its 512 keys, e.g. at T=128). Then
one profiled block of each compiled variant (Inductor's Python wrapper and kernel
profiling on, so extern GEMMs and generated kernels show as events) split into: GEMMs (aten mm / addmm / bmm, with their FLOP rate from the recorded
shapes), attention (the flash kernels), Inductor's generated kernels, other aten ops, and
the rest (autograd, Dynamo's guards, the wrappers); and eager's GEMM share, which bounds
any compiler that keeps the GEMMs: eager F+B / eager GEMM time. Last, the same GEMM shapes
timed alone (operands hot in cache): how close the in-graph GEMMs run to the library's rate.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

GEMM = ("aten::mm", "aten::addmm", "aten::bmm")
FLASH = "aten::_scaled_dot_product_flash_attention_for_cpu"
VARIANTS = {   # name: (compile mode, THREEFOLD_SDPA_REWRITE, profile-time Inductor settings)
    "none": ("none", "1"),
    "inductor": ("inductor", "1"),
    "inductor, attention as written": ("inductor", "0"),
}


def build_chunk(setup: str):
    """(make a fresh chunk module, make its inputs) for a setup."""
    from threefold.codegen.artifact import build_sources, chunk_state
    from threefold.compiler.api import compile_workload
    from threefold.plan import Plan
    from threefold.runtime.loader import import_file
    from threefold.workload import Workload
    if setup.split(":")[0] == "gpt256":
        from pipeline_vs_torch import Config, build_workload, threefold_plan
        seq = int(setup.split(":")[1]) if ":" in setup else 128
        cfg = Config(n_embd=256, seq=seq, batch=16 if seq <= 128 else 8)   # longer: 1 sequence a microbatch
        w = build_workload(cfg)
        plan, index = threefold_plan(cfg, "1f1b", 1), 1
        x = torch.randn(cfg.batch // cfg.microbatches, seq, 256, generator=torch.Generator().manual_seed(0))
        inputs = lambda: (x.clone().requires_grad_(True),)   # noqa: E731
    elif setup == "llama512":
        from compile_backend import build
        model, batch, target, loss_fn = build("llama512")
        w = {"model": model, "inputs": batch, "target": target, "loss_fn": loss_fn}
        plan, index = "m=4", 0
        inputs = lambda: (batch[0][:2], target[:2])   # noqa: E731
    else:
        raise SystemExit(f"unknown setup {setup!r}: gpt256, gpt256:SEQ or llama512")
    prog = compile_workload(Workload(w["model"], w["inputs"], w["target"], w["loss_fn"]), Plan.parse(plan))
    root = tempfile.mkdtemp(prefix="threefold-chunk-")
    for name, text in build_sources(prog).items():
        with open(os.path.join(root, name), "w") as f:
            f.write(text)
    module = import_file(os.path.join(root, f"chunk{index:02d}.py"))
    cls = getattr(module, f"Chunk{index}")

    def make():
        m = cls()
        m.load_state(chunk_state(prog, prog.chunks[index], 0))
        return m
    return make, inputs


def forward_backward(mod, inputs) -> None:
    out = mod(*inputs())
    out = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
           if isinstance(o, torch.Tensor) and o.requires_grad][0]
    out.backward(torch.ones_like(out))


def prepared(make, inputs, variant: str, profiling: bool = False):
    from threefold.runtime import compiled
    mode, sdpa = VARIANTS[variant]
    mod = make()
    if mode != "none":
        os.environ["THREEFOLD_SDPA_REWRITE"] = sdpa
        saved = compiled.config_patches
        if profiling:   # extern calls and kernels visible to the profiler
            compiled.config_patches = lambda ex, gm=None: {"cpp_wrapper": False, "cpp.enable_kernel_profile": True}
        compiled.install({0: mod}, "inductor")
        for _ in range(2):
            forward_backward(mod, inputs)   # compiles here, under this variant's settings
        compiled.config_patches = saved
        os.environ.pop("THREEFOLD_SDPA_REWRITE", None)
    return mod


def gflop(name: str, shapes) -> float:
    if name == "aten::bmm":
        (b, m, k), (_, _, n) = shapes[0], shapes[1]
        return 2.0 * b * m * k * n / 1e9
    a, bm = (shapes[1], shapes[2]) if name == "aten::addmm" else (shapes[0], shapes[1])
    return 2.0 * a[0] * a[1] * bm[1] / 1e9


def profile_split(mod, inputs, n: int = 5) -> dict:
    """ms per F+B by category, and the GEMM calls (name, shapes, ms)."""
    from torch.profiler import profile
    with profile(record_shapes=True) as prof:
        c = time.process_time()
        for _ in range(n):
            forward_backward(mod, inputs)
        cpu = (time.process_time() - c) / n
    parts = {"gemm": 0.0, "flash attention": 0.0, "generated kernels": 0.0, "other aten": 0.0}
    gemms = []
    for e in prof.events():
        ms = e.self_cpu_time_total / 1e3 / n
        if e.name in GEMM:
            parts["gemm"] += ms
            gemms.append((e.name, tuple(tuple(s) for s in e.input_shapes[:3]), e.self_cpu_time_total / 1e3))
        elif e.name.startswith(FLASH):
            parts["flash attention"] += ms
        elif e.name.startswith("graph_") and "cpp_fused" in e.name:
            parts["generated kernels"] += ms
        elif e.name.startswith("aten::"):
            parts["other aten"] += ms
    total = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e3 / n
    parts["rest (autograd, guards, wrappers)"] = max(total - sum(parts.values()), 0.0)
    flops = sum(gflop(name, shapes) for name, shapes, _ in gemms) / n
    return {"parts": parts, "total": total, "cpu": cpu * 1e3, "gemms": gemms, "gflop": flops}


def lone_gemm_rate(gemms) -> float:
    """GFLOP/s of the same GEMM calls made alone, back to back (operands hot)."""
    seen, flop, secs = set(), 0.0, 0.0
    for name, shapes, _ in gemms:
        key = (name, shapes)
        if key in seen:
            continue
        seen.add(key)
        if name == "aten::bmm":
            a, b = torch.randn(*shapes[0]), torch.randn(*shapes[1])
            fn = lambda a=a, b=b: torch.bmm(a, b)   # noqa: E731
        elif name == "aten::addmm":
            bias, a, b = torch.randn(*shapes[0]), torch.randn(*shapes[1]), torch.randn(*shapes[2])
            fn = lambda bias=bias, a=a, b=b: torch.addmm(bias, a, b)   # noqa: E731
        else:
            a, b = torch.randn(*shapes[0]), torch.randn(*shapes[1])
            fn = lambda a=a, b=b: torch.mm(a, b)   # noqa: E731
        fn()
        ts = []
        for _ in range(7):
            c = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - c)
        flop += gflop(name, shapes)
        secs += statistics.median(ts)
    return flop / secs


def run(setup: str, reps: int, profiling: bool) -> None:
    make, inputs = build_chunk(setup)
    mods = {v: prepared(make, inputs, v) for v in VARIANTS}
    times = {v: [] for v in mods}
    for i in range(reps):
        order = list(mods.items()) if i % 2 else list(mods.items())[::-1]
        for v, m in order:
            c = time.process_time()
            forward_backward(m, inputs)
            times[v].append((time.process_time() - c) * 1e3)
    print(f"== {setup}: chunk forward+backward, CPU ms over {reps} alternating rounds, 1 thread, "
          f"load {os.getloadavg()[0]:.1f}")
    base = statistics.median(times["none"])
    for v, t in times.items():
        med = statistics.median(t)
        print(f"  {v:32s} median {med:7.1f} (x{base / med:.2f})  best {min(t):7.1f}  worst {max(t):7.1f}")
    if not profiling:
        return
    eager = profile_split(mods["none"], inputs)
    rows = {"none": eager}
    for v in VARIANTS:
        if v != "none":
            rows[v] = profile_split(prepared(make, inputs, v, profiling=True), inputs)
    print("  profiled (ms per F+B; Inductor's Python wrapper here, so its rest is larger than shipped):")
    for v, r in rows.items():
        parts = ", ".join(f"{k} {ms:.1f}" for k, ms in r["parts"].items())
        flag = "; PREEMPTED (events far above CPU): rerun" if r["cpu"] < 0.9 * r["total"] else ""
        print(f"  {v:32s} total {r['total']:6.1f} (process CPU {r['cpu']:6.1f}{flag}): {parts}; "
              f"GEMM rate {r['gflop'] / r['parts']['gemm'] * 1e3:.0f} GFLOP/s")
    lone = lone_gemm_rate(eager["gemms"])
    print(f"  eager's GEMMs: {eager['parts']['gemm'] / eager['total']:.0%} of its F+B: bound with the GEMMs kept "
          f"{eager['total'] / eager['parts']['gemm']:.2f}x; the same GEMMs alone run at {lone:.0f} GFLOP/s "
          f"(in the graph {eager['gflop'] / eager['parts']['gemm'] * 1e3:.0f})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setups", default="gpt256,llama512")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--no-profile", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from threefold.runtime.allocator import tune_malloc
    tune_malloc()   # as each launched rank does
    for setup in args.setups.split(","):
        run(setup, args.reps, not args.no_profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
