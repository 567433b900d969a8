"""CI installs what the README's test command installs: the test extra at the versions last
tested (constraints/ci.txt), so a registry release cannot turn CI red overnight, and every
package that install pulls in is pinned there."""
import os
import re
from importlib import metadata

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTALL = "python -m pip install torch==2.13.0 -e '.[test]' -c constraints/ci.txt"


def _read(rel: str) -> str:
    with open(os.path.join(ROOT, rel)) as f:
        return f.read()


def pinned() -> dict[str, str]:
    pins = {}
    for line in _read("constraints/ci.txt").splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints/ci.txt: {line!r} is not name==version"
            pins[canonicalize_name(name)] = version
    return pins


def test_readme_and_ci_run_the_same_install_and_test_command():
    ci = _read(".ci/run")
    assert INSTALL.replace("pip install", "pip install -q") in ci
    assert "\npython -m pytest -q\n" in ci
    assert f"{INSTALL} && python -m pytest -q" in _read("README.md")


def _closure(dist: str, extras: tuple[str, ...]) -> set[str]:
    """Every installed distribution `dist[extras]` requires, transitively."""
    seen, todo = set(), [(dist, extras)]
    while todo:
        name, extra = todo.pop()
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue          # an optional dependency's optional dependency, not installed
        for text in requires:
            req = Requirement(text)
            env_extras = extra or ("",)
            if req.marker and not any(req.marker.evaluate({"extra": e}) for e in env_extras):
                continue
            key = canonicalize_name(req.name)
            if key not in seen:
                seen.add(key)
                todo.append((req.name, tuple(req.extras)))
    return seen


def test_every_package_the_test_install_pulls_in_is_pinned():
    try:
        metadata.version("threefold")
    except metadata.PackageNotFoundError:
        pytest.fail("threefold is not installed: run the README's test command")
    installed = {canonicalize_name(d.metadata["Name"]) for d in metadata.distributions()}
    needed = _closure("threefold", ("test",)) & installed
    missing = sorted(needed - set(pinned()))
    assert not missing, (f"constraints/ci.txt pins none of {missing}: add the tested versions "
                         "(see the file's header)")


def test_pins_are_exact_versions():
    for name, version in pinned().items():
        assert re.fullmatch(r"[0-9][0-9A-Za-z.]*", version), (name, version)
