"""Activation recomputation (passes/recompute.py): segments found from the graph, written in
the generated code, exact in training (dropout replays its mask), and measured in bytes."""
import pytest
import torch

import threefold
from threefold import Plan, PlanError
from threefold.codegen.python import generate_module
from threefold.compiler.api import compile_workload
from threefold.models.gpt import GPT, GPTConfig, lm_loss
from threefold.runtime.memory import SavedTensorCounter
from threefold.workload import Workload
from tests.parity import load_workload

# Sizes where the attention scores (a*s*s per sequence) outgrow the residual stream (s*h),
# also per tp rank at tp=2 (tests/test_recompute_parity.py uses the same).
GPT_KW = {"n_layer": 2, "n_embd": 32, "n_head": 4, "seq": 32, "batch": 4}
LLAMA_KW = {"n_layer": 2, "hidden": 32, "n_head": 8, "n_kv_head": 4, "intermediate": 64, "seq": 32, "batch": 4}


def test_plan_recompute_modes_and_aliases():
    assert Plan.parse("recompute=true").recompute == "full"
    assert Plan.parse("recompute=false").recompute == "none"
    assert Plan(recompute=True).recompute == "full" and Plan().recompute == "none"
    assert Plan.parse(str(Plan(recompute="selective"))) == Plan(recompute="selective")
    with pytest.raises(PlanError, match="recompute"):
        Plan.parse("recompute=some")


def _compile(factory, kwargs, plan):
    w = load_workload(factory, **kwargs)
    return compile_workload(Workload(w["model"], w["inputs"], w["target"], w["loss_fn"]), plan)


def _ops(chunk, seg):
    by_name = {n.name: n for n in chunk.gm.graph.nodes}
    return [by_name[x] for x in seg["nodes"]]


@pytest.mark.parametrize("factory,kwargs,layer", [("gpt", GPT_KW, "h.{}"), ("llama", LLAMA_KW, "model.model.layers.{}")])
def test_full_is_one_segment_per_layer_and_selective_the_attention_core(factory, kwargs, layer):
    full = _compile(factory, kwargs, "pp=2,m=2,recompute=full")
    names = []
    for chunk in full.chunks:   # a cut by FLOPs may fall inside a layer: each part is a segment
        segs = chunk.recompute
        src = generate_module(full, chunk)
        assert segs and src.count("= self.recompute(self._recompute_") == len(segs)
        for seg in segs:
            assert f"# recomputed in backward: {seg['name']}" in src
            names.append(seg["name"])
    assert {layer.format(i) for i in range(kwargs["n_layer"])} == set(names)
    sel = _compile(factory, kwargs, "recompute=selective")
    (chunk,) = sel.chunks
    segs = chunk.recompute
    assert len(segs) == kwargs["n_layer"]
    for seg in segs:
        ops = {n.target.__name__ if not hasattr(n.target, "_schema") else n.target._schema.name.split("::")[1]
               for n in _ops(chunk, seg)}
        assert "softmax" in ops and "matmul" in ops, ops
        # no op of the segment reads a parameter: the projections' GEMMs stay saved
        assert not any(a.op == "placeholder" and a.meta["tf"].get("kind") == "param"
                       for n in _ops(chunk, seg) for a in n.all_input_nodes)
    assert "selective: frees" in generate_module(sel, chunk)
    none = _compile(factory, kwargs, "recompute=none")
    assert none.chunks[0].recompute == ()
    assert "self.recompute(" not in generate_module(none, none.chunks[0])


def test_no_repeated_layers_falls_back_to_the_chunk():
    model = torch.nn.Sequential()
    model.add_module("fc", torch.nn.Linear(4, 8))
    model.add_module("act", torch.nn.Tanh())
    model.add_module("out", torch.nn.Linear(8, 2))
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    prog = compile_workload(Workload(model, (x,), y, torch.nn.functional.mse_loss), "recompute=full")
    (seg,) = prog.chunks[0].recompute
    assert seg["name"] == "<chunk>"


def _train(model_fn, plan, steps=3):
    w = model_fn()
    pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"])
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    losses, grads = [], []
    for _ in range(steps):
        opt.zero_grad()
        losses.append(pm.step(*w["inputs"], target=w["target"]))
        grads.append({n: p.grad.clone() for n, p in pm.named_parameters()})
        opt.step()
    return losses, grads


def _dropout_gpt(p=0.5):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=p))
    idx = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(1))
    return {"model": model, "inputs": (idx[:, :-1],), "target": idx[:, 1:], "loss_fn": lm_loss}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_dropout_recomputed_in_backward_draws_the_forward_mask(mode):
    """gpipe runs both forwards before either backward, so by backward the engine's rng_key
    is the last microbatch's: the rerun must get its own forward's key back."""
    torch.manual_seed(123)
    ref_losses, ref_grads = _train(_dropout_gpt, "m=2,schedule=gpipe")
    torch.manual_seed(123)
    losses, grads = _train(_dropout_gpt, f"m=2,schedule=gpipe,recompute={mode}")
    assert losses == ref_losses
    for ref, got in zip(ref_grads, grads):
        for name in ref:
            assert torch.equal(ref[name], got[name]), name
    torch.manual_seed(123)
    no_dropout, _ = _train(lambda: _dropout_gpt(0.0), "m=2,schedule=gpipe", steps=1)
    assert abs(no_dropout[0] - ref_losses[0]) > 1e-4   # the dropout is really drawing masks


