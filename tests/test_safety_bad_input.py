"""The bad-input table: every case exits 2 with one line on stderr and no traceback, and
fails in the parent, before any rank is spawned (the launcher is replaced by a tripwire).

`python tests/test_safety_bad_input.py` prints the table (cases, clean, anything else).
"""
import json
import os
import shutil
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT = os.path.join(ROOT, "examples", "gpt.py")
TINY = f"{GPT}:workload(n_layer=2,n_embd=16,n_head=2,vocab_size=32,seq=8,batch=2)"

SPECS = '''
import torch
from examples_gpt import workload as _gpt

def raises():
    raise RuntimeError("weights file missing\\nsecond line")

def returns_int():
    return 3

def no_loss():
    w = _gpt(n_layer=2, n_embd=16, n_head=2, vocab_size=32, seq=8, batch=2)
    return {"model": w["model"], "inputs": w["inputs"]}

def not_a_module():
    return {"model": 3, "inputs": (torch.zeros(2),)}

def wrong_keys():
    return {"net": 3}

def needs_arg(size):
    return None
'''

BAD_PLANS = ["tp=2,tp=4", "tp=2 pp=2", "tp=2,,pp=2", "tp=2,", ",tp=2", "tp=", "=2", "tp", "tp=two",
             "tp=0", "tp=-1", "tp=1.5", "pp=2;dp=2", "bogus=1", "schedule=zigzag", "v=2", "v=2,pp=2",
             "sp=true", "sp=maybe", "m=0", "pp==2", "tp=2=3",
             # issue 45's probe: non-ASCII digits and booleans, a typo'd key, keys that would do nothing
             "tp=\uff12", "tp=\u0662", "tp=1_0", "tp=+2", "strict=\uff59es", "shedule=gpipe", "sp=1",
             "dp=2,dp_shard=2", "tp=2 ,pp=2 x"]


