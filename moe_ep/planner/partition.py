"""Automatic pipeline partition: split a chain of units (embedding, decoder layers, head) into
contiguous pipeline stages so that the slowest stage is as fast as possible, then the second
slowest, and so on, while every rank stays under a memory cap.

The algorithm knows nothing about models: it takes one :class:`UnitCost` per unit, in execution
order. ``moe_ep.planner.memory.unit_costs`` builds them from a Hugging Face config (the seconds
each unit takes and the bytes of its parameters, gradients, optimizer state and activations,
embedding and head included); ``moe_ep.parallel.pipeline`` uses the result to cut the model into
stages.

Exact: the smallest possible bottleneck time T* is found by binary search over the segment
sums, each probe an exact feasibility check under the time and memory limits (O(n) greedy when
the micro-batches in flight are monotone over the stages, as in GPipe, 1F1B and ZB-V; a sweep
over reachable stage ends otherwise). Minimising the bottleneck alone leaves the other stages
arbitrary: once a heavy LM head makes the last stage the bottleneck, any split of the other
layers ties, e.g. [9, 1, 1, 1]. So a dynamic programme over stages no slower than T* then picks
the lexicographically smallest vector of stage times sorted from the slowest down (leximax),
and among those the leximax one in stage bytes (so equal stages go where they hold least, e.g.
the fewest layers on the stage with the most micro-batches in flight).
"""

from __future__ import annotations

import functools
import itertools
import math
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Sequence

PLACEMENTS = ("loop", "v")


class InfeasiblePartition(ValueError):
    """No cut of the chain meets the constraints (shared parameters, memory cap). Its own class
    so that a caller probing many layouts can skip exactly these and still see any other error."""

# Slack on the memory cap (relative): a stage's bytes add a multiple of its activations to exact
# sums, which rounds.
_REL_EPS = 1e-9


@dataclass(frozen=True)
class UnitCost:
    """The cost of one unit of the chain for one micro-batch.

    ``flops``: the cost of one micro-batch's forward + backward (+ recompute): FLOPs, or any
    measure the stage time is proportional to (the planner gives seconds on the cluster). ``param_bytes``, ``grad_bytes``, ``optim_bytes``: what one rank holds for
    this unit in steady state. ``act_bytes``: activations one micro-batch keeps alive for the
    backward; a stage multiplies them by its number of micro-batches in flight.
    ``work_bytes``: transient memory while the unit runs (recompute working set, gathered
    weights); a stage adds only its largest. ``shared``: names of parameters this unit shares
    with other units (a tied embedding and LM head); units sharing a name must land on one rank.
    """

    name: str
    flops: float
    param_bytes: float = 0.0
    grad_bytes: float = 0.0
    optim_bytes: float = 0.0
    act_bytes: float = 0.0
    work_bytes: float = 0.0
    shared: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self):
        # The solver relies on a stage never getting faster or smaller as it takes more units.
        for name in ("flops", "param_bytes", "grad_bytes", "optim_bytes", "act_bytes", "work_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"UnitCost {self.name!r}: {name} must be a finite number >= 0, got {value!r}")

    @property
    def static_bytes(self) -> float:
        return self.param_bytes + self.grad_bytes + self.optim_bytes


@dataclass(frozen=True)
class Partition:
    """Stage ``s`` holds units ``starts[s] : starts[s + 1]`` (``starts[-1] == len(units)``)."""

    units: tuple[UnitCost, ...]
    starts: tuple[int, ...]
    placement: str
    stages_per_rank: int
    inflight: tuple[float, ...]

    @property
    def num_stages(self) -> int:
        return len(self.starts) - 1

    def stage_units(self, stage: int) -> tuple[UnitCost, ...]:
        return self.units[self.starts[stage] : self.starts[stage + 1]]

    def stage_flops(self, stage: int) -> float:
        return sum(u.flops for u in self.stage_units(stage))

    def stage_bytes(self, stage: int) -> float:
        return _segment_bytes(self.units, self.starts[stage], self.starts[stage + 1], self.inflight[stage])

    @property
    def bottleneck_flops(self) -> float:
        return max(self.stage_flops(s) for s in range(self.num_stages))

    @functools.cached_property
    def _rank_by_stage(self) -> tuple[int, ...]:
        # The search asks for a layout's placement millions of times: computed once.
        ranks = self.num_stages // self.stages_per_rank
        return tuple(stage_to_rank(s, ranks, self.num_stages, self.placement) for s in range(self.num_stages))

    def rank_of_stage(self, stage: int) -> int:
        return self._rank_by_stage[stage]

    def stages_of_rank(self, rank: int) -> list[int]:
        """The stages pipeline rank ``rank`` holds, in model order."""
        return [s for s, r in enumerate(self._rank_by_stage) if r == rank]

    def stage_names(self, stage: int) -> list[str]:
        return [u.name for u in self.stage_units(stage)]


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.4g} B"


