"""Pipeline schedules as data: one ordered action list per pipeline stage.

Model chunks. With `pp` stages and `v` chunks per stage the model is cut into `pp*v`
chunks numbered 0..pp*v-1 in model order; chunk c lives on stage `mesh.stage_of(c, pp,
layout)`: `c % pp` for every schedule but ZB-V (Megatron's interleaved assignment: stage r
holds chunks r, r+pp, r+2pp, ...), and the V of ZB-V (stage s holds chunks s and 2pp-1-s).
Activations flow from chunk c to c+1, gradients from c+1 to c. Chunk 0 reads its input from the data loader;
the last chunk's forward computes the loss and its backward starts from the loss.

Actions (all name a *local* chunk, i.e. one that lives on the rank holding the action):

    F3.1      FORWARD(chunk=3, mb=1)      run chunk 3 forward on microbatch 1
    B3.1      BACKWARD(3, 1)              run chunk 3 backward on microbatch 1 (zero-bubble
                                          schedules: input gradients only, "B" of the paper)
    W3.1      WEIGHT(3, 1)                zero-bubble schedules: chunk 3's weight gradients on
                                          microbatch 1, from what its B kept ("W" of the paper)
    sa3.1>2   SEND_ACT(3, 1, peer=2)      send chunk 3's output to stage 2 (holds chunk 4)
    ra3.1<2   RECV_ACT(3, 1, peer=2)      receive chunk 3's input from stage 2 (holds chunk 2)
    sg3.1>2   SEND_GRAD(3, 1, peer=2)     send d(loss)/d(chunk 3's input) to stage 2 (chunk 2)
    rg3.1<0   RECV_GRAD(3, 1, peer=0)     receive d(loss)/d(chunk 3's output) from stage 0 (chunk 4)

Collectives (inserted by runtime/collective_plan.py into a job's schedule, from its
manifest: the communication a step needs is in the list, so the verifier checks it and the
simulator costs it; the bare schedules of make_schedule have none):

    dn        LOSS_DENOMINATOR            the loss's global denominator (the loss stage; counted
                                          locally over the global batch, no communication)
    ls        LOSS                        post the loss all-reduce (waited at the end of the step)
    ag3.0     UNSHARD(3, 0)               zero=3: all-gather chunk 3's parameters kept whole for
                                          all its microbatches (unit 0); per-layer units are
                                          gathered inside F and B (collective_plan.UnitProgram)
    ar3.1     ALL_REDUCE_GRADS(3, 1)      start the dp all-reduce of chunk 3's gradient bucket 1
    rs3.1     REDUCE_SCATTER_GRADS(3, 1)  zero=1: start its reduce-scatter instead
    wg        WAIT_GRADS                  wait for every gradient reduction of the step
    fr3.0     RESHARD(3, 0)               zero=3: free chunk 3's unit 0 (after its last backward)
    ts.2      TIED_SUM(index 2)           all-reduce tied parameter 2's gradient over its stages
    ss        SP_SUM                      all-reduce sequence-parallel gradients over tp

So `sa c.i` on one stage pairs with `ra c+1.i` on the next, and `sg c.i` with `rg c-1.i`.
Neighbouring chunks on the same stage (ZB-V's turn, chunks pp-1 and pp) exchange no
message: the forward of c+1 reads c's outputs and the backward of c reads c+1's input
gradients on the rank itself.
A rank executes (or posts) its list strictly in order. The lists are built so that they
cannot deadlock even if every send blocks until its receive is posted (rendezvous), and
for every ordered pair of ranks the messages sent from A to B appear in the same order as
the receives B posts from A, so no tags are needed. `threefold.runtime.simulate.verify`
proves both for a given schedule.

How an executor runs a rank's list (pp-rank r of its pipeline; peers are pp-ranks):
  ra c.i<q   receive the input of chunk c, microbatch i, from pp-rank q
  F c.i      run chunk c on that input (chunk 0: microbatch i from the data loader); keep
             what backward needs; the last chunk also computes the loss
  sa c.i>q   send chunk c's output for microbatch i to pp-rank q
  rg c.i<q   receive the gradient of chunk c's output for microbatch i
  B c.i      backward through chunk c (the last chunk: from its loss); free its activations
  sg c.i>q   send the gradient of chunk c's input for microbatch i to pp-rank q
  W c.i      (zb-h1, zbv) weight gradients of chunk c, microbatch i, deferred by its B
Blocking sends are safe; non-blocking sends (isend, waited before the buffer is reused or
at the end of the step) are also safe and avoid the waits that blocking sends add to the
interleaved schedule (`Report.rendezvous_makespan` says how much).
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from threefold.errors import PlanError
from threefold.runtime.mesh import chunk_layout, stage_of


class ScheduleError(PlanError):
    """A schedule that violates the IR's contract (names the rank, the action and why)."""


