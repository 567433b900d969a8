"""Issue 26, part B: files are data, nothing a user or a finished run wrote is lost, every
input is bounded. A table of bad inputs (exit 2, one line, no rank started, quick), then the
behaviours behind them: output-directory ownership and locks, full disks, the streamed text
reader, special files, checkpoint litter and skipped-step reporting.

`python tests/test_safety_inputs.py` prints the table.
"""
import errno
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT = os.path.join(ROOT, "examples", "gpt.py")
TINY = f"{GPT}:workload(n_layer=2,n_embd=16,n_head=2,vocab_size=32,seq=8,batch=2)"
DEEP = 50_000          # nesting that overflows Python's parsers' recursion


def _deep_toml(p):
    with open(p, "w") as f:
        f.write("steps = " + "[" * DEEP + "]" * DEEP + "\n")


def _deep_jsonl(p):
    with open(p, "w") as f:
        f.write('{"text": ' + "[" * DEEP + "]" * DEEP + "}\n")


def _fifo(p):
    os.mkfifo(p)


def _silent_spec(p):
    """A SPEC whose tokenizer turns any prompt into no ids."""
    with open(p, "w") as f:
        # the repository root on the path only where it is not (a rank or a CLI process):
        # this SPEC also loads inside the test session, whose sys.path it must leave alone
        f.write(f"import sys\nif {ROOT!r} not in sys.path:\n    sys.path.insert(0, {ROOT!r})\n"
                "from tests.train_specs import stepped\n\n"
                "class Silent:\n    def encode(self, text):\n        return []\n\n"
                "    def decode(self, ids):\n        return ''\n\n"
                "def silent():\n    w = stepped()\n    w['tokenizer'] = Silent()\n    return w\n")


def _set_manifest(d, edit):
    path = os.path.join(d, "manifest.json")
    with open(path) as f:
        m = json.load(f)
    edit(m)
    with open(path, "w") as f:
        json.dump(m, f)


def _shape(m):
    m["chunks"][1]["inputs"][0]["shape"][-1] += 1


def _dtype(m):
    m["chunks"][0]["outputs"][0]["dtype"] = "float16"


def _dtype_unknown(m):
    m["chunks"][1]["inputs"][0]["dtype"] = "complex128"


def _huge_m(m):
    m["schedule"]["microbatches"] = 2 ** 20
    m["plan"] = m["plan"].replace("m=2", f"m={2 ** 20}")
    m["plan_values"]["microbatches"] = 2 ** 20


def _nested_manifest(d):
    with open(os.path.join(d, "manifest.json"), "w") as f:
        f.write("[" * DEEP + "]" * DEEP)


def _fifo_chunk(d):
    os.remove(os.path.join(d, "chunk00.py"))
    os.mkfifo(os.path.join(d, "chunk00.py"))


ARTIFACT_TAMPERS = {
    "boundary shape": lambda d: _set_manifest(d, _shape),
    "boundary dtype": lambda d: _set_manifest(d, _dtype),
    "boundary dtype unknown": lambda d: _set_manifest(d, _dtype_unknown),
    "m=2^20": lambda d: _set_manifest(d, _huge_m),
    "manifest nested 50000 deep": _nested_manifest,
    "module is a FIFO": _fifo_chunk,
}

