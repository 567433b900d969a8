"""`threefold inspect SPEC --plan P --html FILE`: the compiled plan on one page.

Everything shown is what inspect already computed: `report` is the `inspect --json`
object (cli/inspect_cmd.chunk_report: chunks, collectives, parameters, tensor-parallel
report), `memory` the `inspect --memory --json` list (planner/memory.py), `sources` the
generated modules (codegen), and the schedule timeline is runtime/simulate.py's run of the
plan's schedule timed by the chunks' forward FLOPs (runtime/timeline_svg.py draws it). A
trace (`--trace FILE`, from `threefold train --trace`) adds its measured timeline.
"""
from __future__ import annotations

from html import escape

from threefold.report.code_view import chunk_code
from threefold.cli.units import human, human_bytes
from threefold.report.page import page, search_attr, table

COMPONENTS = ("params", "grads", "optimizer", "activations", "recompute", "buffers")


def inspect_html(name: str, report: dict, memory: list[dict], sources: dict[str, str], schedule_svg: str,
                 trace: dict | None = None) -> str:
    chunks = report["chunks"]
    tp = report.get("tensor_parallel")
    facts = [f"plan {report['plan']}", f"{len(chunks)} chunks",
             f"FLOPs imbalance (max/mean) {report['imbalance']:.3f}",
             f"{human(sum(c['params'] for c in chunks))} parameters per tp rank"]
    if tp:
        facts.append(f"tp={tp['tp']}: {tp['sharded_share']:.1%} of parameters sharded")
    sections = [("chunks", "Chunks", _chunks(chunks, human, human_bytes)),
                ("collectives", "Collectives per chunk", _collectives(chunks)),
                ("parameters", "Parameters and their sharding", _parameters(report, human)),
                ("memory", "Memory per rank", _memory(memory, human_bytes)),
                ("schedule", "Schedule timeline",
                 '<p class="note">The verified schedule of this plan, simulated with each chunk\'s forward FLOPs '
                 "as its forward time and twice that for its backward (zero bubble: B and W one each), in "
                 f'GFLOP; communication free.</p><div class="svgbox">{schedule_svg}</div>')]
    if trace is not None:
        # lazy: start-up: report.trace_page loads only on this path
        from threefold.report.trace_page import trace_sections
        sections += trace_sections(trace)
    sections.append(("code", "Generated code", _code(sources)))
    data = {"inspect": report, "memory": memory, "trace": trace}
    return page(f"threefold inspect: {name}", escape(" · ".join(facts)), sections, data)


def _chunks(chunks: list[dict], human, human_bytes) -> str:
    rows = [[str(c["index"]), str(c["stage"]), escape(",".join(map(str, c["ranks"]))), str(c["ops"]),
             human(c["params"]), human(c["flops"]), human_bytes(c["activation_bytes"]),
             human_bytes(c["boundary_in_bytes"]), human_bytes(c["boundary_out_bytes"])] for c in chunks]
    return ('<p class="note">Per tp rank: parameters, forward FLOPs per microbatch, activation bytes kept '
            "for backward per microbatch, boundary bytes received and sent per microbatch.</p>"
            + table(["chunk", "stage", "ranks", "ops", "params", "fwd FLOPs", "activations", "boundary in",
                     "boundary out"], rows, left=(2,)))


def _collectives(chunks: list[dict]) -> str:
    rows = []
    for c in chunks:
        for e in c["collectives"]:
            rows.append([str(c["index"]), escape(e["kind"]), escape(e["group"]), escape(e["phase"]),
                         str(e["count_per_microbatch"]), f"{e['elements']:,}"])
    if not rows:
        return '<p class="note">None: one chunk and no tensor parallelism.</p>'
    return ('<p class="note">Per microbatch: tensor-parallel collectives (group tp) and pipeline transfers '
            "(group pp) each chunk runs, with the elements each moves.</p>"
            + table(["chunk", "kind", "group", "phase", "count / microbatch", "elements"], rows, left=(1, 2, 3)))


