"""The output folder of a training loop whose checkpoints another library writes (transformers'
Trainer, accelerate's ``save_state``), under ownership.py's rules.

Once the library has written a checkpoint, every rank seals it (``seal``): the ranks hash its files
together and rank 0 writes their manifest (integrity.py), last, so that a checkpoint without one was
cut short and a checkpoint whose files differ from it is damaged. Before start-up each rank checks
the manifests, the listings and the sizes of the checkpoints it may resume (``check``); after it
the ranks compare the checksums together and agree (checkpoint.verified_resume), so a damaged
checkpoint is skipped (``--resume auto``) or refused (``--resume PATH``), never loaded.

The folder is created and marked (``kind``: which script's run it is) by global rank 0, or must be
one the same kind of run marked (an empty folder is taken over); a folder holding anything else is
refused before any work. Its checkpoints are resumed as ``--resume`` says (``resume_target``):
``auto`` the newest, ``never`` none (refused where there are some, which a new run would write
over), or a named one; resuming an older one than the newest sets the later ones aside as an
abandoned branch (``set_aside_later``), and ``--overwrite`` deletes them (``clear``). Once a new
checkpoint is sealed, those older than the newest ``--keep-checkpoints`` are deleted (``prune``;
every one kept by default, as the libraries do). Rank 0 holds
the folder's lock for the job. The final model goes to ``OUTPUT_DIR/final``, marked as an export,
replaced only when it is one."""

from __future__ import annotations

import re
from contextlib import contextmanager
from pathlib import Path

from .checkpoint import ABANDONED_PREFIX, damage_report, refuse_other_data, set_aside_later_checkpoints
from .errors import RunError, UsageError, write_failure
from .integrity import MANIFEST, files_in, local_problems, read_manifest_field, seal
from .ownership import (
    EXPORT_BYTES_PER_PARAMETER,
    METRICS,
    check_appendable,
    check_free_space,
    check_odd_entries,
    check_output_dir_is_ours,
    check_writable,
    checkpoint_bytes,
    checkpoints_to_come,
    delete_atomically,
    hold_output_dir,
    make_managed_dir,
    mark,
    marker_kind,
    not_ours_message,
    ours,
    refuse_linked_checkpoints,
)

FINAL = "final"
# Before start-up each rank hashes the small files of the checkpoints it may resume (states,
# configs); the large shards are hashed after it, shared by the ranks.
QUICK_HASH_BYTES = 1 << 20


