"""Timing for the benchmarks: warmup, several repetitions, the median. On CUDA the clock is a pair
of CUDA events around the timed call, so queued work from the untimed setup is not counted.

Timings whose median lies well above their fastest call were disturbed by other work on the
machine: they get more rounds, and if they stay noisy a NoisyTimingWarning says so (the command
line puts it under the table and in the saved notes)."""

from __future__ import annotations

import os
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch


# A median more than this far above the fastest call means something else ran meanwhile: a quiet
# GPU repeats within a few percent, a quiet CPU within about 5%.
NOISE_LIMIT = 0.10
EXTRA_ROUNDS = 2  # more rounds of ``reps`` calls each for noisy timings, before warning


class NoisyTimingWarning(UserWarning):
    """Timings still noisy after the extra rounds: their figures are not to be trusted."""


@dataclass(frozen=True)
class Timing:
    median_s: float
    min_s: float
    reps: int

    @property
    def spread(self) -> float:
        """How far the median lies above the fastest call, as a fraction of the fastest."""
        return self.median_s / self.min_s - 1 if self.min_s > 0 else 0.0


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_once(fn: Callable, args: tuple, device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        # host sync: reading the elapsed time needs the end event to have run.
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def measure_many(
    cases: dict[str, tuple[Callable, Callable[[], tuple] | None]],
    *,
    device: torch.device,
    warmup: int = 2,
    reps: int = 5,
    label: str | None = None,
    extra_rounds: int = EXTRA_ROUNDS,
) -> dict[str, Timing]:
    """Median wall time of each ``fn(*setup())`` in ``cases`` (name -> (fn, setup or None));
    ``setup`` runs untimed before every call (the forward pass ahead of a timed backward, say).
    ``label``, when given, is printed first with what is about to be timed.

    The cases take turns, one call each per round, so that load from other processes on a
    shared machine falls on all of them alike instead of on whichever ran during a burst. Cases
    whose spread exceeds NOISE_LIMIT get up to ``extra_rounds`` more rounds of ``reps`` calls (all
    of their calls count), then a NoisyTimingWarning. Callers timing collectives pass 0: ranks
    deciding on extra rounds by their own clocks would issue different numbers of collectives."""
    if warmup < 0 or reps < 1:
        raise ValueError(f"warmup must be >= 0 and reps >= 1, got warmup={warmup}, reps={reps}")
    if label:
        print(f"{label}: timing {len(cases)} case(s), {warmup} warmup + {reps} timed calls each", flush=True)
    for fn, setup in cases.values():
        for _ in range(warmup):
            fn(*(setup() if setup else ()))
    synchronize(device)
    times = {name: [] for name in cases}
    pending = dict(cases)
    for _ in range(1 + extra_rounds):
        for _ in range(reps):
            for name, (fn, setup) in pending.items():
                times[name].append(_time_once(fn, setup() if setup else (), device))
        timings = {name: Timing(statistics.median(t), min(t), len(t)) for name, t in times.items()}
        pending = {name: cases[name] for name in pending if timings[name].spread > NOISE_LIMIT}
        if not pending:
            return timings
    worst = max(pending, key=lambda name: timings[name].spread)
    warnings.warn(NoisyTimingWarning(
        f"{label + ': ' if label else ''}{len(pending)} of {len(cases)} timing(s) noisy after "
        f"{timings[worst].reps} calls (worst {worst!r}: median {timings[worst].spread:.0%} above its fastest "
        f"call); other work is using the machine ({_load()})"), stacklevel=2)
    return timings


def _load() -> str:
    try:
        return f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    except OSError:
        return f"{os.cpu_count()} cores"


def measure(
    fn: Callable,
    *,
    device: torch.device,
    warmup: int = 2,
    reps: int = 5,
    setup: Callable[[], tuple] | None = None,
    name: str = "the call",
    extra_rounds: int = EXTRA_ROUNDS,
) -> Timing:
    """Median wall time of ``fn(*setup())``, see measure_many (``name`` is what a noise warning
    calls it)."""
    return measure_many({name: (fn, setup)}, device=device, warmup=warmup, reps=reps,
                        extra_rounds=extra_rounds)[name]


def peak_memory_bytes(fn: Callable, device: torch.device) -> int | None:
    """Bytes allocated at the peak of ``fn()`` above what was allocated before it (CUDA only:
    the CPU allocator keeps no such statistics, so None there)."""
    if device.type != "cuda":
        return None
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base
