"""Pipeline cuts: parity of chunks run in order, balance, recomputed values, pins, costs."""
from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.nn.functional as F

import threefold
from tests.foundation_helpers import canonical, chunk_modules, run_in_order, summed_grads, workload
from threefold.compiler.api import compile_workload
from threefold.passes.cost import chunk_costs, imbalance
from threefold.ir.program import meta_of
from threefold.errors import PlanError
from threefold.passes.pipeline_split import _minmax_partition

# pp in {1,2,3,4} x v in {1,2}; pp=1,v=2 is not a valid plan (interleaving needs stages)
PLANS = [f"pp={pp}" + (f",v={v},schedule=interleaved" if v > 1 else "")
         for pp, v in itertools.product((1, 2, 3, 4), (1, 2)) if not (pp == 1 and v > 1)]
MODELS = {"gpt": dict(n_layer=4), "gpt2": dict(n_layer=4), "llama": dict(n_layer=4)}


@pytest.mark.parametrize("name", list(MODELS))
def test_chunks_in_order_reproduce_loss_and_every_gradient(name):
    """pp in {1,2,3,4} x v in {1,2}: loss and all parameter grads equal the unsplit model's."""
    w = workload(name, **MODELS[name])
    model = w["model"]
    model.zero_grad()
    ref = w["loss_fn"](model(*w["inputs"]), w["target"])
    ref.backward()
    ref_grads = {fqn: p.grad.clone() for fqn, p in model.named_parameters(remove_duplicate=False)}
    batch = tuple(w["inputs"]) + (w["target"],)
    for plan in PLANS:
        prog = compile_workload(w, plan)
        assert len(prog.chunks) == threefold.Plan.parse(plan).num_chunks
        mods = chunk_modules(prog)
        (loss,) = run_in_order(mods, batch)
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0, msg=f"{name} {plan}: loss")
        loss.backward()
        grads = summed_grads(mods)
        alias = canonical(prog)
        for fqn, g in ref_grads.items():
            torch.testing.assert_close(grads[alias.get(fqn, fqn)], g, rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"{name} {plan}: grad of {fqn}: {m}")


def test_tied_embedding_is_held_by_first_and_last_chunk():
    prog = compile_workload(workload("gpt", n_layer=4), "pp=4")
    holders = [c.index for c in prog.chunks if "wte.weight" in c.params]
    assert holders == [0, 3]


def test_uneven_layers_30_on_pp4():
    w = workload("gpt", n_layer=30, n_embd=16, n_head=2, seq=8, batch=2)
    prog = compile_workload(w, "pp=4")
    flops = [c.flops for c in chunk_costs(prog)]
    assert len(flops) == 4 and imbalance(flops) < 1.10
    covered = [n for c in prog.chunks for n in c.nodes]
    assert len(covered) == len(set(covered))


def test_balance_24_layer_gpt_medium_pp8():
    from examples.gpt import gpt_medium_meta
    prog = compile_workload(gpt_medium_meta(24), "pp=8")
    costs = chunk_costs(prog)
    assert imbalance([c.flops for c in costs]) <= 1.10
    # embedding and LM head are counted: the head alone is about one chunk's worth here
    assert costs[-1].flops > 0.8 * max(c.flops for c in costs)
    # cuts land where one hidden-state tensor (B*T*h fp32) is live
    assert all(c.boundary_in_bytes == 1024 * 1024 * 4 for c in costs[1:])


def test_llama_rotary_tables_and_masks_are_recomputed_not_sent():
    prog = compile_workload(workload("llama", n_layer=4), "pp=4")
    for before, chunk in zip((None,) + prog.chunks, prog.chunks):
        assert {"cos", "sin"} <= set(chunk.recomputed), chunk.recomputed
        assert "model.model.rotary_emb.inv_freq" in chunk.buffers
        for value in chunk.input_names:  # everything sent depends on parameters (in its sender)
            assert _depends_on_param(before.node(value)), value
    assert all(len(c.recomputed) >= 10 for c in prog.chunks)  # the causal mask chain too


def _depends_on_param(node, seen=None) -> bool:
    seen = set() if seen is None else seen
    if node in seen:
        return False
    seen.add(node)
    if node.op == "placeholder":   # a boundary value: checked in the chunk that sent it
        return node.meta["tf"]["kind"] in ("param", "boundary")
    return any(_depends_on_param(a, seen) for a in node.all_input_nodes)


def test_gpt2_causal_mask_recomputed_in_every_chunk():
    prog = compile_workload(workload("gpt2", n_layer=4), "pp=2")
    for chunk in prog.chunks:
        assert chunk.recomputed
        assert all(b.dtype.is_floating_point for b in chunk.inputs)
        assert all(meta_of(chunk.node(b.name)).dtype == b.dtype for b in chunk.inputs)


class Marked(torch.nn.Module):
    """An MLP stack whose forward pins a cut with threefold.pipe_split()."""

    def __init__(self, n=6, pin_at=(2,)):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(n))
        self.pin_at = pin_at

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            if i in self.pin_at:
                threefold.pipe_split()
            x = torch.relu(layer(x))
        return x


