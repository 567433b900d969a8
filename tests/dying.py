"""Make a rank die (SIGKILL) in the middle of a step, for the failure tests."""
import os
import signal
import time


def kill_in_forward(pm, call: int = 3) -> None:
    """This process kills itself at the `call`-th chunk forward from now (of any of its
    chunks): with m >= call, during the forward of microbatch call-1 of the next step."""
    calls = {"n": 0}
    for mod in pm.engine.modules.values():
        def dying_forward(*args, _orig=mod.forward):
            calls["n"] += 1
            if calls["n"] == call:
                os.kill(os.getpid(), signal.SIGKILL)
            return _orig(*args)
        mod.forward = dying_forward


def step_timing_failure(pm, w) -> str:
    """One step; a failure re-raised with how long after the step began it came
    ("... [after 0.1 s]", which the tests bound)."""
    start = time.monotonic()
    try:
        pm.step(*w["inputs"], target=w["target"])
    except Exception as exc:
        raise RuntimeError(f"{exc} [after {time.monotonic() - start:.1f} s]") from None
    return "finished"