def stage_to_rank(stage: int, num_ranks: int, num_stages: int, placement: str) -> int:
    """``loop``: stage s on rank s % R (GPipe, 1F1B, interleaved). ``v``: stages go down the ranks
    and back up (ZB-V), so the first and the last stage share rank 0."""
    if placement == "loop":
        return stage % num_ranks
    lap, offset = divmod(stage, num_ranks)
    return offset if lap % 2 == 0 else num_ranks - 1 - offset


def _segment_bytes(units: Sequence[UnitCost], lo: int, hi: int, inflight: float) -> float:
    seg = units[lo:hi]
    return (
        sum(u.static_bytes for u in seg)
        + inflight * sum(u.act_bytes for u in seg)
        + max((u.work_bytes for u in seg), default=0.0)
    )


def _forbidden_boundaries(units: Sequence[UnitCost], placement: str) -> dict[int, str]:
    """Boundary b (a stage starting at unit b) is forbidden when it would separate two units that
    share a parameter. Under the V placement the first and the last unit are on rank 0 whatever
    the cut, so a tie between exactly those two is allowed."""
    owners: dict[str, list[int]] = {}
    for i, unit in enumerate(units):
        for key in unit.shared:
            owners.setdefault(key, []).append(i)
    last = len(units) - 1
    forbidden: dict[int, str] = {}
    for key, idx in owners.items():
        lo, hi = min(idx), max(idx)
        if placement == "v" and set(idx) == {0, last} and last > 0:
            continue
        for b in range(lo + 1, hi + 1):
            forbidden.setdefault(b, key)
    return forbidden


def _check_inputs(units, num_stages, placement, stages_per_rank, inflight, memory_cap):
    if not isinstance(units, (list, tuple)) or not all(isinstance(u, UnitCost) for u in units):
        raise TypeError(f"units must be a list of UnitCost, got {type(units).__name__}")
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive int, got {num_stages!r}")
    if num_stages > len(units):
        raise ValueError(
            f"num_stages={num_stages} exceeds the number of units ({len(units)}): every stage needs at least one"
        )
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if not isinstance(stages_per_rank, int) or stages_per_rank < 1 or num_stages % stages_per_rank:
        raise ValueError(
            f"stages_per_rank must be a positive divisor of num_stages={num_stages}, got {stages_per_rank!r}"
        )
    if placement == "v" and stages_per_rank != 2:
        raise ValueError(f"placement='v' puts exactly 2 stages on each rank, got stages_per_rank={stages_per_rank}")
    if inflight is not None and len(inflight) != num_stages:
        raise ValueError(f"inflight must have one entry per stage ({num_stages}), got {len(inflight)}")
    if memory_cap is not None and not memory_cap > 0:
        raise ValueError(f"memory_cap must be a positive number of bytes or None, got {memory_cap!r}")


