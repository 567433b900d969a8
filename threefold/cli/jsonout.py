"""`--json` output that is always valid JSON: non-finite floats (NaN, inf) become null."""
from __future__ import annotations

import json
import math


def finite_or_none(value):
    """The value with every non-finite float (at any depth) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def dumps(value, **kwargs) -> str:
    return json.dumps(finite_or_none(value), allow_nan=False, **kwargs)
