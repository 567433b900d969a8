"""Typed placements: how a value is laid out over the ranks of each mesh axis.

`OnMesh` holds one placement per mesh axis (as DTensor's), the axes it does not name
replicated. Each axis's pass writes its entry (`place_on`), every reader asks `on_mesh_of`:

  tp        the tensor-parallel pass, every value it emits
  cp        the context-parallel pass: S(d) along the sequence, P for a sum over this
            rank's tokens (the loss numerator)
  dp        the batch rows (passes/mesh_axes.py): S(d) where the batch dim d is, split over
            the batch axes, the `dp` alias of dp_replicate x dp_shard x ep, and microbatches
  dp_shard  zero=3: a trainable parameter's rows (dim 0) over the dp_shard ranks
  ep        expert weights (dim 0, the experts) and the rows of an expert region

Neutral ground: the compiler writes these, the manifest stores their text (`str(p)`, which
`parse` reads back), and the runtime decides transfers with them. Nothing here imports the
compiler or the runtime.

  R      Replicate()                    every tp rank holds all of it
  R(f)   Replicate(partial_grad=True)   f's output: equal values, but each rank's gradient is
                                        a summand (never scattered/gathered across stages)
  R*     Replicate(gathered=True)       all-gathered from sequence shards; its backward
                                        reduce-scatters, so only column-parallel matmuls read it
  P      Partial()                      every rank holds a summand (reduced at once by g)
  S(d)   Shard(d, blocks, seq)          dim d split over the ranks; `blocks`: the dim is a
                                        concatenation of pieces (fused QKV), each split alone;
                                        `seq`: a sequence-parallel activation shard
  (a, b) Tuple((a, b))                  one placement per element of a tuple value
"""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Replicate:
    gathered: bool = False      # all-gathered from sequence shards: its backward already reduces
    partial_grad: bool = False  # f's output: equal values, but each rank's gradient is a summand

    def __str__(self):
        return "R*" if self.gathered else "R(f)" if self.partial_grad else "R"

    @property
    def plain(self) -> bool:
        """Equal values and equal gradients on every rank (what scatter/gather may split)."""
        return not self.gathered and not self.partial_grad


@dataclass(frozen=True)
class Partial:
    def __str__(self):
        return "P"


@dataclass(frozen=True)
class Shard:
    dim: int
    blocks: tuple[int, ...] = ()   # global sizes of the concatenated pieces, () = one piece
    seq: bool = False              # a sequence-parallel shard (plain activations, Korthikanti)

    def __str__(self):
        extra = f",blocks={list(self.blocks)}" if self.blocks else ""
        return f"S({self.dim}{extra}{',seq' if self.seq else ''})"

    def moved(self, dim: int) -> "Shard":
        return Shard(dim, self.blocks, self.seq)


@dataclass(frozen=True)
class Tuple:
    """A tuple-valued op's placements, one per element."""
    items: tuple

    def __str__(self):
        return "(" + ", ".join(map(str, self.items)) + ")"


Placement = Replicate | Partial | Shard | Tuple
R = Replicate()
P = Partial()


@dataclass(frozen=True)
class OnMesh:
    """A value's placement on every mesh axis: `on["tp"]`, Replicate for axes not listed.
    Text: the tp placement alone when no other axis is split (`S(1)`), else
    `tp:S(1);cp:S(1,seq)`, which `parse_on_mesh` reads back."""
    items: tuple[tuple[str, "Placement"], ...] = ()

    @classmethod
    def of(cls, **axes) -> "OnMesh":
        return cls(tuple((a, of(p)) for a, p in axes.items() if of(p) != R))

    def __getitem__(self, axis: str) -> "Placement":
        for a, p in self.items:
            if a == axis:
                return p
        return R

    def with_axis(self, axis: str, place) -> "OnMesh":
        rest = tuple((a, p) for a, p in self.items if a != axis)
        return OnMesh(rest + (((axis, of(place)),) if of(place) != R else ()))

    @property
    def axes(self) -> tuple[str, ...]:
        return tuple(a for a, _ in self.items)

    def dim(self, axis: str) -> int | None:
        """The dim `axis` splits (its Shard's), None where it does not shard this value."""
        p = self[axis]
        return p.dim if isinstance(p, Shard) else None

    def __str__(self):
        if not self.items:
            return "R"
        if self.axes == ("tp",):
            return str(self["tp"])
        return ";".join(f"{a}:{p}" for a, p in self.items)


