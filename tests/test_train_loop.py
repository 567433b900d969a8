"""The training loop's pieces, single process: learning-rate schedule, weight-decay groups
from the graph, SPEC data sources, model FLOPs, sampling and the metrics log."""
import json
import math

import pytest
import torch

from tests import train_specs
from threefold.compiler.api import compile_workload
from threefold.errors import PlanError
from threefold.plan import Plan
from threefold.train.lr_schedule import WarmupCosine
from threefold.compiler.param_roles import graph_roles
from threefold.roles import EMBEDDING, MATMUL, OTHER
from threefold.train.optim import decay_split
from threefold.train.source import StepBatches, factory_overrides, spec_source
from threefold.workload import Workload


# -- learning rate ---------------------------------------------------------------------------

def test_warmup_then_cosine_to_min_lr():
    s = WarmupCosine(lr=1.0, min_lr=0.1, warmup=4, total=20)
    assert [round(s(i), 6) for i in range(5)] == [0.2, 0.4, 0.6, 0.8, 1.0]   # linear, peak at `warmup`
    assert s(19) == pytest.approx(0.1)                                       # min_lr at the last step
    assert s(4 + 8) < 0.55 < s(4 + 7)                                        # halfway down mid-decay
    assert WarmupCosine(1.0, 0.1, 4, 21)(4 + 8) == pytest.approx(0.55)
    decay = [s(i) for i in range(4, 20)]
    assert all(a > b for a, b in zip(decay, decay[1:]))                      # strictly decreasing
    assert WarmupCosine(1.0, 0.1, 0, 10)(0) == 1.0                           # no warmup: the peak
    assert WarmupCosine(1.0, 0.1, 5, 3)(2) == pytest.approx(0.5)             # all warmup
    assert WarmupCosine(1.0, 0.1, 2, 3)(2) == 1.0                            # nothing left to decay


# -- weight decay groups ---------------------------------------------------------------------

def _roles(w: dict, plan: str = "tp=1") -> dict:
    return graph_roles(compile_workload(Workload(w["model"], w["inputs"], w["target"], w["loss_fn"]),
                                        Plan.parse(plan)))


def test_gpt_decays_matmul_weights_not_norms_biases_or_tied_embedding():
    from tests.parity import load_workload
    w = load_workload("gpt", n_layer=2, n_embd=32, n_head=2, seq=8, batch=4)
    roles = _roles(w)
    assert roles["wte.weight"] == EMBEDDING          # tied to the LM head: still an embedding
    assert roles["wpe.weight"] == EMBEDDING
    assert roles["h.0.attn.c_attn.weight"] == roles["h.1.mlp.c_proj.weight"] == MATMUL
    assert roles["h.0.ln_1.weight"] == roles["h.0.attn.c_attn.bias"] == roles["ln_f.bias"] == OTHER
    named = list(w["model"].named_parameters())
    decayed, kept = decay_split(named, roles)
    assert {id(p) for p in decayed} == {id(p) for n, p in named if n.endswith(("c_attn.weight", "c_proj.weight",
                                                                                 "c_fc.weight"))}
    assert len(decayed) + len(kept) == len(named)
    with_emb, _ = decay_split(named, roles, decay_embeddings=True)
    assert len(with_emb) == len(decayed) + 2
    assert _roles(load_workload("gpt", n_layer=2, n_embd=32, n_head=2, seq=8, batch=4), "tp=2") == roles


def test_llama_untied_head_is_a_matrix_rms_norms_are_not():
    from tests.parity import load_workload
    w = load_workload("llama", n_layer=2, hidden=32, n_head=4, n_kv_head=2, intermediate=64, seq=8, batch=4)
    roles = _roles(w)
    emb = [k for k in roles if k.endswith("embed_tokens.weight")]
    head = [k for k in roles if k.endswith("lm_head.weight")]
    norms = [k for k in roles if "norm" in k]
    assert emb and head and norms
    assert roles[emb[0]] == EMBEDDING and roles[head[0]] == MATMUL
    assert all(roles[k] == OTHER for k in norms)
    assert all(roles[k] == MATMUL for k in roles if k.endswith(("q_proj.weight", "down_proj.weight")))


