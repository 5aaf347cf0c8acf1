"""moe_ep.runs in one process, without a model: the job's hold on its folder, the checkpoint cadence,
the resume resolution, a rollback's checkpoints set aside, the metrics log read back, odd files
and links refused by name, the free space a run needs and a full disk said as one (the example's runs exercise the rest:
test_example_units.py, test_example_launch.py, tests/faults/)."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from moe_ep.runs import (
    OutputLock,
    RunError,
    UsageError,
    branch_step,
    check_output_folders,
    checkpoint_due,
    hold_output_dir,
    ownership,
    read_metrics,
    remove_incomplete,
    resume_target,
    set_aside_later_checkpoints,
    step_folders,
)
from moe_ep.runs.checkpoint import step_dir
from moe_ep.runs.errors import failure_cause


@pytest.mark.parametrize(("step", "every", "last", "due"), [
    (2, 2, 6, True), (3, 2, 6, False), (6, 4, 6, True), (5, 0, 6, False), (6, 0, 6, True), (4, 4, 6, True),
])
def test_a_checkpoint_is_due_every_n_steps_and_at_the_last(step, every, last, due):
    assert checkpoint_due(step, every=every, last=last) is due


def test_a_second_job_is_refused_the_held_folder_and_it_is_let_go_after(tmp_path):
    with hold_output_dir(tmp_path, rank=0) as previous:
        assert previous is None
        # Another process's lockf conflicts, this process's own second fd would not: a forked child
        # (no interpreter start) tries the folder.
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                OutputLock(tmp_path).acquire()
                said = "acquired"
            except UsageError as err:
                said = str(err)
            os.write(write_end, said.encode())
            os._exit(0)
        os.close(write_end)
        said = os.read(read_end, 1 << 16).decode()
        os.waitpid(pid, 0)
        os.close(read_end)
        assert "is in use by another job" in said and "pid" in said
    with hold_output_dir(tmp_path, rank=0) as previous:
        assert previous is None  # let go cleanly: no record of a dead holder
    with hold_output_dir(tmp_path / "not-made", rank=1) as previous:
        assert previous is None and not (tmp_path / "not-made").exists()  # only rank 0 locks


def test_a_configuration_error_of_one_rank_is_said_by_that_rank():
    """What moe_ep's agreement raised on every rank is said once, by rank 0; any other error of a
    block whose checks are not all of shared arguments, by the rank that raised it."""
    from moe_ep.runs import configuration_errors

    def raised(error, **kwargs):
        with pytest.raises(UsageError) as caught:
            with configuration_errors(**kwargs):
                raise error
        return caught.value.agreed

    agreed = ValueError("refused on every rank")
    agreed.on_every_rank = True
    assert raised(agreed, checked_alike=False) and raised(ValueError("shared arguments"))
    assert not raised(ValueError("this rank only"), checked_alike=False)


def test_resuming_a_folder_that_is_no_checkpoint_says_so(tmp_path):
    """Not "damaged": a folder holding none of the files a save writes is some other folder."""
    other = tmp_path / "photos"
    other.mkdir()
    (other / "cat.jpg").write_bytes(b"\xff\xd8")
    with pytest.raises(UsageError, match=r"--resume: .*photos is not a checkpoint of moe_ep.runs \(it holds no "
                                         r"manifest.json, trainer_state.json or .distcp shard\)"):
        resume_target(str(other), tmp_path / "checkpoints", overwrite=False)
    # A whole checkpoint another writer sealed (an accelerate loop's RunFolder): of another kind.
    from moe_ep.runs import write_manifest

    sealed = tmp_path / "run" / "checkpoints" / "step_00000002"
    sealed.mkdir(parents=True)
    (sealed / "model.safetensors").write_bytes(b"weights")
    write_manifest(sealed, {"model.safetensors": (7, "0" * 64)}, step=2)
    with pytest.raises(UsageError, match=r"--resume: .*step_00000002 is a checkpoint of another kind \(its "
                                         r"manifest.json lists no trainer_state.json"):
        resume_target(str(sealed), tmp_path / "checkpoints", overwrite=False)


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


@pytest.mark.parametrize("writer", ["Reporter", "StepLog"])
def test_a_log_cut_short_or_left_by_a_run_killed_before_its_first_checkpoint_counts_each_step_once(writer, tmp_path):
    """The next run appends after the last whole line (the cut one removed, so its records do not
    join it), and a run that starts afresh over an earlier run's records supersedes them."""
    from moe_ep.runs.metrics import Reporter, StepLog

    path = tmp_path / "metrics.jsonl"

    def open_log(folder=tmp_path):
        if writer == "Reporter":
            return Reporter(folder, enabled=True, total_steps=3, progress=False, tensorboard=False)
        return StepLog(folder, enabled=True)

    def log_step(log, step):
        if writer == "Reporter":
            log._write({"step": step, "loss": float(step)})
        else:
            log.step({"step": step, "loss": float(step), "lr": 1e-3})

    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 2.0}\n{"step": 3, "lo')
    log = open_log()
    log.resumed(2, tmp_path / "checkpoints" / "step_00000002", None)
    log_step(log, 3)
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    assert '"lo{' not in path.read_text() and path.read_text().endswith("\n")
    log = open_log()  # killed before its first checkpoint, the same command again: afresh
    log.started_afresh()
    log_step(log, 1)
    assert [(r["step"], r["loss"]) for r in read_metrics(path)] == [(1, 1.0)]
    assert json.loads(path.read_text().splitlines()[-2]) == {"resumed_from_step": 0, "checkpoint": None,
                                                             "set_aside": None}
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    log = open_log(fresh)
    log.started_afresh()  # a new log holds no record of a fresh start
    log_step(log, 1)
    assert (fresh / "metrics.jsonl").read_text().count("\n") == 1


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
    # Back to the branch set aside, by the path of its step 4: every checkpoint the live branch
    # made after it left step 2 (its step 3 too, older than the one resumed) leaves with it, so
    # that neither --resume auto nor pruning takes it for this run's; step 2, the two branches'
    # last common checkpoint, stays (the run keeps it from pruning: branch_step).
    for step in (3, 4, 5):
        step_dir(root, step).mkdir(exist_ok=True)
    assert branch_step(root, aside / "step_00000004", 4) == 2 and branch_step(root, step_dir(root, 4), 4) == 4
    back = set_aside_later_checkpoints(root, 4, aside / "step_00000004", rank=0)
    assert re.fullmatch(r"abandoned-\d{8}-\d{6}-from-step-2(\.\d+)?", back.name)
    assert sorted(p.name for p in back.iterdir() if p.is_dir()) == ["step_00000003", "step_00000004", "step_00000005"]
    assert [p.name for p in step_folders(root)] == ["step_00000002"] and (aside / "step_00000004").is_dir()
    from moe_ep.runs.metrics import resume_record

    _, said = resume_record(4, aside / "step_00000004", back)
    assert said == (f"took up the branch of {aside / 'step_00000004'} at step 4: the checkpoints made after step 2 on "
                    f"the other branch (step_00000003, step_00000004, step_00000005) are set aside, not deleted, in "
                    f"{back}")
    _, said = resume_record(2, step_dir(root, 2), aside)
    assert said.startswith("rolled back to step 2: the later checkpoints (step_00000004, step_00000006) are set aside")


def test_a_branch_taken_up_after_two_rollbacks_parts_where_the_live_line_left_it(tmp_path):
    """Line A: 2 4 6 8; rolled back to 4 (A's 6, 8 aside), line B writes 6 8; rolled back to 2
    (B's 4 6 8 aside), line C writes 4 6. A's step 8 taken up by its path shares only step 2 with
    C: C's 4 and 6 are set aside, step 2 alone stays."""
    root = tmp_path / "checkpoints"

    def write(step, line):
        step_dir(root, step).mkdir(parents=True)
        (step_dir(root, step) / "line").write_text(line)

    for step in (2, 4, 6, 8):
        write(step, "A")
    first = set_aside_later_checkpoints(root, 4, step_dir(root, 4), rank=0)
    for step in (6, 8):
        write(step, "B")
    set_aside_later_checkpoints(root, 2, step_dir(root, 2), rank=0)
    for step in (4, 6):
        write(step, "C")
    assert branch_step(root, first / "step_00000008", 8) == 2
    aside = set_aside_later_checkpoints(root, 8, first / "step_00000008", rank=0)
    assert sorted((p.name, (p / "line").read_text()) for p in aside.iterdir() if p.is_dir()) == [
        ("step_00000004", "C"), ("step_00000006", "C")]
    assert [p.name for p in step_folders(root)] == ["step_00000002"]


def test_the_metrics_of_a_branch_taken_up_again_are_that_branchs(tmp_path):
    """The log of the rollbacks above, written as train.py writes it (Reporter.resumed after
    set_aside_later_checkpoints), each line's losses its own: read back after each branch is taken
    up again by its path, the history is that branch's, every step once (the records of A's steps
    5-8, dropped by the first rollback, come back; C's 3-6 go)."""
    from moe_ep.runs import Reporter

    out = tmp_path / "run"
    root = out / "checkpoints"
    loss = {"A": 100.0, "B": 200.0, "C": 300.0, "D": 400.0}

    def train(line, steps, resumed=None, step=0):
        reporter = Reporter(out, enabled=True, total_steps=10, progress=False, tensorboard=False)
        if resumed is not None:
            reporter.resumed(step, resumed, set_aside_later_checkpoints(root, step, resumed, rank=0))
        for s in steps:
            reporter._write({"step": s, "loss": loss[line] + s})
            if s % 2 == 0:
                step_dir(root, s).mkdir(parents=True)
        reporter.close()

    def history():
        return [(r["step"], r["loss"]) for r in read_metrics(out / "metrics.jsonl")]

    train("A", range(1, 9))
    train("B", range(5, 9), step_dir(root, 4), 4)
    train("C", range(3, 7), step_dir(root, 2), 2)
    (first,), (second,) = root.glob("abandoned-*-from-step-4"), root.glob("abandoned-*-from-step-2")
    train("D", [9], first / "step_00000008", 8)
    assert history() == [(s, 100.0 + s) for s in range(1, 9)] + [(9, 409.0)]
    train("B", [9], second / "step_00000008", 8)  # B's line: A's steps 1-4, its own 5-8
    assert history() == [(s, 100.0 + s) for s in range(1, 5)] + [(s, 200.0 + s) for s in range(5, 10)]


def test_non_finite_values_are_written_as_json_null(tmp_path):
    """A diverged step's loss or gradient norm: NaN and Infinity are not JSON (strict parsers
    refuse them; jq reads Infinity as 1.797e308)."""
    from moe_ep.runs.metrics import StepLog

    def strict(text):
        return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} written into the log"))

    StepLog(tmp_path, enabled=True).step({"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-3,
                                          "per_layer": [1.0, float("-inf")]})
    assert strict((tmp_path / "metrics.jsonl").read_text()) == {
        "step": 1, "loss": None, "grad_norm": None, "lr": 1e-3, "per_layer": [1.0, None]}