def _cases() -> list[tuple[str, list[str]]]:
    c = []
    for plan in BAD_PLANS:
        c.append((f"train --plan {plan!r}", ["train", "--plan", plan, "--steps", "1", "--out", "{new}"]))
        c.append((f"check --plan {plan!r}", ["check", TINY, "--plan", plan]))
        c.append((f"compile --plan {plan!r}", ["compile", TINY, "--plan", plan, "--out", "{new}"]))
    c += [
        ("train --steps 0", ["train", "--steps", "0", "--out", "{new}"]),
        ("train --steps -1", ["train", "--steps", "-1", "--out", "{new}"]),
        ("train --steps abc", ["train", "--steps", "abc"]),
        ("train --lr nan", ["train", "--lr", "nan", "--out", "{new}"]),
        ("train --lr inf", ["train", "--lr", "inf", "--out", "{new}"]),
        ("train --lr -1", ["train", "--lr", "-1", "--out", "{new}"]),
        ("train --lr 0", ["train", "--lr", "0", "--out", "{new}"]),
        ("train --seq 100000", ["train", "--seq", "100000", "--out", "{new}"]),
        ("train --seq 0", ["train", "--seq", "0", "--out", "{new}"]),
        ("train --batch 0", ["train", "--batch", "0", "--out", "{new}"]),
        ("train --batch 100000", ["train", "--batch", "100000", "--out", "{new}"]),
        ("train --out FILE", ["train", "--out", "{file}"]),
        ("train --out .", ["train", "--out", "."]),
        ("train --out foreign dir", ["train", "--out", "{foreign}"]),
        ("train --out under a file", ["train", "--out", "{file}/sub"]),
        ("train --out ''", ["train", "--out", ""]),
        ("train --plan tp=12 (24 ranks)", ["train", "--plan", "tp=12", "--out", "{new}"]),
        ("train --plan dp=64", ["train", "--plan", "dp=64", "--out", "{new}"]),
        ("train --plan tp=3 (heads)", ["train", "--plan", "tp=3", "--out", "{new}"]),
        ("train --plan pp=64 (64 ranks)", ["train", "--plan", "pp=64", "--out", "{new}"]),
        ("train --bogus", ["train", "--bogus"]),
        ("train SPEC missing file", ["train", "nope.py:f", "--out", "{new}"]),
        ("train SPEC malformed", ["train", "nocolon", "--out", "{new}"]),
        ("train SPEC raises", ["train", "{specs}:raises", "--out", "{new}"]),
        ("train SPEC no loss", ["train", "{specs}:no_loss", "--out", "{new}"]),
        ("check SPEC raises", ["check", "{specs}:raises", "--plan", "pp=2"]),
        ("check SPEC returns int", ["check", "{specs}:returns_int", "--plan", "pp=2"]),
        ("check SPEC not a module", ["check", "{specs}:not_a_module", "--plan", "pp=2"]),
        ("check SPEC wrong keys", ["check", "{specs}:wrong_keys", "--plan", "pp=2"]),
        ("check SPEC needs arg", ["check", "{specs}:needs_arg", "--plan", "pp=2"]),
        ("check SPEC bad kwargs", ["check", "{specs}:raises(x=)", "--plan", "pp=2"]),
        ("check SPEC no callable", ["check", "{specs}:missing", "--plan", "pp=2"]),
        ("check SPEC syntax error", ["check", "{syntax}:f", "--plan", "pp=2"]),
        ("check SPEC no module", ["check", "no_such_pkg.mod:f", "--plan", "pp=2"]),
        ("check SPEC no loss", ["check", "{specs}:no_loss", "--plan", "pp=2"]),
        ("check --steps 0", ["check", TINY, "--plan", "pp=2", "--steps", "0"]),
        ("check --lr nan", ["check", TINY, "--plan", "pp=2", "--lr", "nan"]),
        ("check --plan tp=3 (heads)", ["check", TINY, "--plan", "tp=3"]),
        ("check --plan m=3 (batch 2)", ["check", TINY, "--plan", "m=3"]),
        ("check --plan dp=3 (batch 2)", ["check", TINY, "--plan", "dp=3"]),
        ("check --plan tp=16,dp=2", ["check", TINY, "--plan", "tp=16,dp=2"]),
        ("check no --plan", ["check", TINY]),
        ("compile --out FILE", ["compile", TINY, "--out", "{file}"]),
        ("compile --out .", ["compile", TINY, "--out", "."]),
        ("compile --out foreign dir", ["compile", TINY, "--out", "{foreign}"]),
        ("compile --out under a file", ["compile", TINY, "--out", "{file}/sub"]),
        ("compile --out /", ["compile", TINY, "--out", "/"]),
        ("compile --out ''", ["compile", TINY, "--out", ""]),
        ("compile SPEC raises", ["compile", "{specs}:raises", "--out", "{new}"]),
        ("compile --plan tp=3 (heads)", ["compile", TINY, "--plan", "tp=3", "--out", "{new}"]),
        ("compile no --out", ["compile", TINY]),
        ("run not an artifact", ["run", "{foreign}"]),
        ("run missing dir", ["run", "{new}"]),
        ("run --steps 0", ["run", "{art}", "--steps", "0"]),
        ("run --lr nan", ["run", "{art}", "--lr", "nan"]),
        ("schedule --pp 64 -m 100000", ["schedule", "--pp", "64", "-m", "100000"]),
        ("schedule --pp 0", ["schedule", "--pp", "0", "-m", "4"]),
        ("schedule -m 0", ["schedule", "--pp", "2", "-m", "0"]),
        ("schedule -v 0", ["schedule", "--pp", "2", "-m", "4", "-v", "0"]),
        ("schedule --schedule zigzag", ["schedule", "--pp", "2", "-m", "4", "--schedule", "zigzag"]),
        ("schedule --svg DIR", ["schedule", "--pp", "2", "-m", "4", "--svg", "{foreign}"]),
        ("schedule --svg no parent", ["schedule", "--pp", "2", "-m", "4", "--svg", "{new}/x/t.svg"]),
        ("schedule --pp abc", ["schedule", "--pp", "abc", "-m", "4"]),
        ("schedule no -m", ["schedule", "--pp", "2"]),
        ("unknown command", ["frobnicate"]),
        ("export --out FILE", ["export", "{foreign}", "--out", "{file}"]),
        ("export --out foreign dir", ["export", "{foreign}", "--out", "{foreign}"]),
        ("export --out .", ["export", "{foreign}", "--out", "."]),
        ("export not a checkpoint", ["export", "{foreign}", "--out", "{new}"]),
        ("export missing checkpoint", ["export", "{new}/none", "--out", "{new}"]),
    ]
    c += [(f"run tampered: {name}", ["run", "{tampered:" + name + "}"]) for name in TAMPERS]
    return c


