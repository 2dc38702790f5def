"""``MoEMonitor`` under 4 spawned gloo processes: the reduced token counts equal the sum of the
per-rank counts, each window's statistics take exactly one all-reduce, and state pickled into the
workers (a monitor caught mid-window in the parent) is not counted again.

One spawn runs both checks: starting 4 processes that import Lightning costs more than the checks.
"""

from __future__ import annotations

import pytest
from harness import spawn
from monitor_workers import dirty_monitor, run_reduction

pytestmark = pytest.mark.distributed


def test_reduced_counts_equal_sum_of_ranks_under_spawn():
    spawn(run_reduction, 4, dirty_monitor())
