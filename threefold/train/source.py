"""Where the loop's batches come from: one interface over the embedded/--data sampler and a
SPEC workload's own data.

A `Source` hands out global batches in order (`next()`; `peek()` shows the next one without
moving), has a position it saves in checkpoints and restores on resume (`state_dict`,
`load_state_dict`), a fixed list of validation batches (`val`, [] when there is none), the
tokenizer when the data is text, and `generate_info`: what `threefold generate` needs to
rebuild the model and tokenizer from a checkpoint.

A SPEC's data is `batches` in its dict: a callable `batches(step)` (step counts from 0) or
an iterable (one batch per step; one that can be iterated again, such as a list or a
DataLoader, starts over when it ends). Without `batches` the factory's one batch is used every
step. A batch is a tuple (inputs..., target) or a dict {"inputs": ..., "target": ...}.
`--batch`/`--seq` given for a SPEC are passed to its factory when it has a `batch`/`seq`
parameter, and are a PlanError when it has none (they would mean nothing).
"""
from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass, field
import dataclasses
import os
from typing import Any, Callable

import torch

from threefold.errors import PlanError


def as_batch(value, where: str) -> tuple:
    """(inputs..., target) from a tuple/list or an {"inputs", "target"} dict."""
    if isinstance(value, dict) and "inputs" in value:
        inputs = value["inputs"]
        inputs = tuple(inputs) if isinstance(inputs, (list, tuple)) else (inputs,)
        return (*inputs, value.get("target"))
    if isinstance(value, (list, tuple)) and len(value) >= 2:
        return tuple(value)
    raise PlanError(f"{where} gave a {type(value).__name__}: a batch is a tuple (inputs..., target) "
                    "or a dict with 'inputs' and 'target'")


def peek_first(batches, name: str) -> tuple[tuple, Any]:
    """The first batch of a data source, and the source to use from now on (a one-shot
    iterator gets its first batch put back in front)."""
    where = f"workload {name!r}: batches"
    if callable(batches):
        return as_batch(batches(0), f"{where}(0)"), batches
    it = iter(batches)
    try:
        first = next(it)
    except StopIteration:
        raise PlanError(f"{where} is empty: give at least one batch") from None
    if it is batches:   # an iterator: iterating again would skip what was read
        return as_batch(first, where), itertools.chain([first], it)
    return as_batch(first, where), batches


class StepBatches:
    """Batch of step k from a callable or an iterable (which is walked forward to step k)."""

    def __init__(self, batches, name: str):
        self.batches, self.name = batches, name
        self._it = None
        self._next = 0          # index of the batch the iterator yields next
        self._last = None       # (index, batch) most recently read
        self._epoch = None      # batches per pass, once an iterable has ended

    def __call__(self, step: int) -> tuple:
        if callable(self.batches):
            return as_batch(self.batches(step), f"workload {self.name!r}: batches({step})")
        if self._epoch is not None:
            step %= self._epoch
        if self._last is not None and self._last[0] == step:
            return self._last[1]
        if self._it is None or step < self._next:
            self._restart(step)
        while self._next <= step:
            try:
                value = next(self._it)
            except StopIteration:
                self._ended(step)
                return self(step)
            self._last = (self._next, as_batch(value, f"workload {self.name!r}: batches"))
            self._next += 1
        return self._last[1]

    def _reiterable(self) -> bool:
        return iter(self.batches) is not self.batches

    def _restart(self, step: int) -> None:
        if self._it is not None and not self._reiterable():
            raise PlanError(f"workload {self.name!r}: batches is an iterator, which cannot go back to "
                            f"batch {step}: give a list, a DataLoader or a batches(step) callable")
        self._it, self._next = iter(self.batches), 0

    def _ended(self, step: int) -> None:
        if not self._reiterable() or self._next == 0:
            raise PlanError(f"workload {self.name!r}: batches ran out after {self._next} batches, before step "
                            f"{step + 1}: give more batches, fewer --steps, or an iterable that can start over")
        self._epoch = self._next
        self._it, self._next, self._last = None, 0, None


