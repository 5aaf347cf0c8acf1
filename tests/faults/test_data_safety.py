"""Fault injection, in one process (fast): what the user owns is never deleted, damaged checkpoints
and token caches are found and named, and a run never starts on a folder it cannot write or fill.

Each test injects one fault of issue #13 into examples/mixtral and asserts its outcome: a clear
error naming what (before any work where it can be known then), nothing of the user's deleted,
and, where the run goes on, losses bit for bit those of an undisturbed run. The launched cases
(several ranks, signals, a second job) are in test_launched_faults.py; the README's reliability
section lists both."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from example_runs import (
    COMMON,
    STEPS,
    copy_run,
    flip_byte,
    losses,
    rewrite,
    snapshot,
    train_in_process,
    trained_model,
)

# The example's own module (example_runs put its folder on the path).
import export  # noqa: E402
from moe_ep.runs import checkpoint as ckpt  # noqa: E402
from moe_ep.runs import integrity, ownership, read_metrics  # noqa: E402

# Trains the example's model again and again (about a minute in all): not in the quick subset
# (bash scripts/test.sh --quick).
pytestmark = pytest.mark.slow


def train_cli(argv, capsys) -> tuple[int, str]:
    """train.py's main in this process (world size 1): (exit status, what it printed to stderr)."""
    capsys.readouterr()
    code = train_in_process(argv)
    return code, capsys.readouterr().err


@pytest.fixture
def base(one_process_run) -> Path:
    """An undisturbed one-process run (conftest.py's, shared with test_rollback.py): checkpoints at
    steps 2, 4 and 6, its losses the reference."""
    return one_process_run


def truncate(path: Path) -> None:
    rewrite(path, path.read_bytes()[: path.stat().st_size // 2])


def shard(step: Path) -> Path:
    return sorted(step.glob(f"*{ckpt.SHARD_SUFFIX}"))[0]


# Damage -> (how, the words that name it in the report).
DAMAGE = {
    "flipped byte in a .distcp shard": (lambda s: flip_byte(shard(s)), "__0_0.distcp does not match its checksum"),
    "truncated .distcp shard": (lambda s: truncate(shard(s)), "__0_0.distcp has "),
    "missing .distcp shard": (lambda s: shard(s).unlink(), "__0_0.distcp is missing"),
    "truncated .metadata": (lambda s: truncate(s / ".metadata"), ".metadata has "),
    "corrupt trainer_state.json": (lambda s: rewrite(s / "trainer_state.json",
                                                     (s / "trainer_state.json").read_bytes().replace(b"{", b"[", 1)),
                                   "trainer_state.json does not match its checksum"),
    "missing manifest (write cut short)": (lambda s: (s / "manifest.json").unlink(), "manifest.json is missing"),
    # A well-formed manifest that vouches for nothing: what it leaves out would load unchecked.
    "manifest listing no file": (lambda s: edit_manifest(s / "manifest.json", lambda files: {}),
                                 "manifest.json does not list .metadata, __0_0.distcp, config.json and"),
}


def edit_manifest(path: Path, change) -> None:
    body = json.loads(path.read_text())
    body["files"] = change(body["files"])
    rewrite(path, json.dumps(body).encode())


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_checkpoint_is_skipped_for_the_newest_intact_one(kind, base, tmp_path, capsys):
    out = copy_run(base, tmp_path / "run")
    damage, named = DAMAGE[kind]
    damage(out / "checkpoints" / f"step_{STEPS:08d}")
    code, err = train_cli([*COMMON, "--output-dir", str(out)], capsys)
    assert code == 0, err
    step6, step4 = (out / "checkpoints" / f"step_{s:08d}" for s in (STEPS, 4))
    assert f"warning: --resume auto: skipping the checkpoint {step6} is damaged: " in err and named in err, err
    assert err.count("warning:") == 1
    resumed, reference = losses(out), losses(base)
    assert [resumed[s] for s in (5, 6)] == [reference[s] for s in (5, 6)]  # bit for bit
    # The damaged checkpoint was replaced by the resumed run's own, intact one.
    assert ckpt.quick_problems(step6) == [] and integrity.verify(step6) == [] and integrity.verify(step4) == []


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_explicit_resume_of_a_damaged_checkpoint_stops_naming_the_file(kind, base, tmp_path, capsys):
    out = copy_run(base, tmp_path / "run")
    damage, named = DAMAGE[kind]
    step6 = out / "checkpoints" / f"step_{STEPS:08d}"
    damage(step6)
    before = snapshot(out)
    code, err = train_cli([*COMMON, "--steps", "8", "--output-dir", str(out), "--resume", str(step6)], capsys)
    assert code == 2
    assert f"error: --resume: the checkpoint {step6} is damaged: " in err and named in err, err
    assert "Traceback" not in err
    after = snapshot(out)
    assert {k: v for k, v in after.items() if k != ownership.LOCK_FILE} == {
        k: v for k, v in before.items() if k != ownership.LOCK_FILE}


def test_every_checkpoint_damaged_stops_instead_of_starting_afresh(base, tmp_path, capsys):
    out = copy_run(base, tmp_path / "run")
    for step in ckpt.step_folders(out / "checkpoints"):
        (step / "manifest.json").unlink()
    code, err = train_cli([*COMMON, "--output-dir", str(out)], capsys)
    assert code == 2 and "--resume auto: every checkpoint in" in err and "is damaged" in err, err
    assert len(ckpt.step_folders(out / "checkpoints")) == 3  # nothing deleted


SHORT = [*COMMON, "--steps", "2", "--warmup-steps", "1", "--checkpoint-every", "0"]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory) -> Path:
    """Two steps of the base run's data in a folder that never had a token cache."""
    out = tmp_path_factory.mktemp("short") / "run"
    assert train_in_process([*SHORT, "--output-dir", str(out)]) == 0
    return out


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "manifest missing", "manifest listing no file"])
def test_damaged_token_cache_is_tokenized_again_not_trained_on(damage, base, short_run, tmp_path, capsys):
    out = copy_run(base, tmp_path / "run")
    cache = next((out / "token_cache").glob("tokens-*.npy"))
    if damage == "flipped byte":
        flip_byte(cache)
    elif damage == "truncated":
        truncate(cache)
    elif damage == "manifest missing":
        (out / "token_cache" / cache.name.replace(".npy", ".manifest.json")).unlink()
    else:
        edit_manifest(out / "token_cache" / cache.name.replace(".npy", ".manifest.json"), lambda files: {})
    code, err = train_cli([*SHORT, "--overwrite", "--output-dir", str(out)], capsys)
    assert code == 0, err
    assert f"warning: the token cache {cache} is damaged (" in err and "tokenizing the data again" in err, err
    assert ckpt.local_problems(cache.parent, manifest=cache.name.replace(".npy", ".manifest.json")) == []
    assert losses(out) == losses(short_run)  # the same data as a run that never had a cache


