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


@pytest.mark.parametrize("timeout", [1e10, float("inf")])
def test_a_timeout_no_thread_can_wait_is_refused(timeout):
    # Past threading.TIMEOUT_MAX the watch's thread died at its start: nothing was watched.
    with pytest.raises(ValueError, match=r"timeout must be a positive number of seconds up to 3\.1536e\+07"):
        StartupWatchdog(timeout)


WATCH_WITHOUT_A_STORE = """
import sys, time
import torch.distributed as dist
from moe_ep.runs import StartupWatchdog

class GoneStore:
    # A tcp:// rendezvous's store lives in rank 0's process: once rank 0 exited, reads fail.
    def set(self, key, value):
        pass

    def check(self, keys):
        raise RuntimeError("Failed to recv, got 0 bytes. Connection was likely closed.")

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
with StartupWatchdog(0.5, store=GoneStore()) as startup:
    startup.phase("tokenizing the data")
    time.sleep(60)
"""


def test_a_rank_whose_store_is_gone_still_says_its_phase_and_exits(tmp_path):
    """The store of a tcp:// rendezvous without torchrun's agent is rank 0's: rank 0's watch exits
    first and takes it along. Another rank's watch then cannot read it; before, its thread died
    with a traceback and the hung rank ran on forever."""
    import subprocess
    import sys

    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", WATCH_WITHOUT_A_STORE, str(tmp_path / "rendezvous")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and time.monotonic() - started < 30, done.stderr
    assert ("error (rank 0): start-up did not reach the step loop within 0.5 s: this rank at 'tokenizing the data' "
            "(the other ranks' phases are unknown: the rendezvous store did not answer: RuntimeError: Failed to recv"
            in done.stderr), done.stderr
    assert "Traceback" not in done.stderr, done.stderr
