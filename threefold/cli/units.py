"""Numbers for people: SI-prefixed counts and binary-prefixed bytes (inspect, its HTML page,
the fallback summary)."""
from __future__ import annotations


def _scaled(x: float, units) -> str:
    """x in the largest unit that keeps its three significant digits below 1000: never
    '1.02e+03 KiB' (a value that rounds to 1000 moves up a unit)."""
    for i, (unit, scale) in enumerate(units):
        v = x / scale
        if abs(v) >= 1 or i == len(units) - 1:
            if abs(float(f"{v:.3g}")) >= 1000 and i > 0:
                v, unit = x / units[i - 1][1], units[i - 1][0]
            text = f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"   # (only the largest unit goes past 999)
            return f"{text}{unit}"
    return str(x)


def human(x: float) -> str:
    """1234567 -> '1.23M' (SI prefixes; FLOPs and parameter counts)."""
    if abs(x) < 999.5:
        return str(int(x))
    return _scaled(x, (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)))


def human_bytes(x: float) -> str:
    """1047000 -> '1 MiB', 5242880 -> '5 MiB', 100 -> '100 B' (binary prefixes)."""
    if abs(x) < 999.5:
        return f"{int(x)} B"
    return _scaled(x, ((" TiB", 2**40), (" GiB", 2**30), (" MiB", 2**20), (" KiB", 2**10)))
