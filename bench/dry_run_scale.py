"""The whole job before the cluster, at the paper's scale: `threefold check --dry-run` on
three large jobs, each on the meta device, every rank's program at full world size.

  gpt-1t     the 1T GPT of Narayanan et al. (SC'21, Table 1): 128 layers, h 25600, 160
             heads, vocab 51200, s 2048, at t=8, p=64, d=6 (3072 ranks)
  llama-405b a Llama-3-405B-shaped decoder (plain PyTorch, below): 126 layers, h 16384, 128
             heads, 8 KV heads (GQA), SwiGLU 53248, vocab 128256, s 8192, at tp=8, pp=16,
             dp=8 (1024 ranks)
  dsv3       a DeepSeek-V3-shaped MoE (plain PyTorch, below; attention as plain MHA, not
             MLA): 61 layers, h 7168, 128 heads, 256 routed experts top-8 of width 2048, vocab
             129280, s 4096, at pp=16, ep=64, dp=64 (1024 ranks)

Wall seconds on a shared machine depend on its load; CPU seconds (user+sys of the
process) are the steadier number. Each runs in a fresh process: compile, then the dry run (one class per pipeline stage, two
witness ranks each; runtime/dry_check.py), the cross-check over every process group and
rank pair. Reported: wall seconds (compile and dry run), peak RSS of the process, ranks run,
groups covered, process groups each rank builds, mismatches. m (microbatches) is a flag:
a rank's dry-run time grows linearly with it.

    python bench/dry_run_scale.py [--jobs gpt-1t llama-405b dsv3] [--m 8]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.abspath(__file__)


# ---- a Llama-shaped decoder ----------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, heads * self.hd, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(heads * self.hd, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.hd).transpose(1, 2)
        k = self.wk(x).view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        v = self.wv(x).view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        rep = self.heads // self.kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, ffn: int):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn, bias=False)
        self.w3 = nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _gmm_fake(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[2])


def _gmm(x, w, offs):
    out, start = x.new_zeros(x.shape[0], w.shape[2]), 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] @ w[e]
        start = end
    return out


def _gmm_bwd(x, w, offs, grad):
    gx, gw, start = torch.zeros_like(x), torch.zeros_like(w), 0
    for e, end in enumerate(offs.tolist()):
        gx[start:end] = grad[start:end] @ w[e].T
        gw[e] = x[start:end].T @ grad[start:end]
        start = end
    return gx, gw


def _gmm_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.offs = inputs[2]


def _gmm_backward(ctx, grad):
    x, w = ctx.saved_tensors
    gx, gw = torch.ops.bench_moe.gmm_backward(x, w, ctx.offs, grad)
    return gx, gw, None


if not hasattr(torch.ops.bench_moe, "gmm"):   # a grouped matmul as its own op (rows sorted by expert)
    torch.library.custom_op("bench_moe::gmm", _gmm, mutates_args=(), schema="(Tensor x, Tensor w, Tensor offs) -> Tensor")
    torch.library.register_fake("bench_moe::gmm", _gmm_fake)
    torch.library.register_autograd("bench_moe::gmm", _gmm_backward, setup_context=_gmm_setup)
    torch.library.custom_op("bench_moe::gmm_backward", _gmm_bwd, mutates_args=(),
                            schema="(Tensor x, Tensor w, Tensor offs, Tensor grad) -> (Tensor, Tensor)")
    torch.library.register_fake("bench_moe::gmm_backward",
                                lambda x, w, offs, g: (torch.empty_like(x), torch.empty_like(w)))


class RoutedExperts(nn.Module):
    """Top-k routing over E SwiGLU experts (stacked weights), grouped matmuls."""

    def __init__(self, dim: int, experts: int, top_k: int, ffn: int):
        super().__init__()
        self.experts, self.top_k = experts, top_k
        self.router = nn.Linear(dim, experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(experts, dim, ffn))
        self.w3 = nn.Parameter(torch.empty(experts, dim, ffn))
        self.w2 = nn.Parameter(torch.empty(experts, ffn, dim))

    def forward(self, x):
        b, s, c = x.shape
        tokens = x.reshape(-1, c)
        gate, expert = self.router(tokens).sigmoid().topk(self.top_k, dim=-1)
        gate = gate / gate.sum(-1, keepdim=True)
        order = expert.reshape(-1).argsort(stable=True)
        rows = tokens[order // self.top_k]
        offs = F.one_hot(expert.reshape(-1), self.experts).sum(0).cumsum(0).to(torch.int32)
        h = F.silu(torch.ops.bench_moe.gmm(rows, self.w1, offs)) * torch.ops.bench_moe.gmm(rows, self.w3, offs)
        y = torch.ops.bench_moe.gmm(h, self.w2, offs) * gate.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(tokens).index_add(0, order // self.top_k, y).reshape(b, s, c)


class Block(nn.Module):
    def __init__(self, dim, heads, kv_heads, mlp):
        super().__init__()
        self.n1, self.n2 = RMSNorm(dim), RMSNorm(dim)
        self.attn, self.mlp = Attention(dim, heads, kv_heads), mlp

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.mlp(self.n2(x))


class Decoder(nn.Module):
    def __init__(self, vocab, dim, layers, heads, kv_heads, make_mlp):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, kv_heads, make_mlp()) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def lm_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def _workload(model, vocab: int, batch: int, seq: int) -> dict:
    idx = torch.empty(batch, seq, dtype=torch.int64, device="meta")
    return {"model": model, "inputs": (idx,), "target": torch.empty_like(idx), "loss_fn": lm_loss}


def llama_405b(batch: int = 8, seq: int = 8192, layers: int = 126):
    """SPEC factory: a Llama-3-405B-shaped decoder on the meta device."""
    with torch.device("meta"):
        model = Decoder(128256, 16384, layers, 128, 8, lambda: SwiGLU(16384, 53248))
    return _workload(model, 128256, batch, seq)


def dsv3(batch: int = 64, seq: int = 4096, layers: int = 61):
    """SPEC factory: a DeepSeek-V3-shaped MoE on the meta device (routed experts only)."""
    with torch.device("meta"):
        model = Decoder(129280, 7168, layers, 128, 128, lambda: RoutedExperts(7168, 256, 8, 2048))
    return _workload(model, 129280, batch, seq)


# ---- the bench -----------------------------------------------------------------------------
JOBS = {
    "gpt-1t": (os.path.join(ROOT, "examples", "gpt.py") + ":paper_1t(batch={b})", "tp=8,pp=64,dp=6,m={m}", 3072, 6),
    "llama-405b": (HERE + ":llama_405b(batch={b})", "tp=8,pp=16,dp=8,m={m}", 1024, 8),
    "dsv3": (HERE + ":dsv3(batch={b})", "pp=16,dp=64,ep=64,m={m}", 1024, 64),
}

_CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, {root!r})
import torch
torch.set_num_threads(1)
from threefold.cli.dry_run_cmd import dry_run
spec, plan, world = sys.argv[1], sys.argv[2], int(sys.argv[3])
start = time.perf_counter()
out = dry_run(spec, plan, world, progress=lambda i, n, run: print(f"{{i}}/{{n}} {{time.perf_counter() - start:.0f}}s",
              file=sys.stderr, flush=True))
out["wall_s"] = time.perf_counter() - start
usage = resource.getrusage(resource.RUSAGE_SELF)
out["cpu_s"] = usage.ru_utime + usage.ru_stime
out["peak_rss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
ranks = out.pop("ranks")
out["groups_built_per_rank"] = sorted({{e["groups_built"] for e in ranks.values()}})
out["groups_joined_per_rank"] = sorted({{e["groups_joined"] for e in ranks.values()}})
out["store_ops_per_rank"] = max((sum(e["store_ops"].values()) for e in ranks.values()), default=0)
out["peak_gib_by_stage"] = {{e["stage"]: round(e["memory"].get("total", 0) / 2**30, 2) for e in ranks.values()}}
out["vs_model_by_stage"] = {{e["stage"]: e.get("memory_vs_model") for e in ranks.values()}}
print(json.dumps(out))
"""


