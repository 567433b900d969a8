"""Lightning attention for tests/test_cp_lightning.py: tables longer than the block (a bound
that equals s/cp by chance), HF MiniMax over several blocks (block_size 4, 2 rows of `seq`
tokens), and the job the multi-rank tests run on local gloo ranks."""
from __future__ import annotations

import torch

from tests.zoo.handwritten_lightning import LightningAttention


class LongTables(LightningAttention):
    """Blocks of 4 positions with decay tables of 16 rows (longer than the block, as a model that
    builds them for its longest block would): at cp=2 on 8 tokens a rank's trace is one block of
    4, the tables sliced D[:4, :4] as if to the sequence, where one process runs two blocks."""
    block = 4

    def __init__(self):
        super().__init__()
        long = LightningAttention()   # its class's block: tables of 16 rows
        self.q_decay, self.k_decay, self.diag_decay = long.q_decay, long.k_decay, long.diag_decay


def hf_minimax_blocks(seq: int = 16, seed: int = 0) -> dict:
    """tests/zoo/hf_recent.py's MiniMax with block_size=4: `seq` tokens are seq/4 blocks, the
    state K^T V carried from block to block."""
    from tests.zoo import common
    from tests.zoo.hf_decoders import build
    from tests.zoo.hf_recent import RECENT
    config, model, kwargs = RECENT["minimax"]
    vocab, batch, length, seed0 = common.token_batch.__defaults__
    common.token_batch.__defaults__ = (vocab, 2, seq, seed0)
    try:
        return build(config, model, dict(kwargs, block_size=4), seed=seed)
    finally:
        common.token_batch.__defaults__ = (vocab, batch, length, seed0)


def minimax_blocks_parity(plan: str, seq: int, steps: int = 3):
    """Run on every rank: hf_minimax_blocks(seq) under `plan`, (losses, grads)."""
    from tests.cp_factory_models import parallel
    torch.set_num_threads(1)
    return parallel(hf_minimax_blocks(seq), plan, steps)
