"""Zero-bubble compute orders (Qi et al., "Zero Bubble Pipeline Parallelism", arXiv 2401.10241).

The backward of each (chunk, microbatch) is split in two: B, the input gradient, which the
previous stage waits for, and W, the weight gradients, which nobody waits for and which
therefore fills the bubbles 1F1B leaves. Both generators return per-stage compute orders
of (phase, chunk, mb) steps (phase 0 F, 1 B, 2 W); runtime/schedule.py places the sends and
receives and runtime/simulate.py verifies and times the result.

ZB-H1 (one chunk per stage, chunk r on stage r). Stage r runs 1F1B's warm-up (pp-1-r
forwards) and then 1F1B's alternation of F and B, but holds back its first r W's: from
then on each F/B pair is followed by the oldest pending W, and the cool-down runs B, W
pairs. The W's held back fill the wait for the first B (stage r's is 2(pp-1-r) shorter
in units of B than 1F1B's, because B is only half a backward). With unit costs
F = B = W = 1 the makespan is 3m + pp - 1 for m >= pp: every stage idles pp-1 units,
against 1F1B's 3(pp-1) (F 1, fused backward 2), so

    ZB-H1 bubble ratio  = (pp-1) / (3m)     (1F1B: (pp-1)/m, a third of it)

In-flight activations (F done, B not) are 1F1B's, min(m, pp-r); what W still keeps
(F done, W not) is at most min(m, pp) on every stage: 1F1B's peak (stage 0's), the
paper's "same peak memory as 1F1B".

ZB-V (two chunks per stage in a V: stage s holds chunk s and chunk 2pp-1-s, see
runtime/mesh.stage_of). Stage s warms up with 2(pp-s)-1 forwards of its first chunk, then
s pairs (F of the second chunk, F of the first), then pp-s triples F, B, W on the second
chunk; the steady state is F B W on the first chunk then F B W on the second; the
cool-down runs s pairs of B's, pp-s (B, W) pairs on the first chunk, and the W's left.
Written for m >= 2pp-1 microbatches; with fewer, the order for 2pp-1 is built and the
missing microbatches' steps dropped (still deadlock-free: dropping every step of a
microbatch removes nodes from an acyclic wait graph). With unit costs per chunk
F = B = W = 1 and m >= 2pp the steady state has no idle step at all; the only idle time is
the ramp, pp-1 units per stage (stage s waits s units for its first input and ends pp-1-s
units before the last stage does), so the makespan is 6m + pp - 1 and

    ZB-V bubble ratio   = (pp-1) / (6m)     (1F1B on the same pp stages: (pp-1)/m)

In-flight activations on stage s (chunk-microbatches, each half a stage's layers), from F to
B and from F to W alike: min(2m, 2pp, m+1+s); for m >= 2pp-1 that is 2pp chunk-microbatches,
pp stage-microbatches' worth, 1F1B's stage-0 peak.
"""
from __future__ import annotations

Step = tuple[int, int, int]
FWD, BWD, WGT = 0, 1, 2


def zb_h1_order(stage: int, pp: int, m: int) -> list[Step]:
    warmup = min(pp - 1 - stage, m)
    order: list[Step] = [(FWD, stage, i) for i in range(warmup)]
    backward = w_done = 0
    for k in range(m - warmup):
        order.append((FWD, stage, warmup + k))
        order.append((BWD, stage, backward))
        backward += 1
        if backward > stage:       # hold back the first `stage` W's for the bubbles
            order.append((WGT, stage, w_done))
            w_done += 1
    while backward < m:
        order.append((BWD, stage, backward))
        backward += 1
        if backward > stage:
            order.append((WGT, stage, w_done))
            w_done += 1
    order.extend((WGT, stage, i) for i in range(w_done, m))
    return order


def zbv_order(stage: int, pp: int, m: int) -> list[Step]:
    first, second = stage, 2 * pp - 1 - stage
    n = max(m, 2 * pp - 1)
    order: list[Step] = []
    f0 = f1 = b0 = b1 = 0

    def step(phase: int, chunk: int, mb: int) -> None:
        order.append((phase, chunk, mb))

    for _ in range(2 * (pp - stage) - 1):
        step(FWD, first, f0)
        f0 += 1
    for _ in range(stage):
        step(FWD, second, f1)
        f1 += 1
        step(FWD, first, f0)
        f0 += 1
    for _ in range(pp - stage):
        step(FWD, second, f1)
        step(BWD, second, b1)
        step(WGT, second, b1)
        f1 += 1
        b1 += 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            step(FWD, first, f0)
            f0 += 1
        step(BWD, first, b0)
        step(WGT, first, b0)
        b0 += 1
        step(FWD, second, f1)
        step(BWD, second, b1)
        step(WGT, second, b1)
        f1 += 1
        b1 += 1
    w0, w1 = b0, b1
    for _ in range(stage):
        step(BWD, first, b0)
        b0 += 1
        step(BWD, second, b1)
        b1 += 1
    for _ in range(pp - stage):
        step(BWD, first, b0)
        b0 += 1
        step(WGT, first, w0)
        w0 += 1
    for i in range(w1, b1):
        step(WGT, second, i)
    for i in range(w0, b0):
        step(WGT, first, i)
    return [s for s in order if s[2] < m]


def inflight_bound(kind: str, pp: int, m: int) -> list[int]:
    """Most (chunk, mb) per stage whose forward ran and whose B has not (module docstring)."""
    if kind == "zb-h1":
        return [min(pp - r, m) for r in range(pp)]
    return [min(2 * m, 2 * pp, m + 1 + s) for s in range(pp)]


def weight_inflight_bound(kind: str, pp: int, m: int) -> list[int]:
    """Most (chunk, mb) per stage whose forward ran and whose W has not (module docstring)."""
    if kind == "zb-h1":
        return [min(pp, m) for _ in range(pp)]
    return inflight_bound(kind, pp, m)
