"""Fault injection on launched multi-process runs (the longer cases; CI runs this module with the
rest of the suite): a second job in a running job's folder, a rank killed or stopped mid-run,
Ctrl-C inside a save, a full disk on one rank, and a checkpoint damaged in one rank's shard.

Every case asserts its outcome: a clear error naming what, said once (every rank agrees), within
a bounded time; nothing deleted; the last good checkpoint intact; and where the run is resumed,
the losses of the undisturbed run bit for bit. The undisturbed run is ``held_run``, which a
second job tries to take while it is held inside its step-2 save."""

from __future__ import annotations

import io
import signal
import sys
import time
from contextlib import redirect_stderr
from pathlib import Path

import pytest

from example_runs import (
    COMMON,
    LAYOUT,
    STEPS,
    copy_run,
    flip_byte,
    kill_launch,
    launch,
    losses,
    paused_files,
    rank_processes,
    run,
    snapshot,
    torchrun_cmd,
    train_in_process,
    wait_until,
)

from moe_ep.runs import checkpoint as ckpt  # noqa: E402
from moe_ep.runs import integrity, ownership  # noqa: E402

# Launches the example and injects faults into it: not in the quick subset (bash scripts/test.sh --quick).
pytestmark = pytest.mark.slow

PAUSE = ckpt.PAUSE_HOOK


def log_of(proc_log: Path) -> str:
    return proc_log.read_text()


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error")]


def reached_step(out: Path, step: int):
    return lambda: (out / "metrics.jsonl").exists() and max(losses(out), default=0) >= step


def seconds_to_end(fault, process) -> float:
    """Inject ``fault`` (a callable), then wait for ``process`` (a Popen or psutil.Process) to end:
    the seconds in between."""
    fault()
    start = time.monotonic()
    process.wait(timeout=120)
    return time.monotonic() - start


@pytest.fixture(scope="module")
def held_run(tmp_path_factory):
    """A 2-rank run held inside its step-2 save (moe_ep.runs.checkpoint's pause hook) while a second job,
    with --overwrite, tries its folder; then let go to finish undisturbed. Returns (its folder,
    its log, the second job's exit status, stderr and seconds, the first job's rank-0 pid, whether
    the folder was untouched by the second job)."""
    root = tmp_path_factory.mktemp("held")
    out = root / "run"
    proc = launch(torchrun_cmd(out), root / "run.log", **{PAUSE: "2"})
    try:
        paused = paused_files(out / "checkpoints" / ".tmp-step_00000002", 2)
        wait_until(lambda: all(p.exists() for p in paused), proc, "the run did not reach its step-2 save")
        holder = rank_processes(proc)[0].pid
        before = snapshot(out)
        stderr = io.StringIO()
        start = time.monotonic()
        with redirect_stderr(stderr):
            code = train_in_process([*COMMON, "--overwrite", "--output-dir", str(out)])
        seconds = time.monotonic() - start
        untouched = snapshot(out) == before
        for p in paused:
            p.unlink()
        assert proc.wait(timeout=240) == 0, log_of(root / "run.log")[-3000:]
    finally:
        kill_launch(proc)
    return out, log_of(root / "run.log"), code, stderr.getvalue(), seconds, holder, untouched


def test_a_second_job_in_a_running_jobs_folder_stops_before_any_work(held_run):
    out, log, code, err, seconds, holder, untouched = held_run
    assert code == 2
    assert err.startswith(f"error: --output-dir {out} is in use by another job (pid {holder} on host "), err
    assert "--overwrite does not override this" in err
    assert untouched and seconds < 60
    # The first job went on as if alone: all its steps, every checkpoint intact.
    assert sorted(losses(out)) == list(range(1, STEPS + 1))
    for step in ckpt.step_folders(out / "checkpoints"):
        assert integrity.verify(step) == [], step
    assert "warning" not in log


def test_rank_killed_mid_run_stops_the_job_and_resumes_bit_for_bit(held_run, tmp_path):
    """kill -9 of rank 0, the holder of the folder's lock, after step 3: the launch ends within a
    bounded time; the same command takes the folder over (the lock died with its holder) and
    resumes onto the undisturbed losses."""
    out = tmp_path / "run"
    proc = launch(torchrun_cmd(out), tmp_path / "killed.log")
    try:
        wait_until(reached_step(out, 3), proc, "the run did not reach step 3")
        victim = rank_processes(proc)[0]
        ended_after = seconds_to_end(victim.kill, proc)
    finally:
        kill_launch(proc)
    assert proc.returncode != 0 and ended_after < 60, ended_after
    assert f"Signal 9 (SIGKILL) received by PID {victim.pid}" in log_of(tmp_path / "killed.log")  # the launcher's
    log = run(torchrun_cmd(out))
    assert f"was held by a job that ended without letting go of it (pid {victim.pid} on host" in log
    assert "resumed from" in log
    assert losses(out) == losses(held_run[0])  # exact, every step


def test_stopped_rank_is_reported_within_the_step_timeout(tmp_path):
    """SIGSTOP of rank 1 mid-run, --step-timeout 8: rank 0 stops on its own within the bound
    with one line saying which step did not finish, instead of waiting forever."""
    out = tmp_path / "run"
    proc = launch(torchrun_cmd(out, "--step-timeout", "8", "--steps", "40", "--checkpoint-every", "0"),
                  tmp_path / "stopped.log")
    try:
        wait_until(reached_step(out, 2), proc, "the run did not reach step 2")
        ranks = rank_processes(proc)
        stopped_after = seconds_to_end(lambda: ranks[1].send_signal(signal.SIGSTOP), ranks[0])
    finally:
        kill_launch(proc)
    lines = error_lines(log_of(tmp_path / "stopped.log"))
    assert len(lines) == 1 and lines[0].startswith("error (rank 0): step "), lines
    assert "did not finish within --step-timeout 8 s (a rank hung, was stopped or is swapping)" in lines[0]
    assert 8 <= stopped_after < 8 + 30, stopped_after


