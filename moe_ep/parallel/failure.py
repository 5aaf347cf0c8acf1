"""Fail fast: when one rank raises in the middle of a step, the others stop within a bounded
time with an error naming that rank, instead of waiting in a collective until the process-group
timeout (30 minutes by default) or forever.

Inside ``with fail_fast():`` a rank that raises writes ``rank: error`` to the process group's
store, then aborts its process groups and re-raises. A watcher thread on every rank polls the
store and aborts its own groups when a peer has failed, which is what unblocks NCCL collectives.
The peers then raise ``PeerFailure`` with the failing rank's message. A step that runs past
``timeout`` seconds is reported the same way (the hung rank is named). After a failure the
process groups are gone: the job must exit and restart from its last checkpoint.

gloo cannot abort (measured on torch 2.13): ``ProcessGroupGloo.abort()`` and ``shutdown()``
return without closing anything, on the failing rank and on a waiting one alike. A peer blocked
in a gloo collective is released only when the failing rank's connections close, which happens
when its process exits or when the last reference to its process groups goes, and a
parallelized model (FSDP2 state, DTensor meshes) keeps them referenced while the caller holds
it. A failing rank that stays alive (catching the error, cleaning up at length) would therefore
keep its peers waiting until the groups' own timeout: 30 minutes for groups created without
one, which DeviceMesh's are. So on gloo ``fail_fast`` bounds the waiting itself: every
collective started inside the block fails after ``collective_timeout`` seconds (gloo reads a
group's default timeout when a collective starts), and the peers then raise ``PeerFailure`` as
above, whether or not the failing process is still alive. The groups' own timeouts come back
when the block ends without a failure. NCCL groups keep theirs: the watcher's abort releases
them."""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

FAILURE_KEY = "moe_ep/fail_fast/failure"
# The "rank" of a failure read as the store itself gone: its host (the launcher's agent, or rank
# 0's process) ended, and with it the job.
STORE_LOST = -1


class PeerFailure(RuntimeError):
    """Another rank failed (or hung past the step timeout); this rank stopped instead of waiting."""

    def __init__(self, rank: int, message: str):
        if rank == STORE_LOST:
            super().__init__(f"the job stopped mid-step, stopping this rank too: {message}")
        else:
            super().__init__(f"rank {rank} failed mid-step, stopping this rank too: {message}")
        self.rank = rank


@dataclass(frozen=True)
class _Failure:
    rank: int
    message: str


def _failure_key() -> str:
    """The failure's key, per attempt of an elastic job: the launcher's store outlives a restart
    (torchrun --max-restarts), and a failure of the attempt before must not stop the new one."""
    return f"{FAILURE_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _post(store, rank: int, message: str) -> None:
    # compare_set with an empty expected value writes only if no failure was posted: first wins.
    try:
        store.compare_set(_failure_key(), "", f"{rank}|{message}")
    except dist.DistError:
        pass  # the store is gone: every rank finds that for itself (_read)


def _read(store) -> _Failure | None:
    try:
        key = _failure_key()
        if not store.check([key]):
            return None
        rank, _, message = store.get(key).decode().partition("|")
    except dist.DistError as err:
        return _Failure(STORE_LOST, f"the job's store is gone, its host (the launcher) ended "
                                    f"({str(err).splitlines()[0]})")
    return _Failure(int(rank), message)


def _abort_all_groups() -> None:
    # Aborting (not destroying) also works while a collective of this process is in flight; it
    # is what releases NCCL collectives, and on gloo it only drops the groups (see the module doc).
    dist.distributed_c10d._abort_process_group()


@dataclass(frozen=True)
class _GlooTimeout:
    """A gloo backend and the default timeout it had before ``fail_fast`` bounded it."""

    backend: object  # torch.distributed.ProcessGroupGloo
    timeout: timedelta


