"""Deterministic batches of windows over a token array, resumable and sharded over dp ranks.

The training split is cut into K windows of seq+1 tokens (inputs and the next-token
targets). Epoch e starts the windows at a seeded offset in [0, slack] (so epochs see
different cuts) and visits them in a seeded permutation; sequence number i of the run is
window perm_e[i % K] of epoch e = i // K. The state is one number, the position (sequences
consumed), so a resumed run draws the same batches, even with another batch size or plan.
A dp rank's rows are its contiguous block of the global batch, the block
ParallelModule.step takes from the global batch, so every rank and one process agree.
"""
from __future__ import annotations

import numpy as np
import torch

from threefold.errors import PlanError


def windows(tokens, starts, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), int64 (len(starts), seq), from the windows starting at `starts`."""
    rows = np.stack([np.asarray(tokens[s:s + seq + 1], dtype=np.int64) for s in starts])
    rows = torch.from_numpy(rows)
    return rows[:, :-1], rows[:, 1:]


TABLE_MAX = 1 << 22     # windows per epoch up to which the order is a randperm table (32 MB)


class Shuffle:
    """A seeded permutation of range(count) computed per index, in constant memory: a 4-round
    Feistel network over the smallest even number of bits that holds count, cycle-walked
    back into range (each step is a bijection of the larger domain, so the walk is one of
    range(count); the domain is under 4*count, so a walk takes a few steps on average)."""

    def __init__(self, count: int, keys: list[int]):
        bits = max(2, (count - 1).bit_length())
        self.half = (bits + 1) // 2
        self.mask = (1 << self.half) - 1
        self.count, self.keys = count, keys

    def _round(self, r: int, key: int) -> int:
        x = (r * 0x9E3779B97F4A7C15 + key) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 31)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        return (x ^ (x >> 29)) & self.mask

    def __getitem__(self, i: int) -> int:
        x = int(i)
        while True:
            left, right = x >> self.half, x & self.mask
            for key in self.keys:
                left, right = right, left ^ self._round(right, key)
            x = (left << self.half) | right
            if x < self.count:
                return x


class Sampler:
    def __init__(self, tokens, batch: int, seq: int, seed: int = 0, position: int = 0):
        if len(tokens) < seq + 1:
            raise PlanError(f"the training split has {len(tokens)} tokens, fewer than seq+1={seq + 1}: "
                            "give more data or a smaller --seq")
        self.tokens, self.batch, self.seq, self.seed = tokens, batch, seq, seed
        self.count = (len(tokens) - 1) // seq           # windows per epoch
        self.slack = len(tokens) - 1 - self.count * seq  # how far an epoch's first window may move
        self.position = position
        self._epoch = None                               # (epoch, offset, permutation) cache

    def _order(self, epoch: int):
        if self._epoch is None or self._epoch[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            offset = int(torch.randint(0, self.slack + 1, (1,), generator=g))
            if self.count <= TABLE_MAX:
                perm = torch.randperm(self.count, generator=g).numpy()
            else:     # a table would grow with the data (8 bytes a window): a keyed bijection instead
                perm = Shuffle(self.count, [int(k) for k in torch.randint(0, 2**62, (4,), generator=g)])
            self._epoch = (epoch, offset, perm)
        return self._epoch

    def starts(self, first: int, n: int) -> list[int]:
        """Token offsets of sequences first .. first+n-1 of the run."""
        out = []
        for i in range(first, first + n):
            _, offset, perm = self._order(i // self.count)
            out.append(offset + int(perm[i % self.count]) * self.seq)
        return out

    def peek(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next global batch, without moving."""
        return windows(self.tokens, self.starts(self.position, self.batch), self.seq)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next global batch (batch, seq) inputs and targets; moves the position."""
        out = self.peek()
        self.position += self.batch
        return out

    def next_rows(self, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This dp rank's rows of the next global batch (only those are read); moves the
        position by the whole global batch, as every rank does."""
        if self.batch % dp:
            raise PlanError(f"--batch {self.batch} is not divisible by dp={dp}: use a multiple of dp")
        n = self.batch // dp
        out = windows(self.tokens, self.starts(self.position + dp_rank * n, n), self.seq)
        self.position += self.batch
        return out

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed, "seq": self.seq, "tokens": len(self.tokens)}

    def load_state_dict(self, state: dict) -> None:
        """Continue at the saved position; the data must be the same split (seed, seq, length)."""
        mine = self.state_dict()
        for key in ("seed", "seq", "tokens"):
            if key in state and state[key] != mine[key]:
                raise PlanError(f"the checkpoint's data position is for {key}={state[key]}, this run has "
                                f"{key}={mine[key]}: resume with the same --data, --seq, --seed and "
                                "--val-fraction")
        self.position = int(state["position"])


def fixed_batches(tokens, batch: int, seq: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` batches of windows spread evenly over `tokens` (the validation split): the
    same every evaluation, so validation losses compare across steps."""
    last = len(tokens) - seq - 1
    if last < 0:
        raise PlanError(f"the validation split has {len(tokens)} tokens, fewer than seq+1={seq + 1}: "
                        "raise --val-fraction, give more data, or use a smaller --seq")
    n = batch * count
    starts = np.linspace(0, last, n).round().astype(np.int64).tolist() if n > 1 else [0]
    return [windows(tokens, starts[i * batch:(i + 1) * batch], seq) for i in range(count)]