def _marked_workload(**kw):
    torch.manual_seed(0)
    return {"model": Marked(**kw), "inputs": (torch.randn(4, 8),), "target": torch.randn(4, 8),
            "loss_fn": F.mse_loss}


def test_pipe_split_marker_pins_the_cut_and_keeps_parity():
    w = _marked_workload(pin_at=(2,))  # an unbalanced pin: 2 layers, then 4
    prog = compile_workload(w, "pp=2")
    first_of_second = prog.chunks[1].node(prog.chunks[1].nodes[0])
    assert first_of_second.meta["tf"]["module"] == "layers.2"
    assert all(n.target is not threefold.markers.PIPE_SPLIT_OP for _, n in prog.chunk_nodes())
    (loss,) = run_in_order(chunk_modules(prog), tuple(w["inputs"]) + (w["target"],))
    torch.testing.assert_close(loss, w["loss_fn"](w["model"](*w["inputs"]), w["target"]), rtol=1e-5, atol=0)


def test_pipe_split_count_must_match_plan():
    with pytest.raises(PlanError, match="pinned split points"):
        compile_workload(_marked_workload(pin_at=(2, 4)), "pp=2")


def test_plan_split_points_pin_cuts():
    w = workload("gpt", n_layer=4)
    prog = compile_workload(w, threefold.Plan(pp=3, split_points=("h.1", "h.3")))
    starts = [c.node(c.nodes[0]).meta["tf"]["module"] for c in prog.chunks[1:]]
    assert [s.split(".")[:2] for s in starts] == [["h", "1"], ["h", "3"]]
    with pytest.raises(PlanError, match="names no module"):
        compile_workload(w, threefold.Plan(pp=2, split_points=("h.9",)))


def test_sequential_stack_splits():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(5)])
    w = {"model": model, "inputs": (torch.randn(4, 8),), "target": torch.randn(4, 8), "loss_fn": F.mse_loss}
    prog = compile_workload(w, "pp=5")
    assert [c.params for c in prog.chunks] == [(f"{i}.weight", f"{i}.bias") for i in range(5)]
    (loss,) = run_in_order(chunk_modules(prog), tuple(w["inputs"]) + (w["target"],))
    torch.testing.assert_close(loss, F.mse_loss(model(*w["inputs"]), w["target"]), rtol=1e-5, atol=0)


def test_more_chunks_than_ops_is_a_plan_error():
    torch.manual_seed(0)
    w = {"model": torch.nn.Sequential(torch.nn.Linear(4, 4)), "inputs": (torch.randn(2, 4),),
         "target": torch.randn(2, 4), "loss_fn": F.mse_loss}
    with pytest.raises(PlanError, match="pp\\*v=8"):
        compile_workload(w, "pp=8")


def test_minmax_partition_is_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(2, 9)
        costs = [rng.choice([0, 1, 2, 5, 9]) for _ in range(n)]
        prefix = [0]
        for c in costs:
            prefix.append(prefix[-1] + c)
        cands = sorted(rng.sample(range(1, n), rng.randint(1, n - 1)))
        k = rng.randint(2, len(cands) + 1)
        cuts = _minmax_partition(prefix, cands, k)
        best = min(_worst(prefix, list(c)) for c in itertools.combinations(cands, k - 1))
        assert cuts is not None and len(set(cuts)) == k - 1 and set(cuts) <= set(cands)
        assert _worst(prefix, cuts) == best, (costs, cands, k, cuts)


def _worst(prefix, cuts):
    bounds = [0] + sorted(cuts) + [len(prefix) - 1]
    return max(prefix[b] - prefix[a] for a, b in zip(bounds, bounds[1:]))


def test_balanced_among_optimal_partitions():
    # four equal layers on three chunks: 2+1+1 (in some order), never 2+2+0-ish slivers
    prefix = [0, 10, 20, 30, 40]
    cuts = _minmax_partition(prefix, [1, 2, 3], 3)
    sizes = sorted(b - a for a, b in zip([0] + cuts, cuts + [4]))
    assert sizes == [1, 1, 2]


def test_in_place_buffer_updates_are_kept():
    """BatchNorm's running stats and num_batches_tracked += 1 run once, in their chunk."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                                torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    w = {"model": model, "inputs": (torch.randn(4, 8),), "target": torch.randn(4, 8), "loss_fn": F.mse_loss}
    prog = compile_workload(w, "pp=2")
    mods = chunk_modules(prog)
    (loss,) = run_in_order(mods, (w["inputs"][0], w["target"]))
    torch.testing.assert_close(loss, F.mse_loss(model(*w["inputs"]), w["target"]), rtol=1e-5, atol=0)
    buffers = {k: b for mod in mods for k, b in mod.named_buffers()}
    for fqn, b in model.named_buffers():
        torch.testing.assert_close(buffers[fqn], b, msg=fqn)
    assert int(buffers["1.num_batches_tracked"]) == 1
