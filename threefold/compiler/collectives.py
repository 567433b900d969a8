"""Which collectives each chunk runs, per microbatch (for `inspect --json`).

Tensor-parallel collectives are read off the chunk graphs (the TP pass tags every comm node
with a typed `Collective`); pipeline point-to-point transfers come from the chunks'
boundary specs; the data-parallel gradient all-reduce runs once per step, so per
microbatch it counts 1/m.
"""
from __future__ import annotations

from collections import Counter

from threefold.ir.program import meta_of, tf
from threefold.runtime.boundary import sent_elements


def chunk_collectives(prog) -> list[list[dict]]:
    plan = prog.plan
    out = []
    for i, chunk in enumerate(prog.chunks):
        counts: Counter = Counter()
        for node in chunk.gm.graph.nodes:
            c = tf(node).get("collective")
            if not c:
                continue
            counts[(c.kind, c.group, c.phase, c.elements)] += c.count
            if c.backward:
                counts[(c.backward, c.group, "backward", c.elements)] += c.count
            if c.regathers:
                counts[(c.kind, c.group, "backward", c.elements)] += c.count
        for kind, phase, elements, n in ring_sends(chunk.gm, plan.cp):
            counts[(kind, "cp", phase, elements)] += n
        if plan.pp > 1:
            sent = sum(_p2p_elements(b, plan) for b in chunk.outputs if i < len(prog.chunks) - 1)
            got = sum(_p2p_elements(b, plan) for b in chunk.inputs)
            if sent:
                counts[("send", "pp", "forward", sent)] += 1
                counts[("recv", "pp", "backward", sent)] += 1
            if got:
                counts[("recv", "pp", "forward", got)] += 1
                counts[("send", "pp", "backward", got)] += 1
        entries = [{"kind": k, "group": g, "phase": p, "count_per_microbatch": n, "elements": e}
                   for (k, g, p, e), n in sorted(counts.items())]
        if plan.dp > 1:
            params = sum(meta_of(n).numel for n in chunk.gm.graph.nodes
                         if n.op == "placeholder" and tf(n).get("kind") == "param")
            entries.append({"kind": "all_reduce", "group": "dp", "phase": "backward",
                            "count_per_microbatch": round(1 / plan.microbatches, 6), "elements": params})
        out.append(entries)
    return out


def ring_sends(gm, cp: int) -> list[tuple[str, str, int, int]]:
    """Each ring attention's sends per rank and microbatch (runtime/cp_ops.py): its K and V
    blocks (and a key-side mask) go cp-1 hops in forward; in backward the same again (cp-1
    hops) and the dK, dV accumulators, cp hops (the last brings each rank its own). A loop
    over time steps hands its state to the next rank and its end state to the one before
    (`state_send`, runtime/cp_recur.py; each waits for the block before: sequential)."""
    out = []
    if cp == 1:
        return out
    for node in gm.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "__name__", "") == "ring_attention":
            kv = meta_of(node.args[1]).numel + meta_of(node.args[2]).numel
            kb = meta_of(node.kwargs["kbias"]).numel if node.kwargs.get("kbias") is not None else 0
            out.append(("ring_send", "forward", kv + kb, cp - 1))
            out.append(("ring_send", "backward", kv, (cp - 1) + cp))
            if kb:   # the key-side mask travels with its keys in backward too (no gradient)
                out.append(("ring_send", "backward", kb, cp - 1))
        if node.op == "call_function" and getattr(node.target, "__name__", "") == "gather_seq":
            local = meta_of(node.args[0]).numel   # the all-gather fallback (runtime/cp_gather.py)
            out.append(("all_gather", "forward", local, 1))
            out.append(("reduce_scatter", "backward", local, 1))
        if node.op == "call_function" and getattr(node.target, "__name__", "") == "scan_seq":
            totals = 2 * _per_position(node.args[0], node.args[1])   # runtime/cp_scan.py: 2 blocks' totals
            out.append(("all_gather", "forward", totals, 1))
            out.append(("all_reduce", "backward", cp * totals, 1))
        if node.op == "call_function" and getattr(node.target, "__name__", "") == "recur_mid":
            state = [meta_of(x).numel for x in node.args[0]]   # runtime/cp_recur.py: a loop's state, rank to rank
            handed = sum(state[i] for i in node.args[1]) + sum(state)   # to r+1 (its start), to r-1 (end of B)
            out.append(("state_send", "forward", handed, 1))   # sequential across the ranks, not overlapped
            out.append(("state_send", "backward", handed, 1))
        halo = _halo_positions(node)
        if halo:   # causal conv1d / token shift: at most two halos out, their gradients back
            out.append(("halo_send", "forward", 2 * halo, 1))
            out.append(("halo_send", "backward", 2 * halo, 1))
    return out


def _per_position(x, dim: int) -> int:
    shape = meta_of(x).shape
    return meta_of(x).numel // max(shape[dim % len(shape)], 1)


def _halo_positions(node) -> int:
    """Elements of one halo a causal conv1d (time last, k-1 wide) or a token shift (|k| wide,
    also HF's labels shift with its fill) sends, 0 for any other node."""
    name = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
    if name == "causal_conv1d":
        return _per_position(node.args[0], -1) * (meta_of(node.args[1]).shape[-1] - 1)
    if name in ("shift_seq", "shift_fill"):   # shift_fill: a shift whose last positions are a number (cp_tail)
        return _per_position(node.args[0], node.args[2]) * abs(node.args[1])
    return 0


def _p2p_elements(spec, plan) -> int:
    """Elements one rank sends for a boundary value: 1/t of replicated ones under
    scatter/gather (runtime/boundary.py), the whole value otherwise."""
    return sent_elements(spec.placement, spec.numel, plan.tp, plan.scatter_gather)
