"""bench/pipeline_vs_torch.py's figures: per-contender medians and ratios, and the printed table."""
from __future__ import annotations

import os
import statistics
from dataclasses import asdict

def summarize(cfg, ranks: list[dict], sim: dict) -> dict:
    """Medians per contender: wall time (rank 0, barrier to barrier) and CPU time summed over
    the ranks; ratios to torch (of the medians, and the median of adjacent pairs) and to eager."""
    rows = {}
    for kind, v in cfg.schedules:
        per = [r["schedules"][kind] for r in ranks]
        r0 = per[0]
        names = list(r0["times"])
        wall = {n: r0["times"][n] for n in names}
        cpu = {n: [sum(c) for c in zip(*(p["cpu"][n] for p in per))] for n in names}
        med = {n: statistics.median(wall[n]) for n in names}
        cpu_med = {n: statistics.median(cpu[n]) for n in names}
        contenders = {}
        for n in names:
            pairs = sorted(x / y for x, y in zip(wall[n], wall["torch"]))
            q1, _, q3 = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else (pairs[0],) * 3
            if "torch compiled" in wall:
                cpairs = sorted(x / y for x, y in zip(wall[n], wall["torch compiled"]))
                extra = {"vs_torch_compiled": med[n] / med["torch compiled"],
                         "vs_torch_compiled_paired": statistics.median(cpairs),
                         "cpu_vs_torch_compiled": cpu_med[n] / cpu_med["torch compiled"]}
            else:
                extra = {}
            contenders[n] = {
                **extra,
                "wall_s": med[n], "wall_min_s": min(wall[n]), "cpu_s": cpu_med[n],
                "vs_torch": med[n] / med["torch"],
                "vs_torch_paired": statistics.median(pairs), "vs_torch_paired_iqr": [q1, q3],
                "vs_eager": med[n] / med["eager"],
                "cpu_vs_eager": cpu_med[n] / cpu_med["eager"],
                "loss": next((p["losses"][n] for p in per if p["losses"][n] is not None), None),
            }
        rows[kind] = {
            "plan": r0["plan"], "v": v, "contenders": contenders,
            "compile_s": max(p["compile_s"] for p in per),
            "engine_peak_inflight": [p["engine_peak_inflight"] for p in per],
            "saved_peak_threefold": [p["saved_peak_threefold"] for p in per],
            "saved_peak_torch": [p["saved_peak_torch"] for p in per],
            "saved_mib_threefold": [p["saved_bytes_threefold"] / 2**20 for p in per],
            "saved_mib_torch": [p["saved_bytes_torch"] / 2**20 for p in per],
            "raw_wall_s": wall, "raw_cpu_s": cpu,
            **sim[kind],
        }
        if cfg.profile:
            rows[kind]["profile"] = {r: p["profile"] for r, p in enumerate(per)}
    return {"config": asdict(cfg), "ranks": len(ranks), "cores": os.cpu_count(), "goal_vs_torch": 0.9,
            "schedules": rows}


def report(s: dict) -> str:
    c = s["config"]
    lines = [f"GPT n_layer={c['n_layer']} n_embd={c['n_embd']} n_head={c['n_head']} vocab={c['vocab_size']} "
             f"seq={c['seq']} batch={c['batch']} m={c['microbatches']} compile={c['compile']}; {s['ranks']} gloo ranks x 1 thread on "
             f"{s['cores']} cores; medians of {c['iters']} rotating iterations after {c['warmup']} warm-up; "
             f"load average before/after {s['loadavg'][0]:.1f}/{s['loadavg'][1]:.1f}",
             "wall = rank 0, barrier to barrier; cpu = process CPU time summed over the ranks; "
             "eager = the whole batch on rank 0, 1 thread, while the others wait",
             "",
             f"{'schedule':<16} {'contender':<22} {'wall ms':>8} {'cpu ms':>8} {'/torch':>7} {'paired (IQR)':>20} "
             f"{'/eager':>7} {'cpu/eager':>9} {'loss':>9}"]
    for kind, r in s["schedules"].items():
        for n, x in r["contenders"].items():
            loss = f"{x['loss']:.5f}" if x["loss"] is not None else "-"
            lines.append(f"{kind + ' v=' + str(r['v']):<16} {n:<22} {x['wall_s']*1e3:>8.0f} {x['cpu_s']*1e3:>8.0f} "
                         f"{x['vs_torch']:>7.3f} {x['vs_torch_paired']:>7.3f} ({x['vs_torch_paired_iqr'][0]:.2f}-{x['vs_torch_paired_iqr'][1]:.2f}) {x['vs_eager']:>7.3f} "
                         f"{x['cpu_vs_eager']:>9.3f} {loss:>9}")
            if "vs_torch_compiled" in x:
                lines.append(f"{'':<16} {'':<22} {'/ torch compiled:':>17} {x['vs_torch_compiled']:>7.3f} "
                             f"{x['vs_torch_compiled_paired']:>7.3f} paired, cpu "
                             f"{x['cpu_vs_torch_compiled']:.3f}")
    lines += ["", f"{'schedule':<16} {'sim bubble':>10} {'(p-1)/(vm)':>10}   peak live activations per stage "
              "(engine counter | saved-tensor count threefold | torch | bound)"]
    for kind, r in s["schedules"].items():
        lines.append(f"{kind + ' v=' + str(r['v']):<16} {r['bubble_ratio']:>10.4f} {r['formula']:>10.4f}   "
                     f"{r['engine_peak_inflight']} | {r['saved_peak_threefold']} | {r['saved_peak_torch']} | "
                     f"{r['bound']}")
    lines.append("saved activation MiB at peak per stage (threefold | torch):")
    for kind, r in s["schedules"].items():
        lines.append(f"  {kind:<14} {[round(x, 1) for x in r['saved_mib_threefold']]} | "
                     f"{[round(x, 1) for x in r['saved_mib_torch']]}")
    if "chunk_check" in s:
        k = s["chunk_check"]
        lines.append(f"compute only, one process, {k['blocks']} fwd+bwd on a microbatch of {k['microbatch']}: "
                     f"threefold generated chunk {k['threefold_ms']:.1f} ms (min {k['threefold_min_ms']:.1f}), "
                     f"torch stage {k['torch_ms']:.1f} ms (min {k['torch_min_ms']:.1f}), ratio {k['ratio']:.3f}")
        lines.append(f"microbatching alone, one process: eager whole batch {k['eager_whole_cpu_ms']:.0f} ms CPU, "
                     f"{c['microbatches']} microbatches accumulated {k['eager_microbatched_cpu_ms']:.0f} ms CPU "
                     f"(x{k['microbatching_cost']:.3f})")
    for kind, r in s["schedules"].items():
        for rank, prof in sorted(r.get("profile", {}).items()):
            for side, per in prof.items():
                lines.append(f"profile {kind} rank {rank} {side:<9}: " + ", ".join(
                    f"{k} {w*1e3:.0f}" + (f"/{c*1e3:.0f}" if c is not None else "")
                    for k, (w, c) in per.items()) + " (ms per step, wall/cpu)")
    return "\n".join(lines)