class _ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.norm = torch.nn.GroupNorm(2, 8)
        self.scale = torch.nn.Parameter(torch.ones(8, 1, 1))   # 3-D, but only multiplied elementwise
        self.head = torch.nn.Linear(8, 10)

    def forward(self, x):
        x = torch.relu(self.norm(self.conv(x))) * self.scale
        return self.head(x.mean(dim=(2, 3)))


def test_conv_weights_decay_and_an_elementwise_tensor_does_not_even_if_3d():
    torch.manual_seed(0)
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
    w = {"model": _ConvNet(), "inputs": (x,), "target": y, "loss_fn": torch.nn.functional.cross_entropy}
    roles = _roles(w)
    assert roles["conv.weight"] == roles["head.weight"] == MATMUL
    assert roles["conv.bias"] == roles["norm.weight"] == roles["head.bias"] == roles["scale"] == OTHER


# -- SPEC data sources -----------------------------------------------------------------------

def test_step_batches_from_a_callable_a_list_and_a_generator():
    calls = StepBatches(lambda step: train_specs.batch_at(step), "t")
    assert torch.equal(calls(5)[0], train_specs.batch_at(5)[0])
    listed = StepBatches([train_specs.batch_at(i) for i in range(3)], "t")
    assert torch.equal(listed(1)[0], train_specs.batch_at(1)[0])
    assert torch.equal(listed(4)[0], train_specs.batch_at(1)[0])     # a list starts over
    assert torch.equal(listed(0)[0], train_specs.batch_at(0)[0])     # and can go back
    gen = StepBatches((train_specs.batch_at(i) for i in range(3)), "t")
    assert torch.equal(gen(0)[0], train_specs.batch_at(0)[0]) and torch.equal(gen(2)[0], train_specs.batch_at(2)[0])
    with pytest.raises(PlanError, match="cannot go back"):
        gen(1)
    ended = StepBatches((train_specs.batch_at(i) for i in range(2)), "t")
    ended(1)
    with pytest.raises(PlanError, match="ran out after 2 batches"):
        ended(2)
    with pytest.raises(PlanError, match="a batch is a tuple"):
        StepBatches(lambda step: 3, "t")(0)


def test_a_workload_with_batches_needs_no_inputs_and_keeps_a_generators_first_batch():
    w = Workload.coerce(train_specs.one_shot(), "one_shot")
    assert torch.equal(w.inputs[0], train_specs.batch_at(0)[0]) and torch.equal(w.target, train_specs.batch_at(0)[1])
    source = spec_source(w)
    firsts = [source.next()[0] for _ in range(3)]
    assert all(torch.equal(a, train_specs.batch_at(i)[0]) for i, a in enumerate(firsts))
    with pytest.raises(PlanError, match="'batches' is a int"):
        Workload.coerce({"model": torch.nn.Linear(2, 2), "batches": 3}, "bad")


def test_source_position_resumes():
    source = spec_source(Workload.coerce(train_specs.stepped(), "s"), None)
    for _ in range(3):
        source.next()
    state = source.state_dict()
    again = spec_source(Workload.coerce(train_specs.stepped(), "s"), None)
    again.load_state_dict(state, step=0)
    assert torch.equal(again.next()[0], train_specs.batch_at(3)[0])


def test_batch_and_seq_go_to_a_factory_that_takes_them_and_are_refused_elsewhere():
    assert factory_overrides(train_specs.stepped, "s", {"batch": 8, "seq": 4}, {}) == {"batch": 8, "seq": 4}
    with pytest.raises(PlanError, match=r"--seq 4 means nothing for SPEC 'f'.*no 'seq' parameter"):
        factory_overrides(train_specs.fixed, "f", {"seq": 4}, {})
    with pytest.raises(PlanError, match="disagrees with batch=2"):
        factory_overrides(train_specs.stepped, "s", {"batch": 8}, {"batch": 2})
    from threefold.workload import load_spec
    w = load_spec("tests/train_specs.py:stepped", {"batch": 2, "seq": 4})
    assert tuple(w.inputs[0].shape) == (2, 4)


