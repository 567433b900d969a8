"""Training data for `threefold train`: a source (--data), a tokenizer (--tokenizer), a
deterministic train/validation split and a resumable sampler.

    data = load_data(cfg)                    # checks everything; PlanError on bad input
    sampler = data.sampler(cfg)              # sampler.next() -> global (inputs, targets)
    evals = data.val_batches(cfg)            # the fixed validation batches

The split is by position: the last `val_fraction` of the tokens (of the file order for a
directory) is validation, the rest is training; the same on every run and rank.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from threefold.dataset.sampler import Sampler, fixed_batches, windows
from threefold.dataset.sources import is_token_file, read_tokens
from threefold.dataset.token_cache import scan_ids
from threefold.dataset.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, tokenizer_from_dict
from threefold.errors import PlanError

EMBEDDED = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "python_reference.txt")

__all__ = ["Data", "load_data", "Sampler", "fixed_batches", "windows", "read_tokens", "load_tokenizer",
           "ByteTokenizer", "HFTokenizer", "tokenizer_from_dict", "EMBEDDED"]


@dataclass
class Data:
    tokenizer: object
    train: np.ndarray        # token ids, 1-D (views of one array or memory map)
    val: np.ndarray
    source: str

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def sampler(self, cfg, position: int = 0) -> Sampler:
        return Sampler(self.train, cfg.batch, cfg.seq, cfg.seed, position)

    def val_batches(self, cfg) -> list:
        """cfg.eval_batches fixed (inputs, targets) batches of cfg.batch rows; [] without a split."""
        if len(self.val) == 0:
            return []
        return fixed_batches(self.val, cfg.batch, cfg.seq, cfg.eval_batches)


def load_data(cfg) -> Data:
    """Read cfg.data (or the embedded corpus) with cfg.tokenizer, check it and split it."""
    tokenizer = load_tokenizer(cfg.tokenizer)
    source = cfg.data or EMBEDDED
    if cfg.data_dtype != "auto" and not is_token_file(source):
        raise PlanError(f"--data-dtype {cfg.data_dtype} applies to token-id files (.bin, .u16, .u32), and "
                        f"{source!r} is text: drop --data-dtype, or give a token-id file")
    tokens = read_tokens(source, tokenizer, cfg.data_dtype)
    if len(tokens) == 0:
        raise PlanError(f"--data {source!r} holds no tokens: give a non-empty source")
    top, where = scan_ids(tokens, tokenizer.vocab_size)    # a memory map is read, not mapped in
    if top >= tokenizer.vocab_size:
        raise PlanError(f"--data {source!r} has token id {top} (first out-of-range id at position {where}), "
                        f"outside the tokenizer's {tokenizer.vocab_size} ids ({tokenizer.name}): give the "
                        "--tokenizer the ids came from, or --data-dtype if the file is misread")
    n_val = int(len(tokens) * cfg.val_fraction)
    train, val = tokens[:len(tokens) - n_val], tokens[len(tokens) - n_val:]
    need = cfg.seq + 1
    if len(train) < need:
        raise PlanError(f"--data {source!r} gives {len(train)} training tokens, fewer than seq+1={need}: "
                        "give more data or a smaller --seq")
    if cfg.val_fraction > 0 and len(val) < need:
        raise PlanError(f"--data {source!r} gives {len(val)} validation tokens (val_fraction "
                        f"{cfg.val_fraction}), fewer than seq+1={need}: raise --val-fraction, give more "
                        "data or a smaller --seq")
    return Data(tokenizer, train, val, source)