# ---- tampered artifacts: each function edits a copy of a good artifact -------------------

def _set_axis(m, name, size):
    """Set one axis of a manifest's mesh (a list of [name, size] pairs)."""
    for axis in m["mesh"]:
        if axis[0] == name:
            axis[1] = size


def _manifest(d, edit=None):
    path = os.path.join(d, "manifest.json")
    with open(path) as f:
        m = json.load(f)
    if edit:
        edit(m)
        with open(path, "w") as f:
            json.dump(m, f)
    return m


def _append(d, rel, data=b"# evil\n"):
    with open(os.path.join(d, rel), "ab") as f:
        f.write(data)


def _truncate(d, rel, size=0):
    with open(os.path.join(d, rel), "r+b") as f:
        f.truncate(size)


def _point(d, rel_key, target):
    _manifest(d, lambda m: (m["chunks"][0].__setitem__("module", target),
                            m["files"].__setitem__(target, "0" * 64)))


def _symlink_out(d):
    os.remove(os.path.join(d, "chunk00.py"))
    os.symlink("/etc/hostname", os.path.join(d, "chunk00.py"))


TAMPERS = {
    "source edited": lambda d: _append(d, "chunk01.py"),
    "weights edited": lambda d: _append(d, "weights/chunk00_tp0.safetensors", b"\0"),
    "weights truncated": lambda d: _truncate(d, "weights/chunk00_tp0.safetensors", 100),
    "weights empty": lambda d: _truncate(d, "weights/chunk01_tp0.safetensors", 0),
    "batch edited": lambda d: _append(d, "batch.safetensors", b"\0"),
    "source deleted": lambda d: os.remove(os.path.join(d, "chunk00.py")),
    "module path ../": lambda d: _point(d, "modules", "../../x/evil.py"),
    "module path absolute": lambda d: _point(d, "modules", "/etc/passwd"),
    "module symlink out": _symlink_out,
    "weights path ../": lambda d: _manifest(d, lambda m: m["chunks"][0]["weights"].__setitem__(
        "0", "../../../../etc/passwd")),
    "hash removed": lambda d: _manifest(d, lambda m: m["files"].pop("chunk00.py")),
    "hash not hex": lambda d: _manifest(d, lambda m: m["files"].__setitem__("chunk00.py", "x")),
    "mesh vs chunks": lambda d: _manifest(d, lambda m: _set_axis(m, "pp", 3)),
    "mesh tp vs weights": lambda d: _manifest(d, lambda m: _set_axis(m, "tp", 2)),
    "mesh not integers": lambda d: _manifest(d, lambda m: _set_axis(m, "dp_shard", "2")),
    "mesh huge": lambda d: _manifest(d, lambda m: _set_axis(m, "dp_shard", 10 ** 9)),
    "num_chunks wrong": lambda d: _manifest(d, lambda m: m.__setitem__("num_chunks", 5)),
    "stage wrong": lambda d: _manifest(d, lambda m: m["chunks"][1].__setitem__("stage", 0)),
    "class not a name": lambda d: _manifest(d, lambda m: m["chunks"][0].__setitem__("class", "os.system")),
    "format 1": lambda d: _manifest(d, lambda m: m.__setitem__("format", 1)),
    "manifest not JSON": lambda d: _truncate(d, "manifest.json", 10),
    "manifest a list": lambda d: open(os.path.join(d, "manifest.json"), "w").write("[]"),
    "schedule missing": lambda d: _manifest(d, lambda m: m.pop("schedule")),
    "no weights in one chunk": lambda d: _manifest(d, lambda m: m["chunks"][1].__setitem__("weights", {})),
}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    base = tmp_path_factory.mktemp("bad_input")
    (base / "afile").write_text("user data\n")
    (base / "foreign").mkdir()
    (base / "foreign" / "notes.txt").write_text("user data\n")
    shutil.copy(GPT, base / "examples_gpt.py")
    (base / "specs.py").write_text(SPECS)
    (base / "syntax.py").write_text("def f(:\n")
    from threefold.codegen.artifact import save_artifact
    from threefold.compiler.api import compile_workload
    from threefold.workload import load_spec
    w = load_spec(TINY)
    art = str(base / "art")
    save_artifact(compile_workload(w, "pp=2"), art, batch=(*w.inputs, w.target))
    return base


