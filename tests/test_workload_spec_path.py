"""The SPEC loader puts a file's folder on sys.path while it imports, and takes away exactly
that entry afterwards: a file that inserts its own folder (an equal string) keeps it."""
from __future__ import annotations

import sys

import pytest

from threefold.errors import PlanError
from threefold.workload import resolve_spec


def _write(folder, name: str, body: str) -> str:
    path = folder / name
    path.write_text(body)
    return str(path)


def _loaded(monkeypatch, path: str):
    monkeypatch.setattr(sys, "path", list(sys.path))      # this test's changes stay here
    key = "_threefold_spec_" + path.rsplit("/", 1)[-1][:-3]
    monkeypatch.delitem(sys.modules, key, raising=False)
    factory, _ = resolve_spec(f"{path}:make")
    monkeypatch.delitem(sys.modules, key, raising=False)
    return factory


def test_a_file_that_inserts_its_project_folder_keeps_it(tmp_path, monkeypatch):
    """specs/x.py putting its project root first (to import the project's package) keeps it."""
    (tmp_path / "specs").mkdir()
    path = _write(tmp_path / "specs", "spec_root_path.py",
                  "import os, sys\n"
                  "sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))\n"
                  "def make():\n    return None\n")
    before = list(sys.path)
    _loaded(monkeypatch, path)
    assert sys.path == [str(tmp_path)] + before   # the file's entry kept, the loader's removed


def test_a_file_that_inserts_its_own_folder_keeps_one_entry(tmp_path, monkeypatch):
    path = _write(tmp_path, "spec_self_path.py",
                  "import os, sys\n"
                  "sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))\n"
                  "def make():\n    return None\n")
    before = list(sys.path)
    _loaded(monkeypatch, path)
    assert sys.path == [str(tmp_path)] + before


def test_the_loader_leaves_sys_path_as_it_found_it(tmp_path, monkeypatch):
    _write(tmp_path, "spec_sibling.py", "VALUE = 3\n")
    path = _write(tmp_path, "spec_plain.py", "import spec_sibling\ndef make():\n    return spec_sibling.VALUE\n")
    monkeypatch.delitem(sys.modules, "spec_sibling", raising=False)
    before = list(sys.path)
    factory = _loaded(monkeypatch, path)
    monkeypatch.delitem(sys.modules, "spec_sibling", raising=False)
    assert factory() == 3                       # the sibling import worked
    assert sys.path == before


def test_a_file_that_removes_the_loaders_entry_is_not_an_error(tmp_path, monkeypatch):
    path = _write(tmp_path, "spec_drop_path.py",
                  "import sys\nsys.path.pop(0)\nsys.path.insert(0, '/elsewhere')\ndef make():\n    return 1\n")
    before = list(sys.path)
    _loaded(monkeypatch, path)
    assert sys.path == ["/elsewhere"] + before  # nothing else removed in its place


def test_a_failed_import_removes_the_entry_too(tmp_path, monkeypatch):
    path = _write(tmp_path, "spec_broken.py", "raise ValueError('nope')\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = list(sys.path)
    with pytest.raises(PlanError, match="failed to import"):
        resolve_spec(f"{path}:make")
    assert sys.path == before