# (name, argv, environment, file makers {placeholder: fn(path)})
CASES = [
    ("compile into a user's dir (issue repro)", ["compile", GPT + ":workload", "--plan", "pp=2,m=2", "--out", "{user}"],
     {}, {}),
    ("train into a user's run-like dir", ["train", "--steps", "1", "--out", "{user}"], {}, {}),
    ("train --sample-prompt ''", ["train", "--steps", "1", "--sample-prompt", "", "--out", "{new}"], {}, {}),
    ("train SPEC tokenizer: prompt gives no ids", ["train", "{silent.py}:silent", "--steps", "1", "--out", "{new}"],
     {}, {"silent.py": _silent_spec}),
    ("train --ckpt-dir = --out", ["train", "--steps", "2", "--save-every", "1", "--out", "{new}",
                                  "--ckpt-dir", "{new}"], {}, {}),
    ("train --ckpt-dir inside --out", ["train", "--steps", "2", "--save-every", "1", "--out", "{new}",
                                       "--ckpt-dir", "{new}/ck"], {}, {}),
    ("train --ckpt-dir a file", ["train", "--steps", "2", "--save-every", "1", "--out", "{new}",
                                 "--ckpt-dir", "{file}"], {}, {}),
    ("train --data FIFO", ["train", "--steps", "1", "--data", "{fifo}", "--out", "{new}"], {}, {"fifo": _fifo}),
    ("train --data /dev/zero", ["train", "--steps", "1", "--data", "/dev/zero", "--out", "{new}"], {}, {}),
    ("train --data /dev/null", ["train", "--steps", "1", "--data", "/dev/null", "--out", "{new}"], {}, {}),
    ("train --config FIFO", ["train", "--config", "{fifo}", "--out", "{new}"], {}, {"fifo": _fifo}),
    ("train --config /dev/zero", ["train", "--config", "/dev/zero", "--out", "{new}"], {}, {}),
    ("train --config nested TOML", ["train", "--config", "{deep.toml}", "--out", "{new}"], {},
     {"deep.toml": _deep_toml}),
    ("train --data nested JSONL", ["train", "--steps", "1", "--data", "{deep.jsonl}", "--out", "{new}"], {},
     {"deep.jsonl": _deep_jsonl}),
    ("train --eval-batches 1e9", ["train", "--eval-batches", "1000000000", "--out", "{new}"], {}, {}),
    ("train --n-embd 2^20", ["train", "--n-embd", str(2 ** 20), "--out", "{new}"], {}, {}),
    ("train --n-embd 65536 --n-layer 1024 (memory)", ["train", "--n-embd", "65536", "--n-layer", "1024", "--steps",
                                                      "1", "--out", "{new}"], {}, {}),
    ("train --n-layer 10^6", ["train", "--n-layer", "1000000", "--out", "{new}"], {}, {}),
    ("train --seed 2^63", ["train", "--seed", str(2 ** 63), "--out", "{new}"], {}, {}),
    ("train --seed 10^13", ["train", "--seed", str(10 ** 13), "--out", "{new}"], {}, {}),
    ("train --seed -1", ["train", "--seed", "-1", "--out", "{new}"], {}, {}),
    ("export --max-shard-size nanGB", ["export", "{user}", "--out", "{new}", "--max-shard-size", "nanGB"], {}, {}),
    ("export --max-shard-size infGB", ["export", "{user}", "--out", "{new}", "--max-shard-size", "infGB"], {}, {}),
    ("generate --temperature 1e-300", ["generate", "{user}", "--prompt", "a", "--temperature", "1e-300"], {}, {}),
    ("generate --seed 2^65", ["generate", "{user}", "--prompt", "a", "--seed", str(2 ** 65)], {}, {}),
    ("generate --tokens 10^12", ["generate", "{user}", "--prompt", "a", "--tokens", str(10 ** 12)], {}, {}),
    ("THREEFOLD_TIMEOUT=abc", ["schedule", "--pp", "2", "-m", "4"], {"THREEFOLD_TIMEOUT": "abc"}, {}),
    ("THREEFOLD_TIMEOUT=1e20", ["schedule", "--pp", "2", "-m", "4"], {"THREEFOLD_TIMEOUT": "1e20"}, {}),
    ("THREEFOLD_TIMEOUT=-5", ["schedule", "--pp", "2", "-m", "4"], {"THREEFOLD_TIMEOUT": "-5"}, {}),
    ("THREEFOLD_TIMEOUT=nan", ["schedule", "--pp", "2", "-m", "4"], {"THREEFOLD_TIMEOUT": "nan"}, {}),
    ("plan --gpus 10^18", ["plan", "--layers", "96", "--hidden", "12288", "--heads", "96", "--batch", "1536",
                           "--gpus", str(10 ** 18)], {}, {}),
    ("plan --batch 10^18", ["plan", "--layers", "96", "--hidden", "12288", "--heads", "96", "--batch",
                            str(10 ** 18), "--gpus", "8"], {}, {}),
] + [(f"run tampered: {name}", ["run", "{tampered:" + name + "}"], {}, {}) for name in ARTIFACT_TAMPERS]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    b = tmp_path_factory.mktemp("inputs")
    (b / "afile").write_text("user data\n")
    from threefold.codegen.artifact import save_artifact
    from threefold.compiler.api import compile_workload
    from threefold.workload import load_spec
    w = load_spec(TINY)
    save_artifact(compile_workload(w, "pp=2,m=2"), str(b / "art"), batch=(*w.inputs, w.target))
    return b


