"""What `inspect` shows of a step's communication: the mesh's axes, the collectives each
stage's schedule holds (runtime/collective_plan.py), and under zero>=2 the units and the
order their gathers and reduce-scatters run in."""
from __future__ import annotations


def step_report(prog) -> dict:
    """{"mesh", "step_collectives": per stage the collective actions in order, "units"}."""
    # lazy: start-up: a command loads codegen.artifact only when it runs
    from threefold.codegen.artifact import build_manifest, build_sources
    # lazy: start-up: a command loads runtime.assemble only when it runs
    from threefold.runtime.assemble import step_schedule
    manifest = build_manifest(prog, build_sources(prog), {}, with_weights=False)
    schedule, cplan = step_schedule(manifest)
    out = {"mesh": prog.plan.mesh.to_json(),
           "step_collectives": [[str(a) for a in acts if a.is_collective] for acts in schedule.actions]}
    if cplan.units:
        out["units"] = {str(c): {"units": [{"name": u.name, "params": len(u.fqns), "elements": u.numel}
                                           for u in units],
                                 "forward": str(cplan.program(c, "forward")),
                                 "backward": str(cplan.program(c, "backward"))}
                        for c, units in cplan.units.items()}
    return out


def format_step(report: dict) -> list[str]:
    mesh = " x ".join(f"{n}={s}" for n, s in report["mesh"])
    lines = [f"mesh: {mesh} (outermost first)", "step collectives per stage (dn/ls loss; ar/rs gradient "
             "buckets; ag/fr zero=3 unit 0; wg wait; ts tied sums; ss sequence-parallel sums):"]
    lines += [f"  stage {s}: {' '.join(acts) or '-'}" for s, acts in enumerate(report["step_collectives"])]
    for c, info in report.get("units", {}).items():
        names = ", ".join(u["name"] for u in info["units"])
        lines.append(f"  chunk {c} units: {names}")
        lines.append(f"    forward:  {info['forward'] or '-'}")
        lines.append(f"    backward: {info['backward'] or '-'}")
    return lines
