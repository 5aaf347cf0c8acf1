"""RunFolder, the run folder of trainer.py and accelerate_loop.py (#21 items 2 and 9): which
checkpoint ``--resume auto|never|CHECKPOINT`` and ``--overwrite`` choose, a rollback that sets the
later checkpoints aside as a branch (never deleted), an ``--overwrite`` that deletes only what
the run made, and damaged checkpoints (their manifest, written by ``seal``) skipped or refused,
never loaded. One process: the collective steps run without a process group."""

from __future__ import annotations

import json

import pytest

from moe_ep.runs import METRICS, RunFolder, StepLog, UsageError, files_in, marker_kind, read_metrics, verified_resume
from moe_ep.runs.run_folder import QUICK_HASH_BYTES

# Where each library writes its checkpoints: transformers' Trainer beside its other files,
# accelerate_loop.py's save_state in a managed subfolder.
LAYOUTS = {"trainer": ("checkpoint-*", (), "checkpoint-{}"),
           "accelerate_loop": ("checkpoints/step_*", ("checkpoints",), "checkpoints/step_{:08d}")}


def make_run(tmp_path, layout: str, steps=(2, 4, 6), data=None) -> tuple[RunFolder, dict[int, object]]:
    glob, managed, name = LAYOUTS[layout]
    run = RunFolder(tmp_path / "run", layout, glob, managed, data=data)
    run.claim()
    made = {}
    for step in steps:
        made[step] = run.path / name.format(step)
        made[step].mkdir()
        (made[step] / "weights.bin").write_bytes(b"w" * step)
        run.seal(made[step], step=step)
    return run, made


@pytest.mark.parametrize("layout", LAYOUTS)
def test_resume_chooses_the_newest_none_or_the_named_checkpoint(tmp_path, layout):
    run, made = make_run(tmp_path, layout)
    (made[2].parent / made[2].name.replace("2", "best")).mkdir()  # a name without a step: not a checkpoint
    assert run.checkpoints() == [made[2], made[4], made[6]]
    assert run.resume_target("auto", overwrite=False) == made[6]
    assert run.resume_target(str(made[2]), overwrite=False) == made[2]
    assert run.resume_target("never", overwrite=True) is None
    assert run.resume_target("auto", overwrite=True) is None
    with pytest.raises(UsageError, match=rf"--resume never, but .* holds checkpoints of an earlier run \(up to "
                                         rf"{made[6].name}\); pass --resume auto to continue it, --overwrite"):
        run.resume_target("never", overwrite=False)
    elsewhere = tmp_path / "elsewhere" / made[2].name
    elsewhere.mkdir(parents=True)
    with pytest.raises(UsageError, match=rf"--resume {elsewhere}: not a checkpoint of this script's run in "
                                         rf".* \(it holds {made[2].name}, {made[4].name}, {made[6].name}\)"):
        run.resume_target(str(elsewhere), overwrite=False)
    empty = RunFolder(tmp_path / "new", layout, LAYOUTS[layout][0], LAYOUTS[layout][1])
    assert empty.resume_target("auto", overwrite=False) is None
    assert empty.resume_target("never", overwrite=False) is None


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_checkpoint_of_other_data_is_refused_before_any_work(tmp_path, layout):
    """The data a checkpoint was trained on rides in its manifest: a resume under another seed,
    packing or global batch (whose count of batches done would skip other sequences) is refused,
    naming what changed; the same data resumes."""
    data = {"corpus_tokens": 1000, "token_sum": 77, "seq_len": 32, "global_batch": 4, "seed": 0}
    run, made = make_run(tmp_path, layout, data=data)
    glob, managed, _ = LAYOUTS[layout]
    same = RunFolder(run.path, layout, glob, managed, data=dict(data))
    assert same.check(resume="auto", overwrite=False, parameters=10) == ([made[6], made[4], made[2]], [])
    for key, value in (("seed", 1), ("global_batch", 8), ("seq_len", 64), ("token_sum", 78)):
        other = RunFolder(run.path, layout, glob, managed, data={**data, key: value})
        with pytest.raises(UsageError, match=rf"--resume .*{made[6].name}: the checkpoint was trained on other data or "
                                             rf"another global batch \({key}: {data[key]!r} then, {value!r} now\)"):
            other.check(resume="auto", overwrite=False, parameters=10)
        with pytest.raises(UsageError, match=rf"{made[2].name}: the checkpoint was trained on other data"):
            other.check(resume=str(made[2]), overwrite=False, parameters=10)
        assert other.check(resume="auto", overwrite=True, parameters=10) == ([], [])  # --overwrite starts afresh
    unrecorded, _ = make_run(tmp_path / "old", layout)  # a checkpoint that records no data: nothing vouches
    with pytest.raises(UsageError, match=r"\(corpus_tokens: None then, 1000 now; token_sum: None then"):
        RunFolder(unrecorded.path, layout, glob, managed, data=data).check(resume="auto", overwrite=False,
                                                                          parameters=10)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_rollback_sets_the_later_checkpoints_aside_and_keeps_the_branch_point(tmp_path, layout):
    run, made = make_run(tmp_path, layout)
    resumed = run.resume_target(str(made[2]), overwrite=False)
    aside = run.set_aside_later(resumed, rank=0)
    assert aside.parent == made[2].parent and aside.name.startswith("abandoned-") and "from-step-2" in aside.name
    assert marker_kind(aside) == "abandoned"
    assert sorted(p.name for p in aside.iterdir() if p.is_dir()) == [made[4].name, made[6].name]
    assert (aside / made[6].name / "weights.bin").read_bytes() == b"w" * 6  # moved whole, not copied or cut
    assert run.checkpoints() == [made[2]] and made[2].is_dir()  # the branch point stays
    assert run.resume_target("auto", overwrite=False) == made[2]  # auto never continues the abandoned branch
    assert run.set_aside_later(made[2], rank=0) is None  # nothing later: nothing moved


