"""Per-op cost rules: forward FLOPs, bytes, parameter bytes, activations kept for backward."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.foundation_helpers import workload
from threefold.compiler.api import compile_workload
from threefold.passes.cost import annotate_costs, chunk_costs, imbalance, op_name
from threefold.compiler.trace import trace


class Ops(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.lin = torch.nn.Linear(8, 16)
        self.w = torch.nn.Parameter(torch.randn(8, 8))
        self.b = torch.nn.Parameter(torch.randn(8))

    def forward(self, img, q):
        y = self.conv(img).flatten(2)                          # (2, 8, 36)
        z = torch.bmm(y.transpose(1, 2), y)                    # (2, 36, 36)
        a = torch.addmm(self.b, q, self.w)                     # (4, 8)
        s = F.scaled_dot_product_attention(q[None], q[None], q[None])  # (1, 4, 8)
        h = self.lin(q)                                        # (4, 16)
        return z.sum() + a.mean() + s.amax() + torch.relu(h).sum() + (q * q).sum()


def _costs():
    torch.manual_seed(0)
    prog = trace(Ops(), (torch.randn(2, 3, 8, 8), torch.randn(4, 8)))
    prog = annotate_costs(prog)
    by_op = {}
    for node in prog.graph.nodes:
        if node.op == "call_function":
            by_op.setdefault(op_name(node), []).append(node.meta["tf"]["cost"])
    return by_op


def test_flop_rules():
    c = _costs()
    assert c["conv2d"][0].flops == (2 * 8 * 6 * 6) * 2 * (3 * 3 * 3)        # out * 2*in*k*k
    assert c["bmm"][0].flops == 2 * (2 * 36 * 36) * 8
    assert c["addmm"][0].flops == 2 * 4 * 8 * 8 + 4 * 8                      # matmul + bias
    assert c["linear"][0].flops == 2 * 4 * 16 * 8 + 4 * 16
    assert c["scaled_dot_product_attention"][0].flops == 2 * 4 * 4 * 8 * 2 + 5 * 4 * 4
    assert c["relu"][0].flops == 4 * 16                                      # elementwise
    assert c["sum"][0].flops == 2 * 36 * 36                                  # reduction over input
    assert all(x.flops == 0 for x in c["transpose"] + c["flatten"])         # views are free


def test_bytes_and_params():
    c = _costs()
    lin = c["linear"][0]
    assert lin.param_bytes == (16 * 8 + 16) * 4
    assert lin.bytes_read == (4 * 8 + 16 * 8 + 16) * 4 and lin.bytes_written == 4 * 16 * 4
    assert c["transpose"][0].bytes_read == 0


def test_saved_activations():
    c = _costs()
    assert c["linear"][0].saved_bytes == 4 * 8 * 4          # its input, not its weight
    assert c["relu"][0].saved_bytes == 4 * 16 * 4           # its output
    assert c["sum"][0].saved_bytes == 0                     # reductions keep nothing
    assert c["mul"][0].saved_bytes == 4 * 8 * 4             # q * q: one value, kept once per name


def test_chunk_sums_and_imbalance():
    prog = compile_workload(workload("gpt", n_layer=2), "pp=2")
    costs = chunk_costs(prog)
    # each chunk's own (copied) nodes carry their costs; a recomputed free node counts in
    # every chunk that copies it, a chunk's own node once
    own = sum(c.node(n).meta["tf"]["cost"].flops for c in prog.chunks for n in c.nodes)
    recomputed = sum(c.node(n).meta["tf"]["cost"].flops for c in prog.chunks for n in c.recomputed)
    assert sum(c.flops for c in costs) == own + recomputed and own > 0
    assert costs[0].boundary_out_bytes == costs[1].boundary_in_bytes == 8 * 16 * 64 * 4
    assert costs[0].params == sum(prog.state[f].numel() for f in prog.chunks[0].params)
    assert imbalance([1, 1, 2]) == 1.5 and imbalance([]) == 1.0
