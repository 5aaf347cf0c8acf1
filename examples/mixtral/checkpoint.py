"""Sharded checkpoints (torch.distributed.checkpoint) that a killed run can always resume from.

A checkpoint is written into ``checkpoints/.tmp-step_XXXXXXXX`` by every rank, and only once all
ranks have finished (DCP's metadata, each rank's RNG state, the trainer state) does rank 0 rename it
to ``checkpoints/step_XXXXXXXX``. A rename within one folder is atomic, so a folder with the final
name is always complete, and a run killed mid-write leaves only a ``.tmp-`` folder, which is never
read and is removed by the next run. Deletion is the same in reverse: a checkpoint that is replaced
or pruned is first renamed to ``.trash-step_XXXXXXXX``, then deleted, so a run killed mid-delete
never leaves a partly deleted folder under a final name. The output folder must be shared by all
nodes.

Test hook: with ``MIXTRAL_EXAMPLE_TEST_PAUSE_IN_CHECKPOINT=N`` in the environment, every rank stops
inside the save of step N once its shards and RNG state are in the ``.tmp-`` folder, touches
``paused-rankR`` there and sleeps, so that a test can kill the run mid-write deterministically.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from errors import UsageError

STEP_DIR = re.compile(r"^step_(\d{8})$")
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
TRAINER_STATE = "trainer_state.json"
PAUSE_HOOK = "MIXTRAL_EXAMPLE_TEST_PAUSE_IN_CHECKPOINT"  # see the module's docstring
# Optimizer state and hyper-parameters keyed by parameter name (state.<fqn>.exp_avg,
# param_groups.<fqn>.lr), not by position in the param groups: the ranks of different pipeline
# stages hold different groups, and a checkpoint then loads under any other layout.
STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


@contextmanager
def quiet_single_process():
    """DCP warns that it assumes a single process when no process group exists; that is the intent
    here (one-process runs and the export), so the warning is dropped, and only that one."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def is_complete(path: Path) -> bool:
    return (
        STEP_DIR.match(path.name) is not None
        and (path / ".metadata").is_file()
        and (path / TRAINER_STATE).is_file()
    )


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first; ``.tmp-`` folders never count."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and is_complete(p)]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name)[1]))


def latest_checkpoint(root: Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1] if found else None


def remove_incomplete(root: Path) -> list[Path]:
    """Delete the leftovers of interrupted writes and deletions (rank 0 only). Returns what it
    removed."""
    if not root.is_dir():
        return []
    stale = sorted(p for p in root.iterdir() if p.name.startswith((TMP_PREFIX, TRASH_PREFIX)))
    for path in stale:
        shutil.rmtree(path)
    return stale


def delete_atomically(path: Path) -> None:
    """Rename ``path`` to a ``.trash-`` name beside it (atomic), then delete it: whenever the
    deletion stops, nothing is left under the old name."""
    trash = path.with_name(TRASH_PREFIX + path.name)
    if trash.exists():  # left by an earlier interrupted deletion
        shutil.rmtree(trash)
    os.rename(path, trash)
    _fsync_dir(path.parent)
    shutil.rmtree(trash)


def clear_run(output_dir: Path) -> None:
    """What --overwrite deletes: checkpoints, metrics and TensorBoard logs (the token cache stays)."""
    for path in (output_dir / "checkpoints", output_dir / "tensorboard"):
        if path.exists():
            delete_atomically(path)
    for leftover in output_dir.glob(TRASH_PREFIX + "*"):
        shutil.rmtree(leftover)
    (output_dir / "metrics.jsonl").unlink(missing_ok=True)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(root: Path, step: int, model, optimizer, trainer_state: dict, *, rank: int, barrier,
                    keep: int, config=None) -> Path:
    """Collective: every rank calls it with what it trains (the model, or its pipeline stages
    under the model's names, layout.rank_view). Returns the final folder."""
    final, tmp = step_dir(root, step), root / f"{TMP_PREFIX}step_{step:08d}"
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS)
    with quiet_single_process():
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    torch.save(rng_state(), rng_file(tmp, rank))
    if os.environ.get(PAUSE_HOOK) == str(step):
        (tmp / f"paused-rank{rank:05d}").touch()
        time.sleep(3600)
    barrier()
    if rank == 0:
        (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=1))
        if config is not None:
            config.save_pretrained(tmp)
        _fsync_dir(tmp)
        trash = None
        if final.exists():
            # A complete checkpoint of this step exists (a resumed run re-saving it): moved aside
            # whole, and deleted only once the new one holds the name.
            trash = root / f"{TRASH_PREFIX}{final.name}"
            if trash.exists():
                shutil.rmtree(trash)
            os.rename(final, trash)
        os.rename(tmp, final)
        _fsync_dir(root)
        if trash is not None:
            shutil.rmtree(trash)
        for old in complete_checkpoints(root)[:-keep]:
            delete_atomically(old)
    barrier()
    return final


def read_trainer_state(path: Path) -> dict:
    if not is_complete(path):
        raise UsageError(f"--resume: {path} is not a complete checkpoint (no .metadata or {TRAINER_STATE})")
    return json.loads((path / TRAINER_STATE).read_text())


def rng_file(path: Path, rank: int) -> Path:
    return path / f"rng-rank{rank:05d}.pt"


def check_rng_files(path: Path, world_size: int) -> None:
    """At the world size that saved it, a checkpoint resumes every rank's RNG streams (what makes a
    resumed run bit-identical), so each rank's file must be there; at another world size the ranks'
    streams have no counterpart and none is read."""
    trainer_state = read_trainer_state(path)
    if trainer_state["world_size"] != world_size:
        return
    missing = [rng_file(path, r).name for r in range(world_size) if not rng_file(path, r).is_file()]
    if missing:
        raise UsageError(f"--resume: {path} was saved by {world_size} ranks but lacks {', '.join(missing)}; the "
                         "checkpoint is damaged: resume an earlier one (--resume PATH) or pass --overwrite")


def load_checkpoint(path: Path, model, optimizer, *, rank: int, world_size: int) -> dict:
    """Collective: load model and optimizer shards (DCP reshards if the layout changed) and, at the
    world size that saved it, this rank's RNG state. Returns the trainer state."""
    check_rng_files(path, world_size)
    trainer_state = read_trainer_state(path)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS)
    state = {"model": model_sd, "optim": optim_sd}
    with quiet_single_process():
        dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=STATE_DICT_OPTIONS)
    if trainer_state["world_size"] == world_size:
        set_rng_state(torch.load(rng_file(path, rank), weights_only=False))
    return trainer_state