@dataclass
class Source:
    next_batch: Callable[[int], tuple]      # position -> the global batch at that position
    val: list = field(default_factory=list)
    tokenizer: Any = None
    generate_info: dict | None = None
    position: int = 0                       # batches handed out (the step, for a SPEC)
    sampler: Any = None                     # the --data sampler, whose own position is saved

    def peek(self) -> tuple:
        return self.sampler.peek() if self.sampler is not None else self.next_batch(self.position)

    def next(self) -> tuple:
        if self.sampler is not None:
            return self.sampler.next()
        batch = self.next_batch(self.position)
        self.position += 1
        return batch

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict()} if self.sampler is not None else {"position": self.position}

    def load_state_dict(self, state: dict | None, step: int) -> None:
        """Continue where a checkpoint left off (older checkpoints: at `step`)."""
        state = state or {}
        if self.sampler is not None and "sampler" in state:
            self.sampler.load_state_dict(state["sampler"])
        elif self.sampler is not None:
            self.sampler.position = step * self.sampler.batch
        else:
            self.position = int(state.get("position", step))


# -- SPEC workloads ------------------------------------------------------------------------

def factory_overrides(factory: Callable, spec: str, given: dict, spec_kwargs: dict) -> dict:
    """The `--batch`/`--seq` values (given: {name: value}) the factory takes; a PlanError
    for one it has no parameter for, or one the SPEC string already sets differently."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    out = {}
    for name, value in given.items():
        if name not in params:
            raise PlanError(f"--{name} {value} means nothing for SPEC {spec!r}: its factory has no '{name}' "
                            f"parameter (it builds its own batches); drop --{name}, or give the factory a "
                            f"{name}= parameter")
        if name in spec_kwargs and spec_kwargs[name] != value:
            raise PlanError(f"--{name} {value} disagrees with {name}={spec_kwargs[name]!r} in SPEC {spec!r}: "
                            "give it once")
        out[name] = value
    return out


def given_sizes(cfg) -> dict:
    """{batch, seq: value} for the ones the command line or config file set."""
    return {n: getattr(cfg, n) for n in ("batch", "seq") if n in getattr(cfg, "given", ())}


def spec_source(workload, cfg=None, spec_text: str = "", sizes: dict | None = None) -> Source:
    """A SPEC workload's data: its `batches` source, or its one batch every step."""
    # lazy: start-up: checkpoint.agree loads only on this path
    from threefold.checkpoint.agree import batch_as_rank0
    n_val = getattr(cfg, "eval_batches", 0) if cfg is not None else 0
    if workload.batches is None:
        fixed = batch_as_rank0((*workload.inputs, workload.target))   # one batch: rank 0's
        step_batch = lambda step: fixed  # noqa: E731
    else:
        batches = StepBatches(workload.batches, workload.name)
        # a data source that is not deterministic over ranks still trains one model: rank 0's
        step_batch = lambda step: batch_as_rank0(batches(step))  # noqa: E731
    val = _val_batches(workload, n_val)
    context = int(workload.inputs[0].shape[-1]) if isinstance(workload.inputs[0], torch.Tensor) and \
        workload.inputs[0].dim() else None
    info = {"spec": _absolute_spec(spec_text or workload.name), "sizes": dict(sizes or {}), "context": context}
    return Source(step_batch, val, workload.tokenizer, info)


def _absolute_spec(spec: str) -> str:
    """A file SPEC with an absolute path, so `threefold generate` finds it from any directory."""
    target, sep, call = spec.rpartition(":")
    if sep and (target.endswith(".py") or "/" in target) and not os.path.isabs(target):
        return f"{os.path.abspath(target)}:{call}"
    return spec


def _val_batches(workload, n: int) -> list:
    vb = workload.val_batches
    if vb is None or n <= 0:
        return []
    where = f"workload {workload.name!r}: val_batches"
    # lazy: start-up: checkpoint.agree loads only on this path
    from threefold.checkpoint.agree import batch_as_rank0
    if callable(vb):
        return [batch_as_rank0(as_batch(vb(i), f"{where}({i})")) for i in range(n)]
    out = [batch_as_rank0(as_batch(v, where)) for v in itertools.islice(vb, n)]
    if not out:
        raise PlanError(f"{where} is empty: give at least one batch, or leave val_batches out")
    return out


# -- the embedded job and --data --------------------------------------------------------------

def data_source(cfg, data, gpt_config) -> Source:
    """threefold.dataset's data (its resumable sampler, fixed validation batches and
    tokenizer) for the embedded GPT of `gpt_config`."""
    info = {"gpt": dataclasses.asdict(gpt_config), "tokenizer": data.tokenizer.to_dict(),
            "context": gpt_config.block_size}
    val = data.val_batches(cfg) if cfg.eval_every > 0 else []
    return Source(next_batch=None, val=val, tokenizer=data.tokenizer, generate_info=info,
                  sampler=data.sampler(cfg))
