"""Rolling back is a branch (issue #21 item 2): a run resumed from a checkpoint older than the
newest keeps the checkpoint it started from, sets the later ones aside by name instead of deleting
or replacing them, never continues the abandoned branch on ``--resume auto``, and its
``metrics.jsonl`` counts every step once. One process, then 2 gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from example_runs import COMMON, STEPS, accelerate_cmd, copy_run, losses, run, snapshot, train_in_process

from moe_ep.runs import integrity, read_metrics
from moe_ep.runs import checkpoint as ckpt

# Trains the example's model several times: not in the quick subset (bash scripts/test.sh --quick).
pytestmark = pytest.mark.slow


@pytest.fixture
def base(one_process_run) -> Path:
    """An undisturbed one-process run (conftest.py's, shared with test_data_safety.py): checkpoints
    at steps 2, 4 and 6."""
    return one_process_run


def abandoned(out: Path) -> list[Path]:
    return sorted((out / "checkpoints").glob("abandoned-*"))


def step_of(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step_{step:08d}"


def test_a_rollback_sets_the_later_checkpoints_aside_and_keeps_its_branch_point(base, tmp_path, capsys):
    out = copy_run(base, tmp_path / "run")
    later = {s: snapshot(step_of(out, s)) for s in (4, STEPS)}
    # Another learning rate: the branch trains other weights than the abandoned run.
    branch = [*COMMON, "--output-dir", str(out), "--lr", "1e-3", "--keep-checkpoints", "1"]
    capsys.readouterr()
    assert train_in_process([*branch, "--resume", str(step_of(out, 2))]) == 0
    printed = capsys.readouterr().out
    [aside] = abandoned(out)
    assert aside.name.endswith("-from-step-2")
    assert (f"rolled back to step 2: the later checkpoints (step_00000004, step_00000006) are set aside, not deleted, "
            f"in {aside}; this run goes on from {step_of(out, 2)}") in printed
    # The abandoned branch, untouched under its own name; the branch point kept through --keep-checkpoints 1.
    assert {s: snapshot(aside / f"step_{s:08d}") for s in (4, STEPS)} == later
    assert [p.name for p in ckpt.step_folders(out / "checkpoints")] == ["step_00000002", "step_00000006"]
    assert integrity.verify(step_of(out, 2)) == [] and integrity.verify(step_of(out, STEPS)) == []
    assert json.loads((step_of(out, STEPS) / "trainer_state.json").read_text())["branch_points"] == [2]
    # metrics.jsonl: every step once, the branch's steps replacing the abandoned run's.
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl")]
    assert steps == list(range(1, STEPS + 1))
    branch_losses, first = losses(out), losses(base)
    # Step 3's loss is taken before its update, on the step-2 weights both runs share.
    assert [branch_losses[s] for s in (1, 2, 3)] == [first[s] for s in (1, 2, 3)]
    assert all(branch_losses[s] != first[s] for s in range(4, STEPS + 1))

    # --resume auto continues the branch, never the abandoned run; the branch point outlives pruning.
    assert train_in_process([*branch, "--steps", "8"]) == 0
    printed = capsys.readouterr().out
    assert f"resumed from {step_of(out, STEPS)} at step {STEPS}" in printed and "rolled back" not in printed
    assert [p.name for p in ckpt.step_folders(out / "checkpoints")] == ["step_00000002", "step_00000008"]
    assert abandoned(out) == [aside] and {s: snapshot(aside / f"step_{s:08d}") for s in (4, STEPS)} == later
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(1, 9))
    assert [losses(out)[s] for s in range(1, STEPS + 1)] == [branch_losses[s] for s in range(1, STEPS + 1)]


def test_resuming_the_newest_checkpoint_sets_nothing_aside(base, tmp_path, capsys):
    out = copy_run(base, tmp_path / "run")
    capsys.readouterr()
    assert train_in_process([*COMMON, "--output-dir", str(out), "--steps", "8"]) == 0
    assert "rolled back" not in capsys.readouterr().out and abandoned(out) == []
    assert json.loads((step_of(out, 8) / "trainer_state.json").read_text())["branch_points"] == []


def test_a_rollback_on_two_ranks_branches_without_deleting(two_rank_run, tmp_path):
    """2 gloo ranks: the rollback to step 2 of a copy of conftest.py's 2-rank run keeps it through
    --keep-checkpoints 1, sets steps 4 and 6 aside, and retrains onto the first run's losses bit for
    bit, each step logged once."""
    out = copy_run(two_rank_run[0], tmp_path / "run")
    first = losses(out)
    later = {s: snapshot(step_of(out, s)) for s in (4, STEPS)}
    log = run(accelerate_cmd(out, "--resume", str(step_of(out, 2)), "--keep-checkpoints", "1"))
    [aside] = abandoned(out)
    assert "rolled back to step 2: the later checkpoints (step_00000004, step_00000006) are set aside" in log
    assert log.count("rolled back") == 1  # said by rank 0 alone
    assert {s: snapshot(aside / f"step_{s:08d}") for s in (4, STEPS)} == later
    assert [p.name for p in ckpt.step_folders(out / "checkpoints")] == ["step_00000002", "step_00000006"]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(1, STEPS + 1))
    assert losses(out) == first
