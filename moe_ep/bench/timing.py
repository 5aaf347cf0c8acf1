"""Timing for the benchmarks: warmup, several repetitions, the median. On CUDA the clock is a pair
of CUDA events around the timed call, so queued work from the untimed setup is not counted."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Timing:
    median_s: float
    min_s: float
    reps: int


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
) -> dict[str, Timing]:
    """Median wall time of each ``fn(*setup())`` in ``cases`` (name -> (fn, setup or None));
    ``setup`` runs untimed before every call (the forward pass ahead of a timed backward, say).

    The cases take turns, one call each per round, so that load from other processes on a
    shared machine falls on all of them alike instead of on whichever ran during a burst."""
    if warmup < 0 or reps < 1:
        raise ValueError(f"warmup must be >= 0 and reps >= 1, got warmup={warmup}, reps={reps}")
    for fn, setup in cases.values():
        for _ in range(warmup):
            fn(*(setup() if setup else ()))
    synchronize(device)
    times = {name: [] for name in cases}
    for _ in range(reps):
        for name, (fn, setup) in cases.items():
            times[name].append(_time_once(fn, setup() if setup else (), device))
    return {name: Timing(statistics.median(t), min(t), reps) for name, t in times.items()}


def measure(
    fn: Callable,
    *,
    device: torch.device,
    warmup: int = 2,
    reps: int = 5,
    setup: Callable[[], tuple] | None = None,
) -> Timing:
    """Median wall time of ``fn(*setup())``, see measure_many."""
    return measure_many({"": (fn, setup)}, device=device, warmup=warmup, reps=reps)[""]


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