# ------------------------------------------------------------------------------ odd files, full disk


def odd_run_folder(tmp_path, case: str):
    """A run folder with one odd entry; returns (the folder, the name the refusal must say, the
    user's file or folder that must come through untouched)."""
    out, user = tmp_path / "run", tmp_path / "users"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    if case == "output folder is a dangling link":
        out.symlink_to(tmp_path / "gone")
        return out, f"{out} is a link to {tmp_path / 'gone'}, which does not exist", user
    out.mkdir()
    if case == "marker is a folder":
        (out / ownership.MARKER).mkdir()
        return out, f"{out / ownership.MARKER} is a folder where the run keeps its file", user
    ownership.mark(out, "run")
    if case in ("metrics.jsonl is a folder", "lock is a folder"):
        name = ownership.METRICS if case.startswith("metrics") else ownership.LOCK_FILE
        (out / name).mkdir()
        return out, f"{out / name} is a folder where the run keeps its file {name}", user
    if case == "metrics.jsonl is a link":
        (out / ownership.METRICS).symlink_to(user / "notes.txt")
        return out, f"{out / ownership.METRICS} is a link where the run keeps its file", user
    if case == "checkpoints/ is a link":
        (out / "checkpoints").symlink_to(user)
        return out, f"{out / 'checkpoints'} is a link (to {user}) where the run keeps its folder checkpoints", user
    root = ownership.make_managed_dir(out / "checkpoints", "checkpoints")
    name = {"a checkpoint is a link": "step_00000002", "a leftover .tmp- is a link": ".tmp-step_00000004"}[case]
    (root / name).symlink_to(user)
    return out, f"{root / name} is a link (to {user}) among the run's checkpoints", user