def _saved_bytes(mode, layers, s=64, h=32, a=4, b=2, vocab=64, p=0.1):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab, block_size=s, n_layer=layers, n_head=a, n_embd=h, dropout=p))
    idx = torch.randint(0, vocab, (b, s + 1), generator=torch.Generator().manual_seed(1))
    pm = threefold.parallelize(model, f"recompute={mode}", (idx[:, :-1],), lm_loss, target=idx[:, 1:])
    (mod,) = pm.engine.modules.values()
    mod.train()
    state = list(mod.parameters()) + list(mod.buffers())
    with SavedTensorCounter(exclude=state) as counter:
        mod(idx[:, :-1], idx[:, 1:])
    return counter.bytes


@pytest.mark.timeout(300)
def test_measured_saved_bytes_per_layer_full_below_selective_below_none():
    """One layer = (3 layers) - (2 layers), so embedding and loss cancel. a*s/h = 8.
    fp32 with 4-byte dropout masks: Korthikanti et al.'s sbh(34 + 5as/h) (16-bit, 1-byte
    masks) becomes sbh(72 + 12as/h) bytes; selective's 34sbh becomes 72sbh; full's 2sbh 4sbh."""
    s, h, a, b = 64, 32, 4, 2
    sbh = s * b * h
    per_layer = {m: (_saved_bytes(m, 3) - _saved_bytes(m, 2)) / sbh for m in ("none", "selective", "full")}
    print("saved bytes per layer / sbh:", per_layer)
    assert per_layer["full"] < per_layer["selective"] < per_layer["none"]
    assert per_layer["none"] == pytest.approx(72 + 12 * a * s / h, rel=0.05)
    assert per_layer["selective"] == pytest.approx(72, rel=0.05)
    assert per_layer["full"] == pytest.approx(4, rel=0.05)


def test_saved_tensor_counter_counts_each_storage_once():
    x = torch.randn(8, 8, requires_grad=True)
    with SavedTensorCounter() as c:
        y = x.t()
        (y * y).sum()     # saves y twice: one storage (x's)
    assert c.bytes == x.numel() * 4
    with SavedTensorCounter(exclude=[x]) as c:
        (x * x).sum()
    assert c.bytes == 0


def test_inspect_says_what_each_chunk_recomputes():
    from threefold.cli.inspect_cmd import chunk_report, format_report
    prog = _compile("gpt", GPT_KW, "pp=2,m=2,recompute=selective")
    report = chunk_report(prog)
    assert report["recompute"]["mode"] == "selective"
    assert [len(segs) for segs in report["recompute"]["chunks"]] == [1, 1]
    text = format_report(prog, report)
    assert "recompute=selective" in text and "chunk 0: h.0:matmul..matmul_1 (8 ops)" in text
    assert "recompute" not in chunk_report(_compile("gpt", GPT_KW, "pp=2,m=2"))


def test_planner_reads_recompute_full_as_its_bool_and_selective_as_a_mode():
    from threefold.planner.constraints import Constraints
    assert Constraints.parse("recompute=full").recompute is True
    assert Constraints.parse("recompute=none").recompute is False
    assert Constraints.parse("recompute=true").admits(Plan(recompute="full"), 1)
    assert not Constraints.parse("recompute=true").admits(Plan(recompute="none"), 1)
    selective = Constraints.parse("recompute=selective")
    assert selective.recompute == "selective"
    assert selective.admits(Plan(recompute="selective"), 1)
    assert not selective.admits(Plan(recompute="full"), 1)


class _InPlaceBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        x.add_(torch.tanh(self.fc(x)))   # writes into the layer's input: a rerun would see the new x
        return x


class _InPlaceNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 8)
        self.blocks = torch.nn.ModuleList([_InPlaceBlock(), _InPlaceBlock()])

    def forward(self, x):
        h = self.inp(x) * 1.0
        for block in self.blocks:
            h = block(h)
        return h


def test_a_layer_that_writes_into_its_input_is_kept_with_a_note():
    torch.manual_seed(0)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    prog = compile_workload(Workload(_InPlaceNet(), (x,), y, torch.nn.functional.mse_loss), "recompute=full")
    assert prog.chunks[0].recompute == ()
    notes = [n for n in prog.notes if n.startswith("recompute:")]
    assert len(notes) == 2 and "blocks.0" in notes[0] and "writes in place" in notes[0]