def partition(
    units: Sequence[UnitCost],
    num_stages: int,
    *,
    memory_cap: float | None = None,
    split_points: Sequence[int] | None = None,
    placement: str = "loop",
    stages_per_rank: int = 1,
    inflight: Sequence[float] | None = None,
) -> Partition:
    """Cut ``units`` into ``num_stages`` contiguous, non-empty stages.

    Args:
        units: the chain in execution order, e.g. ``[embed, layers.0, ..., layers.L-1, head]``.
        num_stages: pipeline stages in all (ranks x ``stages_per_rank``).
        memory_cap: bytes one rank may hold. With several stages per rank each stage gets an
            equal share of it (a sufficient condition, exact for one stage per rank).
        split_points: explicit override, the index of the first unit of stages 1..S-1. Checked
            against the shared-parameter rule and the memory cap, never silently changed.
        placement: ``"loop"`` or ``"v"`` (see :func:`stage_to_rank`).
        stages_per_rank: 1 for GPipe/1F1B, V >= 2 for interleaved schedules.
        inflight: micro-batches whose activations stage ``s`` keeps alive at its peak
            (1F1B: ``pp - s``); defaults to 1 for every stage.

    Raises InfeasiblePartition (a ValueError) when no partition satisfies the constraints, saying
    which one binds; ValueError or TypeError for malformed arguments or ``split_points`` that break
    a constraint.
    """
    units = tuple(units)
    _check_inputs(list(units), num_stages, placement, stages_per_rank, inflight, memory_cap)
    inflight_S = tuple(float(f) for f in inflight) if inflight is not None else (1.0,) * num_stages
    stage_cap = math.inf if memory_cap is None else memory_cap / stages_per_rank
    if split_points is not None:
        forbidden = _forbidden_boundaries(units, placement)
        starts = _check_split_points(units, num_stages, split_points, forbidden, stage_cap, inflight_S)
    else:
        starts = _cut(units, num_stages, placement, stage_cap, inflight_S)
    return Partition(units, starts, placement, stages_per_rank, inflight_S)


@functools.lru_cache(maxsize=4096)
def _cut(units: tuple[UnitCost, ...], num_stages: int, placement: str, stage_cap: float,
         inflight_S: tuple[float, ...]) -> tuple[int, ...]:
    # The planner's search cuts one chain into the same stages for many layouts (those that
    # differ only in dp_replicate or in the count of micro-batches): each is solved once.
    return _solve(units, num_stages, _forbidden_boundaries(units, placement), stage_cap, inflight_S)


def fits(
    units: Sequence[UnitCost],
    num_stages: int,
    memory_cap: float,
    *,
    placement: str = "loop",
    stages_per_rank: int = 1,
    inflight: Sequence[float] | None = None,
) -> bool:
    """Whether some partition meets the memory cap (one feasibility probe, no message built);
    the same arguments as :func:`partition`."""
    units = tuple(units)
    _check_inputs(list(units), num_stages, placement, stages_per_rank, inflight, memory_cap)
    inflight_S = tuple(float(f) for f in inflight) if inflight is not None else (1.0,) * num_stages
    seg = _Segments(units, inflight_S, _forbidden_boundaries(units, placement))
    return seg.feasible(math.inf, memory_cap / stages_per_rank * (1 + _REL_EPS)) is not None


def _check_split_points(units, num_stages, split_points, forbidden, stage_cap, inflight_S):
    points = list(split_points)
    n = len(units)
    if len(points) != num_stages - 1 or not all(isinstance(p, int) and not isinstance(p, bool) for p in points):
        raise ValueError(
            f"split_points must hold {num_stages - 1} ints (first unit of stages 1..{num_stages - 1}), got {points}"
        )
    starts = (0, *points, n)
    if any(a >= b for a, b in zip(starts, starts[1:])):
        raise ValueError(f"split_points must be strictly increasing within [1, {n - 1}], got {points}")
    for p in points:
        if p in forbidden:
            raise ValueError(
                f"split_points={points}: a stage starting at {units[p].name} would separate the units that "
                f"share parameter {forbidden[p]!r}; they must stay on one rank"
            )
    for s in range(num_stages):
        need = _segment_bytes(units, starts[s], starts[s + 1], inflight_S[s])
        if need > stage_cap * (1 + _REL_EPS):
            raise ValueError(
                f"split_points={points}: stage {s} ({units[starts[s]].name}..{units[starts[s + 1] - 1].name}) "
                f"needs {format_bytes(need)}, over the memory cap of {format_bytes(stage_cap)} per stage"
            )
    return starts


