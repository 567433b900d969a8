"""Probe of crafted checkpoints, plans and environments (issue 45): cases tried / clean per family.

    PYTHONPATH=. python bench/files_are_data.py

Families (the cases are tests/test_safety_checkpoint_data.py's and the bad-input tables'):
- payload: a checkpoint whose recorded SPEC runs a command or imports a file shipped in the
  checkpoint folder, through generate (with and without --trust-recorded-spec) and export;
- metadata: every malformed-metadata case through generate, export and `train --resume`;
- plan: Unicode digits, boolean spellings, typos, keys that would do nothing;
- env: every THREEFOLD_* variable with a bad value, through `train`.
A case is clean when the command exits 2 with one line and no traceback within 60 s, no
marker file appeared (no payload ran), and the user's files are all still there.
"""
from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:     # a script run from bench/: the repository's packages
    sys.path.insert(0, ROOT)


class Hang(Exception):
    pass


def run(argv: list[str]) -> tuple[int | None, str, float]:
    from threefold.cli.main import main

    def alarm(*_):
        raise Hang()
    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(60)
    err = io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(argv)
    except Hang:
        code = None
    except BaseException as exc:       # a traceback would have reached the user
        code, err = -1, io.StringIO(f"Traceback: {type(exc).__name__}: {exc}")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return code, err.getvalue().strip(), time.perf_counter() - t0


def clean(code, err) -> bool:
    return code == 2 and "\n" not in err and "Traceback" not in err and err != ""


def main() -> int:
    import torch
    torch.set_num_threads(1)
    from tests import test_safety_checkpoint_data as T
    from tests.test_safety_bad_input import BAD_PLANS
    from tests.test_safety_env import TRAIN, _bad_env
    work = tempfile.mkdtemp(prefix="h45-probe-")
    user = os.path.join(work, "user")
    os.makedirs(user)
    with open(os.path.join(user, "notes.txt"), "w") as f:
        f.write("user data\n")
    table = {}

    def count(family, ok, why=""):
        tried, good, bad = table.get(family, (0, 0, []))
        table[family] = (tried + 1, good + bool(ok), bad + ([why] if not ok else []))

    saved = T._save(os.path.join(work, "saved", "root"), {})
    # payload
    for payload in ("module", "file-in-folder"):
        for trust in (False, True):
            case = os.path.join(work, f"p-{payload}-{trust}")
            os.makedirs(os.path.join(case, "root"))
            marker = os.path.join(case, "MARKER")
            spec = T._payload_module(marker) if payload == "module" else \
                T._payload_file(os.path.join(case, "root", "step_000000001"), marker)
            ck = T._save(os.path.join(case, "root"), {"generate": {"spec": spec, "sizes": {}, "context": 8}})
            code, err, _ = run(["generate", ck, "--prompt", "ab", "--tokens", "2"] +
                               (["--trust-recorded-spec"] if trust else []))
            count("payload", clean(code, err) and not os.path.exists(marker), f"{payload}/{trust}: {code} {err[:80]}")
            code, err, _ = run(["export", ck, "--out", os.path.join(case, "x")])
            count("payload", code == 0 and not os.path.exists(marker), f"export {payload}: {code} {err[:80]}")
    # metadata
    for i, case_fn in enumerate(T.CASES):
        for cmd in ("generate", "export", "resume"):
            case = os.path.join(work, f"m{i}-{case_fn.__name__}-{cmd}")
            os.makedirs(case)
            shutil.copytree(os.path.dirname(saved), os.path.join(case, "c"))
            ck = os.path.join(case, "c", os.path.basename(saved))
            file, _ = case_fn(ck)
            target = os.path.dirname(ck) if file == "latest" else ck
            argv = {"generate": ["generate", target, "--prompt", "ab", "--tokens", "2"],
                    "export": ["export", target, "--out", os.path.join(case, "x")],
                    "resume": ["train", "--resume", target, "--steps", "2", "--n-layer", "2", "--n-embd", "16",
                               "--n-head", "2", "--seq", "8", "--batch", "4", "--out", os.path.join(case, "o")]}[cmd]
            code, err, _ = run(argv)
            count("metadata", clean(code, err), f"{case_fn.__name__}/{cmd}: {code} {err[:100]}")
    # plan
    for plan in BAD_PLANS:
        code, err, _ = run(["train", "--plan", plan, "--steps", "1", "--out", os.path.join(work, "plan-out")])
        count("plan", clean(code, err), f"{plan!r}: {code} {err[:80]}")
    # env
    for name, value, _ in _bad_env(type("P", (), {"__truediv__": lambda s, o: __import__("pathlib").Path(work) / o})()):
        old = os.environ.get(name)
        os.environ[name] = value
        try:
            code, err, _ = run([*TRAIN, "--out", os.path.join(work, "env-out")])
        finally:
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old
        count("env", clean(code, err), f"{name}={value}: {code} {err[:80]}")
    lost = not os.path.exists(os.path.join(user, "notes.txt"))
    print("| family | tried | clean |\n|---|---|---|")
    for fam, (tried, good, bad) in table.items():
        print(f"| {fam} | {tried} | {good} |")
        for why in bad[:5]:
            print(f"|   not clean: {why} | | |")
    print(f"user files lost: {int(lost)}")
    shutil.rmtree(work, ignore_errors=True)
    return 0 if all(t == g for t, g, _ in table.values()) and not lost else 1


if __name__ == "__main__":
    sys.exit(main())