# -- model FLOPs, sampling, the log ----------------------------------------------------------

def test_model_flops_do_not_depend_on_the_plan():
    from tests.parity import load_workload
    from threefold.compiler.model_flops import graph_model_flops
    flops = {}
    for plan in ("tp=1", "tp=2", "pp=2,m=2,dp=2"):
        w = load_workload("gpt", n_layer=2, n_embd=32, n_head=2, seq=8, batch=4)
        flops[plan] = graph_model_flops(compile_workload(Workload(w["model"], w["inputs"], w["target"],
                                                                  w["loss_fn"]), Plan.parse(plan)))
    base = flops["tp=1"]
    # 2 layers of q,k,v,o,fc,proj matmuls alone: 6 * params * tokens for the block matrices
    assert base > 6 * (2 * 12 * 32 * 32) * 32
    assert all(abs(f - base) / base < 0.01 for f in flops.values()), flops


def test_sampling_is_greedy_at_temperature_zero_and_seeded_otherwise():
    from threefold.train.generate import sample
    m = train_specs.model(seq=8)
    greedy = sample(m, [1, 2, 3], 12, context=8, temperature=0)
    assert greedy == sample(m, [1, 2, 3], 12, context=8, temperature=0) and len(greedy) == 15
    a, b = (sample(m, [1, 2, 3], 12, context=8, temperature=1.0, seed=s) for s in (0, 0))
    assert a == b
    assert any(sample(m, [1, 2, 3], 12, context=8, temperature=1.0, seed=s) != a for s in range(1, 4))
    top1 = sample(m, [1, 2, 3], 12, context=8, temperature=1.0, top_k=1, seed=5)
    assert top1 == greedy                                                    # top-1 is greedy
    with pytest.raises(PlanError, match="prompt is empty"):
        sample(m, [], 3, context=8)


def test_metrics_log_is_valid_json_lines(tmp_path):
    from threefold.train.metrics import MetricsLog, tokens_per_second
    log = MetricsLog(str(tmp_path / "m.jsonl"), str(tmp_path / "tb"))
    log.write({"step": 1, "loss": 2.0, "val_loss": None, "grad_norm": math.nan, "memory": [{"rss_mb": 1.0}]})
    log.write({"step": 2, "loss": 1.5, "val_loss": 1.7, "grad_norm": 0.3, "memory": [{"rss_mb": 1.0}]})
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["grad_norm"] is None and rows[1]["val_loss"] == 1.7
    assert tokens_per_second([9.0, 1.0, 3.0], 100) == pytest.approx(50.0)      # the first step left out
    assert tokens_per_second([2.0], 100) == pytest.approx(50.0)


def test_metrics_go_to_tensorboard_when_it_is_installed(tmp_path, monkeypatch):
    import sys
    import types
    from threefold.train.metrics import MetricsLog
    written = []

    class Writer:          # stands in for torch.utils.tensorboard.SummaryWriter
        def __init__(self, logdir):
            self.logdir = logdir

        def add_scalar(self, tag, value, step):
            written.append((tag, value, step))

        def close(self):
            written.append("closed")
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Writer))
    log = MetricsLog(None, str(tmp_path / "tb"))
    log.write({"step": 3, "loss": 2.0, "val_loss": None, "lr": 0.1, "grad_norm": math.inf,
               "memory": [{"rss_mb": 5.0}, {"rss_mb": 6.0}]})
    log.close()
    assert ("train/loss", 2.0, 3) in written and ("train/lr", 0.1, 3) in written
    assert ("memory/rank1_rss_mb", 6.0, 3) in written and written[-1] == "closed"
    assert not any(t[0] in ("train/val_loss", "train/grad_norm") for t in written[:-1])   # None, inf: left out
