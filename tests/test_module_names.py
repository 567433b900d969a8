"""No module of ours can shadow an installed package, and the suite leaves sys.path alone.

A script run as `python bench/x.py` has bench/ first on sys.path, and the test session has the
repository root there: every name below is importable by its bare name in one of those, so an
installed distribution (or the standard library) with the same top-level name would be hidden
by ours. transformers imports the optional `kernels` package whenever one can be found; a
bench/kernels.py of ours once answered, and 45 tests failed.
"""
import os
import sys
from importlib import metadata

from tests import sys_path_guard

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT_FOLDERS = ("bench", "examples", "tools", "tests")


def our_top_level_names() -> dict[str, str]:
    """name -> where it is ours: the packages at the root, and every script in SCRIPT_FOLDERS."""
    names = {n: n + "/" for n in os.listdir(ROOT)
             if os.path.isfile(os.path.join(ROOT, n, "__init__.py"))}
    for folder in SCRIPT_FOLDERS:
        for f in os.listdir(os.path.join(ROOT, folder)):
            if f.endswith(".py") and f != "__init__.py":
                names.setdefault(f[:-3], f"{folder}/{f}")
    return names


def test_no_module_of_ours_is_named_like_an_installed_package_or_the_stdlib():
    installed = {name for name, dists in metadata.packages_distributions().items()
                 if "threefold" not in dists}
    ours = our_top_level_names()
    assert {"threefold", "tests", "examples", "fused_kernels"} <= set(ours)
    clashes = {where: name for name, where in ours.items()
               if name in installed or name in sys.stdlib_module_names}
    assert not clashes, f"rename these (a package of that name exists): {clashes}"


def test_collecting_the_suite_leaves_sys_path_as_it_found_it():
    # the guard records sys.path when it is imported (pytest's own set-up done) and again when
    # collection finishes; every test module has been imported in between
    assert sys_path_guard.SYS_PATH_AFTER_COLLECTION, "pytest_collection_finish did not run"
    after = sys_path_guard.SYS_PATH_AFTER_COLLECTION[-1]
    assert sys_path_guard.changes(sys_path_guard.SYS_PATH_AT_START, after) == ([], [])


def test_a_test_that_changes_sys_path_is_failed_and_the_path_put_back(pytester):
    pytester.makepyfile(test_bad="""
import os, sys
def test_leaks():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
def test_after():
    assert os.path.join(ROOT, "bench") not in sys.path
""".replace("ROOT", repr(ROOT)))
    result = pytester.runpytest_subprocess("-p", "tests.sys_path_guard", "-q", "-o", "addopts=",
                                           "-o", f"pythonpath={ROOT}")
    result.assert_outcomes(passed=2, errors=1)
    assert f"the test changed sys.path (added [{os.path.join(ROOT, 'bench')!r}]" in result.stdout.str()
