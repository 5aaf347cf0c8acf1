"""The automatic pipeline partition against a brute-force optimum, on unbalanced chains, tied
parameters, memory caps and explicit split points."""

import dataclasses
import itertools
import math
import random

import pytest

from moe_ep.planner.partition import InfeasiblePartition, UnitCost, partition, stage_to_rank

GiB = 2**30


def _chain(layer_flops, *, embed=0.0, head=0.0, layer_bytes=1.0, act=0.0, tied=False):
    shared = frozenset({"embed_tokens.weight"}) if tied else frozenset()
    units = [UnitCost("embed", embed, param_bytes=layer_bytes, shared=shared)]
    units += [UnitCost(f"layers.{i}", f, param_bytes=layer_bytes, act_bytes=act) for i, f in enumerate(layer_flops)]
    units.append(UnitCost("head", head, param_bytes=layer_bytes, shared=shared))
    return units


def _layers_per_stage(part):
    return [sum(name.startswith("layers.") for name in part.stage_names(s)) for s in range(part.num_stages)]


def _stage_bytes(units, lo, hi, inflight):
    seg = units[lo:hi]
    return (
        sum(u.param_bytes + u.grad_bytes + u.optim_bytes for u in seg)
        + inflight * sum(u.act_bytes for u in seg)
        + max(u.work_bytes for u in seg)
    )


def _leximax_key(units, starts, inflight):
    """The objective, straight from its definition: stage times sorted from the slowest down,
    then stage bytes likewise; the lexicographically smallest key wins."""
    segs = list(zip(starts, starts[1:]))
    times = sorted((math.fsum(u.flops for u in units[lo:hi]) for lo, hi in segs), reverse=True)
    mem = sorted((_stage_bytes(units, lo, hi, inflight[s]) for s, (lo, hi) in enumerate(segs)), reverse=True)
    return tuple(times), tuple(mem)


def _feasible_keys(units, num_stages, stage_cap, inflight, placement="loop"):
    """The leximax key of every way to cut that keeps each stage under ``stage_cap`` and units
    sharing a parameter in one stage, or, under the V placement, a parameter shared by exactly
    the first and the last unit (their stages, the first and the last, are both on rank 0)."""
    owners = {}
    for i, u in enumerate(units):
        for key in u.shared:
            owners.setdefault(key, set()).add(i)
    ends = {0, len(units) - 1}
    keys = []
    for cuts in itertools.combinations(range(1, len(units)), num_stages - 1):
        stage_of = [sum(c <= i for c in cuts) for i in range(len(units))]
        if any(len({stage_of[i] for i in idx}) > 1 and not (placement == "v" and idx == ends)
               for idx in owners.values()):
            continue
        key = _leximax_key(units, (0, *cuts, len(units)), inflight)
        if key[1][0] <= stage_cap:
            keys.append(key)
    return keys


# placement, stages per rank: GPipe / 1F1B, interleaved 1F1B, ZB-V.
PLACEMENT_CASES = {"loop": ("loop", 1), "interleaved": ("loop", 2), "v": ("v", 2)}