# ------------------------------------------------------------------------ exports and --overwrite


@pytest.mark.parametrize("where", ["the run folder", "an ancestor of it", "inside it"])
def test_export_dir_around_the_run_folder_is_refused_before_any_work(where, base, tmp_path, capsys):
    out = copy_run(base, tmp_path / "parent" / "run")
    export_dir = {"the run folder": out, "an ancestor of it": tmp_path / "parent", "inside it": out / "hf"}[where]
    before = snapshot(tmp_path)
    code, err = train_cli([*COMMON, "--steps", "8", "--output-dir", str(out), "--export-dir", str(export_dir)], capsys)
    relation = {"the run folder": "is", "an ancestor of it": "is an ancestor of", "inside it": "is inside"}[where]
    assert code == 2 and f"error: --export-dir {export_dir} {relation} the run folder (--output-dir) {out}" in err, err
    assert snapshot(tmp_path) == before


def test_export_never_replaces_a_users_folder(base, tmp_path, capsys):
    step6 = base / "checkpoints" / f"step_{STEPS:08d}"
    users = tmp_path / "mine"
    users.mkdir()
    (users / "thesis.tex").write_text("three years of work")
    for out, message in [
        (users, f"--out: {users} is a non-empty folder that no moe_ep export wrote"),
        (base, f"--out {base} is the run folder {base}"),
        (step6, f"--out {step6} is the checkpoint {step6}"),
        (base.parent, f"--out {base.parent} is an ancestor of the checkpoint {step6}"),
        (base / "hf", f"--out {base / 'hf'} is inside the run folder {base}"),
    ]:
        before = snapshot(out)
        assert export.main(["--checkpoint", str(step6), "--out", str(out)]) == 2
        assert message in capsys.readouterr().err
        assert snapshot(out) == before
    assert not (base / "hf").exists() and (users / "thesis.tex").read_text() == "three years of work"
    # The name the export writes under while it works is the user's too, here.
    (tmp_path / ".tmp-hf").mkdir()
    (tmp_path / ".tmp-hf" / "notes.txt").write_text("mine")
    assert export.main(["--checkpoint", str(step6), "--out", str(tmp_path / "hf")]) == 2
    assert "holds files that no moe_ep export wrote" in capsys.readouterr().err
    assert (tmp_path / ".tmp-hf" / "notes.txt").read_text() == "mine"
    # An empty folder is taken (nothing in it to lose), and an earlier export replaced.
    (tmp_path / "empty").mkdir()
    for _ in range(2):
        assert export.main(["--checkpoint", str(step6), "--out", str(tmp_path / "empty")]) == 0
        assert ownership.marker_kind(tmp_path / "empty") == "export"