def run_job(name: str, m: int, timeout: float) -> dict:
    spec, plan, world, dp = JOBS[name]
    spec = spec.format(b=dp * m)
    res = subprocess.run([sys.executable, "-c", _CHILD.format(root=ROOT), spec, plan.format(m=m), str(world)],
                         capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")})
    if res.returncode != 0:
        return {"job": name, "error": res.stderr.strip().splitlines()[-1] if res.stderr.strip() else "failed"}
    return {"job": name, **json.loads(res.stdout.strip().splitlines()[-1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", nargs="+", default=list(JOBS), choices=list(JOBS))
    ap.add_argument("--m", type=int, default=8, help="microbatches per step (default 8)")
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [run_job(j, args.m, args.timeout) for j in args.jobs]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print("| job | world | ranks run | compile s | dry run s | wall s | CPU s | peak RSS GiB | groups covered | "
          "groups built/joined per rank | ok |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['job']} | | | | | | | | | {r['error']} |")
            continue
        print(f"| {r['job']} ({r['plan']}) | {r['world']} | {r['ranks_run']} | {r['compile_s']:.0f} | "
              f"{r['dry_run_s']:.0f} | {r['wall_s']:.0f} | {r['cpu_s']:.0f} | {r['peak_rss_kib'] / 2**20:.2f} | {r['groups_covered']} | "
              f"{r['groups_built_per_rank']}/{r['groups_joined_per_rank']} | {r['ok']} |")
    for r in rows:
        for m in (r.get("mismatches") or []) + (r.get("class_mismatches") or []) + list((r.get("errors") or {}).values()):
            print(f"{r['job']}: {m}")


if __name__ == "__main__":
    main()
