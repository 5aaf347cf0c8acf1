"""Preemption: a signal that says "you are about to be stopped" ends the run at a step boundary,
on every rank at the same step, after one checkpoint, with a status of its own.

    with Preemption(signals=(signal.SIGTERM, signal.SIGUSR1)) as preemption:
        for step in range(start, steps):
            train_one_step()
            if preemption.stop_requested():      # every rank, at every step boundary
                save_checkpoint(step + 1)
                raise Preempted(preemption.signal, step + 1, checkpoint)
    ...
    sys.exit(PREEMPTED_EXIT_STATUS)              # where Preempted is caught

The handler only records the signal; the step in progress finishes (a handler that raised or saved
from inside a collective would leave the ranks at different points). ``stop_requested`` is the
agreement: one all-reduce (MAX) of the signal number this rank received, 0 for none, over
``group``, so a signal that reached one rank, or reached the ranks between two boundaries, stops
them all after the same step, and every rank learns which signal it was. Leaving the context
restores the previous handlers, or, after an agreed stop, ignores the signals for the rest of the
process (see below).

Cost: one all-reduce of one int32 and one host read of it per call. On a group whose backend
serves CPU tensors (gloo, or ``"cpu:gloo,cuda:nccl"``) the flag is a CPU tensor: no CUDA
synchronisation at all. On NCCL alone it lives on the current device, and reading it waits for
the step's kernels, which a loop that already reads its loss once per step pays anyway; call it
right after that read. ``every=N`` checks on every N-th call only (every rank counts its calls
alike), which trades N - 1 steps of the shutdown grace for fewer collectives.

How the signal reaches the ranks (read in torch 2.13's ``torch.distributed.elastic`` and
accelerate 1.15's launcher):

- ``torchrun`` (and ``accelerate launch``, which runs torchrun's launcher in its own process for a
  multi-process job) installs a handler for ``TORCHELASTIC_SIGNALS_TO_HANDLE`` (default SIGTERM,
  SIGINT, SIGHUP, SIGQUIT; torchrun's ``--signals-to-handle``, which accelerate reads from
  ``PET_SIGNALS_TO_HANDLE``) that raises ``SignalException`` in the agent. The agent then sends
  the same signal to every worker (``PContext.close(death_sig, timeout)``), waits ``timeout``
  seconds (``--shutdown-timeout`` or ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, default 30) and SIGKILLs
  whatever is left, then exits 1 with the SignalException's traceback. A signal that hits only the
  launcher therefore reaches every worker at once.
- The workers run in sessions of their own (``start_new_session``): a signal to the launcher's
  process group does not reach them, a signal to their pids (SLURM's proctrack/cgroup, a
  container's kill of every process, ``kill`` of the ranks) does. A signal that hits the workers
  only does not involve the launcher until they exit: the first rank that exits with
  ``PREEMPTED_EXIT_STATUS`` makes the agent SIGTERM the others (handled here too: the signal is
  recorded again, nothing else) and report a ``ChildFailedError`` listing each rank's exit code.
  Both at once (SLURM) is the same: every rank sees its signal once or twice, records it, and
  stops at the same boundary.
- A signal the launcher does not handle takes its default action there: SIGUSR1's kills the
  launcher at once. So for SLURM's ``--signal=USR1@120`` add USR1 to the launcher's list
  (``--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1`` for torchrun,
  ``PET_SIGNALS_TO_HANDLE`` for accelerate launch), or ask for ``B:USR1`` and forward it from the
  batch script.
- The time between the signal and SIGKILL must cover the rest of one step (``every`` steps) and
  one checkpoint: the launcher's shutdown timeout (30 s by default), Kubernetes'
  ``terminationGracePeriodSeconds`` (30 s by default), SLURM's ``KillWait`` after a time limit's
  or ``scancel``'s SIGTERM, a partition's ``GraceTime`` on preemption, or ``--signal``'s lead time.

``PREEMPTED_EXIT_STATUS`` is 75, sysexits' EX_TEMPFAIL ("temporary failure, try again"): not 0,
which tells a scheduler the job finished (a Kubernetes Job would complete, a requeue script would
not requeue); not 1 or 2, the run's own failures; not 128 + N, which a shell or Kubernetes reports
for a process killed by signal N (143 for SIGTERM), so "saved and stopped" and "killed before
saving" stay apart. A rank's status reaches the scheduler where the ranks are its own tasks (srun
of ``python train.py`` per GPU, one pod per rank); torchrun and accelerate launch exit 1 whatever
their workers' statuses and list ``exitcode : 75`` per rank in their failure summary."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterable
from types import FrameType

import torch
import torch.distributed as dist

PREEMPTED_EXIT_STATUS = 75
# The kernel delivers these to no handler.
UNCATCHABLE = frozenset({signal.SIGKILL, signal.SIGSTOP})
# Sent for routine events of a healthy run (a child process ending: a data-loader worker, Triton's
# compiler; a terminal resized; a stopped job continued; a write to a closed pipe), so a run
# stopping on one would stop for nothing.
ROUTINE = frozenset({signal.SIGCHLD, signal.SIGWINCH, signal.SIGURG, signal.SIGCONT, signal.SIGPIPE})
# Raised by a fault in the process itself (or abort()): after a Python handler returns, the faulting
# instruction runs again or the process dies anyway, so none can wait for a step boundary.
FAULTS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGABRT, signal.SIGTRAP,
                    signal.SIGSYS})


class Preempted(Exception):
    """The run stopped on a preemption signal after ``step``, with ``checkpoint`` written (None if
    none could be); raised alike on every rank by the caller of ``Preemption.stop_requested``."""

    def __init__(self, sig: signal.Signals, step: int, checkpoint):
        where = f"{checkpoint} written" if checkpoint is not None else "no checkpoint written"
        super().__init__(f"preempted ({sig.name}) after step {step}: {where}; run the same command to resume")
        self.signal, self.step, self.checkpoint = sig, step, checkpoint


def parse_signal(value) -> signal.Signals:
    """A signal from its name (``SIGUSR1``, ``USR1``, any case) or number; ValueError naming the
    value for one that does not exist or cannot be caught."""
    text = str(value).strip()
    try:
        sig = signal.Signals(int(text)) if text.isdigit() else signal.Signals[
            text.upper() if text.upper().startswith("SIG") else "SIG" + text.upper()]
    except (KeyError, ValueError):
        raise ValueError(f"no such signal: {value!r} (expected a name such as SIGTERM or USR1, or a number)") from None
    if sig in UNCATCHABLE:
        raise ValueError(f"{sig.name} cannot be caught, so it cannot ask for a checkpoint; use e.g. SIGTERM or SIGUSR1")
    if sig in ROUTINE:
        raise ValueError(f"{sig.name} is sent for routine events of a healthy run (child processes, terminals), so it "
                         "cannot ask for a checkpoint; use e.g. SIGTERM or SIGUSR1")
    if sig in FAULTS:
        raise ValueError(f"{sig.name} reports a fault in the process, which cannot wait for a step boundary, so it "
                         "cannot ask for a checkpoint; use e.g. SIGTERM or SIGUSR1")
    return sig


class Preemption:
    """Record ``signals`` while the context is open; ``stop_requested()`` agrees across ``group``
    (default: the default process group, when one exists) whether any rank got one. See the
    module's docstring for the launchers and the cost."""

    def __init__(self, signals: Iterable = (signal.SIGTERM,), group=None, *, every: int = 1,
                 device: torch.device | str | None = None):
        if isinstance(signals, (str, int)):
            raise TypeError(f"signals must be a collection of signals, got {signals!r}; wrap one in a tuple")
        try:
            self.signals = tuple(dict.fromkeys(parse_signal(s) for s in signals))
        except ValueError as err:
            raise ValueError(f"signals: {err}") from None
        if not self.signals:
            raise ValueError("signals must name at least one signal")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an int >= 1 (check on every N-th call), got {every!r}")
        self.group, self.every = group, every
        self.device = None if device is None else torch.device(device)
        self.received: signal.Signals | None = None  # this rank's first, for its own log
        self.signal: signal.Signals | None = None  # the agreed one, once stop_requested said so
        self._previous: dict[signal.Signals, object] = {}
        self._calls = 0

    def __enter__(self) -> Preemption:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("Preemption must be entered in the main thread: Python runs signal handlers only there")
        for sig in self.signals:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)
            # Restart system calls the signal interrupts: a collective or write in C++ code that
            # does not retry on EINTR must not fail because a signal was recorded.
            signal.siginterrupt(sig, False)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            # A handler installed after ours (and chaining to it, or not) is left in place.
            if signal.getsignal(sig) == self._handle:
                # After an agreed stop the process is on its way out, and a launcher signals the
                # ranks still exiting once the first has exited (torchrun: SIGTERM): ignored, so
                # that a rank's status stays the preempted one instead of a kill.
                signal.signal(sig, signal.SIG_IGN if self.signal is not None else previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)
        previous = self._previous.get(signal.Signals(signum))
        # A program's own handler still runs; Python's default for SIGINT (raise
        # KeyboardInterrupt) is a default like SIG_DFL, which this replaces.
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)

    def stop_requested(self) -> bool:
        """Whether any rank of the group received one of the signals: the same answer on every
        rank, which every rank must ask at the same points (it is a collective on those calls
        ``every`` selects). Once True, stays True without another collective."""
        if self.signal is not None:
            return True
        self._calls += 1
        if self._calls % self.every:
            return False
        mine = 0 if self.received is None else int(self.received)
        if dist.is_available() and dist.is_initialized():
            flag = torch.tensor([mine], dtype=torch.int32, device=self._flag_device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            # host sync: one int32 per check (none on a CPU-serving backend's CPU tensor).
            agreed = int(flag.item())
        else:
            agreed = mine
        if agreed:
            self.signal = signal.Signals(agreed)
        return self.signal is not None

    def _flag_device(self) -> torch.device:
        if self.device is not None:
            return self.device
        backend = str(dist.get_backend(self.group))
        if "gloo" in backend or "cpu:" in backend:
            return torch.device("cpu")
        accelerator = torch.accelerator.current_accelerator()
        return torch.device(accelerator.type, torch.accelerator.current_device_index())
