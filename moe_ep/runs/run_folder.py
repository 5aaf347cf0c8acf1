"""The output folder of a training loop whose checkpoints another library writes (transformers'
Trainer, accelerate's ``save_state``), under ownership.py's rules.

The folder is created and marked (``kind``: which script's run it is) by global rank 0, or must be
one the same kind of run marked (an empty folder is taken over); a folder holding anything else is
refused before any work, as is a run folder that holds checkpoints when no resume is asked for (a
new run would write over them), unless a preemption stopped its run (``note_preempted``). Rank 0 holds the folder's lock for the job. The final model goes to
``OUTPUT_DIR/final``, marked as an export, replaced only when it is one."""

from __future__ import annotations

from pathlib import Path

from .errors import UsageError
from .ownership import (
    CHECKPOINT_BYTES_PER_PARAMETER,
    EXPORT_BYTES_PER_PARAMETER,
    LOCK_FILE,
    MARKER,
    check_free_space,
    check_odd_entries,
    check_writable,
    make_managed_dir,
    mark,
    marker_kind,
    not_ours_message,
    ours,
)

FINAL = "final"
# Left in the run folder by a run stopped by a preemption signal: the same command continues it (as
# if told to resume) until the run completes, so a requeued job needs no other command.
PREEMPTED = "preempted"


class RunFolder:
    """``--output-dir`` of a loop whose checkpoints its library writes (module docstring)."""

    def __init__(self, path: Path, kind: str, checkpoint_glob: str, managed: tuple[str, ...] = ()):
        self.path = path
        self.kind = kind
        self.checkpoint_glob = checkpoint_glob
        self.managed = managed  # subfolders the script makes (with their own markers)
        self.final = path / FINAL

    def checkpoints(self) -> list[Path]:
        """This run's complete checkpoints, oldest first."""
        found = [p for p in self.path.glob(self.checkpoint_glob) if p.is_dir()]
        return sorted(found, key=lambda p: int(p.name.rpartition("-")[2].rpartition("_")[2]))

    def check(self, *, resume: bool, parameters: int) -> None:
        """Before any work, on every rank: nothing of the user's is in the way, the folder is
        writable and has room for a checkpoint and the final model."""
        if self.path.exists() and not self.path.is_dir():
            raise UsageError(f"--output-dir: {self.path} exists and is not a folder")
        check_odd_entries(self.path)
        if self.path.exists() and marker_kind(self.path) != self.kind and not self._holds_nothing():
            raise UsageError(not_ours_message(self.path, "--output-dir"))
        for name in self.managed:
            if (self.path / name).exists() and not ours(self.path / name, name):
                raise UsageError(not_ours_message(self.path / name, "--output-dir"))
        found = self.checkpoints() if self.path.exists() else []
        if found and not resume:
            raise UsageError(f"--output-dir {self.path} holds checkpoints of an earlier run (up to {found[-1].name}); "
                             "pass --resume to continue it, or choose a new --output-dir")
        if resume and not found:
            raise UsageError(f"--resume: {self.path} holds no checkpoint of this script")
        if self.final.exists() and not ours(self.final, "export"):
            raise UsageError(not_ours_message(self.final, "--output-dir"))
        check_writable(self.path, "--output-dir")
        check_free_space(self.path, (CHECKPOINT_BYTES_PER_PARAMETER + EXPORT_BYTES_PER_PARAMETER) * parameters,
                         "one checkpoint and the final model", "--output-dir")

    def _holds_nothing(self) -> bool:
        """Empty but for a marker or the lock, which rank 0 may be creating while its peers check."""
        return self.path.is_dir() and all(p.name.startswith(MARKER) or p.name == LOCK_FILE
                                          for p in self.path.iterdir())

    def claim(self) -> None:
        """Rank 0, after ``check`` and with the lock held: create and mark the folder."""
        self.path.mkdir(parents=True, exist_ok=True)
        if marker_kind(self.path) != self.kind:
            mark(self.path, self.kind)
        for name in self.managed:
            make_managed_dir(self.path / name, name)

    def preempted(self) -> bool:
        """Whether the run in this folder was stopped by a preemption and not completed since."""
        return (self.path / PREEMPTED).is_file()

    def note_preempted(self, checkpoint: Path) -> None:
        """Rank 0, after the checkpoint of a preempted run: the same command continues it."""
        (self.path / PREEMPTED).write_text(f"{checkpoint}\n")

    def saved_final(self, log, is_main: bool) -> None:
        """After the final model is written: mark it as an export (rank 0) and say where it is; a
        preempted run is complete now."""
        if is_main:
            mark(self.final, "export")
            (self.path / PREEMPTED).unlink(missing_ok=True)
        log.info(f"saved the model to {self.final} (loads with plain from_pretrained)")
