"""The planner's pipelined activation memory follows the order torch's schedules run: each rank's
peak is the most its stages keep at one moment (``ScheduleInfo.peak_activations``), not every
stage at the rank's average in flight. The order is checked against the action lists torch's
own schedule classes build (their private ``_get_pipeline_order`` /
``_calculate_single_rank_operations``, called on the few attributes they read)."""

import random
import types

import pytest

from moe_ep.planner import Layout, ModelSpec
from moe_ep.planner.memory import build_units, rank_memory, stage_units, unit_costs
from moe_ep.planner.partition import partition
from moe_ep.planner.schedules import SCHEDULES, schedule_info

S = pytest.importorskip("torch.distributed.pipelining.schedules")


def _torch_events(name, pp, m, v, rank):
    """(stage, +1) per forward and (stage, -1) per pass that frees a micro-batch's activations
    (full backward; ZB-V's weight pass) in torch's order for ``rank``, through its last forward."""
    if name == "interleaved-1f1b":
        rounds = max(1, m // pp)
        ns = types.SimpleNamespace(n_local_stages=v, pp_group_size=pp, _n_microbatches=m,
                                   number_of_rounds=rounds, microbatches_per_round=m // rounds)
        ops = S.ScheduleInterleaved1F1B._calculate_single_rank_operations(ns, rank)
    elif name == "zbv":
        ns = types.SimpleNamespace(pp_group_size=pp, _n_microbatches=m, num_stages=2 * pp)
        ops = S.ScheduleZBVZeroBubble._calculate_single_rank_operations(ns, rank)
    elif name == "dualpipev":
        ns = types.SimpleNamespace(pp_group_size=pp, _n_microbatches=m)
        ops = _flattened(S.ScheduleDualPipeV._calculate_single_rank_operations(ns, rank))
    else:
        cls = {"gpipe": S.ScheduleGPipe, "1f1b": S.Schedule1F1B}[name]
        ops = cls._get_pipeline_order(types.SimpleNamespace(_num_stages=pp, _n_microbatches=m))[rank]
    frees = (S._ComputationType.FULL_BACKWARD, S._ComputationType.BACKWARD_WEIGHT)
    events = [(a.stage_index, +1 if a.computation_type == S._ComputationType.FORWARD else -1)
              for a in ops if a is not None and (a.computation_type == S._ComputationType.FORWARD
                                                 or a.computation_type in frees)]
    return _through_last_forward(events)


def _flattened(ops):
    """DualPipeV's overlapped actions as their forward, then their backward."""
    return [sub for a in ops if a is not None for sub in (a.sub_actions or (a,))]


def _through_last_forward(events):
    last = max(i for i, (_, delta) in enumerate(events) if delta > 0)
    return events[:last + 1]


CASES = [(name, pp, m, v) for pp in (2, 3, 4, 8) for m in sorted({pp, 2 * pp, 3 * pp, 16, 5}) if m >= pp
         for name, v in (("gpipe", 1), ("1f1b", 1), ("zbv", 2), ("interleaved-1f1b", 2),
                         ("interleaved-1f1b", 3), ("interleaved-1f1b", 8))
         if name != "interleaved-1f1b" or m % pp == 0]
CASES += [("dualpipev", pp, m, 2) for pp in (2, 3, 4, 8) for m in sorted({2 * pp, 2 * pp + 1, 3 * pp, 16, 24})
          if m >= 2 * pp]


@pytest.mark.parametrize("name, pp, m, v", CASES)
def test_rank_events_are_torchs_schedule_order(name, pp, m, v):
    info = schedule_info(name, v) if name == "interleaved-1f1b" else SCHEDULES[name]
    for rank in range(pp):
        assert _through_last_forward(info.rank_events(pp, m, rank)) == _torch_events(name, pp, m, v, rank), rank


def _peak_by_hand(events, act):
    live, total, peak = {}, 0.0, 0.0
    for stage, delta in events:
        live[stage] = live.get(stage, 0) + delta
        total += delta * act[stage]
        peak = max(peak, total)
    return peak


@pytest.mark.parametrize("name, pp, m, v", [c for c in CASES if c[1] in (3, 4)])
def test_peak_is_the_most_torchs_order_keeps_at_once(name, pp, m, v):
    info = schedule_info(name, v) if name == "interleaved-1f1b" else SCHEDULES[name]
    rng = random.Random(f"{name}/{pp}/{m}/{v}")
    placement = "v" if name in ("zbv", "dualpipev") else "loop"
    for rank in range(pp):
        stages = ([rank, 2 * pp - 1 - rank] if placement == "v" else [j * pp + rank for j in range(v)])
        act = {s: rng.uniform(0.1, 10.0) for s in stages}
        peak, held = info.peak_activations(pp, m, rank, act)
        assert peak == pytest.approx(_peak_by_hand(_torch_events(name, pp, m, v, rank), act), rel=1e-12)
        assert 1 <= held <= m
        # Never more than every stage at the schedule's per-stage bound at once.
        assert peak <= sum(act.values()) * m + 1e-9


def test_interleaved_last_rank_keeps_one_micro_batch_of_its_last_stage():
    """Interleaved 1F1B, 4 ranks, 8 stages each, 8 micro-batches: the last rank runs 28 forwards
    of its first 7 stages (a round of 4 each) before its last stage's first forward, whose
    backward follows at once. With the last stage 20x heavier (the head's logits) the peak is
    7 x 4 light + 1 heavy, where spreading the 29 forwards evenly would count 29/8 heavy."""
    info = schedule_info("interleaved-1f1b", 8)
    act = {j * 4 + 3: 1.0 for j in range(7)} | {31: 20.0}
    peak, held = info.peak_activations(4, 8, 3, act)
    assert peak == 7 * 4 * 1.0 + 20.0 and held == 4
    average = info.inflight(4, 8)[3]
    assert average == 29 / 8 and peak < average * sum(act.values())


def test_memory_table_activations_follow_the_schedule():
    """The planner's table of a pipelined layout: the rank's activations are its schedule's peak
    over its stages' saved bytes per micro-batch."""
    spec = ModelSpec.resolve("mixtral-8x7b")
    lay = Layout(4, 1, 16, 8, 1, 16, "interleaved-1f1b", "selective", 2)
    units = build_units(spec, lay, 4096)
    part = partition(unit_costs(units), lay.num_stages, placement=lay.placement,
                     stages_per_rank=lay.stages_per_rank, inflight=lay.inflight())
    for rank in range(lay.pp):
        stages = [s for s in range(lay.num_stages) if part.rank_of_stage(s) == rank]
        act = {s: sum(u.act for u in stage_units(units, part, s)) for s in stages}
        table = rank_memory(units, part, rank, lay, 0.0, 0.0, 80 * 2**30)
        events = _torch_events("interleaved-1f1b", 4, 16, 2, rank)
        assert table.activations == pytest.approx(_peak_by_hand(events, act), rel=1e-12)


def test_dualpipev_overlapped_share_counts_torchs_overlapped_forwards():
    """The share of a rank's forwards that torch's DualPipeV runs inside an overlapped F&B action,
    which the step time hides the exchanges of (``ScheduleInfo.overlapped_share``)."""
    info = SCHEDULES["dualpipev"]
    for pp, m in ((2, 4), (4, 8), (4, 16), (8, 24)):
        for rank in range(pp):
            ns = types.SimpleNamespace(pp_group_size=pp, _n_microbatches=m)
            ops = [a for a in S.ScheduleDualPipeV._calculate_single_rank_operations(ns, rank) if a is not None]
            overlapped = sum(a.computation_type == S._ComputationType.OVERLAP_F_B for a in ops)
            assert info.overlapped_share(pp, m, rank) == overlapped / (2 * m)
    assert SCHEDULES["zbv"].overlapped_share(4, 16, 0) == 0.0


def test_overlapped_forwards_counted_without_the_action_lists_equal_their_listing():
    """The search counts the overlapped forwards without listing a schedule's actions (a step of
    thousands of micro-batches); the listing is what torch's order is checked against above."""
    from moe_ep.planner.schedules import _dualpipev_actions, _interleaved_order, _overlapped_forwards

    for pp in range(2, 7):
        for m in range(2 * pp, 8 * pp + 1):
            for rank in range(pp):
                listed = sum(kind == "F" and beside for kind, _, beside in _dualpipev_actions(pp, m, rank))
                assert _overlapped_forwards(SCHEDULES["dualpipev"], pp, m, rank) == listed, (pp, m, rank)
                if m % pp == 0:
                    for v in (2, 3, 5):
                        _, steady = _interleaved_order(pp, m, v, rank)
                        counted = _overlapped_forwards(schedule_info("interleaved-1f1b-overlap", v), pp, m, rank)
                        assert counted == sum(f != b for f, b in steady), (pp, m, v, rank)


def test_dualpipev_in_flight_weights_are_its_replays_peak():
    # The stage cut's weights: every rank of DualPipeV peaks at 2 pp + 1 stage micro-batches
    # (split unevenly between its two stages), spread over its 2 stages.
    info = SCHEDULES["dualpipev"]
    for pp in (2, 4, 8):
        m = 4 * pp
        for rank in range(pp):
            peak, _ = info.peak_activations(pp, m, rank, {rank: 1.0, 2 * pp - 1 - rank: 1.0})
            assert peak == 2 * pp + 1
        assert info.inflight(pp, m) == [pp + 0.5] * (2 * pp)


@pytest.mark.parametrize("name", ["1f1b", "interleaved-1f1b", "interleaved-1f1b-overlap", "zbv", "dualpipev"])
def test_beyond_its_steady_count_a_schedule_only_repeats_the_moments_it_reached(name):
    """The planner replays a schedule of ``ScheduleInfo._steady``'s micro-batches for one of more
    (a huge batch has thousands): every larger count gives the same undominated moments on every
    rank, for pp 2-16 and 2-8 stages per rank."""
    from moe_ep.planner.schedules import _live_after_forwards

    for pp in (2, 3, 4, 7, 16):
        for v in ((2, 3, 5, 8) if name.startswith("interleaved") else (None,)):
            info = schedule_info(name, v) if v else SCHEDULES[name]
            cap = info._steady(pp, 10**9)
            assert cap == 4 * pp * max(2, info.stages_per_rank)
            for m in [*range(cap, cap + 2 * pp + 1), 7 * cap + pp, 13 * cap + 2 * pp]:
                if info.check_microbatches(pp, m) is None:
                    for rank in range(pp):
                        assert _live_after_forwards(info, pp, m, rank) == _live_after_forwards(info, pp, cap, rank), (
                            name, pp, v, m, rank)
