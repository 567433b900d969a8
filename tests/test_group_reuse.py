"""Process groups are made once per process (runtime/comm.py `_group`): a second parallelize
in the same job reuses the first one's groups instead of adding its own, each of which holds
the backend's threads (the zoo matrix's 8 ranks reached 1,059 threads each, load 1,700)."""
import sys

import pytest

from threefold.runtime.launch import launch


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_building_the_groups_again_reuses_them():
    from tests.group_jobs import groups_of_three_builds
    for after_first, after_third, same, axes in launch(groups_of_three_builds, 4, "tp=2,pp=2", timeout=150):
        assert same and {"tp", "pp"} <= set(axes), axes
        assert after_third == after_first, (after_first, after_third)
