"""The errors a run reports in one line, without a traceback (``run_reported``).

``UsageError``: the user's to fix (a flag, a file, a layout, a folder); exit status 2, before any
work where it can be found then. ``RunError``: the run could not go on (an I/O error such as a full
disk, a damaged checkpoint found after start-up, non-finite weights); exit status 1, the last
complete checkpoint intact. ``agreed``: raised identically on every rank (after a collective
verdict), so it is said once, by rank 0."""

import os
import shutil
import sys
from contextlib import contextmanager

from .preemption import PREEMPTED_EXIT_STATUS, Preempted


class UsageError(Exception):
    def __init__(self, message: str, *, agreed: bool = False):
        super().__init__(message)
        self.agreed = agreed


class RunError(Exception):
    def __init__(self, message: str, *, agreed: bool = False):
        super().__init__(message)
        self.agreed = agreed


@contextmanager
def said_by_every_rank():
    """Errors raised inside are raised identically on every rank (the same files, the same
    collective verdicts): rank 0 says them, once."""
    try:
        yield
    except (UsageError, RunError) as err:
        err.agreed = True
        raise


# Below this many free bytes, a write that failed without an errno failed for lack of space.
FULL_DISK_BYTES = 1 << 20


def failure_cause(path, err: BaseException) -> str:
    """Why writing ``path`` failed, in a few words: the errno's text (``No space left on device``),
    or, where the error carries none, its first line, said to be a full disk when the file system
    of ``path`` is (torch.save reports a full disk as ``unexpected pos N vs M``)."""
    cause = getattr(err, "strerror", None)
    if cause:
        return cause
    cause = str(err).splitlines()[0] if str(err) else type(err).__name__
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return cause
    if free < FULL_DISK_BYTES:
        return f"No space left on device ({free:,} bytes free on the file system of {folder}; {cause})"
    return cause


def write_failure(path, err: BaseException) -> str:
    """``cannot write PATH: CAUSE`` for an error raised while writing ``path`` (failure_cause)."""
    return f"cannot write {path}: {failure_cause(path, err)}"


def lost_peer(err: BaseException) -> bool:
    """Whether a collective failed because a peer's connection went (gloo's words for a peer that
    died or was killed)."""
    return any(words in str(err) for words in ("Connection closed by peer", "Connection reset by peer"))


def report_failure(err: BaseException, *, rank: int, world_size: int) -> int | None:
    """Say why the run stopped, in one line, and return the exit status: 2 for a UsageError, 1 for
    a RunError or a peer's failure, 130 for an interrupt, 75 (``PREEMPTED_EXIT_STATUS``) for a run
    stopped by a preemption signal after its checkpoint, 1 and nothing said for a collective that
    lost its peer (which says why, or whose death the launcher reports). None for anything else (a
    bug, whose traceback is the report). An ``agreed`` error (every check before start-up is one) is said by
    rank 0, any other by the rank that raised it; a rank that stopped only because a peer failed
    (moe_ep's fail_fast) leaves the saying to that peer, rank 0 naming it."""
    from ..parallel import PeerFailure

    own = err.__cause__ if isinstance(err, PeerFailure) and err.__cause__ is not None else err
    if isinstance(own, Preempted):
        # Raised alike on every rank after their agreement: said once.
        if rank == 0:
            print(own, file=sys.stderr, flush=True)
        return PREEMPTED_EXIT_STATUS
    if isinstance(own, KeyboardInterrupt):
        if rank == 0:
            print("interrupted: the last complete checkpoint is kept; run the same command to resume from it",
                  file=sys.stderr, flush=True)
        return 130
    if isinstance(own, (UsageError, RunError)):
        if world_size > 1 and not own.agreed:
            print(f"error (rank {rank}): {own}", file=sys.stderr, flush=True)
        elif rank == 0:
            print(f"error: {own}", file=sys.stderr, flush=True)
        return 2 if isinstance(own, UsageError) else 1
    if isinstance(err, PeerFailure):
        if rank == 0:
            print(f"error (rank 0): {err}", file=sys.stderr, flush=True)
        return 1
    if isinstance(own, RuntimeError) and lost_peer(own):
        # A collective outside the step loop (start-up, the final save) found a peer gone: the
        # peer's own line, or the launcher's summary of how it died, is the report; a traceback
        # here would only bury it.
        return 1
    return None


def run_reported(train, args) -> int:
    """A script's ``main``: ``train(args)``, and the exit status. A failure ``report_failure``
    knows is said in one line (the process group destroyed, so the launcher ends the job at once);
    anything else propagates with its traceback."""
    try:
        train(args)
    except BaseException as err:
        code = report_failure(err, rank=int(os.environ.get("RANK", 0)), world_size=int(os.environ.get("WORLD_SIZE", 1)))
        if code is None:
            raise
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        return code
    return 0