def test_a_second_export_to_a_folder_being_written_is_refused(base, tmp_path, capsys):
    """Two exports to one folder at once each took the other's .tmp- folder for a leftover and
    deleted it, and could leave one checkpoint's weights under the other's marker: the export holds
    a lock beside the folder, and a second one stops naming its holder, touching nothing."""
    step6 = base / "checkpoints" / f"step_{STEPS:08d}"
    out = tmp_path / "hf"
    # The other export: a process holding the lock (POSIX locks are per process).
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from moe_ep.runs import export_lock\n"
         f"with export_lock(Path({str(out)!r}), '--out'):\n    print('held', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        before = snapshot(tmp_path)
        assert export.main(["--checkpoint", str(step6), "--out", str(out)]) == 2
        assert f"error: --out {tmp_path} is in use by another job (pid {holder.pid}" in capsys.readouterr().err
        assert snapshot(tmp_path) == before
    finally:
        holder.kill()
        holder.wait()
    assert export.main(["--checkpoint", str(step6), "--out", str(out)]) == 0  # let go: the next one runs
    assert ownership.marker_kind(out) == "export"


@pytest.mark.parametrize("damage", ["flipped byte", "shard left out of the manifest"])
def test_a_damaged_checkpoint_is_not_exported(damage, base, tmp_path, capsys):
    step6 = copy_run(base, tmp_path / "run") / "checkpoints" / f"step_{STEPS:08d}"
    if damage == "flipped byte":
        flip_byte(shard(step6))
        named = "__0_0.distcp does not match"
    else:
        edit_manifest(step6 / "manifest.json", lambda files: {k: v for k, v in files.items() if k != shard(step6).name})
        named = "manifest.json does not list __0_0.distcp, so nothing vouches for it"
    assert export.main(["--checkpoint", str(step6), "--out", str(tmp_path / "hf")]) == 2
    assert f"--checkpoint: the checkpoint {step6} is damaged: {named}" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_overwrite_deletes_only_the_runs_own_files(base, tmp_path, capsys):
    out = copy_run(base, tmp_path / "run")
    (out / "notes.txt").write_text("the user's")
    (out / "hf").mkdir()
    (out / "hf" / "weights.bin").write_text("the user's")
    cache = sorted(p.name for p in (out / "token_cache").iterdir())
    code, err = train_cli([*SHORT, "--overwrite", "--output-dir", str(out)], capsys)
    assert code == 0, err
    assert [p.name for p in ckpt.step_folders(out / "checkpoints")] == ["step_00000002"]
    assert sorted(losses(out)) == [1, 2]  # metrics.jsonl started afresh
    assert (out / "notes.txt").read_text() == (out / "hf" / "weights.bin").read_text() == "the user's"
    assert sorted(p.name for p in (out / "token_cache").iterdir()) == cache


@pytest.mark.parametrize("whose", ["checkpoints", "metrics.jsonl", "tensorboard"])
def test_overwrite_refuses_a_folder_holding_the_users_files_under_the_runs_names(whose, tmp_path, capsys):
    out = tmp_path / "run"
    if whose == "metrics.jsonl":
        out.mkdir()
        (out / whose).write_text("the user's own log\n")
    else:
        (out / whose).mkdir(parents=True)
        (out / whose / "results.csv").write_text("the user's")
    before = snapshot(out)
    code, err = train_cli([*COMMON, "--overwrite", "--output-dir", str(out)], capsys)
    assert code == 2 and f"--output-dir: {out / whose} was not" in err and "moe_ep never" in err, err
    assert snapshot(out) == before


# -------------------------------------------------------------------- space, writability, files


def fake_disk_usage(free: int):
    return lambda path: shutil._ntuple_diskusage(total=1 << 40, used=(1 << 40) - free, free=free)


