"""transformers' Trainer and a hand-written accelerate loop on a model moe_ep.parallelize prepared,
through the examples (examples/mixtral/trainer.py, accelerate_loop.py) launched by ``accelerate
launch`` on 2 gloo processes: with expert parallelism (ep=2, FSDP2 over the same two), the per-step
losses and gradient norms of 6 optimizer steps with gradient accumulation and the load-balancing
loss equal, in float32 to 1e-5, those of the same script without expert parallelism (plain data
parallel, transformers' own experts) on the same processes and of one process accumulating the
same per-rank batches; a run stopped after a checkpoint and resumed logs the uninterrupted run's
losses; the saved model loads with plain transformers and gives the baseline's logits; bf16 mixed
precision from accelerate's configuration is applied (the losses move off float32's by about the
bf16 rounding, and stay within the bf16 tolerance of the baseline's in bf16)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_loops import (
    MODEL_SHARD,
    SCRIPTS,
    STEP_2,
    STEP_6,
    check_against_baseline_and_one_process,
    final_logits,
    max_abs_diff,
    max_rel_diff,
    records_before_the_last_resume,
    step_records,
)
from moe_ep.runs import files_in, marker_kind, read_metrics
from numerics import TOLERANCE

# Launches the example loops with accelerate: not in the quick subset (bash scripts/test.sh --quick).
pytestmark = pytest.mark.slow

PROCESSES = 2


@pytest.fixture
def runs(two_rank_loops):
    """The world's folder: conftest.py's two_rank_loops (ep=2 on 2 processes), shared with tests/faults/."""
    return two_rank_loops


@pytest.mark.parametrize("script", SCRIPTS)
def test_expert_parallel_matches_data_parallel_and_one_process(runs, script):
    check_against_baseline_and_one_process(runs, script, PROCESSES)
    baseline = step_records(runs / f"{script}_baseline")
    assert max_rel_diff(baseline, step_records(runs / f"{script}_one_process_x{PROCESSES}"), "loss") <= TOLERANCE[
        torch.float32]


@pytest.mark.parametrize("script", SCRIPTS)
def test_one_process_without_a_process_group_runs_moe_ep_as_the_baseline(runs, script):
    """``accelerate launch --num_processes 1`` gives no process group: the script makes one of one
    rank for moe_ep.parallelize, and accelerate drives the model with it as on several."""
    alone = step_records(runs / f"{script}_ep_one_process_x{PROCESSES}")
    assert sorted(alone) == sorted(step_records(runs / f"{script}_ep"))
    for key in ("loss", "grad_norm"):
        assert max_rel_diff(alone, step_records(runs / f"{script}_one_process_x{PROCESSES}"), key) <= TOLERANCE[
            torch.float32]
        assert max_rel_diff(alone, step_records(runs / f"{script}_ep"), key) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_finished_run_run_again_trains_nothing(runs, script):
    """The same command once more on a finished run: the Trainer resumed at its last step trained
    one more (at learning rate 0) and saved checkpoint-7, at every start; now both loops say so
    and stop."""
    folder = runs / f"{script}_ep"
    assert f"nothing to train: the run in {folder} is already at step 6" in (runs / "launch-2.log").read_text()
    assert sorted(step_records(folder)) == list(range(1, 7))
    assert not (folder / "checkpoint-7").exists() and not (folder / "checkpoints" / "step_00000007").exists()


@pytest.mark.parametrize("script", SCRIPTS)
def test_older_checkpoints_are_deleted_once_a_newer_one_is_sealed(runs, script):
    """The baseline runs keep one checkpoint (``--keep-checkpoints 1``, RunFolder.prune): of those
    of steps 2, 4 and 6 only the last is left, sealed; the expert-parallel runs keep every one."""
    named = "checkpoint-{}" if script == "trainer" else "step_{:08d}"
    for name, steps in (("baseline", (6,)), ("ep", (2, 4, 6))):
        root = Path(STEP_6[script].format(run=runs / f"{script}_{name}")).parent
        assert sorted(p.name for p in root.iterdir() if p.name.startswith(("checkpoint-", "step_"))) == [
            named.format(step) for step in steps]
    sealed = Path(STEP_6[script].format(run=runs / f"{script}_baseline"))
    assert set(json.loads((sealed / "manifest.json").read_text())["files"]) == set(files_in(sealed))


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_resumed_run_gives_the_uninterrupted_losses(runs, script, tmp_path):
    uninterrupted = step_records(runs / f"{script}_ep")
    resumed = records_before_the_last_resume(runs / f"{script}_stopped", tmp_path)
    assert sorted(resumed) == sorted(uninterrupted)
    assert max_abs_diff(resumed, uninterrupted, "loss") == 0.0
    assert max_abs_diff(resumed, uninterrupted, "grad_norm") == 0.0


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_rolled_back_run_keeps_its_branch_point_sets_the_later_checkpoints_aside_and_counts_each_step_once(
        runs, script):
    """``--resume`` of step 2's checkpoint after the run reached step 6: the checkpoints of steps 4
    and 6 moved whole into one marked ``abandoned-`` folder, step 2's kept, the steps after 2
    trained again onto the uninterrupted losses, each step once in the log's history."""
    folder = runs / f"{script}_stopped"
    step_2 = Path(STEP_2[script].format(run=folder))
    assert step_2.is_dir()
    [aside] = [p for p in step_2.parent.iterdir() if p.name.startswith("abandoned-")]
    assert aside.name.endswith("-from-step-2") and marker_kind(aside) == "abandoned"
    later = sorted(p.name for p in aside.iterdir() if p.is_dir())
    assert later == ([f"checkpoint-{s}" for s in (4, 6)] if script == "trainer" else
                     [f"step_{s:08d}" for s in (4, 6)])
    rolled_back, uninterrupted = step_records(folder), step_records(runs / f"{script}_ep")
    assert sorted(rolled_back) == sorted(uninterrupted)
    assert max_abs_diff(rolled_back, uninterrupted, "loss") == 0.0


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_damaged_checkpoint_is_skipped_for_the_newest_intact_one(runs, script):
    """The one-process moe_ep run ran again once a byte of its checkpoint of step 6 was flipped in
    the model's shard: the ranks' checksums found it (one warning naming the file), the checkpoint
    of step 4 was resumed instead and steps 5 and 6 trained again onto the same losses bit for bit;
    the damaged checkpoint was set aside whole, and the new one of step 6 is sealed."""
    folder = runs / f"{script}_ep_one_process_x{PROCESSES}"
    step_6 = Path(STEP_6[script].format(run=folder))
    log = (runs / "launch-1.log").read_text()
    assert [line for line in log.splitlines() if "warning:" in line and str(folder) in line] == [
        f"warning: --resume auto: skipping the checkpoint {step_6} is damaged: {MODEL_SHARD} does not match its "
        "checksum (its contents changed after it was written)"], log[-3000:]
    [aside] = [p for p in step_6.parent.iterdir() if p.name.startswith("abandoned-")]
    assert aside.name.endswith("-from-step-4") and (aside / step_6.name / MODEL_SHARD).is_file()
    lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    [resumed_at] = [i for i, r in enumerate(lines) if "resumed_from_step" in r]
    assert lines[resumed_at]["resumed_from_step"] == 4
    first, again = lines[:resumed_at], lines[resumed_at + 1:]
    assert [(r["step"], r["loss"]) for r in again] == [(r["step"], r["loss"]) for r in first if r["step"] > 4]
    assert sorted(step_records(folder)) == list(range(1, 7)) and read_metrics(folder / "metrics.jsonl")
    assert set(json.loads((step_6 / "manifest.json").read_text())["files"]) == set(files_in(step_6))


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_saved_model_loads_with_plain_transformers(runs, script):
    """(Its logits against the baseline's: test_expert_parallel_matches_data_parallel_and_one_process.)"""
    assert "moe_ep" not in (runs / f"{script}_ep" / "final" / "config.json").read_text()
    assert torch.equal(final_logits(runs / f"{script}_stopped" / "final"), final_logits(runs / f"{script}_ep" / "final"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_bf16_mixed_precision_is_applied(runs, script):
    ep, baseline = step_records(runs / f"{script}_ep_bf16"), step_records(runs / f"{script}_baseline_bf16")
    fp32 = {s: r for s, r in step_records(runs / f"{script}_ep").items() if s in ep}
    assert max_rel_diff(ep, baseline, "loss") <= TOLERANCE[torch.bfloat16]
    # Computed in bf16, not silently in float32 (the first step's loss is the forward alone).
    assert max_abs_diff(ep, fp32, "loss") > 1e-5
