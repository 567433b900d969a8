"""Peak resident memory of `threefold train --data FILE` for text files of several sizes.

    python bench/data_rss.py 1 512          # sizes in MB; prints one JSON line per size

Each run trains the embedded GPT for a few steps on a text file of that size (the embedded
corpus repeated), sampling every process of the job (launcher and ranks) from /proc every
0.1 s; it reports the largest process's peak RSS and the peak of their sum. The token cache
goes to a temporary THREEFOLD_CACHE_DIR, removed afterwards.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def make_text(path: str, mb: int) -> None:
    with open(os.path.join(ROOT, "threefold", "data", "python_reference.txt"), encoding="utf-8") as f:
        corpus = f.read()
    target = mb << 20
    with open(path, "w", encoding="utf-8") as f:
        written = 0
        while written < target:
            piece = corpus[: target - written]
            f.write(piece)
            written += len(piece.encode("utf-8"))


def measure(mb: int, python: str = sys.executable, root: str = ROOT) -> dict:
    work = tempfile.mkdtemp(prefix="data_rss-")
    try:
        data = os.path.join(work, "corpus.txt")
        make_text(data, mb)
        env = dict(os.environ, PYTHONPATH=root, THREEFOLD_CACHE_DIR=os.path.join(work, "cache"))
        cmd = [python, "-m", "threefold", "train", "--data", data, "--steps", "3", "--plan", "pp=2,m=2",
               "--out", os.path.join(work, "out"), "--sample-tokens", "0", "--eval-every", "0", "--json"]
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        peak_one, peak_sum, peaks = 0.0, 0.0, {}
        while proc.poll() is None:
            rss = {p: _rss_mb(p) for p in _tree(proc.pid)}
            for p, r in rss.items():
                peaks[p] = max(peaks.get(p, 0.0), r)
            peak_one, peak_sum = max(peak_one, max(rss.values(), default=0)), max(peak_sum, sum(rss.values()))
            time.sleep(0.1)
        out, err = proc.communicate()
        top = sorted(peaks.values(), reverse=True)[:3]
        return {"text_mb": mb, "exit": proc.returncode, "seconds": round(time.monotonic() - start, 1),
                "peak_rss_mb_largest_process": round(peak_one), "peak_rss_mb_sum": round(peak_sum),
                "peak_rss_mb_top3": [round(x) for x in top],
                "error": err.decode()[-300:] if proc.returncode else ""}
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    python = os.environ.get("BENCH_PYTHON", sys.executable)
    root = os.environ.get("BENCH_ROOT", ROOT)
    for size in (int(a) for a in sys.argv[1:] or ["1", "512"]):
        print(json.dumps(measure(size, python, root)), flush=True)
