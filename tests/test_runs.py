"""moe_ep.runs in one process, without a model: the job's hold on its folder, the checkpoint cadence,
the resume resolution, a rollback's checkpoints set aside and the metrics log read back (the example's runs exercise the rest:
test_example_units.py, test_example_launch.py, tests/faults/)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from moe_ep.runs import (
    UsageError,
    checkpoint_due,
    hold_output_dir,
    ownership,
    read_metrics,
    resume_target,
    set_aside_later_checkpoints,
    step_folders,
)
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


def test_metrics_after_a_resume_count_each_step_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}, {"step": 3, "loss": 1.0}, {"step": 4, "loss": 0.5},
             {"resumed_from_step": 2, "checkpoint": "c/step_00000002", "set_aside": None},
             {"step": 3, "loss": 1.5}, {"step": 4, "loss": 1.25, "skipped": True}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 5, "lo')  # cut short by a kill
    assert [(r["step"], r["loss"]) for r in read_metrics(path)] == [(1, 3.0), (2, 2.0), (3, 1.5), (4, 1.25)]
    path.write_text('{"step": 1, "loss": 3.0}\nnot json\n{"step": 2, "loss": 2.0}\n')
    with pytest.raises(ValueError, match="metrics.jsonl: line 2 is not a JSON record: 'not json'"):
        read_metrics(path)


def test_checkpoints_after_the_one_resumed_are_set_aside_whole_and_marked(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        (step_dir(root, step) / "shard").parent.mkdir(parents=True)
        (step_dir(root, step) / "shard").write_text(str(step))
    (root / ".tmp-step_00000008").mkdir()
    assert set_aside_later_checkpoints(root, 6, step_dir(root, 6), rank=0) is None
    aside = set_aside_later_checkpoints(root, 2, step_dir(root, 2), rank=0)
    assert aside.parent == root and re.fullmatch(r"abandoned-\d{8}-\d{6}-from-step-2", aside.name)
    assert ownership.marker_kind(aside) == "abandoned"
    assert [p.name for p in step_folders(root)] == ["step_00000002"]
    assert {p.name: (p / "shard").read_text() for p in aside.iterdir() if p.is_dir()} == {
        "step_00000004": "4", "step_00000006": "6"}
    assert (root / ".tmp-step_00000008").is_dir()  # not a checkpoint: the next run's clean-up removes it
    # A second rollback in the same second gets a name of its own.
    step_dir(root, 3).mkdir()
    again = set_aside_later_checkpoints(root, 2, step_dir(root, 2), rank=0)
    assert again != aside and (again / "step_00000003").is_dir() and (aside / "step_00000004").is_dir()