class Kind(str, enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    SEND_ACT = "sa"
    RECV_ACT = "ra"
    SEND_GRAD = "sg"
    RECV_GRAD = "rg"
    WEIGHT = "W"
    LOSS_DENOMINATOR = "dn"
    LOSS = "ls"
    UNSHARD = "ag"
    ALL_REDUCE_GRADS = "ar"
    REDUCE_SCATTER_GRADS = "rs"
    WAIT_GRADS = "wg"
    RESHARD = "fr"
    TIED_SUM = "ts"
    SP_SUM = "ss"


COMPUTE = (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT)
SENDS = (Kind.SEND_ACT, Kind.SEND_GRAD)
RECVS = (Kind.RECV_ACT, Kind.RECV_GRAD)
# collectives that name a chunk (`ar3.1`), and those of the whole stage (`wg`, `ts.2`)
CHUNK_COLLECTIVES = (Kind.UNSHARD, Kind.ALL_REDUCE_GRADS, Kind.REDUCE_SCATTER_GRADS, Kind.RESHARD)
STAGE_COLLECTIVES = (Kind.LOSS_DENOMINATOR, Kind.LOSS, Kind.WAIT_GRADS, Kind.TIED_SUM, Kind.SP_SUM)
COLLECTIVES = CHUNK_COLLECTIVES + STAGE_COLLECTIVES


@dataclass(frozen=True, slots=True)
class Action:
    kind: Kind
    chunk: int          # the local model chunk this action runs or serves
    mb: int             # microbatch index, 0..m-1
    peer: int = -1      # the other pipeline stage for send/recv; -1 for compute

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE

    @property
    def is_send(self) -> bool:
        return self.kind in SENDS

    @property
    def is_recv(self) -> bool:
        return self.kind in RECVS

    @property
    def is_collective(self) -> bool:
        return self.kind in COLLECTIVES

    @property
    def message(self) -> tuple[str, int, int]:
        """Identity of the message a send/recv moves: (act|grad, producing chunk, mb).

        Equal on both ends: sa3.1 and ra4.1 are both ('act', 3, 1); sg3.1 and rg2.1 are
        both ('grad', 3, 1).
        """
        k = self.kind
        if k is Kind.SEND_ACT:
            return ("act", self.chunk, self.mb)
        if k is Kind.RECV_ACT:
            return ("act", self.chunk - 1, self.mb)
        if k is Kind.SEND_GRAD:
            return ("grad", self.chunk, self.mb)
        if k is Kind.RECV_GRAD:
            return ("grad", self.chunk + 1, self.mb)
        raise ValueError(f"{self} is a compute action and moves no message")

    def __str__(self) -> str:
        if self.kind in STAGE_COLLECTIVES:
            return self.kind.value + (f".{self.mb}" if self.kind is Kind.TIED_SUM else "")
        text = f"{self.kind.value}{self.chunk}.{self.mb}"
        if self.is_send:
            return f"{text}>{self.peer}"
        if self.is_recv:
            return f"{text}<{self.peer}"
        return text

    __repr__ = __str__


_ACTION_RE = re.compile(r"^(F|B|W|sa|ra|sg|rg|ag|ar|rs|fr)(\d+)\.(\d+)(?:([<>])(\d+))?$")
_STAGE_RE = re.compile(r"^(dn|ls|wg|ss|ts)(?:\.(\d+))?$")


def collective(kind: Kind, chunk: int = -1, index: int = 0) -> Action:
    """A collective action: chunk-level ones name their chunk and bucket or unit `index`;
    stage-level ones have chunk -1 (`index`: the tied parameter of a TIED_SUM)."""
    return Action(kind, chunk if kind in CHUNK_COLLECTIVES else -1, index)


def parse_action(text: str) -> Action:
    """Inverse of str(action): 'F3.1', 'sa3.1>2', 'rg3.1<0', 'ar3.0', 'wg', 'ts.2'."""
    stage_level = _STAGE_RE.match(text.strip())
    if stage_level:
        kind, index = stage_level.groups()
        if (kind == "ts") != (index is not None):
            raise ScheduleError(f"schedule action {text!r} is malformed: only ts takes an index (ts.2)")
        return collective(Kind(kind), index=int(index or 0))
    match = _ACTION_RE.match(text.strip())
    if not match:
        raise ScheduleError(f"schedule action {text!r} is malformed: write e.g. F3.1, B3.1, sa3.1>2 or ra3.1<2")
    kind, chunk, mb, arrow, peer = match.groups()
    action = Action(Kind(kind), int(chunk), int(mb), int(peer) if peer is not None else -1)
    wanted = ">" if action.is_send else "<" if action.is_recv else None
    if arrow != wanted:
        raise ScheduleError(f"schedule action {text!r} is malformed: "
                            f"{'a compute action takes no peer' if wanted is None else f'write {wanted}PEER after it'}")
    return action


@dataclass(frozen=True)
class Schedule:
    name: str                       # gpipe | 1f1b | interleaved | zb-h1 | zbv | forward
    pp: int                         # pipeline stages (ranks of one pipeline)
    v: int                          # model chunks per stage
    m: int                          # microbatches per iteration
    actions: list[list[Action]]     # actions[stage]: that rank's list, in execution order
    layout: str = "loop"            # chunk -> stage rule (mesh.LAYOUTS): "v" for ZB-V and its inference

    @property
    def num_chunks(self) -> int:
        return self.pp * self.v

    @property
    def has_backward(self) -> bool:
        return self.name != "forward"

    @property
    def splits_backward(self) -> bool:
        """B computes input gradients only and W actions the weight gradients (zero bubble)."""
        return self.name in SPLIT_KINDS

    def stage_of(self, chunk: int) -> int:
        return stage_of(chunk, self.pp, self.layout)

    def chunks_of(self, stage: int) -> list[int]:
        """The chunks a stage holds, in model order."""
        return [c for c in range(self.num_chunks) if self.stage_of(c) == stage]

    def compute(self, stage: int) -> list[Action]:
        """Only the forward/backward actions of one stage, in order."""
        return [a for a in self.actions[stage] if a.kind in COMPUTE]

    def to_json(self) -> dict:
        return {"schedule": self.name, "pp": self.pp, "interleave": self.v, "microbatches": self.m,
                "layout": self.layout, "actions": [[str(a) for a in rank] for rank in self.actions]}

    @classmethod
    def from_json(cls, data: dict) -> "Schedule":
        return cls(name=data["schedule"], pp=int(data["pp"]), v=int(data["interleave"]),
                   m=int(data["microbatches"]),
                   actions=[[parse_action(t) for t in rank] for rank in data["actions"]],
                   layout=data.get("layout", chunk_layout(data["schedule"])))

    def __str__(self) -> str:
        head = f"{self.name} pp={self.pp} m={self.m} v={self.v}"
        return "\n".join([head] + [f"rank {r}: " + " ".join(map(str, acts))
                                   for r, acts in enumerate(self.actions)])


# ---- generators ---------------------------------------------------------------------
KINDS = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "forward")
SPLIT_KINDS = ("zb-h1", "zbv")   # backward split into B (input grads) and W (weight grads)