def on_mesh_of(node) -> OnMesh:
    """A graph value's placement on every mesh axis: `node.meta["on_mesh"]` where the sharding
    passes wrote it (the tp pass does for every value it emits), else its tp placement alone
    (`node.meta["tf"]["placement"]`), else replicated everywhere."""
    meta = getattr(node, "meta", None) or {}
    on = meta.get("on_mesh")
    if isinstance(on, OnMesh):
        return on
    return OnMesh.of(tp=(meta.get("tf") or {}).get("placement") or R)


def place_on(node, axis: str, place) -> None:
    """Record `node`'s placement on one mesh axis (its other axes' entries kept): the one
    writer of `node.meta["on_mesh"]` for the axes after tp."""
    node.meta["on_mesh"] = on_mesh_of(node).with_axis(axis, place)


def parse_on_mesh(text) -> OnMesh:
    """`OnMesh` from its text (a bare placement is the tp axis's)."""
    if isinstance(text, OnMesh):
        return text
    s = (text or "").strip()
    if ":" not in s:
        return OnMesh.of(tp=parse(s))
    items = []
    for part in s.split(";"):
        axis, _, place = part.partition(":")
        items.append((axis.strip(), parse(place)))
    return OnMesh(tuple((a, p) for a, p in items if p != R))


def of(place) -> Placement:
    """A placement from what the TP rules hand around (a list for tuple values)."""
    if isinstance(place, (list, tuple)):
        return Tuple(tuple(of(p) for p in place))
    return place


def is_replicated(place) -> bool:
    """Plain R: the only placement a scatter/gather boundary may split 1/t per rank."""
    return isinstance(place, Replicate) and place.plain


def is_split(place) -> bool:
    """Any element sharded or partial (the op runs on a piece of the value)."""
    if isinstance(place, Tuple):
        return any(is_split(p) for p in place.items)
    return isinstance(place, (Shard, Partial))


def shards(place) -> list[Shard]:
    """Every Shard in a placement (a tuple's elements too)."""
    if isinstance(place, Tuple):
        return [s for p in place.items for s in shards(p)]
    return [place] if isinstance(place, Shard) else []


_SHARD = re.compile(r"S\((-?\d+)(?:,blocks=\[([\d, ]*)\])?(,seq)?\)$")


def parse(text: str | None) -> Placement:
    """The placement a manifest or dump wrote with str(); None or '' is R."""
    if text is None or isinstance(text, (Replicate, Partial, Shard, Tuple)):
        return text or R
    s = text.strip()
    if s in ("", "R"):
        return R
    if s == "R(f)":
        return Replicate(partial_grad=True)
    if s == "R*":
        return Replicate(gathered=True)
    if s == "P":
        return P
    m = _SHARD.match(s)
    if m:
        blocks = tuple(int(b) for b in m.group(2).split(",") if b.strip()) if m.group(2) else ()
        return Shard(int(m.group(1)), blocks, bool(m.group(3)))
    if s.startswith("(") and s.endswith(")"):
        return Tuple(tuple(parse(part) for part in _split_top(s[1:-1])))
    raise ValueError(f"not a placement: {text!r} (expected R, R(f), R*, P, S(d[,blocks=[..]][,seq]) or a tuple)")


def _split_top(s: str) -> list[str]:
    """Split on commas outside brackets: 'S(0,blocks=[4, 4]), R' -> ['S(0,blocks=[4, 4])', 'R']."""
    parts, depth, cur = [], 0, ""
    for ch in s:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return parts
