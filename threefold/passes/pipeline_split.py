"""Cut the graph into pp*v chunks, contiguous in graph order, with the most expensive chunk
as cheap as possible.

Vocabulary:
  free node   a cheap compute node that depends on no parameter (only on buffers, constants
              and user inputs): causal masks, position ids, rotary tables, target reshapes.
              Free nodes are not cut; each chunk that needs one recomputes it, so they
              never cross a stage boundary.
  position i  a cut before the i-th non-free node. The boundary at i is the set of values
              made before i and used at or after i; they are sent chunk to chunk.
  candidate   a position whose boundary holds only tensors (not tuples) and is small: at most
              `slack` times the smallest boundary anywhere. We try slack 1, 2, 4, ... and keep
              the smallest slack whose best partition is within 5% of the best we can do at
              any slack, trading a sliver of balance for much less communication.
The balance itself is exact: binary search on the max chunk cost with a greedy feasibility
check, which is optimal for contiguous partitions with non-negative costs; among the optimal
partitions we take the one whose chunks come closest to equal shares.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch.fx as fx

from threefold.ir.contracts import stage_pass
from threefold.passes.cost import measure_chunk
from threefold.ir.program import compute_nodes, meta_of, tf
from threefold.ir.stages import BoundarySpec, Partitioned, Sharded
from threefold.passes.extract_chunks import ChunkCut, extract_chunks
from threefold.errors import PlanError
from threefold.markers import PIPE_SPLIT_OP


@dataclass
class _Layout:
    order: list[fx.Node]          # non-free compute nodes in graph order
    flops_prefix: list[int]       # prefix sums of forward FLOPs over `order`
    boundary_bytes: list[int]     # per position 0..N
    legal: list[bool]             # per position: boundary holds only tensors
    pins: list[int]               # positions the user pinned


@stage_pass(needs=Sharded, gives=Partitioned, requires=("costs",), guarantees=("chunks", "costs"))
def split_pipeline(prog: Sharded) -> Partitioned:
    """Needs: costs on nodes. Guarantees: pp*v chunks, each with its own graph, covering
    every compute node; boundaries as typed specs; no whole-program graph any more."""
    k = prog.plan.num_chunks
    free = _free_nodes(prog.graph, k)
    layout = _layout(prog, free)
    n = len(layout.order)
    if n < k:
        raise PlanError(f"{prog.name} has {n} cuttable ops but the plan asks for pp*v={k} chunks; "
                        f"use pp*v <= {n}")
    if layout.pins:
        if len(layout.pins) != k - 1:
            raise PlanError(f"{prog.name}: {len(layout.pins)} pinned split points make "
                            f"{len(layout.pins) + 1} chunks but the plan has pp*v={k}; "
                            f"pin {k - 1} points or none")
        cuts = layout.pins
    else:
        cuts = _best_cuts(prog, layout, k)
    cut = _build_chunks(prog, layout, free, cuts)
    by_name = {x.name: x for x in prog.graph.nodes}
    params = {tf(x)["fqn"]: x for x in prog.graph.nodes
              if x.op == "placeholder" and tf(x).get("kind") == "param" and meta_of(x) is not None}
    chunks = [chunk.evolve(cost=measure_chunk(prog.state, by_name, params, chunk, chunk.index == k - 1))
              for chunk in extract_chunks(prog.graph, cut)]
    _refuse_empty_stages(prog, chunks)
    order = tuple(x.name for x in compute_nodes(prog.graph))
    inputs = sorted((x for x in prog.graph.nodes if x.op == "placeholder" and tf(x)["kind"] == "input"),
                    key=lambda x: tf(x)["input_index"])
    notes = prog.notes + tuple(_inside_layer_notes(layout, cuts))
    return prog.advance(Partitioned, chunks=tuple(chunks), source_order=order, notes=notes,
                        user_inputs=tuple(BoundarySpec.of(x) for x in inputs))


def _refuse_empty_stages(prog: Sharded, chunks: list) -> None:
    """A pipeline stage that holds no parameter does no training work: it only passes
    activations on, costing a hop and a rank (pp=8 on a 2-layer model)."""
    # lazy: start-up: runtime.mesh loads only on this path
    from threefold.runtime.mesh import chunk_layout, stage_of
    pp = prog.plan.pp
    if pp == 1:
        return
    layout = chunk_layout(prog.plan.schedule)
    held = [0] * pp
    for c in chunks:
        held[stage_of(c.index, pp, layout)] += len(c.params)
    empty = [s for s, n in enumerate(held) if n == 0]
    if empty:
        with_params = pp - len(empty)
        raise PlanError(f"{prog.name}: pp={pp} leaves pipeline stage{'s' if len(empty) > 1 else ''} "
                        f"{', '.join(map(str, empty))} without any parameter (the model has too few layers "
                        f"to cut {pp} ways); use pp <= {max(1, with_params)}")


def _inside_layer(layout: _Layout) -> list[bool]:
    """Per position: does a cut there fall inside one transformer layer (both sides of it
    in the same repeated layer, passes/layers.py)?"""
    # lazy: start-up: passes.layers loads only on this path
    from threefold.passes.layers import layer_key, repeated_containers
    containers = repeated_containers(layout.order)
    keys = [layer_key(n, containers) for n in layout.order]
    return [False] + [a is not None and a == b for a, b in zip(keys, keys[1:])] + [False]


def _inside_layer_notes(layout: _Layout, cuts: list[int]) -> list[str]:
    inside = _inside_layer(layout)
    if not layout.order or not any(inside[c] for c in cuts):
        return []
    # lazy: start-up: passes.layers loads only on this path
    from threefold.passes.layers import layer_key, repeated_containers
    containers = repeated_containers(layout.order)
    where = sorted({layer_key(layout.order[c], containers) for c in cuts if inside[c]})
    worst = max(_chunk_flops(layout.flops_prefix, cuts))
    legal = [p for p in range(1, len(layout.order)) if layout.legal[p] and not inside[p]]
    at_layers = _minmax_partition(layout.flops_prefix, legal, len(cuts) + 1) if len(legal) >= len(cuts) else None
    cost = (f"cutting at layers would make the slowest stage {max(_chunk_flops(layout.flops_prefix, at_layers)) / worst - 1:.0%} "
            "slower" if at_layers is not None and worst else "no layer boundary can cut it that many ways")
    return [f"pipeline cut inside a layer ({', '.join(where)}): {cost}; pin cuts with split=... "
            "to keep layers whole"]


# a cut at a layer boundary is taken over a better-balanced one inside a layer when the most
# expensive chunk costs at most this much more (a layer split across stages sends more
# values, confuses every per-layer report and memory unit, and reads badly)
LAYER_BOUNDARY_SLACK = 0.05


# ---- analysis -----------------------------------------------------------------------------

def _free_nodes(graph: fx.Graph, num_chunks: int) -> set[fx.Node]:
    """Parameter-free compute nodes cheap enough to recompute in every chunk that needs them.

    A node is free when all its inputs are free nodes or non-parameter placeholders (user
    inputs, buffers, constants), it writes nothing in place, and its FLOPs are at most 1% of
    an average chunk's, so copying it into each chunk costs little and its value never
    crosses a stage boundary."""
    total = sum(tf(n)["cost"].flops for n in graph.nodes if n.op == "call_function" and "cost" in tf(n))
    cheap = max(total / max(num_chunks, 1) / 100, 1)
    free: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op != "call_function" or node.target is PIPE_SPLIT_OP:
            continue
        cost = tf(node).get("cost")
        if cost is not None and cost.flops > cheap or _mutates(node):
            continue
        if all((tf(a).get("kind") != "param") if a.op == "placeholder" else a in free
               for a in node.all_input_nodes):
            free.add(node)
    return free


def _mutates(node: fx.Node) -> bool:
    """In-place ops (a BatchNorm's num_batches_tracked += 1) run once, in a chunk of their own
    position, never copied and never dropped for having no users."""
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def _layout(prog: Sharded, free: set[fx.Node]) -> _Layout:
    order = [n for n in compute_nodes(prog.graph) if n not in free and n.target is not PIPE_SPLIT_OP]
    index = {n: i for i, n in enumerate(order)}
    n = len(order)
    flops_prefix = [0]
    for node in order:
        flops_prefix.append(flops_prefix[-1] + tf(node)["cost"].flops)

    # A value made at i is live across positions i+1 .. last_use (inclusive).
    delta_bytes = [0] * (n + 2)
    delta_bad = [0] * (n + 2)
    for i, node in enumerate(order):
        uses = [index.get(u, n) for u in node.users]  # the output node counts as position n
        if not uses:
            continue
        last = max(uses)
        if last <= i:
            continue
        m = meta_of(node)
        if m is None:
            delta_bad[i + 1] += 1
            delta_bad[last + 1] -= 1
        else:
            delta_bytes[i + 1] += m.nbytes
            delta_bytes[last + 1] -= m.nbytes
    boundary, legal = [], []
    acc_b = acc_bad = 0
    for p in range(n + 1):
        acc_b += delta_bytes[p]
        acc_bad += delta_bad[p]
        boundary.append(acc_b)
        legal.append(acc_bad == 0 and 0 < p < n)
    pins = _pins(prog, order, legal)
    return _Layout(order, flops_prefix, boundary, legal, pins)


def _pins(prog: Sharded, order: list[fx.Node], legal: list[bool]) -> list[int]:
    """Positions from pipe_split() markers and Plan.split_points FQNs."""
    index = {n: i for i, n in enumerate(order)}
    pins = set()
    pending_marker = False
    for node in prog.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is PIPE_SPLIT_OP:
            pending_marker = True
        elif pending_marker and node in index:
            pins.add(index[node])
            pending_marker = False
    for fqn in prog.plan.split_points:
        hits = [i for i, node in enumerate(order)
                if tf(node).get("module", "") == fqn or tf(node).get("module", "").startswith(fqn + ".")]
        if not hits:
            raise PlanError(f"split point {fqn!r} names no module of {prog.name}: "
                            "give the FQN of a submodule, e.g. 'h.4' or 'layers.12'")
        pins.add(hits[0])
    for p in pins:
        if not (0 < p < len(order)) or not legal[p]:
            raise PlanError(f"pinned split at op {p} of {prog.name} falls where a tuple value is live "
                            "or at the very start or end; move the marker between layers")
    return sorted(pins)


# ---- balancing ----------------------------------------------------------------------------

def _best_cuts(prog: Sharded, layout: _Layout, k: int) -> list[int]:
    n = len(layout.order)
    legal_positions = [p for p in range(1, n) if layout.legal[p]]
    if len(legal_positions) < k - 1:
        raise PlanError(f"{prog.name} has only {len(legal_positions)} places to cut but pp*v={k} "
                        f"chunks need {k - 1}; use pp*v <= {len(legal_positions) + 1}")
    if k == 1:
        return []
    smallest = min(layout.boundary_bytes[p] for p in legal_positions) or 1
    results = []
    slack = 1.0
    while True:
        cands = [p for p in legal_positions if layout.boundary_bytes[p] <= smallest * slack * (1 + 1e-9)]
        if len(cands) >= k - 1:
            cuts = _minmax_partition(layout.flops_prefix, cands, k)
            if cuts is not None:
                worst = max(_chunk_flops(layout.flops_prefix, cuts))
                results.append((worst, slack, cuts))
        if len(cands) == len(legal_positions):
            break
        slack *= 2
    best_worst = min(r[0] for r in results)
    chosen = next(cuts for worst, slack, cuts in results if worst <= best_worst * 1.05)   # smallest slack first
    inside = _inside_layer(layout)
    if any(inside[c] for c in chosen):
        whole = [p for p in legal_positions if not inside[p]
                 and layout.boundary_bytes[p] <= max(layout.boundary_bytes[c] for c in chosen)]
        at_layers = _minmax_partition(layout.flops_prefix, whole, k) if len(whole) >= k - 1 else None
        if at_layers is not None and \
                max(_chunk_flops(layout.flops_prefix, at_layers)) <= best_worst * (1 + LAYER_BOUNDARY_SLACK):
            return at_layers
    return chosen


def _chunk_flops(prefix: list[int], cuts: list[int]) -> list[int]:
    bounds = [0] + cuts + [len(prefix) - 1]
    return [prefix[b] - prefix[a] for a, b in zip(bounds, bounds[1:])]


def _minmax_partition(prefix: list[int], cands: list[int], k: int) -> list[int] | None:
    """Cut positions (from cands) into k non-empty chunks minimizing the max chunk sum.

    Binary search finds the smallest feasible max; among partitions that reach it we pick
    one whose chunks are close to equal shares of what is left (so 4 layers on pp=3 become
    2+1+1, not 2+2+sliver)."""
    total = prefix[-1]
    if _min_chunks(prefix, cands, total) is None or len(cands) < k - 1:
        return None
    lo, hi = 0, total
    while lo < hi:
        mid = (lo + hi) // 2
        need = _min_chunks(prefix, cands, mid)
        if need is None or need > k:
            lo = mid + 1
        else:
            hi = mid
    # Fill from the front and from the back; keep the partition whose chunk costs, sorted
    # from the largest, are smaller (a heavy LM head at the end is best left alone at the
    # back, a heavy embedding at the front).
    n = len(prefix) - 1
    forward = _balanced_cuts(prefix, cands, k, lo)
    mirrored = [total - prefix[n - i] for i in range(n + 1)]
    backward = sorted(n - c for c in _balanced_cuts(mirrored, sorted(n - c for c in cands), k, lo))
    return min(forward, backward, key=lambda cuts: sorted(_chunk_flops(prefix, cuts), reverse=True))


def _min_chunks(prefix: list[int], cands: list[int], limit: int) -> int | None:
    """Fewest chunks with every chunk <= limit (greedy furthest reach, optimal); None if none."""
    n = len(prefix) - 1
    cand_values = [prefix[c] for c in cands]
    start, count = 0, 1
    while prefix[n] - prefix[start] > limit:
        j = bisect.bisect_right(cand_values, prefix[start] + limit) - 1
        if j < 0 or cands[j] <= start:
            return None
        start = cands[j]
        count += 1
    return count


def _balanced_cuts(prefix: list[int], cands: list[int], k: int, limit: int) -> list[int]:
    n = len(prefix) - 1
    cand_values = [prefix[c] for c in cands]
    # need[j]: fewest chunks covering [cands[j], n] with each <= limit (inf if impossible).
    inf = float("inf")
    need = [inf] * len(cands)
    for j in range(len(cands) - 1, -1, -1):
        if prefix[n] - cand_values[j] <= limit:
            need[j] = 1
        else:
            far = bisect.bisect_right(cand_values, cand_values[j] + limit) - 1
            if far > j:
                need[j] = 1 + need[far]
    neg_need = [-x for x in need]   # non-decreasing, for bisect
    cuts: list[int] = []
    start_value, lo = 0, 0          # lo: first candidate index still usable
    for i in range(k - 1):
        after = k - i - 1           # chunks still to place after this cut
        hi = min(bisect.bisect_right(cand_values, start_value + limit) - 1,
                 len(cands) - after)   # leave a candidate for each later cut
        # need[] is non-increasing in j, so the usable range is [first j with need<=after, hi]
        first = bisect.bisect_left(neg_need, -after, lo, hi + 1) if hi >= lo else hi + 1
        first = max(first, lo)
        if first > hi:
            raise AssertionError("balanced cut search lost feasibility")
        target = start_value + (prefix[n] - start_value) / (k - i)
        j = bisect.bisect_left(cand_values, target, first, hi + 1)
        if j > hi or (j > first and target - cand_values[j - 1] <= cand_values[j] - target):
            j = max(first, j - 1)
        cuts.append(cands[j])
        start_value, lo = cand_values[j], j + 1
    return cuts


# ---- chunk construction -------------------------------------------------------------------

def _build_chunks(prog: Sharded, layout: _Layout, free: set[fx.Node], cuts: list[int]) -> list[ChunkCut]:
    order = layout.order
    n = len(order)
    bounds = [0] + list(cuts) + [n]
    output_node = next(x for x in reversed(prog.graph.nodes) if x.op == "output")
    graph_pos = {x: i for i, x in enumerate(prog.graph.nodes)}
    placeholders = [x for x in prog.graph.nodes if x.op == "placeholder"]

    # live[c]: values made before cut c and used at or after it (graph order), one sweep.
    index = {x: i for i, x in enumerate(order)}
    live: list[list[str]] = [[] for _ in bounds]
    for i, node in enumerate(order):
        last = max((index.get(u, n) for u in node.users), default=i)
        # cuts c with i < bounds[c] <= last (the final bound n is the output, handled below)
        c = bisect.bisect_right(bounds, i)
        while c < len(bounds) - 1 and bounds[c] <= last:
            live[c].append(node.name)
            c += 1
    live[-1] = [a.name for a in output_node.all_input_nodes]

    chunks = []
    for ci, (a, b) in enumerate(zip(bounds, bounds[1:])):
        body = order[a:b]
        needed_free: set[fx.Node] = set()
        stack = [x for node in body for x in node.all_input_nodes if x in free]
        if b == n:  # model outputs that are free values (rare) come from this chunk too
            stack += [x for x in output_node.all_input_nodes if x in free]
        while stack:
            node = stack.pop()
            if node not in needed_free:
                needed_free.add(node)
                stack.extend(x for x in node.all_input_nodes if x in free)
        recomputed = sorted(needed_free, key=graph_pos.__getitem__)
        used_ph = {x for node in body + recomputed for x in node.all_input_nodes if x.op == "placeholder"}
        if b == n:
            used_ph |= {x for x in output_node.all_input_nodes if x.op == "placeholder"}
        mine = [x for x in placeholders if x in used_ph]
        chunks.append(ChunkCut(
            index=ci, nodes=[x.name for x in body], inputs=live[ci] if a else [],
            outputs=live[ci + 1], user_inputs=[tf(x)["input_index"] for x in mine if tf(x)["kind"] == "input"],
            params=[tf(x)["fqn"] for x in mine if tf(x)["kind"] == "param"],
            buffers=[tf(x)["fqn"] for x in mine if tf(x)["kind"] == "buffer"],
            recomputed=[x.name for x in recomputed]))
    return chunks
