"""Golden generated text: kernels.py for one region of each kind.

After an intended change to the generator, rewrite the files with
THREEFOLD_UPDATE_GOLDEN=1 python -m pytest tests/test_fusion_golden.py, and read the diff.
"""
from __future__ import annotations

import os
import pathlib

import pytest

from tests.test_fusion_models import CASES, region_for
from threefold.codegen.triton import kernels_source

GOLDEN = pathlib.Path(__file__).parent / "golden" / "fusion"


@pytest.mark.parametrize("case", sorted(CASES))
def test_generated_kernel_text(case):
    text = kernels_source([region_for(case)])
    path = GOLDEN / f"{case}.py.txt"
    if os.environ.get("THREEFOLD_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"no golden file {path}: run with THREEFOLD_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{case}: generated text differs from {path}"


def test_generated_source_is_valid_python_and_names_its_nodes():
    regions = [region_for(case) for case in sorted(CASES) if case != "hf_rms_norm"]
    text = kernels_source(regions)
    compile(text, "kernels.py", "exec")
    for r in regions:
        assert f"def {r.kernel_name}(" in text
        assert f"# source nodes: {', '.join(r.source_nodes)}" in text
