"""A run resumed from a checkpoint sees the batches the uninterrupted run saw: the sampler's
position travels in the checkpoint, and the global batch does not depend on the plan
(end to end, `threefold train --data`: saved under dp=2, resumed in one process)."""
import json
import os
import subprocess
import sys

import pytest

from tests.parity import ROOT, max_rel_diff


def _train(tmp_path, name, *flags):
    out = tmp_path / name
    proc = subprocess.run([sys.executable, "-m", "threefold", "train", "--data", str(tmp_path / "d.txt"),
                           "--batch", "4", "--seq", "16", "--n-layer", "2", "--n-embd", "32", "--steps", "6",
                           "--eval-every", "0", "--sample-tokens", "0", "--json", "--out", str(out), *flags],
                          cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(out / "losses.json") as f:
        return json.load(f)["losses"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resumed_run_sees_the_same_batches(tmp_path):
    (tmp_path / "d.txt").write_text("".join(f"line {i}: {i * 7919 % 1000} bottles\n" for i in range(400)))
    ckpt = tmp_path / "ckpt"
    whole = _train(tmp_path, "whole", "--plan", "dp=2", "--save-every", "3", "--ckpt-dir", str(ckpt))
    # resumed in one process: the same global batches, so the same losses (parity)
    resumed = _train(tmp_path, "resumed", "--plan", "tp=1", "--resume", str(ckpt / "step_000000003"))
    assert len(whole) == len(resumed) == 6
    assert max_rel_diff(whole[3:], resumed[3:]) < 1e-5, (whole, resumed)
    assert max_rel_diff(whole[3:], whole[:3]) > 1e-3      # later batches are other batches
