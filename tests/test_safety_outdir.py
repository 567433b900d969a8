"""Output directories never lose a user's data; --json is always JSON; check's NaN rule."""
import json
import math
import os

import pytest

from threefold.cli.check_cmd import _rel_diff
from threefold.cli.jsonout import dumps
from threefold.errors import PlanError
from threefold.outdir import MARKER, check_out_dir, write_out_dir


def _fill(files):
    def fill(tmp):
        for name, text in files.items():
            os.makedirs(os.path.dirname(os.path.join(tmp, name)) or tmp, exist_ok=True)
            with open(os.path.join(tmp, name), "w") as f:
                f.write(text)
    return fill


def test_a_new_directory_is_written_with_a_marker(tmp_path):
    out = tmp_path / "a" / "b"
    write_out_dir(str(out), _fill({"x.txt": "1", "sub/y.txt": "2"}), kind="test")
    assert sorted(os.listdir(out)) == [MARKER, "sub", "x.txt"]
    assert sorted(json.loads((out / MARKER).read_text())["files"]) == ["sub/y.txt", "x.txt"]
    assert not [n for n in os.listdir(tmp_path / "a") if n != "b"]         # no temporary left


def test_our_directory_is_replaced_but_a_foreign_one_is_refused(tmp_path):
    out = tmp_path / "out"
    write_out_dir(str(out), _fill({"x.txt": "1"}), kind="test")
    write_out_dir(str(out), _fill({"z.txt": "2"}), kind="test")              # ours: replaced
    assert sorted(os.listdir(out)) == [MARKER, "z.txt"]
    (out / "mine.txt").write_text("user")                                   # now not only ours
    with pytest.raises(PlanError, match="did not write"):
        write_out_dir(str(out), _fill({"q.txt": "3"}), kind="test")
    assert (out / "mine.txt").read_text() == "user"


def test_force_moves_a_foreign_directory_aside_and_deletes_nothing(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("user")
    moved = write_out_dir(str(out), _fill({"x.txt": "1"}), kind="test", force=True)
    assert moved and open(os.path.join(moved, "notes.txt")).read() == "user"
    assert sorted(os.listdir(out)) == [MARKER, "x.txt"]


def test_a_failing_fill_leaves_the_old_directory_and_no_temporary(tmp_path):
    out = tmp_path / "out"
    write_out_dir(str(out), _fill({"x.txt": "old"}), kind="test")

    def boom(tmp):
        raise RuntimeError("disk full")
    with pytest.raises(RuntimeError):
        write_out_dir(str(out), boom, kind="test")
    assert (out / "x.txt").read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["out"]


@pytest.mark.parametrize("make", ["file", "cwd", "parent_of_cwd", "symlink"])
def test_paths_that_cannot_be_replaced_are_refused_up_front(tmp_path, monkeypatch, make):
    target = tmp_path / "t"
    if make == "file":
        target.write_text("user")
    elif make in ("cwd", "parent_of_cwd"):
        (target / "inner").mkdir(parents=True)
        monkeypatch.chdir(target if make == "cwd" else target / "inner")
    else:
        (tmp_path / "real").mkdir()
        target.symlink_to(tmp_path / "real")
    with pytest.raises(PlanError):
        check_out_dir(str(target))


def test_json_output_is_valid_json_with_null_for_non_finite():
    text = dumps({"a": float("nan"), "b": [1.0, float("inf")], "c": (float("-inf"),)})
    assert json.loads(text) == {"a": None, "b": [1.0, None], "c": [None]}


def test_check_never_calls_two_nans_equal():
    assert _rel_diff(float("nan"), float("nan")) == math.inf
    assert _rel_diff(1.0, 1.0) == 0.0