def _bound_gloo_collectives(seconds: float) -> list[_GlooTimeout]:
    """Set the default timeout of every gloo backend of this rank's process groups (DeviceMesh
    groups included) to ``seconds``; returns what to restore."""
    if not dist.is_gloo_available():
        return []
    from torch._C._distributed_c10d import _ProcessGroupWrapper

    backends = {}
    for group in list(dist.distributed_c10d._world.pg_names):
        for device in group._device_types:
            backend = group._get_backend(device)
            # TORCH_DISTRIBUTED_DEBUG=DETAIL wraps each backend in a checker; the collectives
            # run, and time out, in the wrapped one.
            if isinstance(backend, _ProcessGroupWrapper):
                backend = backend.wrapped_pg
            # One backend may serve both the CPU and CUDA tensors of a group: bound it once.
            if isinstance(backend, dist.ProcessGroupGloo):
                backends[id(backend)] = backend
    saved = [_GlooTimeout(backend, backend.options._timeout) for backend in backends.values()]
    for entry in saved:
        entry.backend._set_default_timeout(timedelta(seconds=seconds))
    return saved


def _restore(saved: list[_GlooTimeout]) -> None:
    for entry in saved:
        entry.backend._set_default_timeout(entry.timeout)


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
            if failure is not None and failure.rank != self.rank:
                break
            if time.monotonic() > self.deadline:
                self.timed_out = True
                _post(self.store, self.rank, self.timeout_message())
                break
        else:
            return
        self.aborted = True
        _abort_all_groups()

    def timeout_message(self) -> str:
        return f"its step ran past the fail_fast timeout of {self.timeout:g} s"

    def halt(self) -> None:
        self.stop.set()
        self.join()


def _check_seconds(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


@contextmanager
def fail_fast(*, timeout: float = 1800.0, collective_timeout: float | None = None, poll_interval: float = 0.05,
              store=None):
    """Run the body (one training step, or several) so that a failure on any rank stops every
    rank quickly. ``store``: the rendezvous store (default: the default process group's).

    The ranks that did not fail raise ``PeerFailure`` naming the one that did; the failing
    rank's own exception propagates unchanged, unless it was raised after ``timeout`` (a gloo
    collective giving up at its bound): a rank that ran past ``timeout`` raises TimeoutError. ``collective_timeout`` (default: ``timeout``) bounds each gloo collective
    started inside the block, which is how long a peer of a failing rank that stays alive waits
    on gloo (see the module doc); it must exceed the longest time one rank legitimately waits
    for the others in one collective. Every rank of the default group must enter it."""
    _check_seconds("timeout", timeout)
    if collective_timeout is not None:
        _check_seconds("collective_timeout", collective_timeout)
    if not dist.is_initialized():
        raise RuntimeError("fail_fast needs an initialised default process group")
    store = store if store is not None else dist.distributed_c10d._get_default_store()
    rank = dist.get_rank()
    saved = _bound_gloo_collectives(float(timeout if collective_timeout is None else collective_timeout))
    watcher = _Watcher(store, rank, float(timeout), poll_interval)
    watcher.start()
    try:
        yield
    except BaseException as exc:
        watcher.halt()
        # A gloo collective bounded by collective_timeout == timeout can give up before the
        # watcher's next poll notices the deadline: the step still ran past it.
        if not watcher.timed_out and _peer_failure(watcher, rank) is None and time.monotonic() > watcher.deadline:
            watcher.timed_out = True
            _post(store, rank, watcher.timeout_message())
        _raise_failure(watcher, rank, exc)
        _post(store, rank, f"{type(exc).__name__}: {exc}")
        if not watcher.aborted:
            _abort_all_groups()
        raise
    watcher.halt()
    _raise_failure(watcher, rank, None)
    _restore(saved)


def _peer_failure(watcher: _Watcher, rank: int) -> _Failure | None:
    failure = _read(watcher.store)
    return failure if failure is not None and failure.rank != rank else None


def _raise_failure(watcher: _Watcher, rank: int, cause: BaseException | None) -> None:
    """Raise, after aborting this rank's groups, if a peer failed or this rank timed out; return
    if no other rank posted a failure."""
    failure = _peer_failure(watcher, rank)
    if not watcher.timed_out and failure is None:
        return
    # The groups go on every rank that stops, not only where the watcher acted: a peer's failure
    # can be read here before the watcher's next poll.
    if not watcher.aborted:
        watcher.aborted = True
        _abort_all_groups()
    if watcher.timed_out:
        raise TimeoutError(f"rank {rank}: the step ran past the fail_fast timeout of {watcher.timeout:g} s") from cause
    raise PeerFailure(failure.rank, failure.message) from cause
