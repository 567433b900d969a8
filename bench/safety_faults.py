"""Fault table: kill or stop one rank (or the launcher) and time until every process exited.

    python bench/safety_faults.py [--timeout 5] [--train]

Rows: tests/safety_fault_job.py (pp=2, tp=2, dp=2 on the wire, 8 ranks) with SIGKILL and
SIGSTOP of rank 0 and rank 5 and SIGTERM / SIGKILL of the launcher; with --train also the
real `threefold train --plan tp=2,pp=2,dp=2` with a rank killed or stopped from outside.
Prints a markdown table: fault, seconds from the fault until every process had exited,
the first line of the message, processes left.
"""
import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "safety_fault_job.py")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def children(pid: int) -> list[int]:
    """Rank processes of a launcher (multiprocessing spawn children), in start order."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if ppid == pid and b"spawn_main" in cmd:
            out.append(int(d))
    return sorted(out)


def wait_gone(pids, limit=60.0) -> float:
    start = time.monotonic()
    while any(alive(p) for p in pids) and time.monotonic() - start < limit:
        time.sleep(0.05)
    return time.monotonic() - start


def job_row(victim: int, sig: str, timeout: int):
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, THREEFOLD_TIMEOUT=str(timeout))
        proc = subprocess.Popen([sys.executable, JOB, d, str(victim), sig], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        pids = []
        while len(pids) < 8 and proc.poll() is None:
            time.sleep(0.1)
            pids = [int(open(os.path.join(d, f"rank{r}")).read()) for r in range(8)
                    if os.path.exists(os.path.join(d, f"rank{r}"))]
        if victim < 0:                      # the launcher itself gets the signal
            time.sleep(1.0)
            fault = time.time()
            proc.send_signal(getattr(signal, sig))
        _, err = proc.communicate(timeout=300)
        gone = time.time()
        if victim >= 0:
            fault = float(open(os.path.join(d, "fault")).read())
        wait_gone(pids, 30)
        gone = max(gone, time.time()) if any(alive(p) for p in pids) else gone
        left = [p for p in pids if alive(p)]
        lines = err.strip().splitlines()
        msg = lines[1].strip() if len(lines) > 1 else (lines[0] if lines else f"exit {proc.returncode}")
        if victim < 0 and sig == "SIGKILL":
            msg = "(the launcher cannot speak; its ranks end by PR_SET_PDEATHSIG)"
        who = f"rank {victim}" if victim >= 0 else "launcher"
        return f"{sig} {who} (job, pp=2 tp=2 dp=2)", gone - fault, msg, len(left)


def train_row(rank: int, sig: str, timeout: int):
    env = dict(os.environ, THREEFOLD_TIMEOUT=str(timeout))
    with tempfile.TemporaryDirectory() as d:
        proc = subprocess.Popen([sys.executable, "-m", "threefold", "train", "--plan", "tp=2,pp=2,dp=2,m=2",
                                 "--steps", "100000", "--json", "--out", os.path.join(d, "out")], cwd=ROOT,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        pids = []
        end = time.monotonic() + 240
        while len(pids) < 8 and time.monotonic() < end:
            time.sleep(0.5)
            pids = children(proc.pid)
        time.sleep(30)                       # let every rank compile and train a few steps
        fault = time.time()
        os.kill(pids[rank], getattr(signal, sig))
        _, err = proc.communicate(timeout=300)
        t = time.time() + wait_gone(pids, 30)
        left = [p for p in pids if alive(p)]
        lines = [line for line in err.strip().splitlines() if line.strip()]
        msg = next((line.strip() for line in lines if f"rank {rank}: rank {rank}" in line), lines[0] if lines else "")
        return f"{sig} rank {rank} (threefold train tp=2,pp=2,dp=2)", t - fault, msg, len(left)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=int, default=5)
    ap.add_argument("--train", action="store_true")
    ap.add_argument("--train-only", action="store_true")
    args = ap.parse_args()
    rows = []
    if not args.train_only:
        rows += [job_row(v, s, args.timeout) for s in ("SIGKILL", "SIGSTOP") for v in (0, 5)]
        rows += [job_row(-1, s, args.timeout) for s in ("SIGTERM", "SIGKILL")]
    if args.train or args.train_only:
        rows += [train_row(r, s, 10) for r, s in ((0, "SIGKILL"), (3, "SIGSTOP"))]
    print(f"THREEFOLD_TIMEOUT={args.timeout} s (train rows: 10 s); bound = timeout + 10 s\n")
    print("| fault | seconds until every process exited | message (first line naming the cause) | processes left |")
    print("|---|---|---|---|")
    for fault, seconds, msg, left in rows:
        print(f"| {fault} | {seconds:.1f} | {msg[:160].replace('|', '/')} | {left} |")


if __name__ == "__main__":
    main()