def _user_dir(path):
    os.makedirs(path)
    with open(os.path.join(path, "losses.json"), "w") as f:
        f.write("mine\n")
    with open(os.path.join(path, "loss.png"), "w") as f:
        f.write("x\n")


def _expand(arg, base, tmp, makers):
    if arg.startswith("{tampered:"):
        d = str(tmp / "tampered")
        shutil.copytree(base / "art", d)
        ARTIFACT_TAMPERS[arg[len("{tampered:"):-1]](d)
        return d
    for key, make in makers.items():
        if "{" + key + "}" in arg and not os.path.lexists(tmp / key):
            make(str(tmp / key))
        arg = arg.replace("{" + key + "}", str(tmp / key))
    if "{user}" in arg and not (tmp / "user").exists():
        _user_dir(str(tmp / "user"))
    return arg.replace("{new}", str(tmp / "new")).replace("{user}", str(tmp / "user")).replace(
        "{file}", str(base / "afile"))


def run_cli(argv, monkeypatch, capsys, tmp):
    """main(argv) in this process with the launcher replaced by a tripwire: (exit code, stderr)."""
    import threefold.runtime.launch as launch_mod
    from threefold.cli.main import main

    def tripwire(*a, **k):
        raise AssertionError("ranks were spawned for bad input")
    monkeypatch.setattr(launch_mod, "launch", tripwire)
    monkeypatch.setenv("THREEFOLD_MAX_LOCAL_RANKS", "8")
    monkeypatch.setenv("THREEFOLD_CACHE_DIR", str(tmp / "cache"))
    monkeypatch.chdir(tmp)
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    return code, capsys.readouterr().err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,argv,env,makers", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2(name, argv, env, makers, base, tmp_path, capsys, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    argv = [_expand(a, base, tmp_path, makers) for a in argv]
    start = time.monotonic()
    code, err = run_cli(argv, monkeypatch, capsys, tmp_path)
    seconds = time.monotonic() - start
    lines = [x for x in err.splitlines() if x.strip()]
    if os.environ.get("THREEFOLD_TABLE_OUT"):
        with open(os.environ["THREEFOLD_TABLE_OUT"], "a") as f:
            f.write(json.dumps({"case": name, "code": code, "seconds": round(seconds, 2), "err": err.strip()}) + "\n")
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err)
    assert seconds < 60, seconds
    if (tmp_path / "user").exists():              # the user's files are where they were
        assert sorted(os.listdir(tmp_path / "user")) == ["loss.png", "losses.json"]
        assert (tmp_path / "user" / "losses.json").read_text() == "mine\n"


def test_the_issue_repro_names_force_and_another_directory(base, tmp_path, capsys, monkeypatch):
    _user_dir(str(tmp_path / "d"))
    code, err = run_cli(["compile", TINY, "--plan", "pp=2,m=2", "--out", "d"], monkeypatch, capsys, tmp_path)
    assert code == 2 and "--force" in err and "new directory" in err, err
    assert (tmp_path / "d" / "losses.json").read_text() == "mine\n" and (tmp_path / "d" / "loss.png").exists()
    # with --force it is moved aside, not deleted
    code, err = run_cli(["compile", TINY, "--plan", "pp=2,m=2", "--out", "d", "--force"], monkeypatch, capsys,
                        tmp_path)
    assert code == 0, err
    aside = [n for n in os.listdir(tmp_path) if n.startswith("d.moved-")]
    assert len(aside) == 1 and (tmp_path / aside[0] / "losses.json").read_text() == "mine\n"
    assert (tmp_path / "d" / "manifest.json").exists()


# ---- output directories: ownership marker and locks ---------------------------------------

def _fill(tmp):
    with open(os.path.join(tmp, "x.txt"), "w") as f:
        f.write("ours")


@pytest.mark.parametrize("files", [{"losses.json": "{}"}, {"losses.json": "{}", "loss.png": "x"},
                                   {"manifest.json": '{"threefold_version": "0", "files": {}}'}])