ODD = ["output folder is a dangling link", "marker is a folder", "metrics.jsonl is a folder", "lock is a folder",
       "metrics.jsonl is a link", "checkpoints/ is a link", "a checkpoint is a link", "a leftover .tmp- is a link"]


@pytest.mark.parametrize("case", ODD)
def test_folders_and_links_where_they_do_not_belong_are_refused_by_name(case, tmp_path):
    out, named, user = odd_run_folder(tmp_path, case)
    with pytest.raises(UsageError) as refused:
        check_output_folders(out, None, 1000, keep=2)
    assert named in str(refused.value) and str(refused.value).startswith("--output-dir: "), str(refused.value)
    assert [p.name for p in user.iterdir()] == ["notes.txt"] and (user / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("what", ["a link", "a folder"])
def test_the_lock_is_never_taken_through_a_link_or_on_a_folder(what, tmp_path):
    target = tmp_path / "users-file"
    target.write_text("mine")
    (tmp_path / "run").mkdir()
    lock = tmp_path / "run" / ownership.LOCK_FILE
    lock.symlink_to(target) if what == "a link" else lock.mkdir()
    with pytest.raises(UsageError, match=f"{lock} is {what} where moe_ep keeps its lock file"):
        OutputLock(tmp_path / "run").acquire()
    assert target.read_text() == "mine"


def test_nothing_is_deleted_through_a_link(tmp_path):
    user = tmp_path / "users"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    root = ownership.make_managed_dir(tmp_path / "run" / "checkpoints", "checkpoints")
    (root / "step_00000002").symlink_to(user)
    (root / ".tmp-step_00000004").symlink_to(user)
    with pytest.raises(RunError, match="step_00000002 is a link .* never deletes through a link"):
        ownership.delete_atomically(root / "step_00000002")
    with pytest.raises(RunError, match=r"\.tmp-step_00000004 is a link .* never deletes through a link"):
        remove_incomplete(root)
    assert (user / "notes.txt").read_text() == "mine"


def fake_disk(monkeypatch, free: int) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: shutil._ntuple_diskusage(1 << 40, (1 << 40) - free, free))


