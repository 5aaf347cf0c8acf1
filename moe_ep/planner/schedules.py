"""Pipeline schedules: where each stage lives, how long the pipeline idles and how many
micro-batches each stage keeps alive. One table, read by the planner's cost model and by
``moe_ep.parallel.pipeline`` when it builds the schedule."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ScheduleInfo:
    name: str
    torch_class: str  # in torch.distributed.pipelining.schedules
    stages_per_rank: int
    placement: str  # see moe_ep.planner.partition.stage_to_rank
    description: str

    @property
    def splits_backward(self) -> bool:
        """Whether some of its backwards run as an input-gradient pass, which keeps the graph for
        a later weight-gradient pass (ZB-V, DualPipeV)."""
        return self.name in ("zbv", DUALPIPEV)

    @property
    def interleaved(self) -> bool:
        """Megatron's interleaved 1F1B order over ``stages_per_rank`` virtual stages, with or
        without its forwards overlapped."""
        return self.name in INTERLEAVED_SCHEDULES

    @property
    def overlaps_forward_backward(self) -> bool:
        """Whether some of its actions run one micro-batch's forward beside another's backward on
        two threads (``moe_ep.parallel.pipeline.overlap``), which then communicate over two lanes
        of process groups."""
        return self.name in (DUALPIPEV, INTERLEAVED_OVERLAP)

    def bubble(self, pp: int) -> float:
        """Idle time of a rank per step, in units of one micro-batch's forward + backward through
        all its stages."""
        if pp == 1:
            return 0.0
        if self.name in ("gpipe", "1f1b"):
            return pp - 1.0
        if self.interleaved:
            return (pp - 1.0) / self.stages_per_rank
        if self.name == DUALPIPEV:
            # DualPipe's published figure for its V form, (pp - 1)(F&B + B - 3W) with a chunk's
            # forward, full backward and weight pass 1/6, 1/3 and 1/6 of the unit and the
            # overlapped F&B taken as long as F + B (its exchanges are modelled apart).
            return (pp - 1.0) / 3
        # ZB-V fills the bubble with weight-gradient work; with forward, input-gradient and
        # weight-gradient passes of equal length what remains is taken as a third of the
        # interleaved bubble (the ZB-H1 figure, halved by the two chunks).
        return (pp - 1.0) / (3 * self.stages_per_rank)

    def inflight(self, pp: int, microbatches: int) -> list[float]:
        """Micro-batches whose activations each stage (in stage order) holds, its rank's peak
        count spread evenly over the rank's stages: the weights the stage cut balances memory
        with. The memory table counts each stage's own at the rank's peak
        (:meth:`peak_activations`)."""
        num_stages = pp * self.stages_per_rank
        m = microbatches
        if self.name == "gpipe":
            return [float(m)] * num_stages
        if self.name == "1f1b":
            return [float(min(m, pp - s)) for s in range(num_stages)]
        if self.interleaved:
            # Megatron's warm-up: rank r runs 2 (pp - r - 1) + (V - 1) pp chunk forwards before
            # its first backward; spread over its V stages.
            v = self.stages_per_rank
            return [min(float(m), (2 * (pp - s % pp - 1) + (v - 1) * pp + 1) / v) for s in range(num_stages)]
        if self.name == DUALPIPEV:
            # Its replay peaks at 2 pp + 1 stage micro-batches per rank (DualPipe's "PP + 1"
            # counts chunks of two ranks' stages), spread over the rank's 2 stages.
            return [min(float(m), pp + 0.5)] * num_stages
        # ZB-V keeps the peak of 1F1B's first stage on every rank.
        return [float(min(m, pp))] * num_stages

    def common_inflight(self, microbatches: int) -> float:
        """Micro-batches that every stage of a rank holds at one same moment of its schedule
        (:meth:`rank_events`): GPipe's all, the others' at least one (each rank reaches a point
        where every one of its stages has run a forward whose backward has not run)."""
        return float(microbatches) if self.name == "gpipe" else 1.0

    def rank_events(self, pp: int, microbatches: int, rank: int) -> list[tuple[int, int]]:
        """When pipeline rank ``rank`` keeps and frees micro-batches' activations, in the order
        torch's ``torch_class`` runs its actions: (stage, +1) for a stage's forward of a
        micro-batch, (stage, -1) for the pass that frees what it saved (the full backward; ZB-V's
        weight-gradient pass, which still reads them after the input-gradient pass), at least
        through the last forward: only frees follow it, so the rank's peak lies within. Stages
        are numbered in model order, as ``stage_to_rank`` places them."""
        m, v = microbatches, self.stages_per_rank
        if self.name == DUALPIPEV:
            return [(stage, +1 if kind == "F" else -1) for kind, stage, _ in _dualpipev_actions(pp, m, rank)
                    if kind != "I"]
        if self.name == "gpipe":
            return [(rank, +1)] * m
        if self.name == "1f1b":
            # Schedule1F1B: pp - rank forwards, then a backward before each later forward.
            warmup = min(m, pp - rank)
            return [(rank, +1)] * warmup + [(rank, -1), (rank, +1)] * (m - warmup)
        if self.interleaved:
            warmup, steady = _interleaved_order(pp, m, v, rank)
            return [(stage, +1) for stage in warmup] + [
                event for forward, backward in steady for event in ((forward, +1), (backward, -1))]
        # ScheduleZBVZeroBubble: its warm-up, then forward, input- and weight-gradient of chunk 0
        # and of chunk 1 in turn until chunk 1 has caught up; it plans at least 2 pp - 1
        # micro-batches and drops the actions of those beyond the real ones.
        first, second = rank, pp * v - 1 - rank
        runs, frees, events = {first: 0, second: 0}, {first: 0, second: 0}, []

        def forward(stage):
            events.append((stage, +1, runs[stage]))
            runs[stage] += 1

        def free(stage):
            events.append((stage, -1, frees[stage]))
            frees[stage] += 1

        planned = max(2 * pp - 1, m)
        for _ in range(2 * (pp - rank) - 1):
            forward(first)
        for _ in range(rank):
            forward(second)
            forward(first)
        for _ in range(pp - rank):
            forward(second)
            free(second)
        while runs[second] < runs[first] or runs[first] < planned:
            if runs[first] < planned:
                forward(first)
            free(first)
            forward(second)
            free(second)
        return [(stage, delta) for stage, delta, microbatch in events if microbatch < m]

    def overlapped_share(self, pp: int, microbatches: int, rank: int) -> float:
        """The share of rank ``rank``'s forwards that run beside another micro-batch's backward
        (``moe_ep.parallel.pipeline.overlap``), whose exchanges therefore hide behind that
        backward's compute: DualPipeV's overlapped F&B actions; under interleaved 1F1B with
        overlap, the steady state's forward and backward where they are of different stages (two
        passes through one stage's modules would share its FSDP state and its caches, so those
        run one after the other); 0 for the other schedules."""
        if pp == 1 or not self.overlaps_forward_backward:
            return 0.0
        return _overlapped_forwards(self, pp, microbatches, rank) / (self.stages_per_rank * microbatches)

    def peak_activations(self, pp: int, microbatches: int, rank: int,
                         act_by_stage: dict[int, float]) -> tuple[float, float]:
        """Rank ``rank``'s peak of kept activations over its schedule (:meth:`rank_events`), given
        each of its stages' bytes per micro-batch, and how many micro-batches its fullest stage
        holds then: (bytes, micro-batches)."""
        stages, moments = _live_after_forwards(self, pp, self._steady(pp, microbatches), rank)
        weights = [act_by_stage.get(s, 0.0) for s in stages]
        peak, counts = max((sum(c * w for c, w in zip(counts, weights)), counts) for counts in moments)
        return peak, float(max(counts))

    def _steady(self, pp: int, microbatches: int) -> int:
        """A count of micro-batches whose moments (``_live_after_forwards``) are those of
        ``microbatches``: beyond 4 x pp x max(2, stages per rank) every schedule but GPipe only
        repeats its steady state, whose moments it has already reached (checked at the counts just above
        that and at 7 and 13 times it, for pp 2-16 and 2-8 stages per rank, in
        tests/test_schedule_memory.py),
        so a step of thousands of micro-batches costs what that many do."""
        cap = 4 * pp * max(2, self.stages_per_rank)
        return microbatches if self.name == "gpipe" or microbatches <= cap else cap

    def check_microbatches(self, pp: int, microbatches: int) -> str | None:
        """Why this many micro-batches cannot run, or None."""
        if microbatches < pp:
            return f"schedule {self.name!r} needs at least pp={pp} micro-batches, got {microbatches}"
        if self.name == DUALPIPEV and microbatches < 2 * pp:
            return f"schedule {self.name!r} needs at least 2 * pp = {2 * pp} micro-batches, got {microbatches}"
        if self.interleaved and microbatches % pp:
            return f"schedule {self.name!r} needs a multiple of pp={pp} micro-batches, got {microbatches}"
        return None


@functools.lru_cache(maxsize=4096)
def _interleaved_order(pp: int, microbatches: int, v: int,
                       rank: int) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
    """Rank ``rank``'s passes in ScheduleInterleaved1F1B's order (Megatron's): the warm-up's
    forwards (their stages), then the steady state's (forward stage, backward stage) pairs, each
    forward followed by a backward; the cool-down's backwards follow. Forwards take the rank's
    stages a round of micro-batches at a time, backwards take them in reverse."""
    per_round, warmup = _interleaved_rounds(pp, microbatches, v, rank)

    def stage(op: int, first: int, reverse: bool) -> int:
        return _interleaved_local(op, first, per_round, v, reverse) * pp + rank

    return (tuple(stage(op, 0, False) for op in range(warmup)),
            tuple((stage(op, 0, False), stage(op, warmup, True)) for op in range(warmup, microbatches * v)))


def _interleaved_rounds(pp: int, microbatches: int, v: int, rank: int) -> tuple[int, int]:
    """(micro-batches per round, forwards in the warm-up) of rank ``rank`` (``_interleaved_order``)."""
    per_round = microbatches // max(1, microbatches // pp)
    return per_round, min((v - 1) * per_round + 2 * (pp - 1 - rank), microbatches * v)


def _interleaved_local(op: int, first: int, per_round: int, v: int, reverse: bool) -> int:
    """The rank's local stage (0 to v - 1) of its ``op``-th forward (its ``op - first``-th backward
    when ``reverse``): forwards take the stages a round at a time, backwards in reverse."""
    local = ((op - first) // per_round) % v
    return v - 1 - local if reverse else local


@functools.lru_cache(maxsize=4096)
def _dualpipev_actions(pp: int, microbatches: int, rank: int) -> tuple[tuple[str, int, bool], ...]:
    """Rank ``rank``'s actions in ScheduleDualPipeV's order, as (kind, stage, overlapped): kind
    "F" forward, "B" full backward, "I" input-gradient pass, "W" weight pass (the oldest pending
    one); overlapped for the halves of its F&B actions. Its eight phases: forwards of the first
    chunk, of both, zero-bubble passes of the second, the overlapped steady state, then the
    backwards draining, their second half split into input and weight passes."""
    m = microbatches
    first, second = rank, 2 * pp - 1 - rank
    actions, pending = [], []

    def add(kind, stage, overlapped=False):
        actions.append((kind, stage, overlapped))
        if kind == "I":
            pending.append(stage)

    def weight():
        if pending:
            actions.append(("W", pending.pop(0), False))

    for _ in range(2 * (pp - rank - 1)):
        add("F", first)
    for _ in range(rank + 1):
        add("F", first)
        add("F", second)
    for _ in range(pp - rank - 1):
        add("I", second)
        weight()
        add("F", second)
    for i in range(m - 2 * pp + rank + 1):
        pair = not (i == 0 and rank == pp - 1)  # the last rank runs its first pair apart
        add("F", first, pair)
        add("B", second, pair)
        add("F", second, True)
        add("B", first, True)
    for _ in range(pp - rank - 1):
        add("B", second)
        add("F", second, True)
        add("B", first, True)
    split = False
    for i in range(rank + 1):
        if i == (rank + 1) // 2 and rank % 2 == 1:
            split = True
        add("I" if split else "B", second)
        if i == (rank + 1) // 2 and rank % 2 == 0:
            split = True
        add("I" if split else "B", first)
    for _ in range(pp - rank - 1):
        weight()
        add("I" if split else "B", first)
    for _ in range(rank + 1):
        weight()
    return tuple(actions)


@functools.lru_cache(maxsize=4096)
def _overlapped_forwards(info: ScheduleInfo, pp: int, microbatches: int, rank: int) -> int:
    """ScheduleInfo.overlapped_share's count, asked for by every layout the search costs, so
    counted without listing the actions (thousands of micro-batches at large batches)."""
    if info.name == DUALPIPEV:
        # _dualpipev_actions: two overlapped forwards per steady-state round (the last rank runs
        # its first round's pair apart), and one per round of the backwards' draining.
        rounds = max(0, microbatches - 2 * pp + rank + 1)
        return 2 * rounds - (rounds > 0 and rank == pp - 1) + (pp - rank - 1)
    # _interleaved_order's steady pairs of different stages: whether a pair's two stages differ
    # repeats every v rounds, so count one such period and the part of one that is left.
    v = info.stages_per_rank
    per_round, warmup = _interleaved_rounds(pp, microbatches, v, rank)
    period = per_round * v

    def differing(ops):
        return sum(_interleaved_local(op, 0, per_round, v, False) != _interleaved_local(op, warmup, per_round, v, True)
                   for op in ops)

    periods, rest = divmod(microbatches * v - warmup, period)
    return periods * differing(range(warmup, warmup + period)) + differing(range(warmup, warmup + rest))


def _not_dominated(moments: list[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
    """The moments no other one holds at least as many micro-batches of every stage as: with
    non-negative bytes per stage the peak lies among them (a schedule of thousands of micro-batches
    has thousands of moments, and a front of a few)."""
    front: list[tuple[int, ...]] = []
    for counts in sorted(moments, key=lambda c: (sum(c), c), reverse=True):
        if not any(all(a >= b for a, b in zip(kept, counts)) for kept in front):
            front.append(counts)
    return tuple(front)


@functools.lru_cache(maxsize=4096)
def _live_after_forwards(info: ScheduleInfo, pp: int, microbatches: int,
                         rank: int) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    # The rank's stages and the micro-batch counts they hold right after a forward (only a
    # forward can raise the total), those that another moment dominates left out: a few in a
    # schedule of thousands of actions, so a layout's memory table costs a dot product each.
    events = info.rank_events(pp, microbatches, rank)
    stages = tuple(sorted({s for s, _ in events}))
    index = {s: i for i, s in enumerate(stages)}
    live, moments = [0] * len(stages), {}
    for stage, delta in events:
        live[index[stage]] += delta
        if delta > 0:
            moments.setdefault(tuple(live), None)
    return stages, _not_dominated(list(moments))


SCHEDULES = {
    s.name: s
    for s in (
        ScheduleInfo("gpipe", "ScheduleGPipe", 1, "loop", "all forwards, then all backwards"),
        ScheduleInfo("1f1b", "Schedule1F1B", 1, "loop", "one forward, one backward in steady state"),
        ScheduleInfo("interleaved-1f1b", "ScheduleInterleaved1F1B", 2, "loop", "1F1B over 2 chunks per rank"),
        ScheduleInfo("interleaved-1f1b-overlap", "ScheduleInterleaved1F1B", 2, "loop",
                     "1F1B over 2 chunks per rank, each steady forward beside another stage's backward"),
        ScheduleInfo("zbv", "ScheduleZBVZeroBubble", 2, "v", "zero-bubble V: 2 chunks per rank, weight grads fill idle slots"),
        ScheduleInfo("dualpipev", "ScheduleDualPipeV", 2, "v",
                     "DualPipeV: V over 2 chunks per rank, one micro-batch's forward beside another's backward"),
    )
}
NO_PIPELINE = "none"


INTERLEAVED = "interleaved-1f1b"
INTERLEAVED_OVERLAP = "interleaved-1f1b-overlap"
INTERLEAVED_SCHEDULES = (INTERLEAVED, INTERLEAVED_OVERLAP)
DUALPIPEV = "dualpipev"


def schedule_info(name: str, virtual_stages: int | None = None) -> ScheduleInfo:
    """The schedule ``name``; ``virtual_stages`` (interleaved 1F1B only, either form) sets its
    stages per rank, any V >= 2 (Megatron-Core's virtual pipeline size; None: 2)."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {tuple(SCHEDULES)}, got {name!r}")
    info = SCHEDULES[name]
    if virtual_stages is None:
        return info
    if name not in INTERLEAVED_SCHEDULES:
        raise ValueError(f"virtual_stages applies to schedules {' and '.join(map(repr, INTERLEAVED_SCHEDULES))} "
                         f"only; {name!r} runs "
                         f"{info.stages_per_rank} stage(s) per rank, got virtual_stages={virtual_stages!r}")
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 2:
        raise ValueError(f"virtual_stages must be an int >= 2 (stages per pipeline rank), got {virtual_stages!r}")
    return replace(info, stages_per_rank=virtual_stages,
                   description=info.description.replace("2 chunks", f"{virtual_stages} chunks"))
