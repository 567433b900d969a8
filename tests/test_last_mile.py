"""Issue 21 items 3-6: models a new user brings (HF caches, untraceable losses, uneven
shards, projections reached through repeat / copy_ / complex views).

Compile-level checks run in the default suite; parity cells (zoo workloads under tp=2 and
pp=2, world size 2, one launched job) are marked slow."""
import pytest
import torch

from threefold.compiler.api import compile_workload
from tests.zoo import ZOO


def test_hf_cache_compiles_under_tp_and_its_empty_start_is_gone():
    # use_cache=True: each layer's cache starts as torch.tensor([]) and is cat with the new
    # keys; the tensor-parallel rules used to see a cat of a 1-D value with a 4-D one.
    fused = compile_workload(ZOO["llama_cache"](), "tp=2")
    for _, gm in fused.graph_modules():
        for n in gm.graph.nodes:
            if n.target is torch.ops.aten.cat.default:
                assert all(a.meta["val"].dim() > 1 for a in n.args[0]), n.format_node()