def _exact_prefix(values: Sequence[float]) -> list[float]:
    """Prefix sums whose differences are exact: each value is first rounded to a multiple of a
    power of two q with sum / q < 2^52, so every partial sum is an integer multiple of q that a
    double represents exactly. A value moves by at most q / 2 (2^-53 of the sum); in exchange
    stages holding equal units cost exactly the same wherever they sit, and the leximax
    compares real differences, never rounding noise."""
    prefix = [0.0]
    total = math.fsum(values)
    if total == 0:
        return prefix * (len(values) + 1)
    q = 2.0 ** (math.frexp(total)[1] - 52)
    for v in values:
        prefix.append(prefix[-1] + round(v / q) * q)
    return prefix


class _Segments:
    """Time and bytes of any segment [lo, hi) in O(1): exact prefix sums, and a table of the
    largest transient term of each segment."""

    def __init__(self, units: Sequence[UnitCost], inflight_S: Sequence[float], forbidden: dict[int, str]):
        n = len(units)
        self.n, self.num_stages, self.inflight_S, self.forbidden = n, len(inflight_S), inflight_S, forbidden
        self.flops = _exact_prefix([u.flops for u in units])
        self.static = _exact_prefix([u.static_bytes for u in units])
        self.act = _exact_prefix([u.act_bytes for u in units])
        works = [u.work_bytes for u in units]
        # work[lo][hi]: the largest transient term in [lo, hi) (index hi <= lo unused).
        self.work = [[0.0] * (lo + 1) + list(itertools.accumulate(works[lo:], max)) for lo in range(n)]
        # Whether a stage may start at each position, and how many such cuts lie strictly before
        # and after it: the stages on either side of a cut need cuts of their own, not just units.
        self.free = [0 < c < n and c not in forbidden for c in range(n + 1)]
        self.free_before = list(itertools.accumulate([0] + self.free[:-1]))
        self.free_after = list(itertools.accumulate([0] + self.free[:0:-1]))[::-1]
        diffs = [y - x for x, y in zip(inflight_S, inflight_S[1:])]
        self.monotone = "up" if all(d >= 0 for d in diffs) else "down" if all(d <= 0 for d in diffs) else None

    def time(self, lo, hi):
        return self.flops[hi] - self.flops[lo]

    def bytes(self, s, lo, hi):
        return self.static[hi] - self.static[lo] + self.inflight_S[s] * (self.act[hi] - self.act[lo]) + self.work[lo][hi]

    def ok(self, s, lo, hi, max_time, max_bytes):
        return self.time(lo, hi) <= max_time and self.bytes(s, lo, hi) <= max_bytes

    def can_end(self, s, end):
        """Stage s may end at `end`: not inside a shared-parameter span, and enough allowed cuts
        left after it for the stages that follow."""
        if end == self.n:
            return s == self.num_stages - 1
        return self.free[end] and self.free_after[end] >= self.num_stages - 2 - s

    def peaks(self, starts) -> tuple[float, float]:
        """(slowest stage time, fullest stage bytes)."""
        segs = list(enumerate(zip(starts, starts[1:])))
        return max(self.time(lo, hi) for _, (lo, hi) in segs), max(self.bytes(s, lo, hi) for s, (lo, hi) in segs)

    def feasible(self, max_time, max_bytes):
        """Stage starts with every stage within both limits, or None. Both limits only get
        harder as a segment grows. When the per-stage factor never decreases, a stage that takes
        as many units as it can never leaves the later stages worse off, so a greedy pass from
        the front is exact; when it never increases, the same holds from the back; otherwise an
        exact sweep over the reachable stage ends."""
        if self.monotone == "up":
            return self._greedy_front(max_time, max_bytes)
        if self.monotone == "down":
            return self._greedy_back(max_time, max_bytes)
        return self._reachable(max_time, max_bytes)

    def _greedy_front(self, max_time, max_bytes):
        starts, lo = [0], 0
        for s in range(self.num_stages):
            end = None
            for hi in range(lo + 1, self.n + 1):
                if not self.ok(s, lo, hi, max_time, max_bytes):
                    break
                if self.can_end(s, hi):
                    end = hi
            if end is None:
                return None
            starts.append(end)
            lo = end
        return tuple(starts) if lo == self.n else None

    def _greedy_back(self, max_time, max_bytes):
        ends, hi = [self.n], self.n
        for s in range(self.num_stages - 1, -1, -1):
            start = None
            for lo in range(hi - 1, -1, -1):
                if not self.ok(s, lo, hi, max_time, max_bytes):
                    break
                # The first stage starts at 0; any other stage's start is a cut, and the s stages
                # before it need s - 1 more.
                first_ok = s == 0 and lo == 0
                later_ok = s > 0 and self.free[lo] and self.free_before[lo] >= s - 1
                if first_ok or later_ok:
                    start = lo
            if start is None:
                return None
            ends.append(start)
            hi = start
        return tuple(reversed(ends)) if hi == 0 else None

    def _reachable(self, max_time, max_bytes):
        """Sweep stage by stage over the positions where the previous stage can end. For a
        fixed stage the furthest feasible end never moves left as the start moves right, so one
        pointer serves all starts: O(n) per stage. (The hot loop of the planner, hence inlined.)"""
        n, S, forbidden = self.n, self.num_stages, self.forbidden
        flops, static, act, work = self.flops, self.static, self.act, self.work
        reach = [0]
        history = []
        for s in range(S):
            factor = self.inflight_S[s]
            last_end = n - (S - 1 - s)
            pred = {}  # stage end -> a start that reaches it
            hi = marked = 0
            for lo in reach:
                if hi < lo:
                    hi = lo
                row, f0, s0, a0 = work[lo], flops[lo], static[lo], act[lo]
                while hi < n:
                    nxt = hi + 1
                    if flops[nxt] - f0 > max_time or static[nxt] - s0 + factor * (act[nxt] - a0) + row[nxt] > max_bytes:
                        break
                    hi = nxt
                for end in range((lo if lo > marked else marked) + 1, (hi if hi < last_end else last_end) + 1):
                    if end == n or (end not in forbidden and s < S - 1):
                        pred[end] = lo
                if hi > marked:
                    marked = hi
            history.append(pred)
            reach = sorted(pred)
        if n not in reach:
            return None
        starts = [n]
        for pred in reversed(history):
            starts.append(pred[starts[-1]])
        return tuple(reversed(starts))


