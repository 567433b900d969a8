"""GPT-2, LLaMA, Mistral, Qwen2, GPT-NeoX and OPT under tp=2 keep Megatron's layout exactly:
no sharding fallback, no projection kept whole, two all-reduces of b*s*h per layer forward."""
import pytest

from threefold.compiler.api import compile_workload
from tests.zoo.common import BATCH, HIDDEN, LAYERS, SEQ
from tests.zoo.hf_decoders import FACTORIES

ARCHS = ["gpt2", "llama", "mistral", "qwen2", "gpt_neox", "opt"]


def _layer_of(module: str) -> int | None:
    parts = module.split(".")
    for a, b in zip(parts, parts[1:]):
        if a in ("h", "layers") and b.isdigit():
            return int(b)
    return None


@pytest.mark.parametrize("arch", ARCHS)
def test_megatron_layout_without_fallback(arch):
    prog = compile_workload(FACTORIES[arch](), "tp=2")
    rep = prog.tp_report
    assert rep["fallbacks"] == [] and rep["replicated_weights"] == {}, rep
    assert rep["sharded_share"] > 0.9, rep
    per_layer: dict[int, list] = {}
    for _, node in prog.chunk_nodes():
        c = node.meta.get("tf", {}).get("collective")
        layer = _layer_of(node.meta.get("tf", {}).get("module", ""))
        if c and c.phase == "forward" and layer is not None:
            per_layer.setdefault(layer, []).append((c.kind, c.elements))
    assert sorted(per_layer) == list(range(LAYERS)), per_layer
    for layer, colls in per_layer.items():
        assert colls == [("all_reduce", BATCH * SEQ * HIDDEN)] * 2, (arch, layer, colls)