def test_a_folder_of_the_users_or_made_for_something_else_is_never_taken_as_the_run_folder(tmp_path):
    """A non-empty folder without the run's marker is the user's (or another run's checkpoints,
    another tool's export): refused before any work, nothing written into it. A new folder, an
    empty one, and one holding only a run's marked subfolders (its checkpoints copied over) are
    taken."""
    users = tmp_path / "notes"
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match=r"notes was not made by moe_ep \(it has no \.moe_ep-owner marker\)"):
        check_output_folders(users, None, 1, keep=1)
    assert sorted(p.name for p in users.iterdir()) == ["notes.txt"]
    other_run = tmp_path / "other"
    other_run.mkdir()
    ownership.mark(other_run, "run")
    checkpoints = ownership.make_managed_dir(other_run / "checkpoints", "checkpoints")
    step_dir(checkpoints, 2).mkdir()
    with pytest.raises(UsageError, match=r"checkpoints was made by moe_ep for something else \(its \.moe_ep-owner "
                                         r"marker says 'checkpoints'\)"):
        check_output_folders(checkpoints, None, 1, keep=1)
    assert ownership.marker_kind(checkpoints) == "checkpoints"
    loop_run = tmp_path / "loop"  # another script's run: its marker says so, and so does the refusal
    loop_run.mkdir()
    ownership.mark(loop_run, "accelerate_loop")
    (loop_run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(UsageError, match=r"loop was made by moe_ep for something else \(its \.moe_ep-owner marker "
                                         r"says 'accelerate_loop'\)"):
        check_output_folders(loop_run, None, 1, keep=1)
    for taken in (tmp_path / "new", tmp_path / "empty"):
        check_output_folders(taken, None, 1, keep=1)
    (tmp_path / "empty").mkdir()
    check_output_folders(tmp_path / "empty", None, 1, keep=1)
    copied = tmp_path / "copied"
    copied.mkdir()
    shutil.copytree(checkpoints, copied / "checkpoints")
    check_output_folders(copied, None, 1, keep=1)


def test_a_new_folder_is_taken_while_the_ranks_own_start_up_writes_are_in_it(tmp_path):
    """Every rank checks the run folder before the process group exists, while rank 0 may already
    hold its lock there and a peer may be in its write check (a file there for an instant). A rank
    that listed the folder then took the peer's file for the user's and stopped alone (CI, a
    4-process resume: the others waited for it at the rendezvous)."""
    new = tmp_path / "new"
    OutputLock(new).acquire()
    (new / (ownership.WRITE_CHECK_PREFIX + "k2x9q1")).touch()
    check_output_folders(new, None, 1, keep=1)
    (new / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match=r"new was not made by moe_ep"):
        check_output_folders(new, None, 1, keep=1)
    # An empty managed folder left unmarked (a kill between its mkdir and its marker) is taken over,
    # a peer's write check in it too.
    ownership.mark(new, "run")
    (new / "tensorboard").mkdir()
    (new / "tensorboard" / (ownership.WRITE_CHECK_PREFIX + "p3m1x0")).touch()
    check_output_folders(new, None, 1, keep=1)


def _write_manifests(folder: str, writer: int, rounds: int) -> int:
    from pathlib import Path

    from moe_ep.runs import write_manifest

    for i in range(rounds):
        write_manifest(Path(folder), {"tokens.npy": (writer, f"{i:064x}")}, manifest="tokens.manifest.json")
    return rounds


def test_several_writers_of_one_manifest_each_write_it_whole(tmp_path):
    """Several processes writing one manifest at once (a token cache's, several jobs): each writes
    under a name of its own, so the last rename wins, whole. A fixed temporary name let one's rename
    take the file from under another's (FileNotFoundError, a launch stopped)."""
    import multiprocessing

    from moe_ep.runs import local_problems

    with multiprocessing.get_context("spawn").Pool(3) as pool:
        assert pool.starmap(_write_manifests, [(str(tmp_path), w, 200) for w in range(3)]) == [200] * 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokens.manifest.json"]  # no temporary left
    listed = json.loads((tmp_path / "tokens.manifest.json").read_text())["files"]["tokens.npy"]
    assert listed["sha256"] == f"{199:064x}" and listed["bytes"] in (0, 1, 2)
    assert local_problems(tmp_path, manifest="tokens.manifest.json", must_list=["tokens.npy"])  # no such file: said


def test_leftovers_a_running_job_removes_meanwhile_count_for_nothing(tmp_path, monkeypatch):
    """A second job checks the folder of one still running (its lock refuses it just after): the
    first job's .tmp- folders may go while the second counts them, which stopped it with a
    traceback instead of the lock's message."""
    root = ownership.make_managed_dir(tmp_path / "checkpoints", "checkpoints")
    for name in (".tmp-step_00000004", ".trash-step_00000002"):
        (root / name / "sub").mkdir(parents=True)
        (root / name / "shard.distcp").write_bytes(bytes(100))
        (root / name / "sub" / "more.distcp").write_bytes(bytes(7))
    assert ownership.leftover_bytes(root) == 214
    real_walk = os.walk

    def walk_while_the_other_job_deletes(top, *args, **kwargs):
        for i, step in enumerate(real_walk(top, *args, **kwargs)):
            yield step
            if i == 0 and Path(top).name.startswith(".trash-"):
                shutil.rmtree(top)  # the running job's deletion, mid-walk

    monkeypatch.setattr(ownership.os, "walk", walk_while_the_other_job_deletes)
    assert ownership.leftover_bytes(root) == 107 + 100  # the .tmp- folder whole, the other's first file
    monkeypatch.setattr(ownership.os, "walk", real_walk)
    shutil.rmtree(root)  # an --overwrite of the running job took the whole folder
    assert ownership.leftover_bytes(root) == 0


def test_free_space_counts_keep_plus_one_checkpoints_and_the_runs_own_leftovers(tmp_path, monkeypatch):
    out, parameters = tmp_path / "run", 1 << 24  # 12 bytes a parameter, and what the format adds
    one = ownership.checkpoint_bytes(parameters)
    assert one == int(1.05 * 12 * parameters) + (4 << 20)
    fake_disk(monkeypatch, 2 * one)
    # A fresh run with --keep-checkpoints 2 holds 3 at a save's peak.
    with pytest.raises(UsageError, match=r"0\.40 GiB free .* but 3 more checkpoints \(weights and AdamW state; "
                                         r"--keep-checkpoints 2 and one more while a save is written\) take about 0\.60"):
        check_output_folders(out, None, parameters, keep=2)
    check_output_folders(out, None, parameters, keep=1)
    # Two complete ones on disk already: one more is needed. A folder cut short (no manifest) holds
    # less than a checkpoint, so it pays for none.
    root = ownership.make_managed_dir(out / "checkpoints", "checkpoints")
    for step in (2, 4):
        step_dir(root, step).mkdir()
    fake_disk(monkeypatch, one // 2)
    with pytest.raises(UsageError, match=r"but 3 more checkpoints"):
        check_output_folders(out, None, parameters, keep=2)
    for step in (2, 4):
        (step_dir(root, step) / "manifest.json").write_text("{}")
    with pytest.raises(UsageError, match=r"but 1 more checkpoint \(weights"):
        check_output_folders(out, None, parameters, keep=2)
    # An interrupted save's leftover holds the rest: the run removes it at start, so it counts as free.
    (root / ".tmp-step_00000006").mkdir()
    (root / ".tmp-step_00000006" / "__0_0.distcp").write_bytes(bytes(one - one // 2))
    check_output_folders(out, None, parameters, keep=2)
    fake_disk(monkeypatch, one // 4)
    with pytest.raises(UsageError, match=r"\(and 0\.10 GiB in leftovers of interrupted saves, removed at start\)"):
        check_output_folders(out, None, parameters, keep=2)
    # What else the run writes into its folder before its first checkpoint (the example's token cache).
    fake_disk(monkeypatch, one)
    check_output_folders(out, None, parameters, keep=2)
    with pytest.raises(UsageError, match=r"but 1 more checkpoint \(weights.*\) and the token cache take about 0\.40"):
        check_output_folders(out, None, parameters, keep=2, also=(one, "the token cache"))


def test_a_full_disk_is_said_as_one_whatever_the_writer_said(tmp_path, monkeypatch):
    path = tmp_path / "shard.distcp"
    assert failure_cause(path, OSError(errno.ENOSPC, "No space left on device")) == "No space left on device"
    torn = RuntimeError("unexpected pos 704 vs 598")
    fake_disk(monkeypatch, 1 << 30)
    assert failure_cause(path, torn) == "unexpected pos 704 vs 598"
    fake_disk(monkeypatch, 0)
    assert failure_cause(path, torn) == (f"No space left on device (0 bytes free on the file system of {tmp_path}; "
                                         "unexpected pos 704 vs 598)")


def test_a_librarys_save_on_a_full_disk_is_one_line_and_a_bug_stays_a_traceback(tmp_path, monkeypatch):
    """accelerate's save_state and the Trainer's checkpoints and final model (trainer.py and
    accelerate_loop.py): safetensors says a full disk as its own error, which ended the run with a
    traceback. A failure while the disk is full, or an OSError of a block that only writes, is a
    RunError; anything else (a bug) propagates as it was."""
    from moe_ep.runs import library_writes

    class SafetensorError(Exception):
        pass

    tmp = tmp_path / "checkpoints" / ".tmp-step_00000020"
    full = SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")
    fake_disk(monkeypatch, 1000)
    for only_writes in (True, False):
        with pytest.raises(RunError, match=rf"cannot write {tmp}: No space left on device \(1,000 bytes free on the "
                                           rf"file system of {tmp_path / 'checkpoints'}; Error while serializing: "
                                           r".*\); the last complete checkpoint is kept"):
            with library_writes(tmp, only_writes=only_writes):
                raise full
    fake_disk(monkeypatch, 1 << 30)
    with pytest.raises(RunError, match=rf"cannot write {tmp}: Permission denied; the last complete checkpoint"):
        with library_writes(tmp, only_writes=True):
            raise PermissionError(errno.EACCES, "Permission denied")
    for only_writes, bug in ((True, full), (False, full), (False, FileNotFoundError(2, "No such file: data.bin"))):
        with pytest.raises(type(bug)):
            with library_writes(tmp, only_writes=only_writes):
                raise bug
    stop = UsageError("--resume: damaged")
    with pytest.raises(UsageError):
        with library_writes(tmp, only_writes=True):
            raise stop
    # DCP (accelerate's save_state, the Trainer's sharded checkpoints) raises CheckpointException,
    # a BaseException, with every failing rank's own error: said once, rank by rank.
    from torch.distributed.checkpoint.api import CheckpointException

    dcp_full = CheckpointException("save failed", {1: (OSError(errno.ENOSPC, "No space left on device"), None),
                                                   0: (OSError(errno.ENOSPC, "No space left on device"), None)})
    fake_disk(monkeypatch, 1000)
    with pytest.raises(RunError, match=rf"cannot write {tmp}: rank 0: No space left on device; rank 1: No space "
                                       r"left on device; the last complete checkpoint is kept"):
        with library_writes(tmp, only_writes=False):
            raise dcp_full
    fake_disk(monkeypatch, 1 << 30)
    with pytest.raises(CheckpointException):  # not a full disk, a block that does more than write: as it was
        with library_writes(tmp, only_writes=False):
            raise dcp_full


def test_a_rank_that_lost_its_peer_outside_the_step_loop_says_nothing(capsys):
    """The peer that failed says why (or the launcher reports its death): the survivors exit 1
    without a traceback or a line that would come after the peer's."""
    from moe_ep.runs import report_failure

    gone = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                        "[127.0.0.1]:29500")
    for rank in (0, 1):
        assert report_failure(gone, rank=rank, world_size=2) == 1
    assert capsys.readouterr().err == ""
    assert report_failure(RuntimeError("CUDA error: an illegal memory access"), rank=0, world_size=2) is None


def _stop_on_every_rank(rank, world_size, agreed, rank_0_delay_s):
    """Every rank raises the same UsageError (rank 0 late); how long each rank took to return."""
    import time

    from moe_ep.runs import UsageError, run_reported

    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)

    def train(_):
        if rank == 0:
            time.sleep(rank_0_delay_s)
        raise UsageError("--steps must be >= 1, got 0", agreed=agreed)

    start = time.monotonic()
    return run_reported(train, None), time.monotonic() - start


@pytest.mark.slow
@pytest.mark.parametrize("agreed", [True, False])
def test_a_rank_leaving_the_report_to_rank_0_exits_only_after_rank_0_said_it(agreed):
    """A launcher ends the job at the first rank that exits with an error: a rank that left an
    agreed error's line to rank 0 and exited first would get rank 0 killed before it spoke (seen in
    CI through torchrun). Such a rank waits for rank 0's line; a rank that says its own error does
    not."""
    from dist_utils import run_ranks

    delay_s = 2.0
    (code_0, _), (code_1, seconds_1) = run_ranks(_stop_on_every_rank, 2, agreed, delay_s)
    assert code_0 == code_1 == 2
    if agreed:
        assert seconds_1 >= delay_s, seconds_1
    else:
        assert seconds_1 < delay_s, seconds_1


def _stop_on_rank_1_alone(rank, world_size):
    """Rank 1 raises an error it takes to be every rank's; rank 0 goes on past the wait. What
    rank 1 said and its exit status."""
    import contextlib
    import io
    import time
    from datetime import timedelta

    from moe_ep.runs import UsageError, errors, run_reported

    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
    errors.RANK_0_REPORT_WAIT = timedelta(seconds=1)

    def train(_):
        if rank == 1:
            raise UsageError("--output-dir: out was not made by moe_ep", agreed=True)
        time.sleep(3)

    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        code = run_reported(train, None)
    return code, said.getvalue()


@pytest.mark.slow
def test_an_error_left_to_rank_0_that_rank_0_never_met_is_said_by_its_rank():
    """A check every rank makes alike may still see something else on one rank (a peer's file in
    the folder for an instant): that rank leaves the line to rank 0, which never raised it. Once
    its wait for rank 0's line runs out, it says the line itself, named as its own; before, the job
    ended with exit status 2 and no word of why (CI, a 4-process resume)."""
    from dist_utils import run_ranks

    (code_0, said_0), (code_1, said_1) = run_ranks(_stop_on_rank_1_alone, 2)
    assert (code_0, said_0) == (0, "")
    assert code_1 == 2 and said_1 == "error (rank 1): --output-dir: out was not made by moe_ep\n", said_1


def test_a_rank_launched_on_its_own_says_an_error_left_to_rank_0_itself(monkeypatch, capsys):
    """WORLD_SIZE and RANK set but no launcher's store and no process group yet (srun, a pod per
    rank): a before-any-work check that failed on this rank only (a node-local read-only disk)
    was left to rank 0, which passed it, and the rank ended with status 2 and no word."""
    from moe_ep.runs import run_reported, said_by_every_rank

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)

    def train(_):
        with said_by_every_rank():
            raise UsageError("--output-dir: cannot write in /scratch/run: Read-only file system")

    assert run_reported(train, None) == 2
    assert capsys.readouterr().err == "error (rank 1): --output-dir: cannot write in /scratch/run: Read-only file system\n"

    def own(_):  # an error of this rank's alone: said once, by it
        raise UsageError("--output-dir: not ours")

    assert run_reported(own, None) == 2
    assert capsys.readouterr().err == "error (rank 1): --output-dir: not ours\n"


def test_run_reported_leaves_the_process_group_to_the_exit_which_destroys_it(monkeypatch):
    """A finished run keeps its process group (a process may run again on it, and accelerate's
    state outlives the run); a handler destroys it before the interpreter's exit (left to the
    exit, gloo's threads can abort the rank after a run that succeeded), registered once."""
    import atexit

    import torch.distributed as dist

    from moe_ep.runs import errors, run_reported

    registered = []
    monkeypatch.setattr(atexit, "register", registered.append)
    monkeypatch.setattr(atexit, "unregister", lambda f: registered.remove(f) if f in registered else None)

    def start_one(_):
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        dist.barrier()

    try:
        assert run_reported(start_one, None) == 0 and run_reported(start_one, None) == 0
        assert dist.is_initialized() and registered == [errors.destroy_process_group_at_exit]
    finally:
        errors.destroy_process_group_at_exit()
    assert not dist.is_initialized()
    errors.destroy_process_group_at_exit()  # nothing to destroy: a no-op


def test_an_earlier_export_holding_files_it_did_not_write_is_not_replaced(tmp_path):
    """An export replaces its folder whole: files added to an earlier one since (a tokenizer, notes)
    were deleted with it. Its marker lists what it wrote; anything else stops the next export
    before any work. An export made before the list was recorded wrote what save_pretrained writes."""
    from moe_ep.runs import check_export_target, files_added_to_export, mark

    out = tmp_path / "hf"
    out.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (out / name).write_text("{}")
    mark(out, "export", files=["config.json", "generation_config.json", "model.safetensors"])
    check_export_target(out, {}, "--out")  # replaced: nothing else in it
    (out / "tokenizer.json").write_text("{}")
    (out / "notes").mkdir()
    (out / "notes" / "eval.txt").write_text("mine")
    assert files_added_to_export(out) == ["notes/eval.txt", "tokenizer.json"]
    with pytest.raises(UsageError, match=r"earlier export that also holds files it did not write \(notes/eval.txt, "
                                         r"tokenizer.json\)"):
        check_export_target(out, {}, "--out")
    mark(out, "export")  # an export from before the list: save_pretrained's files only
    assert files_added_to_export(out) == ["notes/eval.txt", "tokenizer.json"]
    shutil.rmtree(out / "notes")
    (out / "tokenizer.json").unlink()
    (out / "model-00001-of-00002.safetensors").write_text("{}")
    check_export_target(out, {}, "--out")
