"""A start-up watchdog: a rank that stops or hangs before the step loop is reported within a
bound, instead of leaving the others blocked in a start-up collective until the process group's
own timeout (30 minutes, or never for groups created without one).

    with StartupWatchdog(timeout=600) as startup:
        init_process_group(...)
        startup.phase("tokenizing the data")      # the first phase with a process group starts the watch
        ...
        startup.phase("building the model")
        ...
        startup.reached()                         # at the step loop: the watch ends
        for step in ...:

Each rank writes its phase to the rendezvous store (one small write per phase). If a rank has not
reached the step loop ``timeout`` seconds after its first phase, its watchdog thread reads every rank's
phase, and the first rank to get there (a compare-and-set on the store) says in one line which
ranks had not reached the step loop and where each was; then every such rank exits with status 1.
Exiting is the only bounded way out: a rank blocked in a gloo collective cannot be released from
another thread (``moe_ep.parallel.failure`` explains why), and the launcher then ends the job (its
summary names the ranks). The output folder's lock is a POSIX lock the kernel releases, and
everything a run writes at start-up is written atomically, so exiting there loses nothing.

The step loop has its own bound (``fail_fast``'s step timeout); this one must exceed the longest
legitimate start-up: tokenizing a corpus (once, by rank 0), reading a checkpoint or pretrained weights,
the first compilation."""

from __future__ import annotations

import os
import sys
import threading

import torch.distributed as dist

PHASE_KEY = "moe_ep/startup/phase/"
REPORT_KEY = "moe_ep/startup/report"
DONE = "done"
STARTUP_TIMEOUT_EXIT_STATUS = 1


class StartupWatchdog:
    """See the module's docstring. The watch starts with the first ``phase`` once a process group
    exists (the timeout counts from there) and ends at ``reached()`` or when the block ends; without
        a process group nothing is watched. ``store``: the rendezvous store (default: the default
    process group's)."""

    # A year: beyond threading.TIMEOUT_MAX (about 292 years) the watch's thread would die at its
    # start and nothing would be watched.
    MAX_TIMEOUT_S = 365 * 24 * 3600.0

    def __init__(self, timeout: float, *, store=None):
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= self.MAX_TIMEOUT_S:
            raise ValueError(f"timeout must be a positive number of seconds up to {self.MAX_TIMEOUT_S:g} (a year), got "
                             f"{timeout!r}")
        self.timeout, self._store = float(timeout), store
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.rank = 0
        self.world_size = 1
        self._phase = "not started"

    def __enter__(self) -> StartupWatchdog:
        return self

    def phase(self, name: str) -> None:
        """Where this rank is now, for the report; the first call with a process group starts the
        watch."""
        if self._thread is None and not self._stop.is_set() and dist.is_available() and dist.is_initialized():
            self._store = self._store if self._store is not None else dist.distributed_c10d._get_default_store()
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            self._thread = threading.Thread(target=self._watch, name="moe_ep-startup-watchdog", daemon=True)
            self._thread.start()
        self._phase = name
        if self._thread is not None:
            self._store.set(PHASE_KEY + str(self.rank), name)

    def reached(self) -> None:
        """This rank reached the step loop: the watch ends."""
        self._halt()
        if self._thread is not None:
            self._store.set(PHASE_KEY + str(self.rank), DONE)

    def __exit__(self, *exc) -> None:
        self._halt()

    def _halt(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join()

    def _watch(self) -> None:
        if self._stop.wait(self.timeout):
            return
        try:
            self._report()
        except Exception as err:  # noqa: BLE001 -- the store is gone (its host, rank 0 of a tcp:// rendezvous, exited)
            print(f"error (rank {self.rank}): start-up did not reach the step loop within {self.timeout:g} s: this "
                  f"rank at '{self._phase}' (the other ranks' phases are unknown: the rendezvous store did not "
                  f"answer: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); it exits",
                  file=sys.stderr, flush=True)
        finally:
            sys.stdout.flush()
            os._exit(STARTUP_TIMEOUT_EXIT_STATUS)

    def _report(self) -> None:
        """The report, said once, by the first rank to get there."""
        phases = {}
        for rank in range(self.world_size):
            key = PHASE_KEY + str(rank)
            phases[rank] = self._store.get(key).decode() if self._store.check([key]) else "not started"
        late = ", ".join(f"rank {rank} at '{phase}'" for rank, phase in phases.items() if phase != DONE)
        message = (f"start-up did not reach the step loop within {self.timeout:g} s: {late}; a rank hung, was "
                   "stopped or is still working (raise the start-up timeout if it is); every rank still starting "
                   "exits")
        # compare_set with an empty expected value writes only if nobody reported yet: said once.
        if self._store.compare_set(REPORT_KEY, "", str(self.rank)).decode() == str(self.rank):
            print(f"error (rank {self.rank}): {message}", file=sys.stderr, flush=True)
