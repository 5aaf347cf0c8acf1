"""Interleaved 1F1B with overlap (``schedule="interleaved-1f1b-overlap"``): torch's interleaved
order with each steady-state forward and the following backward of another stage merged into one
overlapped action (``moe_ep.parallel.pipeline.overlap.merge_steady_state``), run on two threads as
DualPipeV's are.

- The merged order is torch's order regrouped: nothing added, dropped or moved; no pair holds two
  passes of one stage; the planner's ``overlapped_share`` counts exactly the merged pairs.
- Merging never deadlocks the pipeline: a dependency replay where an overlapped action waits for
  the inputs of both its passes and publishes its outputs only when both are done (the runtime
  is never stricter: its two threads wait apart) finishes every action, in no more rounds than
  the unmerged order.
- Through ``moe_ep.parallelize`` and TrainStep, on 4 gloo ranks (pp=2 x ep=2; plain, and
  node-aware with activation checkpointing, chunked overlap and a global aux loss; pp=2 x FSDP2
  over 2 without expert parallelism; pp=4 over 8 micro-batches) and on 8 (ep=4 as 2 nodes of 2,
  node-aware, checkpointing): the losses of five steps equal ONE process in float64 within 1e-5,
  the 4-rank runs equal torch's sequential runtime of the merged order bit for bit, and each step
  runs exactly the merged pairs' backwards on the second thread."""

from __future__ import annotations

import types

import pytest

from dist_utils import run_ranks
from moe_ep.planner.schedules import schedule_info
from test_pipeline import AUX

S = pytest.importorskip("torch.distributed.pipelining.schedules")

CASES = [(pp, m, v) for pp in (2, 3, 4, 8) for m in (pp, 2 * pp, 4 * pp, 5 * pp) for v in (2, 3, 4)]