def test_too_little_free_space_stops_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(ownership.shutil, "disk_usage", fake_disk_usage(10 << 20))
    out = tmp_path / "run"
    code, err = train_cli([*COMMON, "--output-dir", str(out)], capsys)
    # The tiny model: 3.4M parameters x 12 bytes, and what the format adds (5% + 4 MiB), 6 times
    # (--keep-checkpoints 5, and the next one), and its token cache (2 bytes a token,
    # --max-corpus-tokens at most).
    assert code == 2 and "--output-dir: 0.01 GiB free on the file system of" in err, err
    assert ("but 6 more checkpoints (weights and AdamW state; --keep-checkpoints 5 and one more while a save is "
            "written) and the token cache take about 0.26 GiB") in err
    assert not out.exists()


def test_a_full_disk_reported_as_a_torn_write_says_no_space_left(base, tmp_path, capsys, monkeypatch):
    """torch's writer reports a full disk inside a DCP shard as ``unexpected pos N vs M``: said as
    no space left, naming the folder, step 2 intact; once space is freed the same command removes
    the leftover and resumes onto the undisturbed losses."""
    import torch.distributed.checkpoint.filesystem as dcp_files

    write_item = dcp_files._write_item

    def full_in_step_4(transforms, stream, *args, **kwargs):
        if ".tmp-step_00000004" in str(getattr(stream, "name", "")):
            monkeypatch.setattr(ownership.shutil, "disk_usage", fake_disk_usage(0))
            raise RuntimeError("unexpected pos 704 vs 598")
        return write_item(transforms, stream, *args, **kwargs)

    monkeypatch.setattr(dcp_files, "_write_item", full_in_step_4)
    out = tmp_path / "run"
    code, err = train_cli([*COMMON, "--output-dir", str(out)], capsys)
    tmp, step2 = out / "checkpoints" / ".tmp-step_00000004", out / "checkpoints" / "step_00000002"
    assert code == 1
    assert err.strip() == (f"error: cannot write the checkpoint {tmp}: rank 0: No space left on device (0 bytes free "
                           f"on the file system of {tmp}; unexpected pos 704 vs 598); {step2} is intact")
    monkeypatch.undo()
    code, err = train_cli([*COMMON, "--output-dir", str(out)], capsys)
    assert code == 0, err
    assert losses(out) == losses(base) and not tmp.exists()


@pytest.mark.parametrize("case", ["metrics.jsonl is a folder", "a checkpoint is a link"])
def test_odd_files_stop_the_run_before_any_work_naming_them(case, base, tmp_path, capsys):
    """A folder where the run keeps a file, a link where it keeps a checkpoint (whose pruning would
    otherwise crash every later start): one line naming it, exit status 2, nothing touched."""
    out = copy_run(base, tmp_path / "run")
    if case == "metrics.jsonl is a folder":
        (out / "metrics.jsonl").unlink()
        (out / "metrics.jsonl").mkdir()
        named = f"{out / 'metrics.jsonl'} is a folder where the run keeps its file metrics.jsonl"
    else:
        step2 = out / "checkpoints" / "step_00000002"
        step2.rename(tmp_path / "elsewhere")
        step2.symlink_to(tmp_path / "elsewhere")
        named = f"{step2} is a link (to {tmp_path / 'elsewhere'}) among the run's checkpoints"
    before, kept = snapshot(out), snapshot(tmp_path / "elsewhere") if case != "metrics.jsonl is a folder" else {}
    code, err = train_cli([*COMMON, "--steps", "8", "--keep-checkpoints", "1", "--output-dir", str(out)], capsys)
    assert code == 2 and err.strip().startswith(f"error: --output-dir: {named}"), err
    assert len(err.strip().splitlines()) == 1
    assert snapshot(out) == before and (not kept or snapshot(tmp_path / "elsewhere") == kept)


def test_disk_full_during_a_save_keeps_the_previous_checkpoint_and_resumes_bit_for_bit(base, tmp_path, capsys,
                                                                                       monkeypatch):
    """A full disk inside the step-4 save (moe_ep.runs.checkpoint's hook: the rank's DCP shard is a link to
    /dev/full, whose writes fail with ENOSPC): one line naming the folder and the cause, step 2
    intact; the same command then resumes from step 2 onto the undisturbed losses."""
    out = tmp_path / "run"
    monkeypatch.setenv(ckpt.DISK_FULL_HOOK, "4:0")
    code, err = train_cli([*COMMON, "--output-dir", str(out)], capsys)
    step2 = out / "checkpoints" / "step_00000002"
    assert code == 1
    assert err.strip() == (f"error: cannot write the checkpoint {out / 'checkpoints' / '.tmp-step_00000004'}: rank 0: "
                           f"No space left on device; {step2} is intact")
    assert integrity.verify(step2) == [] and not (out / "checkpoints" / "step_00000004").exists()
    monkeypatch.delenv(ckpt.DISK_FULL_HOOK)
    code, err = train_cli([*COMMON, "--output-dir", str(out)], capsys)
    assert code == 0, err
    assert losses(out) == losses(base)


