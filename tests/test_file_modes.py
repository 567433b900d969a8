"""What threefold creates has the modes a plain open()/mkdir gives under the user's umask
(0666/0777 & ~umask), not mkstemp's 0600 and mkdtemp's 0700: SVGs, exports, artifacts,
checkpoint directories."""
from __future__ import annotations

import os
import stat

import pytest
import torch

import threefold
from threefold.cli.main import main


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_svg_export_and_checkpoint_follow_the_umask(tmp_path, umask_022, capsys):
    svg = tmp_path / "s.svg"
    assert main(["schedule", "--pp", "2", "-m", "4", "--svg", str(svg)]) == 0
    assert _mode(svg) == 0o644                                     # was 0600
    torch.manual_seed(0)
    model, x = torch.nn.Sequential(torch.nn.Linear(4, 4)), torch.randn(2, 4)
    pm = threefold.parallelize(model, "", (x,), torch.nn.functional.mse_loss, target=torch.zeros(2, 4))
    step_dir = threefold.save(pm, None, str(tmp_path / "ckpt"), step=1)
    assert _mode(step_dir) == 0o755                                # was 0700
    assert all(_mode(os.path.join(step_dir, f)) == 0o644 for f in os.listdir(step_dir))
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "exported")]) == 0
    assert _mode(tmp_path / "exported") == 0o755
    assert {_mode(p) for p in (tmp_path / "exported").iterdir()} == {0o644}


def test_a_stricter_umask_is_kept(tmp_path):
    from threefold.outdir import write_file_atomically
    old = os.umask(0o077)
    try:
        write_file_atomically(str(tmp_path / "f.txt"), "x")
    finally:
        os.umask(old)
    assert _mode(tmp_path / "f.txt") == 0o600