def _smallest_feasible(values, probe):
    """Binary search over sorted candidate limits: the result of the first probe that succeeds."""
    lo_i, hi_i, found = 0, len(values) - 1, None
    while lo_i <= hi_i:
        mid = (lo_i + hi_i) // 2
        trial = probe(values[mid])
        if trial is None:
            lo_i = mid + 1
        else:
            hi_i, found = mid - 1, trial
    return found


_DESCENT_STEPS = 8


def _least_bytes(seg: _Segments):
    """A partition with the smallest peak bytes (to 1e-12 relative), whatever its time. First
    probe just below the peak of the best so far: each success strictly lowers it, and the
    first cut found is usually close already. If that keeps succeeding, bisect between 0 and
    the peak."""
    best = seg.feasible(math.inf, math.inf)
    for _ in range(_DESCENT_STEPS):
        if best is None or seg.peaks(best)[1] <= 0:
            return best
        lower = seg.feasible(math.inf, seg.peaks(best)[1] * (1 - _REL_EPS))
        if lower is None:
            return best
        best = lower
    lo_bytes, hi_bytes = 0.0, seg.peaks(best)[1]
    while hi_bytes - lo_bytes > 1e-12 * hi_bytes:
        mid = (lo_bytes + hi_bytes) / 2
        trial = seg.feasible(math.inf, mid)
        if trial is None:
            lo_bytes = mid
        else:
            best, hi_bytes = trial, seg.peaks(trial)[1]
    return best