@contextmanager
def read_only(folder: Path):
    """``folder`` read-only for this process: by its mode, or for root (whom modes do not stop) by a
    read-only bind mount of it over itself."""
    if os.geteuid() != 0:
        mode = folder.stat().st_mode
        folder.chmod(0o555)
        try:
            yield
        finally:
            folder.chmod(mode)
        return
    mounted = subprocess.run(["mount", "--bind", "-o", "ro", str(folder), str(folder)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"running as root without the right to mount: {mounted.stderr.decode().strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_read_only_output_folder_stops_before_any_work(base, tmp_path, capsys):
    out = copy_run(base, tmp_path / "run")
    before = snapshot(out)
    with read_only(out / "checkpoints"):
        code, err = train_cli([*COMMON, "--steps", "8", "--output-dir", str(out)], capsys)
    assert code == 2 and f"error: --output-dir: cannot write in {out / 'checkpoints'}: " in err, err
    assert ("Read-only file system" if os.geteuid() == 0 else "Permission denied") in err
    assert snapshot(out) == before


@pytest.fixture(scope="module")
def exported(one_process_run, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("exported") / "hf"
    step6 = one_process_run / "checkpoints" / f"step_{STEPS:08d}"
    assert export.main(["--checkpoint", str(step6), "--out", str(folder)]) == 0
    return folder


@pytest.mark.parametrize("damage", ["model.safetensors truncated", "model.safetensors garbage", "config.json"])
def test_corrupt_pretrained_files_are_named(damage, exported, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(exported, model)
    name = damage.split()[0]
    if damage.endswith("truncated"):
        truncate(model / name)
    else:
        (model / name).write_bytes(b"\x00garbage{")
    out = tmp_path / "run"
    code, err = train_cli([*COMMON, "--model", str(model), "--tokenizer", "byte", "--output-dir", str(out)], capsys)
    assert code == 2 and f"error: --model: {model / name} " in err, err
    assert "Traceback" not in err and not out.exists()


def test_non_finite_weights_are_never_checkpointed(tmp_path):
    from transformers import AutoModelForCausalLM

    from models import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config())
    opt = torch.optim.AdamW(model.parameters())
    root = tmp_path / "checkpoints"
    state = {"step": 2, "tokens_seen": 0, "world_size": 1, "data": {}}
    good = ckpt.save_checkpoint(root, 2, model, opt, state, rank=0, barrier=lambda: None, keep=1)
    with torch.no_grad():
        model.model.layers[1].mlp.experts.down_proj[3, 0, 0] = float("nan")
    with pytest.raises(ckpt.RunError, match=(r"step 4: the weights hold NaN or infinite values \(model.layers.1.mlp."
                                             r"experts.down_proj on rank 0\); not checkpointed, .*step_00000002 is "
                                             "intact")):
        ckpt.save_checkpoint(root, 4, model, opt, {**state, "step": 4}, rank=0, barrier=lambda: None, keep=1)
    assert ckpt.step_folders(root) == [good] and integrity.verify(good) == []
    assert sorted(p.name for p in root.iterdir()) == [ownership.MARKER, good.name]


def test_a_lock_left_by_a_dead_job_is_taken_over_and_said(tmp_path, capsys):
    """A job killed while holding the folder leaves its record in the lock file (the kernel released
    the lock itself): the next job takes the folder and says whose it was."""
    out = tmp_path / "run"
    out.mkdir()
    record = {"host": "node-7", "pid": 4242, "job": "10.0.0.7:29500 run 1", "since": "2026-01-01 00:00:00 UTC"}
    (out / ownership.LOCK_FILE).write_text(json.dumps(record))
    code, err = train_cli([*SHORT, "--output-dir", str(out)], capsys)
    assert code == 0, err
    assert (f"warning: {out} was held by a job that ended without letting go of it (pid 4242 on host node-7, job "
            "10.0.0.7:29500 run 1, since 2026-01-01 00:00:00 UTC); this job holds it now") in err
    assert (out / ownership.LOCK_FILE).read_text() == ""  # let go at the end


# ----------------------------------------------------------------------------- non-finite steps


def poison(monkeypatch, *, grads_at=(), weights_at=()) -> None:
    """Make the run's steps ``grads_at`` (1-based) produce a NaN gradient norm with a finite loss
    (every gradient of the LM head NaN: the case a step used to apply), and the weights NaN right
    after the optimizer step of ``weights_at``."""
    import train

    real_make_step = train.make_step

    def make_step(target, optimizer, *args, **kwargs):
        step = real_make_step(target, optimizer, *args, **kwargs)
        forwards = [0]  # one forward per step here (one process, no accumulation)
        target.register_forward_pre_hook(lambda module, inputs: forwards.__setitem__(0, forwards[0] + 1))
        weight = target.lm_head.weight
        weight.register_hook(lambda g: torch.full_like(g, float("nan")) if forwards[0] in grads_at else g)

        def after_step(opt, args, kwargs):
            if forwards[0] in weights_at:
                with torch.no_grad():
                    weight[0, 0] = float("nan")

        optimizer.register_step_post_hook(after_step)
        return step

    monkeypatch.setattr(train, "make_step", make_step)


def state_of(step: Path) -> dict[str, torch.Tensor]:
    return trained_model(step).state_dict()


def test_poisoned_steps_are_skipped_logged_and_never_applied(tmp_path, capsys, monkeypatch):
    poison(monkeypatch, grads_at=(3, 4))
    out = tmp_path / "run"
    code = train_in_process([*COMMON, "--output-dir", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    for step, in_a_row in ((3, 1), (4, 2)):
        line = next(l for l in printed.splitlines() if l.startswith(f"step {step:>6} | skipped: loss "))
        assert line.endswith(f", grad_norm nan (not finite on some rank); nothing applied | {in_a_row} in a row "
                             f"(the run stops at 20), {in_a_row} in all"), line
    records = {r["step"]: r for r in read_metrics(out / "metrics.jsonl")}
    assert [s for s, r in records.items() if r.get("skipped")] == [3, 4]
    assert records[3]["grad_norm"] is None and records[4]["loss"] > 0 and records[6]["steps_skipped"] == 2
    assert "steps skipped (non-finite loss or gradient norm): 2" in printed
    # Steps 3 and 4 moved nothing: the step-4 checkpoint holds the step-2 weights, bit for bit.
    root = out / "checkpoints"
    after2, after4 = state_of(root / "step_00000002"), state_of(root / "step_00000004")
    assert all(torch.equal(after2[k], after4[k]) for k in after2)
    assert all(torch.isfinite(t).all() for t in state_of(root / f"step_{STEPS:08d}").values())


def test_too_many_skips_in_a_row_stop_the_run_with_the_good_checkpoint_kept(tmp_path, capsys, monkeypatch):
    poison(monkeypatch, grads_at=range(3, 9))
    out = tmp_path / "run"
    code, err = train_cli([*COMMON, "--steps", "8", "--max-consecutive-skips", "3", "--keep-checkpoints", "1",
                           "--output-dir", str(out)], capsys)
    step4 = out / "checkpoints" / "step_00000004"
    assert code == 1
    assert err.startswith("error: step 5: 3 steps in a row were skipped (max_consecutive_skips=3): the last had loss "), err
    assert err.rstrip().endswith(f"; stopped; the last complete checkpoint, {step4}, holds finite weights"), err
    assert ckpt.step_folders(out / "checkpoints") == [step4] and integrity.verify(step4) == []


def test_non_finite_weights_stop_the_run_before_they_are_checkpointed(tmp_path, capsys, monkeypatch):
    poison(monkeypatch, weights_at=(4,))
    out = tmp_path / "run"
    code, err = train_cli([*COMMON, "--keep-checkpoints", "1", "--output-dir", str(out)], capsys)
    step2 = out / "checkpoints" / "step_00000002"
    assert code == 1
    assert err.strip() == (f"error: step 4: the weights hold NaN or infinite values (lm_head.weight on rank 0); not "
                           f"checkpointed, {step2} is intact")
    # With --keep-checkpoints 1 too, the last good checkpoint survives: it is pruned only once a
    # newer one is written.
    assert ckpt.step_folders(out / "checkpoints") == [step2] and integrity.verify(step2) == []
