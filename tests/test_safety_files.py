"""Files are data, the job is its own (issue 26, part A).

- A checkpoint never runs code: a `.metadata` replaced by a pickle whose __reduce__ runs a
  command (CRC in threefold.json updated), or a non-tensor entry replaced by one, is
  refused in one line by threefold.load, `train --resume`, `generate` and `export`, and the
  command never runs.
- Artifacts are code: `run` lists what it imports; `compile --sign` / `run --verify` refuse
  a tampered, re-hashed artifact.
- The rendezvous store is the job's: a foreign process writing keys during start-up is
  ignored and the job runs on; one that overwrites the job's own keys is named.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import zlib

import pytest
import torch

import threefold
from threefold import PlanError
from threefold.cli.main import main
from tests.parity import ROOT

TINY = os.path.join(ROOT, "examples", "gpt.py") + ":workload(n_layer=2,n_embd=16,n_head=2,vocab_size=32,seq=8,batch=2)"


class _RunsCommand:
    """What an attacker puts in a pickle: unpickling it runs a shell command."""

    def __init__(self, cmd: str):
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


def _reindex(ckpt: str, name: str) -> None:
    """Update the file's size and CRC in threefold.json, as an attacker can."""
    index_path = os.path.join(ckpt, "threefold.json")
    with open(index_path) as f:
        index = json.load(f)
    with open(os.path.join(ckpt, name), "rb") as f:
        data = f.read()
    index["files"][name] = [len(data), zlib.crc32(data)]
    with open(index_path, "w") as f:
        json.dump(index, f)


def _attack_metadata(ckpt: str, marker: str) -> None:
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        pickle.dump(_RunsCommand(f"touch {marker}"), f)
    _reindex(ckpt, ".metadata")


