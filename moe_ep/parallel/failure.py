"""Fail fast: when one rank raises in the middle of a step, the others stop within a bounded
time with an error naming that rank, instead of waiting in a collective until the process-group
timeout (30 minutes by default) or forever.

Inside ``with fail_fast():`` a rank that raises writes ``rank: error`` to the process group's
store, then aborts its process groups and re-raises. A watcher thread on every rank polls the
store and aborts its own groups when a peer has failed, which is what unblocks NCCL collectives.
The peers then raise ``PeerFailure`` with the failing rank's message. A step that runs past
``timeout`` seconds is reported the same way (the hung rank is named). After a failure the
process groups are gone: the job must exit and restart from its last checkpoint.

gloo has no abort (``ProcessGroupGloo`` does not implement it, torch 2.13): a peer blocked in a
gloo collective is released when the failing rank's connections close, which happens when its
process exits (or once nothing holds its process groups, and a parallelized model, FSDP2 or
DTensor keep them alive). So on gloo the bound is "as soon as the failing process exits", which
it does when the exception ends the training script; a failing rank that stays alive (catching
the error to clean up at length) keeps its peers waiting until then, or until the process-group
timeout."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import torch.distributed as dist

FAILURE_KEY = "moe_ep/fail_fast/failure"


class PeerFailure(RuntimeError):
    """Another rank failed (or hung past the step timeout); this rank stopped instead of waiting."""

    def __init__(self, rank: int, message: str):
        super().__init__(f"rank {rank} failed mid-step, stopping this rank too: {message}")
        self.rank = rank


def _post(store, rank: int, message: str) -> None:
    # compare_set with an empty expected value writes only if no failure was posted: first wins.
    store.compare_set(FAILURE_KEY, "", f"{rank}|{message}")


def _read(store) -> tuple[int, str] | None:
    if not store.check([FAILURE_KEY]):
        return None
    rank, _, message = store.get(FAILURE_KEY).decode().partition("|")
    return int(rank), message


def _abort_all_groups() -> None:
    # Aborting (not destroying) also works while a collective of this process is in flight.
    dist.distributed_c10d._abort_process_group()


class _Watcher(threading.Thread):
    def __init__(self, store, rank: int, timeout: float, poll_interval: float):
        super().__init__(name="moe_ep-fail-fast", daemon=True)
        self.store, self.rank, self.timeout, self.poll_interval = store, rank, timeout, poll_interval
        self.deadline = time.monotonic() + timeout
        self.stop = threading.Event()
        self.aborted = False
        self.timed_out = False

    def run(self) -> None:
        while not self.stop.wait(self.poll_interval):
            failure = _read(self.store)
            if failure is not None and failure[0] != self.rank:
                break
            if time.monotonic() > self.deadline:
                self.timed_out = True
                _post(self.store, self.rank, f"its step ran past the fail_fast timeout of {self.timeout:g} s")
                break
        else:
            return
        self.aborted = True
        _abort_all_groups()


@contextmanager
def fail_fast(*, timeout: float = 1800.0, poll_interval: float = 0.05, store=None):
    """Run the body (one training step, or several) so that a failure on any rank stops every
    rank quickly. ``store``: the rendezvous store (default: the default process group's).

    The ranks that did not fail raise ``PeerFailure`` naming the one that did; the failing
    rank's own exception propagates unchanged; a rank that ran past ``timeout`` raises
    TimeoutError. Every rank of the default group must enter it."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if not dist.is_initialized():
        raise RuntimeError("fail_fast needs an initialised default process group")
    store = store if store is not None else dist.distributed_c10d._get_default_store()
    rank = dist.get_rank()
    watcher = _Watcher(store, rank, float(timeout), poll_interval)
    watcher.start()
    try:
        yield
    except BaseException as exc:
        watcher.stop.set()
        watcher.join()
        _raise_failure(watcher, rank, exc)
        _post(store, rank, f"{type(exc).__name__}: {exc}")
        if not watcher.aborted:
            _abort_all_groups()
        raise
    watcher.stop.set()
    watcher.join()
    _raise_failure(watcher, rank, None)


def _raise_failure(watcher: _Watcher, rank: int, cause: BaseException | None) -> None:
    """Raise if a peer failed or this rank timed out; return if nothing was posted by others."""
    if watcher.timed_out:
        raise TimeoutError(f"rank {rank}: the step ran past the fail_fast timeout of {watcher.timeout:g} s") from cause
    failure = _read(watcher.store)
    if failure is not None and failure[0] != rank:
        raise PeerFailure(*failure) from cause
