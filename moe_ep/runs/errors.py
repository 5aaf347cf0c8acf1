"""The errors a run reports in one line, without a traceback (``run_reported``).

``UsageError``: the user's to fix (a flag, a file, a layout, a folder); exit status 2, before any
work where it can be found then. ``RunError``: the run could not go on (an I/O error such as a full
disk, a damaged checkpoint found after start-up, non-finite weights); exit status 1, the last
complete checkpoint intact. ``agreed``: raised identically on every rank (after a collective
verdict), so it is said once, by rank 0."""

import atexit
import os
import shutil
import sys
from contextlib import contextmanager
from datetime import timedelta

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


@contextmanager
def configuration_errors(*, checked_alike: bool = True):
    """moe_ep's and accelerate's refusals of a layout or configuration (ValueError) as one line:
    by rank 0 where every rank raises it (``checked_alike``: every check inside is of arguments
    the ranks share; else only what moe_ep's agreement raised on every rank, ``on_every_rank``),
    by the rank that raised it otherwise (an error of one rank, which rank 0 would not say)."""
    try:
        yield
    except ValueError as err:
        raise UsageError(str(err), agreed=checked_alike or getattr(err, "on_every_rank", False)) from err


# Below this many free bytes, a write that failed without an errno failed for lack of space.
FULL_DISK_BYTES = 1 << 20


def _free_bytes(path) -> tuple[str, int | None]:
    """The folder of ``path`` (itself where it is one) and the bytes free on its file system (None
    where that cannot be read)."""
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    try:
        return folder, shutil.disk_usage(folder).free
    except OSError:
        return folder, None


def failure_cause(path, err: BaseException) -> str:
    """Why writing ``path`` failed, in a few words: the errno's text (``No space left on device``),
    or, where the error carries none, its first line, said to be a full disk when the file system
    of ``path`` is (torch.save reports a full disk as ``unexpected pos N vs M``)."""
    cause = getattr(err, "strerror", None)
    if cause:
        return cause
    cause = str(err).splitlines()[0] if str(err) else type(err).__name__
    folder, free = _free_bytes(path)
    if free is not None and free < FULL_DISK_BYTES:
        return f"No space left on device ({free:,} bytes free on the file system of {folder}; {cause})"
    return cause


def write_failure(path, err: BaseException) -> str:
    """``cannot write PATH: CAUSE`` for an error raised while writing ``path`` (failure_cause)."""
    return f"cannot write {path}: {failure_cause(path, err)}"


@contextmanager
def library_writes(path, *, only_writes: bool):
    """A library's save into ``path`` (accelerate's ``save_state``; the Trainer, whose checkpoints
    are written inside its ``train``) said in one line as a RunError when it fails for want of
    room: any error while the file system of ``path`` is full (safetensors reports a full disk
    as its own error, torch.save as ``unexpected pos``), and, where the block does nothing but
    write (``only_writes``), any OSError. The last complete checkpoint is untouched: the library
    writes a new one beside it."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except (RunError, UsageError, Preempted):
        raise
    except (Exception, CheckpointException) as err:
        # DCP (the sharded model and optimizer of accelerate's save_state and of the Trainer's
        # checkpoints) raises CheckpointException, a BaseException, on every rank alike, carrying
        # each failing rank's own error.
        causes = ([exc for _, (exc, _trace) in sorted(err.failures.items())]
                  if isinstance(err, CheckpointException) else [err])
        free = _free_bytes(path)[1]
        if (only_writes and all(isinstance(c, OSError) for c in causes)) or (
                free is not None and free < FULL_DISK_BYTES):
            if isinstance(err, CheckpointException):
                ranks = sorted(err.failures)
                raise RunError(f"cannot write {path}: " + "; ".join(
                    f"rank {r}: {failure_cause(path, c)}" for r, c in zip(ranks, causes))
                    + "; the last complete checkpoint is kept", agreed=True) from None
            raise RunError(f"{write_failure(path, err)}; the last complete checkpoint is kept") from err
        raise


def lost_peer(err: BaseException) -> bool:
    """Whether a collective failed because a peer's connection went (gloo's words for a peer that
    died or was killed)."""
    return any(words in str(err) for words in ("Connection closed by peer", "Connection reset by peer"))


def own_error(err: BaseException) -> BaseException:
    """The error a rank stopped for: a PeerFailure's cause where it has one (the peer's error
    re-raised here), else ``err``."""
    from ..parallel import PeerFailure

    return err.__cause__ if isinstance(err, PeerFailure) and err.__cause__ is not None else err


def said_by_rank_0(err: BaseException) -> bool:
    """Whether ``err`` is reported by rank 0 alone: a preemption or an interrupt (raised alike on
    every rank after their agreement), an ``agreed`` error, and a rank's stop because a peer failed
    (moe_ep's fail_fast; the peer says why, rank 0 names it)."""
    from ..parallel import PeerFailure

    own = own_error(err)
    if isinstance(own, (UsageError, RunError)):
        return own.agreed
    return isinstance(own, (Preempted, KeyboardInterrupt)) or isinstance(err, PeerFailure)


def failure_line(err: BaseException, *, rank: int, world_size: int,
                 alone: bool = False) -> tuple[str | None, int] | None:
    """The line that says why the run stopped and the exit status: 2 for a UsageError, 1 for a
    RunError or a peer's failure, 130 for an interrupt, 75 (``PREEMPTED_EXIT_STATUS``) for a run
    stopped by a preemption signal after its checkpoint, no line and 1 for a collective that lost
    its peer (which says why, or whose death the launcher reports). None for anything else (a bug,
    whose traceback is the report). ``alone``: said by this rank for want of rank 0's line, and
    named so."""
    from ..parallel import PeerFailure

    own = own_error(err)
    if isinstance(own, Preempted):
        return str(own), PREEMPTED_EXIT_STATUS
    if isinstance(own, KeyboardInterrupt):
        return "interrupted: the last complete checkpoint is kept; run the same command to resume from it", 130
    if isinstance(own, (UsageError, RunError)):
        line = f"error (rank {rank}): {own}" if world_size > 1 and (alone or not own.agreed) else f"error: {own}"
        return line, 2 if isinstance(own, UsageError) else 1
    if isinstance(err, PeerFailure):
        return f"error (rank {rank if alone else 0}): {err}", 1
    if isinstance(own, RuntimeError) and lost_peer(own):
        # A collective outside the step loop (start-up, the final save) found a peer gone: the
        # peer's own line, or the launcher's summary of how it died, is the report; a traceback
        # here would only bury it.
        return None, 1
    return None


def report_failure(err: BaseException, *, rank: int, world_size: int) -> int | None:
    """Say why the run stopped, in one line (``failure_line``), and return the exit status; None
    for a bug. What ``said_by_rank_0`` names is said by rank 0 only, any other error by the rank
    that raised it."""
    described = failure_line(err, rank=rank, world_size=world_size)
    if described is None:
        return None
    line, code = described
    if line is not None and (rank == 0 or not said_by_rank_0(err)):
        print(line, file=sys.stderr, flush=True)
    return code


# A launcher ends the whole job as soon as one rank exits with an error, so a rank that leaves
# the report to rank 0 and exits first can get rank 0 killed before its line is written: it waits
# for rank 0 to mark the line written (in the job's store), at most this long.
SAID_KEY = "moe_ep/runs/rank_0_has_said"
RANK_0_REPORT_WAIT = timedelta(seconds=30)


def job_store():
    """The store every rank of the job reaches, or None: the launcher's where torchrun or
    ``accelerate launch`` hosts one for the whole job (a usage error is found before the process
    group exists), else the process group's."""
    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and {"MASTER_ADDR", "MASTER_PORT"} <= set(os.environ):
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=RANK_0_REPORT_WAIT)
    if dist.is_initialized():
        return dist.distributed_c10d._get_default_store()
    return None