def _leximax(seg: _Segments, max_time, max_bytes):
    """Among partitions with every stage within max_time and max_bytes, the one whose stage
    times, sorted from the slowest down, are lexicographically smallest; among those, likewise
    for the stage bytes (the fullest stage as empty as possible, then the next...). None if
    there is none.

    Dynamic programme over (stage, where it ends). Adding the same stage to two partial
    partitions keeps their order (it is decided by the largest value in which their multisets
    differ, and a common value is not one), so the best prefix ending at a position is the only
    one worth extending. max_time is the optimal bottleneck: no slower segment can be part of
    the answer, which on balanced chains bounds a stage at about n / S units and the work at
    about n^2 segment steps."""
    n, S, free = seg.n, seg.num_stages, seg.free
    flops, static, act, work = seg.flops, seg.static, seg.act, seg.work
    # Reachable end -> (stage times, stage bytes), each negated and sorted ascending: larger is
    # better, so Python's tuple order does the leximax comparison.
    best: dict[int, tuple] = {0: ((), ())}
    history = []
    for s in range(S):
        step, pred, factor = {}, {}, seg.inflight_S[s]
        for lo, (neg_times, neg_bytes) in best.items():
            ends = [n] if s == S - 1 else range(lo + 1, n - (S - 1 - s) + 1)
            row, f0, s0, a0 = work[lo], flops[lo], static[lo], act[lo]
            for hi in ends:
                # seg.time and seg.bytes, inlined: this is the planner's hot loop.
                t, b = flops[hi] - f0, static[hi] - s0 + factor * (act[hi] - a0) + row[hi]
                # Both only grow with hi: nothing further along fits either.
                if t > max_time or b > max_bytes:
                    break
                if hi != n and not free[hi]:
                    continue
                i, j = bisect_left(neg_times, -t), bisect_left(neg_bytes, -b)
                key = (neg_times[:i] + (-t,) + neg_times[i:], neg_bytes[:j] + (-b,) + neg_bytes[j:])
                if hi not in step or key > step[hi]:
                    step[hi], pred[hi] = key, lo
        history.append(pred)
        best = step
    if n not in best:
        return None
    starts = [n]
    for pred in reversed(history):
        starts.append(pred[starts[-1]])
    return tuple(reversed(starts))


def _solve(units, num_stages, forbidden, stage_cap, inflight_S) -> tuple[int, ...]:
    """The smallest bottleneck time is one of the segment sums: binary search over them, each
    probe an exact feasibility check. Then the leximax partition within that bottleneck."""
    seg = _Segments(units, inflight_S, forbidden)
    cap = stage_cap * (1 + _REL_EPS)
    if seg.feasible(math.inf, cap) is None:
        raise InfeasiblePartition(_infeasible_message(units, num_stages, forbidden, stage_cap, seg))
    sums = sorted({seg.time(lo, hi) for lo in range(seg.n) for hi in range(lo + 1, seg.n + 1)})
    bottleneck = seg.peaks(_smallest_feasible(sums, lambda t: seg.feasible(t, cap)))[0]
    starts = _leximax(seg, bottleneck, cap)
    assert starts is not None, "a partition within the optimal bottleneck exists by construction"
    return starts


def _infeasible_message(units, num_stages, forbidden, stage_cap, seg) -> str:
    free = sum(seg.free)
    if free < num_stages - 1:
        keys = sorted(set(forbidden.values()))
        return (
            f"cannot cut {len(units)} units into {num_stages} stages: shared parameters {keys} must stay on one "
            f"rank, which leaves {free} possible cuts; use fewer stages, untie the parameters, or a V placement "
            f"(schedule 'zbv' or 'dualpipev') that puts the first and the last stage on one rank"
        )
    least = seg.peaks(_least_bytes(seg))[1]
    return (
        f"no partition into {num_stages} stages fits the memory cap of {format_bytes(stage_cap)} per stage: "
        f"the partition that needs the least memory still needs {format_bytes(least)} on its fullest stage; "
        f"raise the cap, add stages or shard further"
    )