# A compute step before communication is placed: (phase, chunk, mb), phase 0 forward,
# 1 backward (B), 2 weight gradients (W). False/True read as 0/1.
Step = tuple[int, int, int]
FWD, BWD, WGT = 0, 1, 2


def make_schedule(kind: str, pp: int, m: int, v: int = 1, layout: str | None = None) -> Schedule:
    """Build the named schedule (gpipe, 1f1b, interleaved, zb-h1, zbv, forward); PlanError if
    it cannot work. `layout` only matters for forward-only schedules of a ZB-V artifact
    (layout="v"); the others follow from the kind."""
    kind = str(kind).lower().replace("-", "_")
    kind = {"pipedream_flush": "1f1b", "forward_only": "forward", "zb_h1": "zb-h1", "zbh1": "zb-h1",
            "zb_v": "zbv"}.get(kind, kind)
    _check_sizes(kind, pp, m, v)
    if kind == "forward" and layout == "v":
        _check_v_shape(kind, pp, v)
        return _with_communication(kind, pp, m, v, _forward_by_chunk(pp, m, v, "v"), layout="v")
    if kind in SPLIT_KINDS:
        # lazy: start-up: runtime.zero_bubble loads only on this path
        from threefold.runtime.zero_bubble import zb_h1_order, zbv_order
        if kind == "zbv":
            _check_v_shape(kind, pp, v)
            orders = [zbv_order(r, pp, m) for r in range(pp)]
        else:
            orders = [zb_h1_order(r, pp, m) for r in range(pp)]
        return _with_communication(kind, pp, m, v, orders)
    if kind == "gpipe":
        orders = [[(False, r, i) for i in range(m)] + [(True, r, i) for i in range(m)] for r in range(pp)]
    elif kind == "1f1b":
        orders = [_one_f_one_b([(r, i) for i in range(m)], [(r, i) for i in range(m)], pp - r - 1)
                  for r in range(pp)]
    elif kind == "interleaved":
        orders = [_interleaved_order(r, pp, m, v) for r in range(pp)]
    else:
        orders = [[(False, c, i) for c, i in _megatron_table(r, pp, m, v, backward=False)] for r in range(pp)]
    return _with_communication(kind, pp, m, v, orders)