def _attack_meta_entry(ckpt: str, marker: str) -> str:
    """Replace the `meta` entry (a torch.save'd dict DCP reads with torch.load) by a pickle
    that runs a command: appended to its .distcp file, the metadata pointed at it."""
    with open(os.path.join(ckpt, ".metadata"), "rb") as f:
        md = pickle.load(f)         # the test's own, untampered file
    index = next(i for i in md.storage_data if i.fqn == "meta")
    info = md.storage_data[index]
    buf = io.BytesIO()
    torch.save(_RunsCommand(f"touch {marker}"), buf)
    path = os.path.join(ckpt, info.relative_path)
    info.offset, info.length = os.path.getsize(path), len(buf.getvalue())
    with open(path, "ab") as f:
        f.write(buf.getvalue())
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    _reindex(ckpt, info.relative_path)
    _reindex(ckpt, ".metadata")
    return info.relative_path


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A one-step checkpoint of a tiny GPT that records, as `threefold train` does, how to
    rebuild it (so generate and export get past the checkpoint to the model)."""
    from threefold.models.gpt import GPT, GPTConfig, lm_loss
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)
    x = torch.randint(0, 64, (4, 8))
    pm = threefold.parallelize(GPT(cfg), "tp=1", (x,), lm_loss, target=x.roll(-1, 1))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    pm.step(x, target=x.roll(-1, 1))
    opt.step()
    root = tmp_path_factory.mktemp("ckpt") / "root"
    path = threefold.save(pm, opt, str(root), extra={"generate": {"gpt": dataclasses.asdict(cfg)}})
    return path, pm, opt


def _tampered(saved, tmp_path, attack):
    path = saved[0]
    ckpt = str(tmp_path / "ckpt" / os.path.basename(path))
    shutil.copytree(os.path.dirname(path), str(tmp_path / "ckpt"))
    marker = str(tmp_path / "PWNED")
    where = attack(ckpt, marker)
    return ckpt, marker, where


@pytest.mark.parametrize("attack", [_attack_metadata, _attack_meta_entry], ids=["metadata", "meta-entry"])
def test_a_checkpoint_that_would_run_code_is_refused_everywhere(saved, tmp_path, capsys, attack):
    ckpt, marker, where = _tampered(saved, tmp_path, attack)
    file = where or ".metadata"
    _, pm, opt = saved
    with pytest.raises(PlanError) as e:
        threefold.load(pm, opt, ckpt)
    msg = str(e.value)
    assert "posix.system" in msg and os.path.join(ckpt, file) in msg and "\n" not in msg, msg
    capsys.readouterr()
    for argv in (["generate", ckpt, "--prompt", "ab", "--tokens", "2"],
                 ["export", ckpt, "--out", str(tmp_path / "exported")]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert "posix.system" in err and file in err and "\n" not in err, err
    assert not os.path.exists(marker), "the checkpoint ran its command"
    assert not os.path.exists(tmp_path / "exported")


def test_an_untampered_checkpoint_still_loads_with_everything(saved):
    path, pm, opt = saved
    info = threefold.load(pm, opt, path)
    assert info["step"] == 1 and info["extra"]["generate"]["gpt"]["n_embd"] == 16
    assert info["optimizer_groups"] != "none"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_train_resume_refuses_a_checkpoint_that_would_run_code(saved, tmp_path):
    # any checkpoint will do: the metadata is read (and refused) before the model is compared
    ck, marker, _ = _tampered(saved, tmp_path, _attack_metadata)
    out = subprocess.run([sys.executable, "-m", "threefold", "train", "--plan", "tp=1", "--batch", "2", "--seq", "8",
                          "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--eval-every", "0",
                          "--sample-tokens", "0", "--steps", "2", "--resume", os.path.dirname(ck),
                          "--out", str(tmp_path / "b")],
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=240)
    err = out.stderr.strip().splitlines()
    assert out.returncode == 2, out.stderr[-2000:]
    assert "posix.system" in err[-1] and os.path.join(ck, ".metadata") in err[-1], err
    assert not os.path.exists(marker), "train --resume ran the checkpoint's command"


def test_the_metadata_reader_admits_only_dcp_classes(tmp_path):
    from threefold.checkpoint.safe_read import read_metadata_file
    path = str(tmp_path / ".metadata")
    with open(path, "wb") as f:
        pickle.dump({"x": collections_counter()}, f)
    with pytest.raises(PlanError, match=r"names collections\.Counter"):
        read_metadata_file(path)
    with open(path, "wb") as f:
        pickle.dump([1, 2], f)
    with pytest.raises(PlanError, match="not DCP metadata"):
        read_metadata_file(path)
    with open(path, "wb") as f:
        f.write(b"\x80\x04garbage")
    with pytest.raises(PlanError, match="unreadable"):
        read_metadata_file(path)


def collections_counter():
    import collections
    return collections.Counter("ab")


# -- artifacts are code: the list of imports, signing --------------------------------------

@pytest.fixture(scope="module")
def signed(tmp_path_factory):
    d = tmp_path_factory.mktemp("signed")
    key = d / "key"
    key.write_bytes(os.urandom(32))
    assert main(["compile", TINY, "--out", str(d / "art"), "--sign", str(key)]) == 0
    return d, key


def _tamper_and_rehash(art, marker: str) -> None:
    with open(os.path.join(art, "chunk00.py"), "a") as f:
        f.write(f"\nimport os\nos.system('touch {marker}')\n")
    with open(os.path.join(art, "chunk00.py"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    with open(os.path.join(art, "manifest.json")) as f:
        manifest = json.load(f)
    manifest["files"]["chunk00.py"] = digest
    with open(os.path.join(art, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)


def test_run_verify_refuses_a_tampered_rehashed_artifact(signed, tmp_path, capsys):
    d, key = signed
    art = str(tmp_path / "art")
    shutil.copytree(str(d / "art"), art)
    marker = str(tmp_path / "PWNED")
    _tamper_and_rehash(art, marker)
    capsys.readouterr()
    assert main(["run", art, "--verify", str(key), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "does not match its signature" in err and "\n" not in err, err
    other = tmp_path / "other.key"
    other.write_bytes(os.urandom(32))
    assert main(["run", str(d / "art"), "--verify", str(other), "--steps", "1"]) == 2
    assert "does not match its signature" in capsys.readouterr().err
    os.remove(os.path.join(art, "manifest.json.hmac"))
    assert main(["run", art, "--verify", str(key), "--steps", "1"]) == 2
    assert "is not signed" in capsys.readouterr().err
    short = tmp_path / "short.key"
    short.write_bytes(b"pw\n")
    assert main(["run", str(d / "art"), "--verify", str(short)]) == 2
    assert "too few for a key" in capsys.readouterr().err
    assert main(["compile", TINY, "--out", str(tmp_path / "x"), "--sign", str(tmp_path)]) == 2
    assert "not a regular file" in capsys.readouterr().err
    assert not os.path.exists(marker)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_run_lists_its_imports_and_runs_a_verified_artifact(signed):
    d, key = signed
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-m", "threefold", "run", str(d / "art"), "--verify", str(key),
                          "--steps", "1", "--json"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    with open(d / "art" / "manifest.json") as f:
        digest = json.load(f)["files"]["chunk00.py"]
    assert f"chunk00.py  sha256 {digest}" in out.stderr and "signature under" in out.stderr
    assert len(json.loads(out.stdout)["losses"]) == 1
    out = subprocess.run([sys.executable, "-m", "threefold", "run", str(d / "art"), "--steps", "1"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()    # text mode: the list on stdout, before the losses
    assert "unsigned" in lines[0] and lines[1] == f"  chunk00.py  sha256 {digest}" and lines[2].startswith("step 1:")
    out = subprocess.run([sys.executable, "-m", "threefold", "run", str(d / "art"), "--trust", "--steps", "1"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0 and "sha256" not in out.stdout + out.stderr, out.stderr[-2000:]


# -- the job's own store --------------------------------------------------------------------

def test_a_foreign_overwrite_of_the_jobs_own_key_is_named():
    from datetime import timedelta
    import torch.distributed as dist
    from threefold.runtime.job_store import ForeignWrite, JobStore, new_secret
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    job = JobStore(server, new_secret())
    job.set("addr", b"10.0.0.1:1234")
    assert job.get("addr") == b"10.0.0.1:1234"
    assert job.compare_set("fail", "", "rank 1 died") == b"rank 1 died"
    assert job.compare_set("fail", "", "echo") == b"rank 1 died"      # the first report stays
    foreign = dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=timedelta(seconds=10))
    ours = [k for k in foreign.list_keys() if k.endswith("addr")]
    assert ours and all("addr" in k and k.startswith("tfjob-") for k in ours)
    foreign.set("addr", b"evil")                     # outside the namespace: never read
    assert job.get("addr") == b"10.0.0.1:1234"
    foreign.set(ours[0], b"evil:1.2.3.4")            # inside it: named, not used
    with pytest.raises(ForeignWrite, match="'addr' holds a value this job did not write"):
        job.get("addr")
    assert not JobStore(server, new_secret()).check(["addr"])   # another job sees none of this one's keys


def _ranks_meet():
    """What a rank does at start: the default group, sub-groups, a collective, a barrier."""
    import torch.distributed as dist
    g = dist.new_group([0, 1])
    t = torch.ones(2) * (dist.get_rank() + 1)
    dist.all_reduce(t, group=g)
    dist.barrier()
    return t.tolist()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_foreign_process_writing_the_store_at_start_up_is_ignored(monkeypatch):
    import threefold.runtime.launch as launch_mod
    original = launch_mod._store_server
    writers = []

    def with_foreign_writer(world):
        store, port = original(world)
        w = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "foreign_store_writer.py"), str(port), "60"],
                             stdout=subprocess.PIPE, text=True)
        writers.append(w)
        assert w.stdout.readline().strip() == "ready"   # it writes before any rank starts
        return store, port

    monkeypatch.setattr(launch_mod, "_store_server", with_foreign_writer)
    try:
        assert launch_mod.launch(_ranks_meet, 2, timeout=120) == [[3.0, 3.0], [3.0, 3.0]]
        assert len(writers) == 1 and writers[0].poll() is None     # it attacked throughout
    finally:
        for w in writers:
            w.kill()
            w.wait()


_TORCHRUN_JOB = """
import os
import torch, torch.distributed as dist
from threefold.runtime import comm
from threefold.runtime.launch import init_from_env
init_from_env("gloo")
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t, group=dist.new_group([0, 1]))
# one write per line: print writes its fields (and the newline) one by one, and the two
# ranks share torchrun's stdout, so their lines could interleave ("01 3.0 JobStore, 3.0 ...")
os.write(1, f"{dist.get_rank()} {t.item()} {type(comm._store()).__name__}\\n".encode())
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_under_torchrun_threefold_job_secret_puts_the_job_behind_its_own_store(tmp_path):
    from threefold.runtime.launch import free_port
    (tmp_path / "job.py").write_text(_TORCHRUN_JOB)
    env = {**os.environ, "PYTHONPATH": ROOT, "THREEFOLD_JOB_SECRET": os.urandom(16).hex(), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(free_port()), str(tmp_path / "job.py")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stderr[-2000:]
    assert sorted(out.stdout.split("\n")[:2]) == ["0 3.0 JobStore", "1 3.0 JobStore"], out.stdout
