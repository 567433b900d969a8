"""ep over dense experts written as einsum (or matmul broadcasting E): passes/dense_experts.py
reads the equation for the experts' letter, the weight's dim 0, which the activation and the
output keep on any dim ('betc,ecf->betf', Soft MoE's 'bepd,edf->bepf' and 'bnd,ndf->bnf'),
and runtime/dense_experts.py exchanges each row input and output on that dim.

Quick tier: which equations are dense expert matmuls and where their experts sit; the zoo's
einsum MoEs (tests/zoo/handwritten_moe_einsum.py) found at dp=2,ep=2 with their expert dims
in the generated call (before: "no expert computation found"). Slow tier: dp=2,ep=2 trains
like one process (losses and every gradient over 3 SGD steps, fp32, rtol 1e-5), each rank
holding E/2 experts' parameters."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import threefold
from tests.parity import max_rel_diff, sgd_losses_and_grads
from tests.zoo.common import workload

STEPS = 3


def _compile(w: dict, plan: str = "dp=2,ep=2"):
    from threefold.compiler.api import compile_workload
    return compile_workload(w, plan)


class _OneProduct(nn.Module):
    """x (a parameter-free input) times a stacked [E, C, F] weight by `eq` (or @)."""

    def __init__(self, eq: str | None):
        super().__init__()
        self.eq = eq
        self.w = nn.Parameter(torch.randn(4, 6, 5))

    def forward(self, x):
        return x @ self.w if self.eq in (None, "@2d") else torch.einsum(self.eq, x, self.w)


def _square_mean(out, target):
    return (out * out).mean()


_X = {"betc,ecf->betf": (2, 4, 3, 6), "bnc,ncf->bnf": (2, 4, 6), "etc,ecf->etf": (4, 3, 6),
      "btec,ecf->bfte": (2, 3, 4, 6), "betc,ecf->btf": (2, 4, 3, 6), "btc,ecf->betf": (2, 3, 6),
      "betc,ecf->betcf": (2, 4, 3, 6), None: (2, 4, 3, 6), "@2d": (3, 6), "...tc,...cf->...tf": (2, 4, 3, 6)}


@pytest.mark.parametrize("eq,dims", [
    ("betc,ecf->betf", (1, 1)),       # experts on dim 1 of the activation and of the output
    ("bnc,ncf->bnf", (1, 1)),         # Soft MoE's one slot per expert
    ("etc,ecf->etf", (0, 0)),         # the bmm form
    ("btec,ecf->bfte", (2, 3)),       # the output reorders its letters
    ("betc,ecf->btf", None),          # the experts contracted: a sum over experts in one einsum
    ("btc,ecf->betf", (None, 1)),     # every expert on every token: x read whole by every expert
    ("betc,ecf->betcf", None),        # nothing contracted with the weight: not a matmul
    (None, (1, 1)),                   # x @ w, matmul broadcasting [E, C, F] against [B, E, T, C]
    ("@2d", (None, 0)),               # [T, C] @ [E, C, F]: every expert on every token
    ("...tc,...cf->...tf", (1, 1)),   # ellipsis dims right-aligned: E meets x's dim 1
], ids=lambda v: str(v))
def test_dense_expert_matmul_reads_the_experts_dims_from_the_equation(eq, dims):
    from threefold.passes.dense_experts import dense_expert_matmul
    w = workload(_OneProduct(eq), (torch.randn(*_X[eq]),), torch.zeros(1), _square_mean)
    graph = _compile(w, "dp=1").chunks[0].gm.graph
    found = [d for d in map(dense_expert_matmul, graph.nodes) if d is not None]
    assert [(d.x_dim, d.out_dim) for d in found] == ([dims] if dims else []), eq
    if dims:
        assert found[0].param.name.endswith("w")


@pytest.mark.parametrize("name", ["einsum", "matmul", "soft", "soft_one_slot", "mixture", "mixture_matmul",
                                  "ellipsis"])
def test_einsum_experts_are_split_under_ep_with_their_expert_dims(name):
    """Regression: before, these were refused ("no expert computation found")."""
    arch, kw = CASES[name]
    prog = _compile(_workload(name))
    regions = [r for c in prog.chunks for r in c.experts]
    names = ("w_in", "w_out") if arch == "hw_moe_einsum" else ("w1", "w2")
    assert [sorted(r["params"].items()) for r in regions] == [
        [(f"moes.{k}.{names[0]}", 4), (f"moes.{k}.{names[1]}", 4)] for k in (0, 1)]
    # where the experts sit: [B, E, ...] on dim 1; a mixture's input [B, T, C] (or [N, C]) has
    # none (None: every expert reads it whole) and its output [E, N, C] of `@` has them on dim 0
    row_dim, out_dim = {"mixture": (None, 1), "mixture_matmul": (None, 0)}.get(name, (1, 1))
    for r in regions:
        assert r["offs"] is None and len(r["rows"]) == 1 and len(r["outputs"]) == 1
        assert (r["dims"].get(r["rows"][0]), r["dims"][r["outputs"][0]]) == (row_dim, out_dim)
    from threefold.codegen.artifact import build_sources
    src = next(v for k, v in build_sources(prog).items() if k.endswith(".py"))
    call = re.escape(f"dims=(({row_dim},), ({out_dim},))")
    assert len(re.findall(r"= self\.experts\(\s*self\._experts_\d+, 4, None,[^=]*" + call, src)) == 4, src
    # 2 layers, in forward and in model_outputs


def test_einsum_whose_expert_weights_meet_another_dim_than_the_experts_is_refused_in_one_line():
    """An einsum whose weight's experts meet the activation on a dim that is not where its
    experts went (moved to dim 0 first, and the batch of the same size meets the weight):
    not split (left inline), and with nothing else to split, its reason is the PlanError."""
    from tests.zoo.handwritten_moe_einsum import EinsumMoELM, EinsumExperts
    from tests.zoo.common import token_batch

    class Crossed(EinsumExperts):
        def forward(self, x):
            b, t, c = x.shape
            routed = x.unsqueeze(1).expand(b, self.experts, t, c)          # [B, E, T, C]
            g, u = torch.einsum("betc,ecf->betf", routed, self.w_in).chunk(2, dim=-1)
            h = (F.silu(g) * u).transpose(0, 1)                              # [E, B, T, F]: rows on dim 0
            y = torch.einsum("btef,efc->btec", h.transpose(1, 2), self.w_out)  # B's index meets E's weights
            return y.sum(2)

    torch.manual_seed(0)
    inputs, target = token_batch(batch=4)
    w = workload(EinsumMoELM(Crossed).train(), (inputs,), target)
    with pytest.raises(threefold.PlanError) as err:
        _compile(w)
    assert "\n" not in str(err.value) and "not the experts' own" in str(err.value), str(err.value)


# -- multi-rank --------------------------------------------------------------------------
CASES = {"einsum": ("hw_moe_einsum", {}), "matmul": ("hw_moe_einsum", {"matmul": True}),
         "soft": ("hw_moe_einsum_soft", {}), "soft_one_slot": ("hw_moe_einsum_soft", {"slots": 1}),
         "mixture": ("hw_moe_einsum", {"mixture": True}),
         "mixture_matmul": ("hw_moe_einsum", {"mixture": True, "matmul": True}),
         "ellipsis": ("hw_moe_einsum", {"ellipsis": True})}


def _workload(name: str) -> dict:
    from tests.zoo import ZOO
    arch, kw = CASES[name]
    return ZOO[arch](**kw)


def _rank(names: list[str], plan: str) -> list[dict]:
    """Per workload the losses, every gradient this rank holds after each step's backward,
    the shapes of the expert parameters it keeps (with their full shapes), and the bytes its
    expert all-to-alls moved."""
    from tests.a2a_bytes import counting_all_to_all
    torch.set_num_threads(1)
    with counting_all_to_all() as sent:
        return [_train(name, plan, sent) for name in names]


def _train(name: str, plan: str, sent: dict) -> dict:
    torch.manual_seed(1234)
    w = _workload(name)
    full = {f: tuple(p.shape) for f, p in w["model"].named_parameters()}
    pm = threefold.parallelize(w["model"], plan, w["inputs"], w["loss_fn"], target=w["target"])
    experts = pm.manifest["experts"]
    held = {f: (tuple(p.shape), full[f]) for f, p in pm.named_parameters() if f in experts}
    opt = pm.optimizer(torch.optim.SGD, lr=0.1)
    losses, grads = [], []
    sent.clear()
    for _ in range(STEPS):
        opt.zero_grad()
        losses.append(pm.step(*w["inputs"], target=w["target"]))
        grads.append({f: p.grad.clone() for f, p in pm.named_parameters() if p.grad is not None})
        opt.step()
    return {"losses": losses, "grads": grads, "held": held, "sent": dict(sent)}


def _reference(name: str):
    torch.manual_seed(1234)
    return sgd_losses_and_grads(_workload(name), STEPS)


def _held_half(name: str, r: dict) -> None:
    assert len(r["held"]) == 4, (name, r["held"])                      # 2 weights x 2 layers
    for shape, full in r["held"].values():
        assert shape[0] * 2 == full[0] and shape[1:] == full[1:], (name, shape, full)   # E/ep experts


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dp2_ep2_einsum_experts_train_like_one_process_each_rank_holding_half():
    names = list(CASES)
    ranks = threefold.launch(_rank, 2, names, "dp=2,ep=2", timeout=840)
    for k, name in enumerate(names):
        ref_losses, ref_grads = _reference(name)
        a, b = ranks[0][k], ranks[1][k]
        assert a["losses"] == b["losses"], name
        assert max_rel_diff(a["losses"], ref_losses) < 1e-5, (name, a["losses"], ref_losses)
        for r in (a, b):
            _held_half(name, r)
        for step in range(STEPS):
            for fqn, ref in ref_grads[step].items():
                for r, rank in ((a, 0), (b, 1)):
                    got = r["grads"][step][fqn]
                    want = ref[rank * got.shape[0]:(rank + 1) * got.shape[0]] if fqn in r["held"] else ref
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6,
                                               msg=f"{name} {fqn} step {step} rank {rank}")
        # a rank's [2, E, T, C] slices go out whole (its own experts' included) and come back,
        # per layer and step; a mixture's [2, T, C] input goes once to each of the 2 ranks
        per = STEPS * 2 * 4            # steps x layers x fp32 bytes
        slices = per * 2 * 4 * 8 * 32
        if name in ("einsum", "mixture"):
            tokens = per * 2 * (2 * 8 * 32) if name == "mixture" else slices
            for r in (a, b):
                assert r["sent"]["expert tokens"] == r["sent"]["expert tokens gradients"] == tokens, (name, r["sent"])
                assert r["sent"]["expert outputs"] == r["sent"]["expert outputs gradients"] == slices, (name, r["sent"])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tp2_dp2_ep2_einsum_experts_train_like_one_process():
    names = ["einsum", "soft", "mixture"]
    ranks = threefold.launch(_rank, 4, names, "tp=2,dp=2,ep=2", timeout=840)
    for k, name in enumerate(names):
        ref_losses, _ = _reference(name)
        for r in ranks:
            assert r[k]["losses"] == ranks[0][k]["losses"], name
            assert r[k]["held"] and all(shape[0] * 2 == full[0] for shape, full in r[k]["held"].values()), \
                (name, r[k]["held"])
        assert max_rel_diff(ranks[0][k]["losses"], ref_losses) < 1e-5, (name, ranks[0][k]["losses"], ref_losses)


@pytest.mark.parametrize("eq,ndims,want", [
    ("...nd,...dh->...nh", [4, 3], "ABnd,Bdh->ABnh"),     # right-aligned: w's one ellipsis dim is x's last
    ("b n d, e s d -> b n e s", [3, 3], "bnd,esd->bnes"),  # spaces dropped
    ("...d,...d->...", [2, 3], "Bd,ABd->AB"),
    ("ab,bc", [2, 2], None),                               # implicit output
    ("...d,df->...f", [-1, 2], None),                      # a rank not known
])
def test_explicit_einsum_writes_the_ellipsis_as_letters(eq, ndims, want):
    from threefold.passes.row_state import explicit_einsum
    assert explicit_einsum(eq, ndims) == want


def test_einsum_attention_heads_against_head_stacked_weights_are_not_taken_for_experts():
    """'btc,hdc->bhtd' reads every token whole against [heads, d, C] weights, as a mixture's
    first product does, but nothing after it is a product of per-head slices by per-head
    weights: not experts, so ep still says it found none."""
    from tests.zoo import ZOO
    with pytest.raises(threefold.PlanError, match="no expert computation found"):
        _compile(ZOO["hw_einsum"]())


@pytest.mark.parametrize("name", ["einsum", "mixture"])
def test_inspect_counts_the_einsum_experts_slices_and_all_to_all_bytes(name):
    from threefold.cli.inspect_experts import expert_report
    w = _workload(name)
    report = expert_report(_compile(w), tuple(w["inputs"]) + (w["target"],))
    assert [l["held_by_ep_rank"] for l in report["layers"]] == [[[0, 1], [2, 3]]] * 2
    slices = 2 * 4 * 8 * 32 * 4                                         # [B, E, T, C] of a rank's 2 rows, fp32
    # the mixture's [B, T, C] input goes whole to each of the 2 ranks; the slices come back
    there = 2 * (2 * 8 * 32 * 4) if name == "mixture" else slices
    for layer in report["layers"]:
        assert layer["rows_per_microbatch"] == 2 * 4 * 8              # a rank's 2 rows x 4 experts x 8 tokens
        assert layer["all_to_all_bytes"]["forward"] == there + slices


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_checkpoint_stores_einsum_experts_whole_and_loads_under_any_plan(tmp_path):
    """Saved at dp=2,ep=2 (each rank E/2 experts of Soft MoE's [E, D, F] weights), loaded at dp=2
    and at dp=2,ep=2: both continue as one process does (AdamW, its moments included)."""
    import functools
    from tests.parity import adamw_losses, ep_checkpoint_round_trip
    make = functools.partial(_workload, "soft")
    ref = adamw_losses(make(), 4, 1e-2)
    ranks = threefold.launch(ep_checkpoint_round_trip, 2, make, str(tmp_path), timeout=540)
    for losses in ranks:
        assert max_rel_diff(losses, ref[2:] * 2) < 1e-5, (losses, ref)