def test_ctrl_c_inside_a_save_leaves_no_partial_checkpoint_and_lets_go_of_the_folder(held_run, tmp_path):
    """SIGINT to the launcher (a terminal's Ctrl-C) while the ranks are inside the step-4 save:
    the launch ends within a bounded time, the half-written checkpoint is only a .tmp- folder,
    the folder's lock is free, and the same command resumes onto the undisturbed losses."""
    out = tmp_path / "run"
    proc = launch(torchrun_cmd(out), tmp_path / "interrupted.log", **{PAUSE: "4"})
    try:
        partial = out / "checkpoints" / ".tmp-step_00000004"
        wait_until(lambda: all(p.exists() for p in paused_files(partial, 2)), proc,
                   "the run did not reach its step-4 save")
        ended_after = seconds_to_end(lambda: proc.send_signal(signal.SIGINT), proc)
    finally:
        kill_launch(proc)
    assert proc.returncode != 0 and ended_after < 60, ended_after
    assert [p.name for p in ckpt.step_folders(out / "checkpoints")] == ["step_00000002"]
    assert log_of(tmp_path / "interrupted.log").count("interrupted: the last complete checkpoint is kept") == 1
    lock = ownership.OutputLock(out)
    lock.acquire()
    lock.release()
    log = run(torchrun_cmd(out))
    assert f"resumed from {out / 'checkpoints' / 'step_00000002'} at step 2" in log
    assert losses(out) == losses(held_run[0])


def test_full_disk_on_one_rank_stops_every_rank_with_one_line(tmp_path):
    """Rank 1's shard of the step-4 save hits a full disk (moe_ep.runs.checkpoint's hook: a link to
    /dev/full): DCP's failure reaches every rank, rank 0 says it once, naming the folder, the
    rank and the cause; step 2 stays intact."""
    out = tmp_path / "run"
    proc = launch(torchrun_cmd(out), tmp_path / "full.log", **{ckpt.DISK_FULL_HOOK: "4:1"})
    try:
        assert proc.wait(timeout=240) != 0
    finally:
        kill_launch(proc)
    step2 = out / "checkpoints" / "step_00000002"
    lines = error_lines(log_of(tmp_path / "full.log"))
    assert lines == [f"error: cannot write the checkpoint {out / 'checkpoints' / '.tmp-step_00000004'}: rank 1: No "
                     f"space left on device; {step2} is intact"], lines
    assert integrity.verify(step2) == [] and ckpt.step_folders(out / "checkpoints") == [step2]


def test_one_ranks_damaged_shard_is_found_by_every_rank(held_run, tmp_path):
    """A flipped byte in rank 1's shard of the last checkpoint of a 2-rank run: under --resume
    auto every rank agrees to skip it (one warning) and the run resumes from step 4 onto the
    undisturbed losses; --resume PATH to it stops every rank with one line naming the shard."""
    out = copy_run(held_run[0], tmp_path / "run")
    last = out / "checkpoints" / f"step_{STEPS:08d}"
    flip_byte(last / "__1_0.distcp")
    explicit = tmp_path / "explicit.log"
    proc = launch(torchrun_cmd(out, "--resume", str(last)), explicit)
    try:
        assert proc.wait(timeout=240) != 0
    finally:
        kill_launch(proc)
    assert error_lines(log_of(explicit)) == [
        f"error: --resume: the checkpoint {last} is damaged: __1_0.distcp does not match its checksum (its contents "
        "changed after it was written); resume another checkpoint"]
    log = run(torchrun_cmd(out))
    assert log.count("warning: --resume auto: skipping the checkpoint") == 1
    assert f"resumed from {out / 'checkpoints' / 'step_00000004'} at step 4" in log
    assert losses(out) == losses(held_run[0])


def test_a_rank_stuck_in_start_up_is_reported_within_the_start_up_timeout(tmp_path):
    """Rank 1 never finishes building its model (tests/faults/hung_startup.py, train.py otherwise);
    --startup-timeout 15: the job ends within the bound, with one line naming rank 1 and the phase
    it is stuck in, instead of rank 0 waiting in a start-up collective for the process group's
    timeout; the folder is let go of, so the same command (train.py itself) then runs."""
    out = tmp_path / "run"
    hung = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(Path(__file__).with_name("hung_startup.py")), *COMMON, *LAYOUT, "--output-dir", str(out),
            "--startup-timeout", "15"]
    proc = launch(hung, tmp_path / "hung.log")
    try:
        started = time.monotonic()
        proc.wait(timeout=180)
        ended_after = time.monotonic() - started
    finally:
        kill_launch(proc)
    lines = error_lines(log_of(tmp_path / "hung.log"))
    assert len(lines) == 1, lines
    assert "start-up did not reach the step loop within 15 s: " in lines[0], lines
    assert "rank 1 at 'building the model'" in lines[0], lines
    assert proc.returncode != 0 and ended_after < 15 + 120, ended_after
    assert "resumed from" not in run(torchrun_cmd(out))