def _parameters(report: dict, human) -> str:
    params = report.get("parameters", [])
    rows, attrs = [], []
    for p in params:
        whole = p.get("kept_whole")
        fallbacks = p.get("fallbacks", [])
        status = ('<span class="pill shard">sharded</span>' if p["placement"] != "R" else
                  '<span class="pill whole">kept whole</span>' if whole else '<span class="pill">replicated</span>')
        why = escape("; ".join(([whole] if whole else []) + fallbacks))
        rows.append([f'<span class="mono">{escape(p["fqn"])}</span>', escape(",".join(map(str, p["chunks"]))),
                     escape(_shape(p["shape"])), escape(_shape(p["local_shape"])),
                     f'<span class="mono">{escape(p["placement"])}</span>', status + (" frozen" if p["frozen"] else ""),
                     f'<span class="why">{why}</span>' if why else ""])
        attrs.append(search_attr("param", p["fqn"], p["placement"], whole or "", " ".join(fallbacks)))
    html = ('<p class="note">Every parameter: the chunks holding it (several: tied), its full shape, its '
            "shape on one tp rank, its placement (S(d): split along d over the tp ranks; R: whole on every "
            "rank), and the tensor-parallel pass's reason where it keeps one whole or an op fell back.</p>"
            f'<div class="scroll">{table(["parameter", "chunks", "shape", "local shape", "placement", "", "reason"], rows, left=(0, 5, 6), attrs=attrs)}</div>')
    tp = report.get("tensor_parallel")
    if tp and tp.get("fallbacks"):
        fb = [[escape(f["op"]), escape(f["module"]), f"{f['bytes_per_step']:,}", f'<span class="why">{escape(f["reason"])}</span>']
              for f in tp["fallbacks"]]
        html += ("<h3>Tensor-parallel fallbacks (ops run on gathered inputs; strict=true makes them errors)</h3>"
                 + table(["op", "module", "bytes / step", "reason"], fb, left=(0, 1, 3)))
    return html


def _shape(shape) -> str:
    return "?" if shape is None else "[" + ", ".join(map(str, shape)) + "]"


def _memory(memory: list[dict], human_bytes) -> str:
    top = max((r["total"] for r in memory), default=0) or 1
    legend = "".join(f'<span><i class="c-{k}"></i>{k}</span>' for k in COMPONENTS)
    rows = []
    for r in memory:
        parts = "".join(f'<span class="c-{k}" style="width:{100 * r[k] / top:.3f}%" '
                        f'title="{k}: {escape(human_bytes(r[k]))}"></span>' for k in COMPONENTS if r[k])
        rows.append(f'<div>rank {r["rank"]} <span class="note">(stage {r["stage"]})</span></div>'
                    f'<div class="bar" data-rank="{r["rank"]}">{parts}</div><div>{escape(human_bytes(r["total"]))}</div>')
    return ('<p class="note">The memory model of <code>inspect --memory</code> (planner/memory.py): AdamW state, '
            "activations at the schedule's peak of saved-for-backward bytes, communication buffers.</p>"
            f'<div class="legend">{legend}</div><div class="bars">{"".join(rows)}</div>')


def _code(sources: dict[str, str]) -> str:
    parts = ['<p class="note">One module per chunk, shared by its tp ranks. Each generated line names the '
             "model module it came from, its placement and its local shape (its trailing comment); the "
             "column on the right repeats the module. The search box filters these lines.</p>"]
    for i, (name, text) in enumerate(sorted(sources.items())):
        if not name.startswith("chunk"):
            continue
        parts.append(f'<details class="chunk-code"{" open" if i == 0 else ""}><summary>{escape(name)}'
                     f'<span class="hits"></span></summary><div class="code">{chunk_code(text)}</div></details>')
    return "".join(parts)
