"""A parameter the weights lack is initialised on the shard only, with the module's own
initialiser, and the shards of every layout assemble into the single-process tensor."""
import math

import pytest
import torch

from threefold.checkpoint.init_shard import ShardInit
from threefold.checkpoint.layout import local_shape, pieces
from threefold.runtime.shard import ShardSpec, rank_shard


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 6, padding_idx=3)
        self.lin = torch.nn.Linear(6, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.ortho = torch.nn.Linear(4, 4)
        self.trunc = torch.nn.Linear(6, 4)
        self.chain = torch.nn.Linear(6, 4)         # a hand-written element-wise chain
        self.chain.reset_parameters = lambda: self.chain.weight.uniform_(-1, 1).mul_(0.3).add_(0.1)
        self.trunc.reset_parameters = lambda: torch.nn.init.trunc_normal_(self.trunc.weight, std=0.5, a=-0.6, b=0.6)
        self.ortho.reset_parameters = lambda: torch.nn.init.orthogonal_(self.ortho.weight)


def _meta_net():
    with torch.device("meta"):
        return Net()


def _shard(init, fqn, shape, spec, r):
    dest = torch.full(local_shape(spec, shape, r), float("nan"))
    dim, parts = pieces(spec, shape, r)
    return init.fill(dest, fqn, shape, dim, parts)


@pytest.mark.parametrize("fqn,dim,blocks", [("lin.weight", 0, ()), ("lin.weight", 1, ()), ("lin.bias", 0, ()),
                                            ("lin.weight", 0, (4, 4)),        # a fused projection
                                            ("emb.weight", 0, ()), ("emb.weight", 1, ()), ("chain.weight", 1, ()),
                                            ("trunc.weight", 1, ()), ("ortho.weight", 0, ())])
@pytest.mark.parametrize("t", [2, 4])
def test_each_shard_is_the_full_tensors_cut(fqn, dim, blocks, t):
    net = _meta_net()
    shape = list(dict(net.named_parameters())[fqn].shape)
    init = ShardInit(net, "(test)")
    full = init.init_full(fqn, shape)
    padded = -(-shape[dim] // t) * t
    spec = ShardSpec(dim=dim, blocks=blocks, padded=padded, t=t)
    for r in range(t):
        assert torch.equal(_shard(init, fqn, shape, spec, r), rank_shard(full, spec, r)), r


def test_recipes_keep_the_module_distribution():
    net = _meta_net()
    init = ShardInit(net, "(test)")
    w = init.init_full("lin.weight", [8, 6])
    bound = 1 / math.sqrt(6)                     # kaiming_uniform(a=sqrt 5) on fan-in 6
    assert w.abs().max() <= bound and w.abs().max() > 0.5 * bound
    assert torch.equal(init.init_full("norm.weight", [8]), torch.ones(8))
    assert torch.equal(init.init_full("norm.bias", [8]), torch.zeros(8))
    e = init.init_full("emb.weight", [10, 6])
    assert torch.equal(e[3], torch.zeros(6)) and e.abs().sum() > 0   # padding_idx row zeroed after normal_
    ch = init.init_full("chain.weight", [4, 6])
    assert [s.op.__name__ for s in init.recipe("chain.weight")] == ["uniform_.default", "mul_.Scalar", "add_.Scalar"]
    assert (ch - 0.1).abs().max() <= 0.3 and ch.std() > 0.05
    assert init.recipe("trunc.weight") is None       # returns early on meta: materialised instead
    tr = init.init_full("trunc.weight", [4, 6])
    assert tr.abs().max() <= 0.6 and tr.std() > 0.1


def test_padded_vocab_rows_stay_zero():
    net = _meta_net()
    init = ShardInit(net, "(test)")
    spec = ShardSpec(dim=0, blocks=(), padded=12, t=4)      # 10 rows padded to 12: the last rank has 1 real row
    last = _shard(init, "emb.weight", [10, 6], spec, 3)
    assert last.shape[0] == 3 and torch.equal(last[1:], torch.zeros(2, 6))
    assert torch.equal(last[0], init.init_full("emb.weight", [10, 6])[9])


def test_unreplayable_initialiser_falls_back_to_its_own_tensor():
    net = _meta_net()
    init = ShardInit(net, "(test)")
    assert init.recipe("ortho.weight") is None   # orthogonal_ copies a QR factor in
    spec = ShardSpec(dim=1, blocks=(), padded=4, t=2)
    halves = [_shard(init, "ortho.weight", [4, 4], spec, r) for r in range(2)]
    q = torch.cat(halves, dim=1)
    assert torch.allclose(q @ q.T, torch.eye(4), atol=1e-5)
    assert net.ortho.weight.is_meta              # put back on meta: the full tensor is not kept
