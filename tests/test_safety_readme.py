"""The README's "Use it" program runs as written (copied out of README.md, run with python)."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_snippet() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    section = text.split("## Use it", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_snippet_is_a_complete_program():
    code = readme_snippet()
    compile(code, "README.md", "exec")
    assert 'if __name__ == "__main__":' in code      # ranks are spawned: they import the file


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_readme_snippet_runs_as_written(tmp_path):
    (tmp_path / "train_tiny.py").write_text(readme_snippet())
    (tmp_path / "tmp").mkdir()
    env = dict(os.environ, PYTHONPATH=ROOT, TMPDIR=str(tmp_path / "tmp"))
    out = subprocess.run([sys.executable, "train_tiny.py"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"final loss \d+\.\d+ on every rank: True", out.stdout), out.stdout
    # pm(x) is a tensor on the last stage (ranks 2, 3 of tp=2,pp=2): `logits.shape` works
    assert "logits per rank: [None, None, (8, 16, 64), (8, 16, 64)]" in out.stdout, out.stdout
    assert sorted(os.listdir(tmp_path)) == ["tmp", "train_tiny.py"]      # no files left behind
    assert not [n for n in os.listdir(tmp_path / "tmp") if n.startswith("threefold")]
