"""A module whose import blocks (as one opening a FIFO at import would) when the env says so:
the start-up watchdog's test unpickles a function from it in each rank."""
import os
import time

if os.environ.get("H45_HANG_AT_IMPORT") == "1":
    while True:
        time.sleep(1)


def value(x):
    return x