def forward_only(pp: int, m: int, v: int = 1, layout: str = "loop") -> Schedule:
    """Inference: every chunk's forward on every microbatch, no backward, no gradients
    (layout "v": on a ZB-V artifact's chunk placement)."""
    return make_schedule("forward", pp, m, v, layout=layout)


def _check_sizes(kind: str, pp: int, m: int, v: int) -> None:
    for name, value in (("pp", pp), ("m", m), ("v", v)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlanError(f"schedule {name}={value!r} is invalid: it must be a positive integer")
    if kind not in KINDS:
        raise PlanError(f"schedule {kind!r} is unknown: use one of gpipe, 1f1b, interleaved, zb-h1, zbv "
                        "(or forward)")
    if kind == "zbv":
        return
    if v > 1 and kind not in ("interleaved", "forward"):
        raise PlanError(f"schedule v={v} needs the interleaved schedule (got {kind}): "
                        "use the interleaved schedule (plan schedule=interleaved, CLI --schedule interleaved) or set v=1")
    if v > 1 and pp == 1:
        raise PlanError(f"schedule v={v} with pp=1 is pointless: all chunks would sit on one rank; "
                        "set v=1 or use pp>=2")


def _check_v_shape(kind: str, pp: int, v: int) -> None:
    if v != 2:
        raise PlanError(f"schedule {kind} with v={v} is invalid: ZB-V runs exactly two chunks per stage "
                        "in a V; set v=2 (plan v=2, CLI -v 2)")
    if pp < 2:
        raise PlanError(f"schedule {kind} with pp={pp} is pointless: its V needs two stages or more; "
                        "set pp>=2 or use zb-h1")


def _forward_by_chunk(pp: int, m: int, v: int, layout: str) -> list[list[Step]]:
    """Inference on any layout: each stage runs its chunks' forwards sorted by (chunk, mb),
    an order every stage agrees with (a forward depends only on a smaller chunk)."""
    return [[(FWD, c, i) for c in range(pp * v) if stage_of(c, pp, layout) == r for i in range(m)]
            for r in range(pp)]


def _one_f_one_b(fwd: list[tuple[int, int]], bwd: list[tuple[int, int]], warmup: int) -> list[Step]:
    """Warm-up forwards, then alternate one forward / one backward, then drain backwards."""
    total = len(fwd)
    warmup = min(warmup, total)
    order: list[Step] = [(False, c, i) for c, i in fwd[:warmup]]
    for k in range(total - warmup):
        order.append((False, *fwd[warmup + k]))
        order.append((True, *bwd[k]))
    order.extend((True, c, i) for c, i in bwd[total - warmup:])
    return order


def microbatch_groups(m: int, pp: int) -> list[int]:
    """Sizes of the microbatch groups of the interleaved schedule.

    Megatron uses groups of exactly pp and needs m % pp == 0. We split m into
    max(1, m // pp) groups as equal as possible (largest first), so every group holds
    pp..2pp-1 microbatches: the group still covers a trip around the pipeline, and the
    simulator shows the bubble stays (pp-1)/(v*m) for any m >= pp. When m is a multiple of
    pp these are Megatron's groups. m < pp gives one short group (verified, bigger bubble).
    """
    count = max(1, m // pp)
    return [m // count + (1 if j < m % count else 0) for j in range(count)]


def _megatron_table(stage: int, pp: int, m: int, v: int, backward: bool) -> list[tuple[int, int]]:
    """Megatron's interleaved (chunk, mb) order for one stage: microbatches in groups, and
    within a group every local chunk in turn (model order forward, reverse backward)."""
    table, first = [], 0
    for size in microbatch_groups(m, pp):
        for k in range(v):
            local = v - 1 - k if backward else k
            table.extend((local * pp + stage, i) for i in range(first, first + size))
        first += size
    return table


def _interleaved_warmup(stage: int, pp: int, m: int, v: int) -> int:
    if v == 1:   # one chunk per stage: interleaving degenerates to plain 1F1B
        return pp - stage - 1
    # Megatron: two steps per downstream stage, plus the other chunks of one group.
    return (pp - stage - 1) * 2 + (v - 1) * microbatch_groups(m, pp)[0]


def _interleaved_order(stage: int, pp: int, m: int, v: int) -> list[Step]:
    return _one_f_one_b(_megatron_table(stage, pp, m, v, False), _megatron_table(stage, pp, m, v, True),
                        _interleaved_warmup(stage, pp, m, v))


def inflight_bound(schedule_or_kind, pp: int = 0, m: int = 0, v: int = 1) -> list[int]:
    """Most activations (per (chunk, mb), forward done and backward not) each stage may hold.

    GPipe: m. 1F1B: pp-r (capped at m). Interleaved: its warm-up plus one,
    2(pp-r-1) + (v-1)G + 1 with G the first group's size (pp when pp divides m), capped at
    v*m. Forward-only holds none for backward. ZB-H1 and ZB-V: see
    `runtime/zero_bubble.inflight_bound` (counted from F to B, as here; what W keeps is
    bounded separately by `zero_bubble.weight_inflight_bound`).
    """
    kind = schedule_or_kind
    if isinstance(schedule_or_kind, Schedule):
        kind, pp, m, v = schedule_or_kind.name, schedule_or_kind.pp, schedule_or_kind.m, schedule_or_kind.v
    if kind == "gpipe":
        return [m] * pp
    if kind == "1f1b":
        return [min(pp - r, m) for r in range(pp)]
    if kind == "interleaved":
        return [min(v * m, _interleaved_warmup(r, pp, m, v) + 1) for r in range(pp)]
    if kind == "forward":
        return [0] * pp
    if kind in SPLIT_KINDS:
        # lazy: start-up: runtime.zero_bubble loads only on this path
        from threefold.runtime.zero_bubble import inflight_bound as zb_bound
        return zb_bound(kind, pp, m)
    raise PlanError(f"schedule {kind!r} is unknown: use one of {', '.join(KINDS)}")


# ---- placing sends and receives -----------------------------------------------------
def _with_communication(name: str, pp: int, m: int, v: int, orders: list[list[Step]],
                        layout: str | None = None) -> Schedule:
    """Insert sends and receives into per-stage compute orders.

    We time the compute orders once (forward 1, backward 2 or, split, B 1 and W 1; free
    communication) and give every event a key: a compute its start time, a message (send and
    receive alike) the time its producer finishes. Each rank's list is its events sorted by
    (time, message before compute, message id). All ranks therefore follow one global order
    in which a message is a single event, so even sends that wait for their receive cannot
    deadlock, and the messages between two ranks are sent and received in the same order.
    W actions move no message, and neither does a hand-over between two chunks on one stage
    (the turn of ZB-V's V): the executor passes those tensors on locally.
    """
    layout = layout or chunk_layout(name)
    last = pp * v - 1
    cost = _unit_costs(name)
    end = _time_compute(name, pp, m, v, orders)

    def peer(c: int) -> int:
        return stage_of(c, pp, layout)

    keyed: list[list[tuple[tuple, Action]]] = [[] for _ in range(pp)]
    for r, order in enumerate(orders):
        events = keyed[r]
        for phase, c, i in order:
            finish = end[(phase, c, i)]
            start = finish - cost[phase]
            remote_prev = c > 0 and peer(c - 1) != r
            remote_next = c < last and peer(c + 1) != r
            if phase == FWD:
                if remote_prev:
                    t = end[(FWD, c - 1, i)]
                    events.append(((t, 0, 0, c - 1, i), Action(Kind.RECV_ACT, c, i, peer(c - 1))))
                events.append(((start, 1, 0, 0, 0), Action(Kind.FORWARD, c, i)))
                if remote_next:
                    events.append(((finish, 0, 0, c, i), Action(Kind.SEND_ACT, c, i, peer(c + 1))))
            elif phase == BWD:
                if remote_next:
                    t = end[(BWD, c + 1, i)]
                    events.append(((t, 0, 1, c + 1, i), Action(Kind.RECV_GRAD, c, i, peer(c + 1))))
                events.append(((start, 1, 0, 0, 0), Action(Kind.BACKWARD, c, i)))
                if remote_prev:
                    events.append(((finish, 0, 1, c, i), Action(Kind.SEND_GRAD, c, i, peer(c - 1))))
            else:
                events.append(((start, 1, 0, 0, 0), Action(Kind.WEIGHT, c, i)))
    actions = []
    for events in keyed:
        events.sort(key=lambda e: e[0])
        actions.append([a for _, a in events])
    return Schedule(name=name, pp=pp, v=v, m=m, actions=actions, layout=layout)


def _unit_costs(name: str) -> tuple[int, int, int]:
    """Unit costs (F, B, W) the generators order by: a fused backward is two forwards; split,
    B and W are one each (the paper's T_F = T_B = T_W)."""
    return (1, 1, 1) if name in SPLIT_KINDS else (1, 2, 0)


def _time_compute(name: str, pp: int, m: int, v: int, orders: list[list[Step]]) -> dict[Step, int]:
    """End time of every compute step when each stage runs its order as early as data allows."""
    last = pp * v - 1
    cost = _unit_costs(name)
    end: dict[Step, int] = {}
    clock = [0] * pp
    pos = [0] * pp
    moved = True
    while moved:
        moved = False
        for r in range(pp):
            order, t, k = orders[r], clock[r], pos[r]
            while k < len(order):
                phase, c, i = step = order[k]
                if phase == WGT:
                    deps = ((BWD, c, i),)
                elif phase == BWD:
                    deps = ((FWD, c, i),) if c == last else ((FWD, c, i), (BWD, c + 1, i))
                else:
                    deps = ((FWD, c - 1, i),) if c > 0 else ()
                if any(d not in end for d in deps):
                    break
                t = max([t] + [end[d] for d in deps]) + cost[phase]
                end[step] = t
                k += 1
            if k != pos[r]:
                clock[r], pos[r], moved = t, k, True
    stuck = [r for r in range(pp) if pos[r] < len(orders[r])]
    if stuck:
        r = stuck[0]
        phase, c, i = orders[r][pos[r]]
        raise ScheduleError(f"schedule {name} pp={pp} m={m} v={v} cannot run: rank {r} waits forever "
                            f"at {'FBW'[phase]}{c}.{i}; choose another m or schedule")
    return end