def test_files_that_look_like_ours_without_the_marker_are_the_users(tmp_path, files):
    from threefold.errors import PlanError
    from threefold.outdir import write_out_dir
    out = tmp_path / "out"
    out.mkdir()
    for name, text in files.items():
        (out / name).write_text(text)
    with pytest.raises(PlanError, match="did not write"):
        write_out_dir(str(out), _fill, kind="test")
    assert sorted(os.listdir(out)) == sorted(files)


HOLD = """
import sys, time
sys.path.insert(0, {root!r})
from threefold.dir_lock import dir_lock
with dir_lock({path!r}):
    print("held", flush=True)
    time.sleep(60)
"""


def test_a_directory_held_by_another_process_is_refused_naming_its_pid(tmp_path):
    from threefold.errors import PlanError
    from threefold.outdir import write_out_dir
    out = str(tmp_path / "out")
    holder = subprocess.Popen([sys.executable, "-c", HOLD.format(root=ROOT, path=out)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(PlanError, match=f"in use by another threefold run \\(pid {holder.pid}\\)"):
            write_out_dir(out, _fill, kind="test")
        assert not os.path.exists(out)
    finally:
        holder.kill()          # SIGKILL: the kernel drops the lock; the next run is not blocked
        holder.wait()
    write_out_dir(out, _fill, kind="test")
    assert sorted(os.listdir(tmp_path)) == ["out"]     # the lock file went with the lock


def test_train_on_a_checkpoint_directory_held_by_another_run_is_refused(tmp_path, capsys, monkeypatch):
    ck = str(tmp_path / "ck")
    holder = subprocess.Popen([sys.executable, "-c", HOLD.format(root=ROOT, path=ck)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        code, err = run_cli(["train", "--steps", "2", "--save-every", "1", "--ckpt-dir", ck, "--out", "out"],
                            monkeypatch, capsys, tmp_path)
        assert code == 2 and f"--ckpt-dir {ck!r} is in use by another threefold run (pid {holder.pid})" in err, err
        assert not (tmp_path / ".out.lock").exists()     # the --out lock it took first was given back
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_is_reentrant_in_one_process_and_removed_after(tmp_path):
    from threefold.dir_lock import dir_lock, lock_path
    from threefold.outdir import write_out_dir
    out = str(tmp_path / "out")
    with dir_lock(out):
        write_out_dir(out, _fill, kind="test")       # the command holding --out writes it
        assert os.path.exists(lock_path(out))
    assert not os.path.exists(lock_path(out))


# ---- full disks ---------------------------------------------------------------------------

def test_a_full_disk_while_writing_out_is_named_and_the_old_directory_kept(tmp_path):
    from threefold.errors import PlanError
    from threefold.outdir import write_out_dir
    out = tmp_path / "out"
    write_out_dir(str(out), _fill, kind="test")

    def fill_full(tmp):         # a real ENOSPC: /dev/full refuses every write
        os.symlink("/dev/full", os.path.join(tmp, "big.bin"))
        with open(os.path.join(tmp, "big.bin"), "wb") as f:
            f.write(b"x" * 10)
    with pytest.raises(PlanError, match="disk is full"):
        write_out_dir(str(out), fill_full, kind="test")
    assert (out / "x.txt").read_text() == "ours"
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_train_keeps_its_record_when_out_cannot_be_written(tmp_path, capsys, monkeypatch):
    """The run trained; writing --out hits a full disk: exit 2, one line naming the full disk
    and where the losses are (losses.json and metrics kept beside --out); a user's old --out intact."""
    import threefold.cli.jobs as jobs
    import threefold.cli.train_cmd as train_cmd
    import threefold.train.report as report
    from threefold.plan import Plan
    result = {"losses": [3.0, 2.5], "seconds": [0.1, 0.1], "tokens_per_step": 64, "skipped": [], "stopped": None,
              "rows": [], "flops_per_step": 1.0, "sample": None, "initial_val_loss": None, "trace": None}
    monkeypatch.setattr(train_cmd, "validate_in_parent", lambda cfg: Plan.parse("pp=2,m=2"))
    monkeypatch.setattr(jobs, "run_on_ranks", lambda *a, **k: [result])

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(report, "write_run", full)
    code, err = run_cli(["train", "--steps", "2", "--out", "out"], monkeypatch, capsys, tmp_path)
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and "disk is full" in err, err
    live = [n for n in os.listdir(tmp_path) if n.startswith(".out.live-")]
    assert len(live) == 1 and live[0] in err
    assert json.loads((tmp_path / live[0] / "losses.json").read_text())["losses"] == [3.0, 2.5]
    assert not (tmp_path / "out").exists()


def test_a_full_disk_in_a_checkpoint_save_is_named(tmp_path, monkeypatch):
    """torch's CheckpointException (every rank's OSError inside) becomes one line."""
    from torch.distributed.checkpoint.api import CheckpointException
    from threefold.checkpoint.save import _any_disk_full
    from threefold.outdir import is_disk_full
    exc = CheckpointException("save", {0: (OSError(errno.ENOSPC, "No space left on device"), None),
                                       1: (OSError(errno.ENOSPC, "No space left on device"), None)})
    assert _any_disk_full(exc)
    assert not _any_disk_full(CheckpointException("save", {0: (ValueError("other"), None)}))
    assert is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded")) and not is_disk_full(OSError(errno.EACCES, "x"))


# ---- streamed text data -------------------------------------------------------------------

@pytest.fixture
def small_stream(monkeypatch, tmp_path):
    from threefold.dataset import token_cache
    monkeypatch.setattr(token_cache, "STREAM_BYTES", 256 << 10)
    monkeypatch.setattr(token_cache, "STREAM_CHUNK", 32 << 10)
    monkeypatch.setenv("THREEFOLD_CACHE_DIR", str(tmp_path / "cache"))
    return token_cache


def _text(path, mb):
    with open(path, "w", encoding="utf-8") as f:
        i = 0
        while f.tell() < mb << 20:
            f.write(f"line {i}: caf\u00e9 \u2014 na\u00efve r\u00e9sum\u00e9\n")
            i += 1


def test_large_text_is_streamed_not_read_whole(small_stream, tmp_path):
    """A 4 MB text file read with 32 KB chunks: the ids are the file's bytes (the byte
    tokenizer), a read-only memory map, and the reader's Python allocations stay near one
    chunk, not the file (tracemalloc sees numpy's buffers too)."""
    import tracemalloc
    from threefold.dataset import ByteTokenizer, read_tokens
    path = str(tmp_path / "big.txt")
    _text(path, 4)
    tracemalloc.start()
    try:
        ids = read_tokens(path, ByteTokenizer())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(ids, np.memmap)
    assert np.array_equal(np.asarray(ids), np.fromfile(path, dtype=np.uint8))
    assert peak < (1 << 20), peak       # the file is 4 MB; one chunk is 32 K characters
    cached = os.listdir(small_stream.cache_dir())
    before = os.path.getmtime(os.path.join(small_stream.cache_dir(), cached[0]))
    again = read_tokens(path, ByteTokenizer())       # the cache is reused, not rewritten
    assert np.array_equal(np.asarray(again), np.asarray(ids))
    assert os.listdir(small_stream.cache_dir()) == cached
    assert os.path.getmtime(os.path.join(small_stream.cache_dir(), cached[0])) == before


def test_streamed_directories_and_jsonl_match_the_in_memory_reader(small_stream, tmp_path, monkeypatch):
    from threefold.dataset import ByteTokenizer, read_tokens
    d = tmp_path / "d"
    d.mkdir()
    _text(str(d / "a.txt"), 1)
    with open(d / "b.jsonl", "w") as f:
        for i in range(3000):
            f.write(json.dumps({"text": f"document {i} " * 20}) + "\n")
    streamed = read_tokens(str(d), ByteTokenizer())
    assert isinstance(streamed, np.memmap)
    monkeypatch.setattr(small_stream, "STREAM_BYTES", 1 << 40)     # everything in memory, as before
    whole = read_tokens(str(d), ByteTokenizer())
    assert not isinstance(whole, np.memmap)
    assert np.array_equal(np.asarray(streamed), whole)


@pytest.mark.parametrize("count", [1, 2, 3, 7, 1000, 4099])
def test_the_tableless_shuffle_is_a_permutation(count):
    from threefold.dataset.sampler import Shuffle
    order = [Shuffle(count, [5, 6, 7, 8])[i] for i in range(count)]
    assert sorted(order) == list(range(count))
    assert count < 7 or order != list(range(count))


def test_a_large_epoch_is_ordered_without_a_table_and_still_resumes(monkeypatch):
    """Above TABLE_MAX windows the order is a keyed bijection (memory independent of the data):
    every window once per epoch, the same batches from a saved position."""
    import threefold.dataset.sampler as sampler
    monkeypatch.setattr(sampler, "TABLE_MAX", 16)
    tokens = np.arange(8 * 100 + 1) % 256
    s = sampler.Sampler(tokens, batch=4, seq=8, seed=3)
    assert isinstance(s._order(0)[2], sampler.Shuffle)
    starts = s.starts(0, s.count)
    assert sorted(starts) == sorted(set(starts)) and len(starts) == s.count
    first = [s.next()[0] for _ in range(5)]
    again = sampler.Sampler(tokens, batch=4, seq=8, seed=3, position=8)
    assert all(np.array_equal(a, b) for a, b in zip(first[2:], [again.next()[0] for _ in range(3)]))


def test_the_id_scan_of_a_memory_map_reads_the_file(tmp_path):
    from threefold.dataset.token_cache import scan_ids
    path = tmp_path / "t.bin"
    ids = np.arange(1000, dtype=np.uint16)
    ids[700] = 999
    ids.tofile(path)
    mm = np.memmap(path, dtype=np.uint16, mode="r")
    assert scan_ids(mm, 2000) == (999, None)
    assert scan_ids(mm, 500) == (999, 500)


def test_a_text_file_that_is_not_utf8_is_one_line_when_streamed(small_stream, tmp_path):
    from threefold.dataset import ByteTokenizer, read_tokens
    from threefold.errors import PlanError
    path = tmp_path / "bad.txt"
    path.write_bytes(b"ok\n" * 200_000 + b"\xff\xfe")
    with pytest.raises(PlanError, match="not UTF-8"):
        read_tokens(str(path), ByteTokenizer())
    assert not os.listdir(small_stream.cache_dir())          # no partial cache file left


# ---- litter and reporting -----------------------------------------------------------------

def test_partial_checkpoints_are_dropped_but_nothing_else(tmp_path):
    from threefold.checkpoint.files import drop_partial
    root = tmp_path / "ck"
    for name in (".tmp-step_000000003-abc123", ".tmp-step_000000004-x", "step_000000002", "notes"):
        (root / name).mkdir(parents=True)
    (root / ".tmp-step_000000005-file").write_text("a file, not ours")
    assert sorted(drop_partial(str(root))) == [".tmp-step_000000003-abc123", ".tmp-step_000000004-x"]
    assert sorted(os.listdir(root)) == [".tmp-step_000000005-file", "notes", "step_000000002"]


def test_skipped_updates_are_in_the_summary_and_losses_json(tmp_path):
    from threefold.cli.train_cmd import summary_text
    from threefold.plan import Plan
    from threefold.train.report import summarize, write_losses
    result = {"losses": [3.0, float("inf"), 2.0], "seconds": [0.1] * 3, "tokens_per_step": 64, "rows": [],
              "flops_per_step": 1.0, "sample": None, "initial_val_loss": None, "trace": None,
              "skipped": [{"step": 2, "reason": "non-finite loss inf (--skip-nonfinite)"},
                          {"step": 3, "reason": "fp16 overflow (loss scale lowered)"}]}
    plan = Plan.parse("pp=2,m=2")
    summary = summarize(result, plan, str(tmp_path))
    text = summary_text(summary)
    assert "skipped 2 update(s)" in text and "fp16 overflow" in text and "2 (non-finite" in text
    write_losses(str(tmp_path), result, plan)
    saved = json.loads((tmp_path / "losses.json").read_text())
    assert [s["step"] for s in saved["skipped_steps"]] == [2, 3]
    old = dict(result, skipped=[4])                   # a checkpoint written before reasons existed
    assert summarize(old, plan, str(tmp_path))["skipped_steps"] == [
        {"step": 4, "reason": "non-finite (--skip-nonfinite)"}]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-k", "one_line_exit_2", "-p", "no:logging", "-rf"]))