def wait_for_rank_0_report(err: BaseException, rank: int) -> bool:
    """Rank 0: mark its report written. Any other rank whose error rank 0 reports: wait for that
    mark, bounded (a rank 0 that died or hangs never writes it). False where the mark never came:
    rank 0 did not say this error (it died, or it never met it: a check before the process group
    that saw something else on this rank)."""
    import torch.distributed as dist

    from ..parallel.failure import STORE_LOST, PeerFailure

    if int(os.environ.get("WORLD_SIZE", dist.get_world_size() if dist.is_initialized() else 1)) == 1:
        return True
    if isinstance(err, PeerFailure) and err.rank == STORE_LOST:
        return True  # the store it would be marked in is gone; the rank that lost it said so
    key = SAID_KEY + "/" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    try:
        store = job_store()
        if store is None:
            # No launcher's store and no process group (a rank launched on its own: srun, a pod per
            # rank): a check every rank makes alike before the process group may have failed here
            # only, and nothing tells whether rank 0 met it, so this rank says it too (a line said
            # twice rather than by nobody). A preemption or an interrupt is met by every rank.
            left_to_rank_0 = said_by_rank_0(err) and isinstance(own_error(err), (UsageError, RunError))
            return rank == 0 or not left_to_rank_0
        if rank == 0:
            store.set(key, "1")
        elif said_by_rank_0(err):
            store.wait([key], RANK_0_REPORT_WAIT)
    except Exception:
        # The store went with its host, or the wait timed out.
        return rank == 0 or not said_by_rank_0(err)
    return True


def run_reported(train, args) -> int:
    """A script's ``main``: ``train(args)``, and the exit status. A failure ``report_failure``
    knows is said in one line (the process group destroyed, so the launcher ends the job at once);
    anything else propagates with its traceback. A process group still alive when the
    interpreter exits is destroyed first (``destroy_process_group_at_exit``)."""
    import torch.distributed as dist

    atexit.unregister(destroy_process_group_at_exit)  # registered once, however many runs
    atexit.register(destroy_process_group_at_exit)
    try:
        train(args)
    except BaseException as err:
        rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        code = report_failure(err, rank=rank, world_size=world_size)
        if code is None:
            raise
        if not wait_for_rank_0_report(err, rank):
            # Left to rank 0, which did not say it: said here, or nobody would.
            print(failure_line(err, rank=rank, world_size=world_size, alone=True)[0], file=sys.stderr, flush=True)
        if dist.is_initialized():
            dist.destroy_process_group()
        return code
    return 0


def exit_process(code: int):
    """End a script's process with ``code`` once Python's own exit work is done (the atexit
    handlers: the process group destroyed, loggers closed; the streams flushed), without the
    interpreter's finalisation and the C++ teardown of torch's and gloo's static objects after
    it, where a worker thread still joinable now and then aborts a rank that finished
    (SIGABRT, "terminate called without an active exception", pytorch/pytorch#179291; seen under
    load even with the group destroyed first). For a script's ``__main__`` only."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def destroy_process_group_at_exit() -> None:
    """The default process group, destroyed while the interpreter is still whole: left to its
    finalisation, gloo's worker threads can be torn down still joinable and the rank dies of SIGABRT
    ("terminate called without an active exception") after a run that finished
    (pytorch/pytorch#179291). At exit, not when a run returns: accelerate's state outlives a run
    and a process may start another on the same group (tests/hf_loops_driver.py does)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