class RunFolder:
    """``--output-dir`` of a loop whose checkpoints its library writes (module docstring)."""

    def __init__(self, path: Path, kind: str, checkpoint_glob: str, managed: tuple[str, ...] = (), *,
                 data: dict | None = None):
        """``checkpoint_glob``: where the library writes its checkpoints, relative to ``path``, a
        ``*`` standing for the optimizer step (``checkpoint-*``, ``checkpoints/step_*``). ``data``:
        what a resumed run must share with the saved one (the token stream, the packing, the
        global batch, the seed), recorded in each checkpoint's manifest and compared on resume."""
        self.path = path
        self.data = data
        self.kind = kind
        glob = Path(checkpoint_glob)
        self.checkpoint_root = path / glob.parent
        self._checkpoint_name = re.compile(re.escape(glob.name).replace(r"\*", r"(\d+)"))
        self.managed = managed  # subfolders the script makes (with their own markers)
        self.final = path / FINAL
        self.previous_holder: dict | None = None

    @contextmanager
    def held(self, *, rank: int):
        """The folder's lock for the job (ownership.hold_output_dir: rank 0 takes it, the other
        ranks hold nothing). While it is held, ``previous_holder`` is the record of a job that
        ended without letting go of it (to be said once the run is claimed), else None."""
        with hold_output_dir(self.path, rank=rank) as previous_holder:
            self.previous_holder = previous_holder
            yield

    def checkpoints(self) -> list[Path]:
        """This run's checkpoints, complete or cut short, oldest first."""
        if not self.checkpoint_root.is_dir():
            return []
        found = [p for p in self.checkpoint_root.iterdir() if p.is_dir() and self._checkpoint_name.fullmatch(p.name)]
        return sorted(found, key=self.step_of)

    def step_of(self, checkpoint: Path) -> int:
        return int(self._checkpoint_name.fullmatch(checkpoint.name)[1])

    def is_complete(self, checkpoint: Path) -> bool:
        """Sealed: the library wrote it whole on every rank (a library that writes under the
        final name, as the Trainer does, leaves a checkpoint cut short without a manifest)."""
        return (checkpoint / MANIFEST).is_file()

    def seal(self, checkpoint: Path, *, step: int) -> None:
        """Collective, once the library has written ``checkpoint`` on every rank: its manifest
        (integrity.seal), which makes it complete. Raises RunError when a file cannot be read back
        or the manifest cannot be written."""
        try:
            unreadable = seal(checkpoint, step=step, data=self.data)
        except OSError as err:  # rank 0's manifest
            raise RunError(write_failure(checkpoint / MANIFEST, err)) from None
        if unreadable:
            raise RunError(f"cannot read back {checkpoint}: {', '.join(unreadable)}", agreed=True)

    def resume_target(self, resume: str, *, overwrite: bool) -> Path | None:
        """The checkpoint to resume (None: start afresh). ``resume``: ``auto`` (the newest complete
        one, if any), ``never`` (refused where checkpoints exist: a new run would write over them)
        or one of this run's complete checkpoints; ``overwrite``: start afresh, the checkpoints
        deleted."""
        found = self.checkpoints() if self.path.is_dir() else []
        if overwrite:
            return None
        if resume == "never":
            if found:
                raise UsageError(f"--resume never, but {self.path} holds checkpoints of an earlier run (up to "
                                 f"{found[-1].name}); pass --resume auto to continue it, --overwrite to delete them, "
                                 "or choose another --output-dir")
            return None
        if resume == "auto":
            complete = [p for p in found if self.is_complete(p)]
            return complete[-1] if complete else None
        named = Path(resume).resolve()
        for checkpoint in found:
            if checkpoint.resolve() == named:
                if not self.is_complete(checkpoint):
                    raise UsageError(f"--resume {resume}: the checkpoint was cut short (it has no {MANIFEST}, "
                                     "which is written last); resume another one, or auto for the newest complete one")
                return checkpoint
        raise UsageError(f"--resume {resume}: not a checkpoint of this script's run in {self.path} (it holds "
                         f"{', '.join(p.name for p in found) or 'none'})")

    def resume_candidates(self, resume: str, *, overwrite: bool) -> tuple[list[Path], list[str]]:
        """Before start-up, each rank alone: the checkpoints to try, newest first, and a warning for
        each one skipped. ``auto``: every complete checkpoint, those whose manifest, listing, sizes
        or small files are wrong left out (refused when that is all of them); a checkpoint named by
        ``--resume`` must pass. The shards' checksums are compared after start-up, by every rank
        together (checkpoint.verified_resume, with ``files_in`` as what the manifest must list)."""
        target = self.resume_target(resume, overwrite=overwrite)
        if target is None:
            return [], []
        tried = [p for p in reversed(self.checkpoints()) if self.is_complete(p)] if resume == "auto" else [target]
        good, skipped = [], []
        for path in tried:
            problems = local_problems(path, must_list=files_in(path),
                                      hash_if=lambda name, path=path: (path / name).stat().st_size <= QUICK_HASH_BYTES)
            if problems:
                skipped.append(damage_report(path, problems))
            else:
                good.append(path)
        if self.data is not None:
            for path in good:
                refuse_other_data(path, read_manifest_field(path, "data"), self.data)
        if resume != "auto" and skipped:
            raise UsageError(f"--resume: {skipped[0]}; resume another checkpoint (--resume PATH, or auto for the newest "
                             "intact one)")
        if skipped and not good:
            raise UsageError(f"--resume auto: every checkpoint in {self.checkpoint_root} is damaged "
                             f"({'; '.join(skipped)}); start afresh with --overwrite (which deletes them) or choose "
                             "another --output-dir")
        return good, [f"--resume auto: skipping {s}" for s in skipped]

    def check(self, *, resume: str, overwrite: bool, parameters: int, keep: int | None = None
              ) -> tuple[list[Path], list[str]]:
        """Before any work, on every rank: nothing of the user's is in the way, the folder is
        writable and has room for the checkpoints to come (``keep``, as ``prune`` keeps them, and
        one more while a save is written; one where every checkpoint is kept) and the final model.
        Returns the checkpoints to try resuming and the warnings for those skipped
        (resume_candidates)."""
        check_odd_entries(self.path)
        # Where the Trainer writes its checkpoints beside the run's other files (check_odd_entries
        # looks in checkpoints/ only).
        refuse_linked_checkpoints(self.checkpoint_root, lambda name: bool(
            self._checkpoint_name.fullmatch(name) or name.startswith(ABANDONED_PREFIX)))
        check_output_dir_is_ours(self.path, self.kind, self.managed)
        for name in self.managed:
            if (self.path / name).exists() and not ours(self.path / name, name):
                raise UsageError(not_ours_message(self.path / name, "--output-dir"))
        candidates = self.resume_candidates(resume, overwrite=overwrite)
        if self.final.exists() and not ours(self.final, "export"):
            raise UsageError(not_ours_message(self.final, "--output-dir"))
        check_writable(self.path, "--output-dir")
        if not overwrite:  # --overwrite deletes the log, which the folder's writability allows
            check_appendable(self.path / METRICS, "--output-dir")
        existing = 0 if overwrite else sum(map(self.is_complete, self.checkpoints()))
        count = checkpoints_to_come(existing, keep)
        check_free_space(self.path, count * checkpoint_bytes(parameters) + EXPORT_BYTES_PER_PARAMETER * parameters,
                         f"{count} more checkpoint{'s' if count > 1 else ''} and the final model", "--output-dir")
        return candidates

    def prune(self, keep: int | None, *, rank: int) -> None:
        """Rank 0, once the newest checkpoint is sealed: delete the complete checkpoints older than
        the newest ``keep`` (each whole, atomically; None keeps every one, the libraries' own
        default). Only a sealed checkpoint makes room, so the last good state is never deleted
        for one that is cut short; the branches a rollback set aside are never touched."""
        if keep is None or rank != 0:
            return
        complete = [p for p in self.checkpoints() if self.is_complete(p)]
        for old in complete[:max(0, len(complete) - keep)]:
            delete_atomically(old)

    def claim(self) -> None:
        """Rank 0, after ``check`` and with the lock held: create and mark the folder."""
        self.path.mkdir(parents=True, exist_ok=True)
        if marker_kind(self.path) != self.kind:
            mark(self.path, self.kind)
        for name in self.managed:
            make_managed_dir(self.path / name, name)

    def clear(self) -> None:
        """``--overwrite``, rank 0, after ``claim``: delete the run's checkpoints and abandoned
        branches (each whole, atomically, never through a link) and its metrics."""
        if not self.checkpoint_root.is_dir():
            return
        aside = [p for p in self.checkpoint_root.iterdir()
                 if p.name.startswith(ABANDONED_PREFIX) and marker_kind(p) == "abandoned"]
        for path in [*self.checkpoints(), *aside]:
            delete_atomically(path)
        (self.path / METRICS).unlink(missing_ok=True)

    def set_aside_later(self, resumed: Path | None, *, rank: int) -> Path | None:
        """Collective, after ``claim``: the checkpoints later than ``resumed`` (every one where the
        run starts afresh: those cut short), moved, whole, into a marked ``abandoned-...`` folder
        beside them (set_aside_later_checkpoints), whose path every rank gets back; None where
        nothing is later. The library then never writes into a checkpoint cut short."""
        step = 0 if resumed is None else self.step_of(resumed)
        return set_aside_later_checkpoints(self.checkpoint_root, step, resumed, rank=rank, folders=self.checkpoints(),
                                           step_of=self.step_of)

    def saved_final(self, log, is_main: bool) -> None:
        """After the final model is written: mark it as an export (rank 0) and say where it is."""
        if is_main:
            mark(self.final, "export")
        log.info(f"saved the model to {self.final} (loads with plain from_pretrained)")