@pytest.mark.parametrize("case", list(PLACEMENT_CASES))
@pytest.mark.parametrize("inflight_shape", ["random", "non_decreasing", "non_increasing"])
def test_matches_brute_force_on_random_small_chains(inflight_shape, case):
    # Monotone micro-batches in flight (GPipe, ZB-V: constant; 1F1B: non-increasing) take the
    # greedy paths, anything else the reachable-set sweep; all must be exact. Times drawn from a
    # few integers tie often, which exercises every level of the leximax and the byte tie-break.
    # With two stages per rank each stage gets half the rank's cap; under V a parameter tied
    # between the first and the last unit (embedding and head) is no obstacle to cutting.
    placement, per_rank = PLACEMENT_CASES[case]
    rng = random.Random(f"{inflight_shape}/{case}")  # a str seed is the same in every process, unlike hash()
    checked = {"infeasible": 0, "shared": 0, "beyond_bottleneck": 0}
    if placement == "v":
        checked["tied_ends_cut"] = 0
    for _ in range(400):
        n = rng.randint(2, 10)
        S = per_rank * rng.randint(1, min(5, n) // per_rank)
        units = [
            UnitCost(f"u{i}", rng.choice([0.0, 1.0, 2.0, rng.uniform(0.1, 5)]), param_bytes=rng.uniform(0, 3),
                     act_bytes=rng.uniform(0, 2), work_bytes=rng.uniform(0, 1))
            for i in range(n)
        ]
        tied = None
        if rng.random() < 0.3:
            tied = {0, n - 1} if placement == "v" and rng.random() < 0.5 else set(rng.sample(range(n), 2))
            for k in tied:
                units[k] = dataclasses.replace(units[k], shared=frozenset({"w"}))
            checked["shared"] += 1
        inflight = [rng.randint(1, S) for _ in range(S)]
        if inflight_shape != "random":
            inflight.sort(reverse=inflight_shape == "non_increasing")
        cap = rng.uniform(4, 40) * per_rank
        kwargs = dict(memory_cap=cap, inflight=inflight, placement=placement, stages_per_rank=per_rank)
        keys = _feasible_keys(units, S, cap / per_rank, inflight, placement)
        if not keys:
            checked["infeasible"] += 1
            cause = "memory cap" if _feasible_keys(units, S, math.inf, inflight, placement) else "shared parameters"
            with pytest.raises(InfeasiblePartition, match=cause):
                partition(units, S, **kwargs)
            continue
        expected = min(keys)
        part = partition(units, S, **kwargs)
        assert part.num_stages == S and part.starts[0] == 0 and part.starts[-1] == n
        times, mem = _leximax_key(units, part.starts, inflight)
        assert times == pytest.approx(expected[0], rel=1e-9, abs=1e-12)
        assert mem == pytest.approx(expected[1], rel=1e-9)
        assert part.bottleneck_flops == pytest.approx(expected[0][0], rel=1e-9, abs=1e-12)
        assert all(part.stage_bytes(s) <= cap / per_rank * (1 + 1e-9) for s in range(S))
        if tied == {0, n - 1} and S > 1 and placement == "v":
            assert part.rank_of_stage(0) == part.rank_of_stage(S - 1) == 0
            checked["tied_ends_cut"] += 1
        # Cases where minimising the slowest stage alone would not have settled the answer.
        if any(k[0][0] == expected[0][0] and k[0] != expected[0] for k in keys):
            checked["beyond_bottleneck"] += 1
    assert min(checked.values()) > 20, checked


def test_decreasing_inflight_needs_more_than_a_front_greedy():
    # Taking as much as possible into stage 0 would leave the heavy unit to stage 1, which keeps
    # 3 micro-batches in flight; the only fit puts one unit per early stage.
    units = [UnitCost("a", 1.0, act_bytes=1.0), UnitCost("b", 1.0, act_bytes=1.0),
             UnitCost("big", 1.0, act_bytes=3.0), UnitCost("c", 1.0, act_bytes=1.0)]
    part = partition(units, 3, inflight=[3, 3, 1], memory_cap=6.0)
    assert part.starts == (0, 1, 2, 4)


def test_large_embedding_and_head_get_fewer_layers_at_the_ends():
    # Embedding and head each cost 1.5 decoder layers: an even split [2, 2, 2, 2] has a
    # bottleneck of 3.5 layers, while [1, 3, 3, 1] has 3.
    units = _chain([1.0] * 8, embed=1.5, head=1.5)
    part = partition(units, 4)
    assert _layers_per_stage(part) == [1, 3, 3, 1]
    assert part.bottleneck_flops == pytest.approx(3.0)


@pytest.mark.parametrize("inflight", [[4, 4, 4, 4], [4, 3, 2, 1]], ids=["gpipe", "1f1b"])
def test_heavy_head_takes_one_layer_and_the_others_split_evenly(inflight):
    # As the planner chains a model: the embedding (no FLOPs, 5 bytes) rides with the first
    # layer, the head (8 layers' FLOPs, 20 bytes) with the last. The last stage is the bottleneck
    # whatever the others do, and minimising it alone accepted [9, 1, 1, 1]. The other 11 layers
    # split 3/4/4, the 3 on stage 0, which also holds the embedding and (1F1B) keeps the most
    # micro-batches in flight.
    units = [UnitCost(f"layers.{i}", 1.0, param_bytes=1.0, act_bytes=1.0) for i in range(12)]
    units[0] = UnitCost("embed+layers.0", 1.0, param_bytes=6.0, act_bytes=1.0)
    units[-1] = UnitCost("layers.11+head", 9.0, param_bytes=21.0, act_bytes=1.0)
    part = partition(units, 4, inflight=inflight)
    assert [part.starts[s + 1] - part.starts[s] for s in range(4)] == [3, 4, 4, 1]
    assert [part.stage_flops(s) for s in range(4)] == [3.0, 4.0, 4.0, 9.0]


def test_uniform_chain_splits_evenly_and_single_stage_takes_all():
    units = _chain([1.0] * 8)
    assert _layers_per_stage(partition(units, 4)) == [2, 2, 2, 2]
    assert partition(units, 1).starts == (0, len(units))


def test_memory_cap_moves_layers_off_the_stage_with_most_microbatches_in_flight():
    # 1F1B: stage 0 keeps 2 micro-batches in flight, stage 1 one. The time-optimal split is
    # [2, 2]: stage 0 holds 3 x 0.5 bytes + 2 micro-batches x 2 activations = 5.5. A cap of 5
    # forces [1, 3] (stage 0: 1 + 2 = 3, stage 1: 2 + 3 = 5).
    units = _chain([1.0] * 4, layer_bytes=0.5, act=1.0)
    assert _layers_per_stage(partition(units, 2, inflight=[2, 1])) == [2, 2]
    capped = partition(units, 2, inflight=[2, 1], memory_cap=5.0)
    assert _layers_per_stage(capped) == [1, 3]
    assert [capped.stage_bytes(s) for s in range(2)] == [3.0, 5.0]
    least = r"4 B per stage: the partition that needs the least memory still needs 5 B"
    with pytest.raises(InfeasiblePartition, match=least):
        partition(units, 2, inflight=[2, 1], memory_cap=4.0)


def test_tied_embedding_and_head_stay_on_one_rank():
    units = _chain([1.0] * 6, tied=True)
    with pytest.raises(InfeasiblePartition, match=r"embed_tokens\.weight.*V placement"):
        partition(units, 2)
    assert partition(units, 1).num_stages == 1
    part = partition(units, 4, placement="v", stages_per_rank=2)
    assert part.rank_of_stage(0) == part.rank_of_stage(3) == 0
    assert part.rank_of_stage(1) == part.rank_of_stage(2) == 1


def test_parameter_shared_by_interior_units_keeps_them_and_what_lies_between_together():
    units = [UnitCost(f"u{i}", 1.0) for i in range(6)]
    units[1] = UnitCost("u1", 1.0, shared=frozenset({"w"}))
    units[3] = UnitCost("u3", 1.0, shared=frozenset({"w"}))
    part = partition(units, 3)
    owner = {name: s for s in range(3) for name in part.stage_names(s)}
    assert owner["u1"] == owner["u2"] == owner["u3"]
    # Every cut must come before the span u3..u5: filling stage 0 up to the room left for three
    # more stages (u0..u2) would leave no allowed cut for stage 2.
    units[1], units[3] = UnitCost("u1", 1.0), UnitCost("u3", 1.0, shared=frozenset({"w"}))
    units[5] = UnitCost("u5", 1.0, shared=frozenset({"w"}))
    for inflight in ([1, 1, 1, 1], [4, 3, 2, 1], [1, 3, 2, 4]):
        assert partition(units, 4, inflight=inflight).starts == (0, 1, 2, 3, 6)


def test_split_points_override_and_their_errors():
    units = _chain([1.0] * 8, embed=1.5, head=1.5)
    part = partition(units, 4, split_points=[3, 5, 7])
    assert part.starts == (0, 3, 5, 7, 10)
    with pytest.raises(ValueError, match=r"split_points must hold 3 ints"):
        partition(units, 4, split_points=[3, 5])
    with pytest.raises(ValueError, match="strictly increasing"):
        partition(units, 4, split_points=[5, 3, 7])
    with pytest.raises(ValueError, match=r"stage 0 \(embed..layers.7\) needs 9 B, over the memory cap of 5 B"):
        partition(units, 2, split_points=[9], memory_cap=5.0)
    tied = _chain([1.0] * 4, tied=True)
    with pytest.raises(ValueError, match="share parameter 'embed_tokens.weight'"):
        partition(tied, 2, split_points=[3])


def test_argument_errors():
    units = _chain([1.0] * 2)
    with pytest.raises(ValueError, match=r"num_stages=5 exceeds the number of units \(4\)") as err:
        partition(units, 5)
    # A malformed request is not "no feasible cut": the planner skips only the latter.
    assert not isinstance(err.value, InfeasiblePartition)
    with pytest.raises(ValueError, match="num_stages must be a positive int, got 0"):
        partition(units, 0)
    with pytest.raises(ValueError, match="placement must be one of"):
        partition(units, 2, placement="zigzag")
    with pytest.raises(ValueError, match="stages_per_rank must be a positive divisor of num_stages=3"):
        partition(units, 3, stages_per_rank=2)
    with pytest.raises(ValueError, match="exactly 2 stages on each rank"):
        partition(units, 4, placement="v", stages_per_rank=4)
    with pytest.raises(ValueError, match=r"inflight must have one entry per stage \(2\)"):
        partition(units, 2, inflight=[1])
    with pytest.raises(ValueError, match="memory_cap must be a positive"):
        partition(units, 2, memory_cap=0)
    with pytest.raises(TypeError, match="units must be a list of UnitCost"):
        partition([1.0, 2.0], 1)
    with pytest.raises(ValueError, match=r"UnitCost 'u': flops must be a finite number >= 0, got -1.0"):
        UnitCost("u", -1.0)
    with pytest.raises(ValueError, match=r"UnitCost 'u': act_bytes must be a finite number >= 0, got nan"):
        UnitCost("u", 1.0, act_bytes=math.nan)


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4])
def test_v_placement_goes_down_and_back(num_ranks):
    ranks = [stage_to_rank(s, num_ranks, 2 * num_ranks, "v") for s in range(2 * num_ranks)]
    assert ranks == list(range(num_ranks)) + list(reversed(range(num_ranks)))
    assert [stage_to_rank(s, num_ranks, 2 * num_ranks, "loop") for s in range(2 * num_ranks)] == list(range(num_ranks)) * 2
