"""Held-out Hugging Face causal LMs: architectures the zoo does not have, built from one generic
tiny config (AutoConfig.for_model), compiled (not run) under each plan; a verdict per cell.

    python bench/heldout_hf.py "tp=2;pp=2,m=2;cp=2;dp=2,ep=2" afmoe doge llama4_text ...

A generic config does not suit every architecture: a model that fails to trace under every plan
is a config to fix, not a finding. Results go to heldout_hf.json in the working directory.
"""
import json
import os
import signal
import sys
import time
import warnings

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]   # bench/kernels.py shadows `kernels`
sys.path.insert(0, os.path.dirname(_HERE))
warnings.filterwarnings("ignore")
import torch
torch.set_num_threads(1)
import transformers
from transformers import AutoConfig, AutoModelForCausalLM
from threefold.compiler.api import compile_workload
from threefold.errors import PlanError
import torch.nn.functional as F

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=64, head_dim=8, max_position_embeddings=64,
            num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            tie_word_embeddings=False, attention_dropout=0.0, hidden_dropout=0.0, pad_token_id=0,
            first_k_dense_replace=1, n_group=1, topk_group=1, sliding_window=16, layer_types=None)

class Logits(torch.nn.Module):
    def __init__(self, m):
        super().__init__(); self.m = m
    def forward(self, ids):
        return self.m(input_ids=ids).logits

def loss(logits, t):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), t.reshape(-1))

def build(mt):
    kw = dict(TINY)
    kw.pop("layer_types")
    cfg = AutoConfig.for_model(mt, **kw)
    if hasattr(cfg, "layer_types") and cfg.layer_types is not None and len(cfg.layer_types) != cfg.num_hidden_layers:
        cfg.layer_types = cfg.layer_types[:cfg.num_hidden_layers]
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg).float().train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 64, (4, 17), generator=g)
    return {"model": Logits(m), "inputs": (ids[:, :-1],), "target": ids[:, 1:], "loss_fn": loss}

class TO(Exception): pass
def alarm(*a): raise TO()
signal.signal(signal.SIGALRM, alarm)
out = {}
for mt in sys.argv[2:]:
    try:
        w = build(mt)
    except Exception as e:
        out[mt] = {"build": f"{type(e).__name__}: {str(e)[:150]}"}; print(mt, "BUILD", out[mt]["build"], flush=True); continue
    res = {}
    for plan in sys.argv[1].split(";"):
        t = time.time(); signal.alarm(240)
        try:
            compile_workload(build(mt), plan); res[plan] = "ok"
        except PlanError as e:
            res[plan] = "planerror: " + str(e)[:220]
        except TO:
            res[plan] = "timeout"
        except Exception as e:
            res[plan] = f"CRASH {type(e).__name__}: {str(e)[:220]}"
        finally:
            signal.alarm(0)
        print(f"{mt:<22} {plan:<12} {time.time()-t:5.1f}s {res[plan]}", flush=True)
    out[mt] = res
with open("heldout_hf.json", "w") as f:
    json.dump(out, f, indent=1)
