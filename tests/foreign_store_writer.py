"""A foreign local process that attacks a job's rendezvous store (tests/test_safety_files.py).

Usage: python foreign_store_writer.py PORT SECONDS. It connects to the store like any local
process can, prints "ready" once it has written its first keys, then for SECONDS keeps
overwriting every key it can see or guess with garbage: the keys an unprotected job uses
(c10d/gloo rank addresses, threefold's failure key), every key `list_keys` shows outside
the job's namespace, and counters it bumps. It never learns the job's secret.
"""
import sys
import time
from datetime import timedelta

import torch.distributed as dist

GUESSED = ["threefold/failure"] + [f"{g}//cpu//0/{r}" for g in range(6) for r in range(4)] + \
          [f"{g}//{s}//cpu//0/{r}" for g in range(3) for s in range(6) for r in range(4)]


def main() -> None:
    port, seconds = int(sys.argv[1]), float(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, 1, False, timeout=timedelta(seconds=10), wait_for_workers=False)
    end = time.monotonic() + seconds
    first = True
    while time.monotonic() < end:
        keys = set(GUESSED)
        try:
            keys |= {k for k in store.list_keys() if not k.startswith("tfjob-")}
        except Exception:
            pass
        for k in keys:
            try:
                store.set(k, b"\x00forged by a foreign process")
            except Exception:
                pass
        try:
            store.add("init/", 1)
        except Exception:
            pass
        if first:
            print("ready", flush=True)
            first = False
        time.sleep(0.002)


if __name__ == "__main__":
    main()