def test_the_log_of_a_rolled_back_run_counts_each_step_once(tmp_path, capsys):
    run, made = make_run(tmp_path, "trainer")
    log = StepLog(run.path, enabled=True)
    for step in range(1, 7):
        log.step({"step": step, "loss": float(step), "grad_norm": None, "lr": 1e-3})
    log.resumed(2, made[2], run.set_aside_later(made[2], rank=0))
    for step in range(3, 5):
        log.step({"step": step, "loss": 10.0 + step, "grad_norm": None, "lr": 1e-3})
    assert [(r["step"], r["loss"]) for r in read_metrics(run.path / METRICS)] == [
        (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0)]
    out = capsys.readouterr().out
    assert f"resumed from {made[2]} at step 2" in out
    assert "rolled back to step 2: the later checkpoints (checkpoint-4, checkpoint-6) are set aside, not deleted" in out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_overwrite_deletes_the_runs_checkpoints_branches_and_log_and_nothing_else(tmp_path, layout):
    run, made = make_run(tmp_path, layout)
    aside = run.set_aside_later(made[4], rank=0)
    (run.path / METRICS).write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    (run.path / "notes.txt").write_text("the user's")
    users_branch = made[2].parent / "abandoned-by-hand"  # named like ours, not marked: the user's
    users_branch.mkdir()
    run.final.mkdir()
    assert run.check(resume="auto", overwrite=True, parameters=10) == ([], [])
    run.clear()
    assert run.checkpoints() == [] and not aside.exists() and not (run.path / METRICS).exists()
    assert (run.path / "notes.txt").read_text() == "the user's" and users_branch.is_dir() and run.final.is_dir()
    assert not [p for p in made[2].parent.iterdir() if p.name.startswith(".trash-")]


def test_a_trainer_checkpoint_cut_short_is_never_resumed_nor_written_into(tmp_path):
    """transformers' Trainer writes ``checkpoint-N`` under its final name, and the manifest is
    written after it (``seal``, on_save): a job killed mid-save leaves a folder without one, which
    ``--resume auto`` passes over (the newest complete one is resumed) and which is set aside
    before the Trainer could write into it again; named by ``--resume``, it is refused."""
    run, _ = make_run(tmp_path, "trainer", steps=(2, 4))
    cut = run.path / "checkpoint-6"
    cut.mkdir()
    (cut / "model.safetensors").write_bytes(b"partial")
    (cut / "trainer_state.json").write_text("{}")  # the Trainer's last file: its own save had ended
    assert run.resume_target("auto", overwrite=False) == run.path / "checkpoint-4"
    with pytest.raises(UsageError, match=rf"--resume {cut}: the checkpoint was cut short \(it has no "
                                         r"manifest.json, which is written last\)"):
        run.resume_target(str(cut), overwrite=False)
    aside = run.set_aside_later(run.path / "checkpoint-4", rank=0)
    assert [p.name for p in aside.iterdir() if p.is_dir()] == ["checkpoint-6"]
    assert (aside / "checkpoint-6" / "model.safetensors").read_bytes() == b"partial"  # kept, not deleted

    # Only checkpoints cut short: the run starts afresh, and they are set aside all the same.
    again = RunFolder(tmp_path / "again", "trainer", "checkpoint-*")
    again.claim()
    (again.path / "checkpoint-2").mkdir()
    assert again.resume_target("auto", overwrite=False) is None
    aside = again.set_aside_later(None, rank=0)
    assert aside.name.endswith("-from-step-0") and (aside / "checkpoint-2").is_dir() and again.checkpoints() == []


def flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


def resumed(run, resume: str):
    """What the scripts resume: RunFolder.check's candidates, then the ranks' checksums
    (loops.claim_run), with the warnings said on the way."""
    warned = []
    tried, warnings = run.check(resume=resume, overwrite=False, parameters=10)
    chosen = verified_resume(tried, explicit=resume != "auto", warn=warned.append, must_list=files_in)
    return chosen, warnings + warned


@pytest.mark.parametrize("layout", LAYOUTS)
def test_damaged_checkpoints_are_skipped_or_refused_never_resumed(tmp_path, layout):
    """Every file under the checkpoint (accelerate's sharded states sit in subfolders) is in its
    manifest: a flipped byte in a small file is found before start-up, one in a large shard by the
    ranks' checksums after it, a file the manifest leaves out or a manifest that lists nothing
    makes the checkpoint damaged too; ``auto`` falls back to the newest intact one with a warning
    naming the file, ``--resume PATH`` stops, and all damaged stops rather than start afresh."""
    run, made = make_run(tmp_path, layout, steps=(2, 4, 6, 8))
    for step in (4, 6, 8):
        (made[step] / "model_0").mkdir()
        (made[step] / "model_0" / "__0_0.distcp").write_bytes(bytes(QUICK_HASH_BYTES + 1))
        (made[step] / "manifest.json").unlink()
        run.seal(made[step], step=step)
    assert "model_0/__0_0.distcp" in json.loads((made[8] / "manifest.json").read_text())["files"]
    flip_byte(made[8] / "model_0" / "__0_0.distcp")  # large: only the shared checksums find it
    flip_byte(made[6] / "weights.bin")  # small: found before start-up
    assert resumed(run, "auto") == (made[4], [
        f"--resume auto: skipping the checkpoint {made[6]} is damaged: weights.bin does not match its checksum "
        "(its contents changed after it was written)",
        f"--resume auto: skipping the checkpoint {made[8]} is damaged: model_0/__0_0.distcp does not match its "
        "checksum (its contents changed after it was written)"])
    with pytest.raises(UsageError, match=rf"--resume: the checkpoint {made[8]} is damaged: model_0/__0_0.distcp does "
                                         r"not match its checksum"):
        resumed(run, str(made[8]))
    with pytest.raises(UsageError, match=rf"--resume: the checkpoint {made[6]} is damaged: weights.bin does not"):
        resumed(run, str(made[6]))
    (made[4] / "optimizer.bin").write_bytes(b"written after the seal")  # nothing vouches for it
    manifest = json.loads((made[2] / "manifest.json").read_text())
    (made[2] / "manifest.json").write_text(json.dumps({**manifest, "files": {}}))
    (made[8] / "model_0" / "__0_0.distcp").write_bytes(b"cut")  # its size tells before start-up
    with pytest.raises(UsageError, match=r"--resume auto: every checkpoint in .* is damaged \(.*4 is damaged: "
                                         r"manifest.json does not list optimizer.bin, so nothing vouches for it; .*"
                                         r"manifest.json does not list weights.bin"):
        resumed(run, "auto")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_checkpoint_or_branch_that_is_a_link_is_refused_before_any_work(tmp_path, layout):
    """Where the Trainer writes its checkpoints beside the run's other files (``checkpoint-N``),
    a link under a checkpoint's or a branch's name was found only after the folder was claimed."""
    run, made = make_run(tmp_path, layout)
    users = tmp_path / "users_checkpoint"
    users.mkdir()
    for name in (made[6].name.replace("6", "8"), "abandoned-20261129-120000-from-step-2"):
        link = made[6].parent / name
        link.symlink_to(users)
        with pytest.raises(UsageError, match=rf"--output-dir: {link} is a link \(to {users}\) among the run's "
                                             "checkpoints; moe_ep never reads, prunes or deletes"):
            run.check(resume="auto", overwrite=True, parameters=10)
        link.unlink()
    assert run.check(resume="auto", overwrite=False, parameters=10)[0] == [made[6], made[4], made[2]]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_log_the_run_cannot_append_to_is_refused_before_any_work(tmp_path, layout, monkeypatch):
    """A ``metrics.jsonl`` made read-only (or another user's): refused by the checks before any
    work, not at the run's first record. Root ignores file modes, so the refusal is the open's."""
    import builtins

    from moe_ep.runs import check_output_folders

    run, _ = make_run(tmp_path, layout)
    log = run.path / METRICS
    log.write_text('{"step": 1}\n')
    real_open = builtins.open

    def read_only_log(path, mode="r", *args, **kwargs):
        if str(path) == str(log) and set(mode) & set("wa+"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", read_only_log)
    message = rf"--output-dir: cannot append to {log}: Permission denied"
    with pytest.raises(UsageError, match=message):
        run.check(resume="auto", overwrite=False, parameters=10)
    train_run = tmp_path / "train_run"
    train_run.mkdir()
    log = train_run / METRICS
    log.write_text('{"step": 1}\n')
    from moe_ep.runs import mark

    mark(train_run, "run")
    with pytest.raises(UsageError, match=rf"--output-dir: cannot append to {log}: Permission denied"):
        check_output_folders(train_run, None, 10, keep=2)
    assert log.read_text() == '{"step": 1}\n'


def test_a_lock_left_by_a_dead_job_is_recorded_while_the_folder_is_held(tmp_path):
    """The loops say whose a dead job's lock was once they claim the folder (loops.claim_run):
    rank 0 takes the lock over and keeps its record; the other ranks hold nothing and see none."""
    from moe_ep.runs import ownership

    run = RunFolder(tmp_path / "run", "trainer", "checkpoint-*")
    run.path.mkdir()
    record = {"host": "node-7", "pid": 4242, "job": "10.0.0.7:29500 run 1", "since": "2026-01-01 00:00:00 UTC"}
    (run.path / ownership.LOCK_FILE).write_text(json.dumps(record))
    assert run.previous_holder is None
    with run.held(rank=1):
        assert run.previous_holder is None
    with run.held(rank=0):
        assert {key: run.previous_holder[key] for key in record} == record
    with run.held(rank=0):
        assert run.previous_holder is None  # let go cleanly by the job before


@pytest.mark.parametrize("layout", LAYOUTS)
def test_older_checkpoints_go_once_a_newer_one_is_sealed_and_never_a_branch(tmp_path, layout):
    """--keep-checkpoints of the loops: rank 0 deletes the complete checkpoints older than the
    newest ``keep`` (whole); a checkpoint cut short makes no room, an abandoned branch is never
    touched, the other ranks delete nothing, and None keeps every one."""
    run, made = make_run(tmp_path, layout, steps=(2, 4, 6, 8))
    run.set_aside_later(made[6], rank=0)  # a rollback to step 6: step 8 set aside as a branch
    branch = [p for p in run.checkpoint_root.iterdir() if p.name.startswith("abandoned")]
    run.prune(1, rank=1)
    run.prune(None, rank=0)
    assert run.checkpoints() == [made[2], made[4], made[6]]
    cut_short = run.path / LAYOUTS[layout][2].format(10)
    cut_short.mkdir()  # a save under the final name (the Trainer's) not sealed yet
    run.prune(2, rank=0)
    assert run.checkpoints() == [made[4], made[6], cut_short]
    run.prune(1, rank=0)
    assert run.checkpoints() == [made[6], cut_short]
    assert len(branch) == 1 and marker_kind(branch[0]) == "abandoned" and any(branch[0].iterdir())


@pytest.mark.parametrize(("keep", "existing", "fits"), [(None, 3, 1), (2, 0, 3), (2, 1, 2), (2, 3, 1), (1, 1, 1)])
def test_the_free_space_check_counts_the_checkpoints_to_come(tmp_path, monkeypatch, keep, existing, fits):
    """``keep`` kept and one more while a save is written, less the complete ones already there
    (one at least, and one where every checkpoint is kept), and the final model."""
    import shutil

    from moe_ep.runs.ownership import EXPORT_BYTES_PER_PARAMETER, checkpoint_bytes

    run, _ = make_run(tmp_path, "trainer", steps=(2, 4, 6)[:existing])
    parameters = 1 << 20
    needed = fits * checkpoint_bytes(parameters) + EXPORT_BYTES_PER_PARAMETER * parameters

    def check_with(free: int):
        monkeypatch.setattr(shutil, "disk_usage", lambda _p: shutil._ntuple_diskusage(1 << 40, (1 << 40) - free, free))
        return run.check(resume="auto", overwrite=False, parameters=parameters, keep=keep)

    check_with(needed)
    plural = "s" if fits > 1 else ""
    with pytest.raises(UsageError, match=rf"--output-dir: .* but {fits} more checkpoint{plural} and the final model"):
        check_with(needed - 1)
