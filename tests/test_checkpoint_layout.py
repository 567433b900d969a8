"""Layout pieces reassemble the full tensor exactly, for every kind of ShardSpec."""
import pytest
import torch

from threefold.checkpoint.layout import Sharded, local_shape, pieces
from threefold.runtime.shard import ShardSpec


def _reassemble(full, spec):
    out = torch.full_like(full, float("nan"))
    for r in range(spec.t):
        local = spec(full, r)
        assert list(local.shape) == local_shape(spec, full.shape, r)
        dim, parts = pieces(spec, full.shape, r)
        s = Sharded(local, dim, parts, full.shape)
        for p in parts:
            out.narrow(dim, p.start, p.length).copy_(s.view(p))
    return out


@pytest.mark.parametrize("shape,spec", [
    ((8, 6), ShardSpec(0, (), 8, 2)),                 # plain row split
    ((6, 8), ShardSpec(1, (), 8, 4)),                 # column split
    ((12, 4), ShardSpec(0, (4, 4, 4), 12, 2)),        # fused q, k, v
    ((16, 4), ShardSpec(0, (8, 4, 4), 16, 4)),        # GQA-style uneven blocks
    ((10, 4), ShardSpec(0, (), 12, 4)),               # padded vocabulary: 10 rows -> 12
    ((5, 3), ShardSpec(0, (), 8, 4)),                 # last rank is all padding
])
def test_pieces_cover_the_full_tensor_once(shape, spec):
    full = torch.randn(shape)
    assert torch.equal(_reassemble(full, spec), full)
    # no overlap: the pieces' lengths add up to the full size
    total = sum(p.length for r in range(spec.t) for p in pieces(spec, shape, r)[1])
    assert total == shape[spec.dim]


def test_zero_padding_clears_only_the_padded_rows():
    spec = ShardSpec(0, (), 12, 4)
    local = torch.ones(3, 2)
    dim, parts = pieces(spec, (10, 2), 3)   # rank 3 holds row 9 and two padding rows
    Sharded(local, dim, parts, (10, 2)).zero_padding()
    assert local[0].eq(1).all() and local[1:].eq(0).all()
