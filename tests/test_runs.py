"""moe_ep.runs in one process, without a model: the job's hold on its folder, the checkpoint cadence
and the resume resolution a loop of its own uses (the example's runs exercise the rest:
test_example_units.py, test_example_launch.py, tests/faults/)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from moe_ep.runs import UsageError, checkpoint_due, hold_output_dir, resume_target
from moe_ep.runs.checkpoint import step_dir


@pytest.mark.parametrize(("step", "every", "last", "due"), [
    (2, 2, 6, True), (3, 2, 6, False), (6, 4, 6, True), (5, 0, 6, False), (6, 0, 6, True), (4, 4, 6, True),
])
def test_a_checkpoint_is_due_every_n_steps_and_at_the_last(step, every, last, due):
    assert checkpoint_due(step, every=every, last=last) is due


def test_a_second_job_is_refused_the_held_folder_and_it_is_let_go_after(tmp_path):
    with hold_output_dir(tmp_path, rank=0) as previous:
        assert previous is None
        # Another process's lockf conflicts; this process's own second fd would not, so the second
        # job is a child process.
        code = ("import sys; from pathlib import Path; from moe_ep.runs import OutputLock, UsageError\n"
                "try:\n    OutputLock(Path(sys.argv[1])).acquire()\nexcept UsageError as e:\n    print(e)")
        said = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                              check=True).stdout
        assert "is in use by another job" in said and "pid" in said
    with hold_output_dir(tmp_path, rank=0) as previous:
        assert previous is None  # let go cleanly: no record of a dead holder
    with hold_output_dir(tmp_path / "not-made", rank=1) as previous:
        assert previous is None and not (tmp_path / "not-made").exists()  # only rank 0 locks


def test_resume_resolution(tmp_path):
    root = tmp_path / "checkpoints"
    assert resume_target("never", root, overwrite=False) == ([], [])
    assert resume_target("auto", root, overwrite=False) == ([], [])
    step_dir(root, 2).mkdir(parents=True)
    with pytest.raises(UsageError, match="--resume never, but .* holds checkpoints up to step_00000002"):
        resume_target("never", root, overwrite=False)
    assert resume_target("never", root, overwrite=True) == ([], [])
    with pytest.raises(UsageError, match="every checkpoint in .* is damaged"):
        resume_target("auto", root, overwrite=False)  # step_00000002 has no manifest
