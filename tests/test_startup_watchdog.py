"""moe_ep.runs.StartupWatchdog: a rank that hangs before the step loop is reported within the
bound, in one line naming every rank still starting and its phase, and the ranks still starting
exit instead of waiting in a start-up collective; a start-up that finishes in time costs nothing."""

from __future__ import annotations

import os
import time

import pytest

from dist_utils import RankError, run_ranks
from moe_ep.runs import StartupWatchdog


def _start(rank, world_size, stderr_dir, hang_s):
    import torch.distributed as dist

    # The watchdog's line goes to this rank's stderr: a file the test reads.
    os.dup2(os.open(os.path.join(stderr_dir, f"rank{rank}"), os.O_WRONLY | os.O_CREAT), 2)
    with StartupWatchdog(timeout=3) as startup:
        if rank == 1:
            startup.phase("tokenizing the data")
            time.sleep(hang_s)
        else:
            startup.phase("waiting for the token cache")
        dist.barrier()
        startup.reached()
    return "reached the step loop"


@pytest.mark.slow
def test_a_rank_hanging_before_the_step_loop_is_reported_once_and_the_ranks_exit(tmp_path):
    # Without the watchdog rank 1 would wake after 30 s and both would reach the step loop.
    with pytest.raises(RankError, match=r"died without reporting \(exit codes \[1, 1\]\)"):
        run_ranks(_start, 2, str(tmp_path), 30, timeout=60)
    lines = [line for p in sorted(tmp_path.iterdir()) for line in p.read_text().splitlines() if "error" in line]
    assert len(lines) == 1, lines
    assert lines[0].endswith(
        "start-up did not reach the step loop within 3 s: rank 0 at 'waiting for the token cache', rank 1 at "
        "'tokenizing the data'; a rank hung, was stopped or is still working (raise the start-up timeout if it is); "
        "every rank still starting exits"), lines
    # A start-up within the bound: nothing said, the step loop reached.
    assert run_ranks(_start, 2, str(tmp_path), 0, timeout=60) == ["reached the step loop"] * 2


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), True, "60"])
def test_the_timeout_must_be_a_positive_number(timeout):
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
        StartupWatchdog(timeout)