def _torch_order(pp, m, v):
    rounds = max(1, m // pp)
    ns = types.SimpleNamespace(n_local_stages=v, pp_group_size=pp, _n_microbatches=m,
                               number_of_rounds=rounds, microbatches_per_round=m // rounds)
    return {rank: S.ScheduleInterleaved1F1B._calculate_single_rank_operations(ns, rank) for rank in range(pp)}


def _merged(pp, m, v):
    from moe_ep.parallel.pipeline.overlap import merge_steady_state

    return {rank: merge_steady_state(actions) for rank, actions in _torch_order(pp, m, v).items()}


def _flat(actions):
    return [sub for a in actions if a is not None for sub in (a.sub_actions or (a,))]


@pytest.mark.parametrize("pp, m, v", CASES)
def test_merged_pairs_regroup_torchs_order_and_are_the_planners_share(pp, m, v):
    info = schedule_info("interleaved-1f1b-overlap", v)
    torch_order, merged = _torch_order(pp, m, v), _merged(pp, m, v)
    for rank in range(pp):
        assert _flat(merged[rank]) == _flat(torch_order[rank])
        pairs = [a.sub_actions for a in merged[rank] if a is not None and a.computation_type == S.OVERLAP_F_B]
        for forward, backward in pairs:
            assert forward.computation_type == S.FORWARD and backward.computation_type == S.FULL_BACKWARD
            assert forward.stage_index != backward.stage_index
        assert info.overlapped_share(pp, m, rank) == len(pairs) / (v * m), rank
    # The plain interleaved schedule overlaps nothing.
    assert schedule_info("interleaved-1f1b", v).overlapped_share(pp, m, 0) == 0.0


def _replay(order, num_stages):
    """Rounds of a replay in which each rank runs its next action once the inputs of all its
    passes were published in an earlier round, publishing its passes' outputs at the end of the
    round; None when no rank can go on (a deadlock)."""
    queues = {rank: [a for a in actions if a is not None] for rank, actions in order.items()}
    done, rounds = set(), 0

    def key(p):
        return p.stage_index, p.computation_type == S.FORWARD, p.microbatch_index

    def ready(p):
        if p.computation_type == S.FORWARD:
            return p.stage_index == 0 or (p.stage_index - 1, True, p.microbatch_index) in done
        if p.stage_index == num_stages - 1:
            return (p.stage_index, True, p.microbatch_index) in done
        return (p.stage_index + 1, False, p.microbatch_index) in done

    while any(queues.values()):
        rounds += 1
        published = []
        for queue in queues.values():
            passes = (queue[0].sub_actions or (queue[0],)) if queue else ()
            if passes and all(ready(p) for p in passes):
                queue.pop(0)
                published += [key(p) for p in passes]
        if not published:
            return None
        done.update(published)
    return rounds


@pytest.mark.parametrize("pp, m, v", CASES)
def test_merging_never_deadlocks_the_pipeline(pp, m, v):
    plain, merged = _torch_order(pp, m, v), _merged(pp, m, v)
    plain_rounds, merged_rounds = _replay(plain, pp * v), _replay(merged, pp * v)
    assert plain_rounds is not None and merged_rounds is not None
    assert merged_rounds <= plain_rounds


def test_the_replay_finds_a_deadlock():
    # The last stage's backward beside its own forward of that micro-batch waits for itself.
    f0, f1, b1 = (S._Action(0, S.FORWARD, 0), S._Action(1, S.FORWARD, 0), S._Action(1, S.FULL_BACKWARD, 0))
    b0 = S._Action(0, S.FULL_BACKWARD, 0)
    assert _replay({0: [f0, b0], 1: [f1, b1]}, 2) == 4
    assert _replay({0: [f0, b0], 1: [S._Action(-1, S.OVERLAP_F_B, None, (f1, b1))]}, 2) is None


LAYERS = dict(num_hidden_layers=6)  # three stages per rank leave both of 2 ranks merged pairs
OVERLAP = dict(schedule="interleaved-1f1b-overlap", virtual_stages=3, model=LAYERS)
RUNS = {
    "ep2": OVERLAP,
    "fsdp2_without_ep": dict(OVERLAP, ep=1),
    # Four pipeline ranks of three stages each over 8 micro-batches: every rank has merged pairs,
    # and the sends and receives cross three rank boundaries.
    "pp4": dict(OVERLAP, ep=1, pp=4, microbatches=8, model=dict(num_hidden_layers=12)),
    "ep2_node_aware_checkpointing_global_aux": dict(OVERLAP, dispatch_mode="node", node_size=1,
                                                    activation_checkpointing=True, overlap_chunks=2, aux=AUX),
}
RUNS8 = {"ep4_two_nodes_of_two_checkpointing": dict(OVERLAP, ep=4, dispatch_mode="node", node_size=2,
                                                   overlap_chunks=2, activation_checkpointing=True)}


@pytest.fixture(scope="module")
def world4():
    from test_dualpipev import _world
    from test_pipeline import _batch

    return run_ranks(_world, 4, _batch(), RUNS, timeout=600)


@pytest.fixture(scope="module")
def world8():
    from test_dualpipev import _batch16, _world

    return run_ranks(_world, 8, _batch16(), RUNS8, (True,), timeout=600)


@pytest.fixture(scope="module")
def references():
    from test_dualpipev import _batch16
    from test_pipeline import _batch, _reference_losses

    global_rows = [[m, m + 4] for m in range(4)]
    plain = _reference_losses(_batch(), model_kwargs=LAYERS)
    return {"ep2": plain, "fsdp2_without_ep": plain,
            "pp4": _reference_losses(_batch(), model_kwargs=RUNS["pp4"]["model"]),
            "ep2_node_aware_checkpointing_global_aux": _reference_losses(_batch(), aux_coef=AUX,
                                                                         aux_chunks=global_rows, model_kwargs=LAYERS),
            "ep4_two_nodes_of_two_checkpointing": _reference_losses(_batch16(), model_kwargs=LAYERS)}


def _check_runs(ranks, reference):
    from test_pipeline import STEPS, _check

    info = schedule_info(OVERLAP["schedule"], OVERLAP["virtual_stages"])
    for threaded, sequential in ranks:
        _check(threaded["losses"], reference)
        # Each step ran exactly the merged pairs' backwards on the second thread.
        m = threaded["microbatches"]
        pairs = info.overlapped_share(threaded["pp"], m, threaded["pp_rank"]) * info.stages_per_rank * m
        assert pairs > 0 and threaded["threaded_backwards"] == STEPS * pairs
        assert threaded["twins"] >= 1  # the data-parallel group's twin, and the ep group's where ep > 1
        if sequential is not None:
            assert threaded["losses"] == sequential["losses"]  # bit for bit
            assert sequential["threaded_backwards"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_interleaved_overlap_matches_one_process_and_the_sequential_runtime(world4, references, name):
    _check_runs([(r[(name, True)], r[(name, False)]) for r in world4], references[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS8))
def test_interleaved_overlap_on_two_nodes_of_two_ranks_matches_one_process(world8, references, name):
    _check_runs([(r[(name, True)], None) for r in world8], references[name])


def test_interleaved_overlap_is_refused_where_it_cannot_run():
    from moe_ep.parallel import ParallelConfig, PipelineConfig

    with pytest.raises(ValueError, match="needs a multiple of pp=2 micro-batches, got 3"):
        PipelineConfig(microbatches=3, schedule="interleaved-1f1b-overlap").check(2, 8)
    with pytest.raises(ValueError, match="reshard_after_forward=True cannot run schedule='interleaved-1f1b-overlap'"):
        ParallelConfig(pp=2, pipeline=PipelineConfig(microbatches=4, schedule="interleaved-1f1b-overlap"),
                       reshard_after_forward=True)


def test_a_torch_without_the_action_runtime_is_refused(monkeypatch):
    from moe_ep.parallel import PipelineConfig

    monkeypatch.setattr(S, "ScheduleInterleaved1F1B", type("ScheduleInterleaved1F1B", (), {}))
    with pytest.raises(ValueError, match=r"schedule='interleaved-1f1b-overlap' needs torch's ScheduleInterleaved1F1B "
                                         r"on its action runtime \(_PipelineScheduleRuntime\)"):
        PipelineConfig(microbatches=4, schedule="interleaved-1f1b-overlap")
    monkeypatch.delattr(S, "OVERLAP_F_B")
    with pytest.raises(ValueError, match="needs torch's OVERLAP_F_B, which this torch"):
        PipelineConfig(microbatches=4, schedule="interleaved-1f1b-overlap")
    PipelineConfig(microbatches=4, schedule="interleaved-1f1b")  # the plain form needs neither