def _expand(arg: str, base, tmp) -> str:
    if arg.startswith("{tampered:"):
        name = arg[len("{tampered:"):-1]
        d = str(tmp / "tampered")
        shutil.copytree(base / "art", d, symlinks=True)
        TAMPERS[name](d)
        return d
    return (arg.replace("{new}", str(tmp / "new")).replace("{file}", str(base / "afile"))
            .replace("{foreign}", str(base / "foreign")).replace("{specs}", str(base / "specs.py"))
            .replace("{syntax}", str(base / "syntax.py")).replace("{art}", str(base / "art")))


def run_case(argv, base, tmp, capsys, monkeypatch) -> tuple[int, str]:
    import threefold.runtime.launch as launch_mod
    from threefold.cli.main import main

    def tripwire(*a, **k):
        raise AssertionError("ranks were spawned for bad input")
    monkeypatch.setattr(launch_mod, "launch", tripwire)
    monkeypatch.setenv("THREEFOLD_MAX_LOCAL_RANKS", "8")
    monkeypatch.chdir(tmp)
    argv = [_expand(a, base, tmp) for a in argv]
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    return code, capsys.readouterr().err


CASES = _cases()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv", [a for _, a in CASES], ids=[n for n, _ in CASES])
def test_bad_input_is_exit_2_with_one_line(argv, paths, tmp_path, capsys, monkeypatch):
    start = time.monotonic()
    code, err = run_case(argv, paths, tmp_path, capsys, monkeypatch)
    lines = [line for line in err.splitlines() if line.strip()]
    if os.environ.get("THREEFOLD_TABLE_OUT"):      # the table for BENCHMARKS.md
        with open(os.environ["THREEFOLD_TABLE_OUT"], "a") as f:
            f.write(json.dumps({"argv": argv, "code": code, "lines": len(lines), "seconds":
                                round(time.monotonic() - start, 2), "err": err.strip()[:300]}) + "\n")
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err)
    assert os.listdir(paths / "foreign") == ["notes.txt"]        # a user's directory is untouched
    assert (paths / "afile").read_text() == "user data\n"


def test_the_table_has_at_least_100_cases():
    assert len(CASES) >= 100


def test_a_tampered_artifact_runs_nothing(paths, tmp_path, capsys, monkeypatch):
    """The tampered module would write a file on import: it must never run."""
    d = tmp_path / "evil"
    shutil.copytree(paths / "art", d)
    marker = tmp_path / "pwned"
    _append(str(d), "chunk00.py", f"open({str(marker)!r}, 'w').write('x')\n".encode())
    code, err = run_case(["run", str(d)], paths, tmp_path, capsys, monkeypatch)
    assert code == 2 and "chunk00.py does not match its sha256" in err, err
    assert not marker.exists()
    from threefold.runtime.loader import load_chunk, open_artifact
    with pytest.raises(Exception, match="sha256"):
        load_chunk(open_artifact(str(d)), 0)        # ranks refuse it too, before importing
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_bad_weights_found_on_the_ranks_are_still_one_line_and_quick(paths, tmp_path):
    """Weights re-hashed to match but of the wrong shapes pass the parent's hash check and
    are caught by each rank against its module: exit 2, one line, no grace period."""
    import hashlib
    import subprocess

    import torch
    from safetensors.torch import load_file, save_file
    d = tmp_path / "reshaped"
    shutil.copytree(paths / "art", d)
    rel = "weights/chunk00_tp0.safetensors"
    state = {k: torch.zeros(*v.shape, 2) for k, v in load_file(str(d / rel)).items()}
    save_file(state, str(d / rel))
    digest = hashlib.sha256((d / rel).read_bytes()).hexdigest()
    _manifest(str(d), lambda m: m["files"].__setitem__(rel, digest))
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "threefold", "run", str(d)], cwd=ROOT, capture_output=True,
                         text=True, timeout=180)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert rel in lines[0] and "expects" in lines[0], lines
    assert time.monotonic() - start < 60


if __name__ == "__main__":   # print the table: python tests/test_safety_bad_input.py
    sys.exit(pytest.main([__file__, "-q", "-k", "bad_input_is_exit_2", "-p", "no:logging", "-rf"]))
