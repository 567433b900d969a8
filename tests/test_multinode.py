"""Across nodes: `threefold run` and `threefold train` under `torchrun --nnodes 2
--nproc-per-node 2`, two launcher processes on this machine meeting at a c10d rendezvous on
127.0.0.1, with HSDP (dp=4, zero=3, dp_shard=2): each node's two ranks shard the state, and
the two nodes hold replicas of it. Losses equal the single-process run's."""
import json
import os
import socket
import subprocess
import sys

import pytest

from threefold.runtime.mesh import Mesh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HSDP = "dp=4,zero=3,dp_shard=2"
TINY = ["--steps", "3", "--batch", "8", "--seq", "16", "--n-layer", "2", "--n-embd", "32",
        "--eval-every", "0", "--sample-tokens", "0"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _threefold(*args, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "threefold", *args], capture_output=True, text=True,
                          timeout=timeout, env=_env(), cwd=ROOT)


def two_nodes(args: list[str], timeout: float = 600) -> list[str]:
    """Run `python -m threefold ARGS` as a 2 x 2 torchrun job (two agents); their stdouts."""
    port = _free_port()
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                                "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"tf{port}",
                                "-m", "threefold", *args],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
               for _ in range(2)]
    outs = []
    try:
        for a in agents:
            out, err = a.communicate(timeout=timeout)
            assert a.returncode == 0, err[-3000:]
            outs.append(out)
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    return outs


def _json_line(outs: list[str]) -> dict:
    lines = [l for o in outs for l in o.splitlines() if l.startswith("{")]
    assert lines, outs
    return json.loads(lines[0])


def test_hsdp_places_replicas_across_nodes_and_shards_within():
    mesh = Mesh(dp=4, dp_shard=2)             # torchrun: node k holds ranks 2k, 2k+1
    assert mesh.group(0, "dp_shard") == [0, 1] and mesh.group(2, "dp_shard") == [2, 3]
    assert mesh.group(0, "dp_replicate") == [0, 2] and mesh.group(1, "dp_replicate") == [1, 3]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_run_and_train_under_torchrun_two_nodes_equal_one_process(tmp_path):
    spec = os.path.join(ROOT, "examples", "gpt.py") + ":workload(n_layer=2,n_embd=32,n_head=4,seq=8,batch=8)"
    for plan, out in (("", "one"), (HSDP, "hsdp")):
        r = _threefold("compile", spec, "--plan", plan, "--out", str(tmp_path / out))
        assert r.returncode == 0, r.stderr[-2000:]
    one = json.loads(_threefold("run", str(tmp_path / "one"), "--json").stdout)
    hsdp = _json_line(two_nodes(["run", str(tmp_path / "hsdp"), "--json"]))
    assert hsdp["plan"].endswith("zero=3,dp_shard=2")
    assert max(abs(a - b) / abs(b) for a, b in zip(hsdp["losses"], one["losses"])) < 1e-5, (hsdp, one)

    r = _threefold("train", "--plan", "", *TINY, "--out", str(tmp_path / "t1"), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    two_nodes(["train", "--plan", HSDP, *TINY, "--out", str(tmp_path / "t4"), "--json"])
    train, hsdp_train = (json.load(open(tmp_path / d / "losses.json")) for d in ("t1", "t4"))
    assert hsdp_train["plan"].endswith("zero=3,dp_shard=2") and len(train["losses"]) == 3
    assert max(abs(a - b) / abs(b) for a, b in zip(hsdp_train["losses"], train["losses"])) < 1e-5
