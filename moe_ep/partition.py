"""Automatic pipeline partition: split a chain of units (embedding, decoder layers, head) into
contiguous pipeline stages so that the slowest stage is as fast as possible while every rank
stays under a memory cap.

The algorithm knows nothing about models: it takes one :class:`UnitCost` per unit, in execution
order. ``moe_ep.planner.costs.unit_costs`` builds them from a Hugging Face config (FLOPs and the
bytes of parameters, gradients, optimizer state and activations of each unit, embedding and head
included); ``moe_ep.parallel.pipeline`` uses the result to cut the model into stages.

Exact, not greedy: a dynamic programme over (stage, first unit of the next stage) finds the
smallest possible bottleneck time T*; a second pass, restricted to stages no slower than T*,
picks among the optimal partitions the one whose most loaded rank holds the fewest bytes.
Both passes cost O(S * n^2) for S stages and n units.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

PLACEMENTS = ("loop", "v")
# Two stage times closer than this (relative) count as equal: the DP compares sums of floats
# accumulated in different orders.
_REL_EPS = 1e-9


@dataclass(frozen=True)
class UnitCost:
    """The cost of one unit of the chain for one micro-batch.

    ``flops``: forward + backward (+ recompute) FLOPs of one micro-batch; the stage time is taken
    proportional to it. ``param_bytes``, ``grad_bytes``, ``optim_bytes``: what one rank holds for
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

    def rank_of_stage(self, stage: int) -> int:
        return stage_to_rank(stage, self.num_stages // self.stages_per_rank, self.num_stages, self.placement)

    def rank_bytes(self, rank: int) -> float:
        return sum(self.stage_bytes(s) for s in range(self.num_stages) if self.rank_of_stage(s) == rank)

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

    Raises ValueError when no partition satisfies the constraints, saying which one binds.
    """
    units = tuple(units)
    _check_inputs(list(units), num_stages, placement, stages_per_rank, inflight, memory_cap)
    inflight_S = tuple(float(f) for f in inflight) if inflight is not None else (1.0,) * num_stages
    stage_cap = math.inf if memory_cap is None else memory_cap / stages_per_rank
    forbidden = _forbidden_boundaries(units, placement)
    if split_points is not None:
        starts = _check_split_points(units, num_stages, split_points, forbidden, stage_cap, inflight_S)
    else:
        starts = _solve(units, num_stages, forbidden, stage_cap, inflight_S)
    return Partition(units, starts, placement, stages_per_rank, inflight_S)


def _check_split_points(units, num_stages, split_points, forbidden, stage_cap, inflight_S):
    points = list(split_points)
    n = len(units)
    if len(points) != num_stages - 1 or not all(isinstance(p, int) for p in points):
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


def _solve(units, num_stages, forbidden, stage_cap, inflight_S) -> tuple[int, ...]:
    n = len(units)
    prefix_flops = [0.0]
    for u in units:
        prefix_flops.append(prefix_flops[-1] + u.flops)

    def seg_time(lo, hi):
        return prefix_flops[hi] - prefix_flops[lo]

    def fits(s, lo, hi):
        return _segment_bytes(units, lo, hi, inflight_S[s]) <= stage_cap * (1 + _REL_EPS)

    best_time = _dp(n, num_stages, forbidden, lambda s, lo, hi: seg_time(lo, hi), fits)
    if best_time is None:
        raise ValueError(_infeasible_message(units, num_stages, forbidden, stage_cap, inflight_S))
    bound = best_time[0] * (1 + _REL_EPS) + 1e-30

    def fits_in_time(s, lo, hi):
        return fits(s, lo, hi) and seg_time(lo, hi) <= bound

    best_mem = _dp(
        n, num_stages, forbidden, lambda s, lo, hi: _segment_bytes(units, lo, hi, inflight_S[s]), fits_in_time
    )
    assert best_mem is not None, "the time-optimal partition satisfies the second pass by construction"
    return best_mem[1]


def _dp(n, num_stages, forbidden, seg_cost, allowed):
    """min over partitions of max_s seg_cost(s, lo, hi), with allowed(s, lo, hi) on every stage.
    Returns (value, starts) or None when nothing is allowed."""
    inf = math.inf
    # best[s][u]: the smallest bottleneck of stages 0..s-1 covering units [0, u).
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    arg = [[-1] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        # Stage s-1 ends at u; later stages need at least one unit each.
        for u in range(s, n - (num_stages - s) + 1):
            if u < n and u in forbidden:
                continue
            for t in range(s - 1, u):
                # A forbidden t never ends a stage: best[s-1][t] stays inf.
                if best[s - 1][t] == inf:
                    continue
                if not allowed(s - 1, t, u):
                    continue
                value = max(best[s - 1][t], seg_cost(s - 1, t, u))
                if value < best[s][u]:
                    best[s][u], arg[s][u] = value, t
    if best[num_stages][n] == inf:
        return None
    starts = [n]
    for s in range(num_stages, 0, -1):
        starts.append(arg[s][starts[-1]])
    return best[num_stages][n], tuple(reversed(starts))


def _infeasible_message(units, num_stages, forbidden, stage_cap, inflight_S) -> str:
    free = [b for b in range(1, len(units)) if b not in forbidden]
    if len(free) < num_stages - 1:
        keys = sorted(set(forbidden.values()))
        return (
            f"cannot cut {len(units)} units into {num_stages} stages: shared parameters {keys} must stay on one "
            f"rank, which leaves {len(free)} possible cuts; use fewer stages, untie the parameters, or a V placement "
            f"(schedule 'zbv') that puts the first and the last stage on one rank"
        )
    least = _dp(
        len(units), num_stages, forbidden,
        lambda s, lo, hi: _segment_bytes(units, lo, hi, inflight_S[s]), lambda s, lo, hi: True,
    )
    return (
        f"no partition into {num_stages} stages fits the memory cap of {format_bytes(stage_cap)} per stage: "
        f"the best balanced one still needs {format_bytes(least[0])} on its fullest stage; "
        f"raise the cap, add stages or shard further"
    )
