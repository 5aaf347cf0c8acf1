"""DualPipeV (``schedule="dualpipev"``): one micro-batch's forward beside another's backward on
two threads, their collectives on two lanes of process groups (``moe_ep.dispatch.lanes``).

On 4 gloo ranks (pp=2 x ep=2, two data-parallel halves of 4 micro-batches each) and on 8 (pp=2 x
ep=4 as 2 nodes of 2, node-aware, four data-parallel quarters of a 16-row batch), through
``moe_ep.parallelize`` and TrainStep, five AdamW steps of the tiny Mixtral of test_pipeline:
- every step's loss equals ONE process training the same model on the whole batch in float64
  (transformers' eager experts and loss) within 1e-5;
- the threaded run equals torch's sequential runtime of the same schedule bit for bit (4 ranks);
- the overlapped actions really ran their backward on the second thread, the dispatcher's
  backward exchanges on the twins, plain and node-aware (2 nodes of one rank), with the layers
  recomputed inside the backward (activation checkpointing) and a global aux loss whose
  statistics the recompute gathers again.
The planner's replay of the schedule is checked against torch's in test_schedule_memory."""

from __future__ import annotations

import os

import pytest
import torch

from dist_utils import run_ranks
from numerics import rel_err
from test_pipeline import AUX, LR, STEPS, TINY, _batch, _check, _model, _reference_losses

RUNS = {
    "ep2": dict(),
    "ep2_node_aware_checkpointing_global_aux": dict(dispatch_mode="node", node_size=1, activation_checkpointing=True,
                                                    overlap_chunks=2, aux=AUX),
}
RUNS8 = {"ep4_two_nodes_of_two_checkpointing": dict(ep=4, dispatch_mode="node", node_size=2, overlap_chunks=2,
                                                   activation_checkpointing=True)}
MICROBATCHES = 4  # DualPipeV needs at least 2 * pp


def _batch16():
    """16 rows of 6 tokens, ignored targets spread unevenly over the quarters."""
    from hf_models import tiny_batch, tiny_config

    batch = tiny_batch(tiny_config("mixtral", **TINY), batch=16, seq=6, seed=2)
    batch["labels"][0, 1:4] = -100
    batch["labels"][9, 2] = -100
    batch["labels"][13, 3:] = -100
    return batch


def _train(batch, run: dict, overlapped: bool):
    import moe_ep
    import moe_ep.parallel.pipeline.overlap as overlap
    from moe_ep.dispatch.lanes import _TWINS
    from moe_ep.hf import patch
    from moe_ep.training import TrainStep

    run = {"ep": 2, "schedule": "dualpipev", "pp": 2, "microbatches": MICROBATCHES, **run}
    aux, microbatches = run.pop("aux", 0.0), run["microbatches"]
    model = patch(_model(torch.float32, "eager", **run.pop("model", {})), fused_router=False)
    target = moe_ep.parallelize(model, **run)
    dp_rank, dp = target.meshes.dp.get_local_rank(), target.meshes.dims.dp
    share = {k: v.chunk(dp)[dp_rank] for k, v in batch.items()}
    backward_threads = []
    full_backward = overlap._full_backward

    def recording_backward(*args):
        import threading

        backward_threads.append(threading.current_thread().name)
        return full_backward(*args)

    overlap._full_backward = recording_backward
    enable = overlap.enable_overlap
    if not overlapped:
        overlap.enable_overlap = lambda schedule: None
    try:
        step = TrainStep(target, torch.optim.AdamW(target.parameters(), lr=LR), microbatches=microbatches,
                         aux_loss_coef=aux, global_aux_loss=bool(aux))
        losses = [step(share).item() for _ in range(STEPS)]
    finally:
        overlap._full_backward, overlap.enable_overlap = full_backward, enable
    threaded = sum(name.startswith("moe_ep-backward") for name in backward_threads)
    return {"losses": losses, "threads": sorted(set(backward_threads)), "twins": len(_TWINS),
            "threaded_backwards": threaded, "pp_rank": target.pp_rank,
            "pp": run["pp"], "microbatches": microbatches}


def _world(rank, world, batch, runs, modes=(True, False)):
    if len(modes) > 1:
        # MKL's float32 GEMMs round by their buffers' alignment on some CPUs (an AMD EPYC: the two
        # runtimes, whose allocations interleave differently, parted in the 7th digit at step 5);
        # its conditional reproducibility mode, read at its first call in this process, rounds
        # alike whatever the alignment, so bit for bit compares the schedules' arithmetic alone.
        os.environ["MKL_CBWR"] = "COMPATIBLE"
    return {(name, overlapped): _train(batch, run, overlapped) for name, run in runs.items() for overlapped in modes}


@pytest.fixture(scope="module")
def world4():
    return run_ranks(_world, 4, _batch(), RUNS, timeout=600)


@pytest.fixture(scope="module")
def world8():
    # Threaded only: the 4-rank runs compare it with the sequential runtime.
    return run_ranks(_world, 8, _batch16(), RUNS8, (True,), timeout=600)


@pytest.fixture(scope="module")
def references():
    batch = _batch()
    # Each data-parallel half runs 4 micro-batches of one row; the global aux loss joins row m of
    # both halves in micro-batch m.
    global_rows = [[m, m + 4] for m in range(4)]
    return {"ep2": _reference_losses(batch),
            "ep2_node_aware_checkpointing_global_aux": _reference_losses(batch, aux_coef=AUX, aux_chunks=global_rows),
            "ep4_two_nodes_of_two_checkpointing": _reference_losses(_batch16())}


def _check_runs(ranks, references, name):
    for result in ranks:
        threaded, sequential = result[(name, True)], result.get((name, False))
        _check(threaded["losses"], references[name])
        # The overlapped actions' backwards ran on the second thread.
        assert any(t.startswith("moe_ep-backward") for t in threaded["threads"])
        assert threaded["twins"] >= 2  # the ep group's twin and the data-parallel group's
        if sequential is not None:
            assert threaded["losses"] == sequential["losses"]  # bit for bit
            assert sequential["threads"] == []  # without overlap, no second thread


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_dualpipev_matches_one_process_and_the_sequential_runtime(world4, references, name):
    _check_runs(world4, references, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS8))
def test_dualpipev_on_two_nodes_of_two_ranks_matches_one_process(world8, references, name):
    _check_runs(world8, references, name)


def _bf16_gradients(rank, world, batch, schedule):
    """One step's gradients (float32, whole tensors, by name) of the tiny Mixtral under a bf16
    FSDP policy reducing in float32: as 2 pipeline stages of ``schedule``, or (None) in one
    process accumulating the same micro-batches."""
    import moe_ep
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from moe_ep.hf import patch
    from moe_ep.training import TrainStep

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    pipeline = {} if schedule is None else dict(pp=2, schedule=schedule, microbatches=MICROBATCHES)
    target = moe_ep.parallelize(patch(_model(torch.float32, "eager"), fused_router=False), mixed_precision=policy,
                                **pipeline)
    names = {id(p): name for name, p in target.named_parameters()}
    grads = {}

    def keep(optimizer, args, kwargs):
        for p in (p for group in optimizer.param_groups for p in group["params"]):
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[names[id(p)]] = grad.float().numpy().copy()  # pickled by value, unlike a tensor
    optimizer = torch.optim.SGD(target.parameters(), lr=0.0)
    optimizer.register_step_pre_hook(keep)
    TrainStep(target, optimizer, microbatches=None if pipeline else MICROBATCHES)(batch)
    return grads


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["dualpipev", "zbv"])
def test_split_backward_gradients_under_a_bf16_policy_equal_one_process(schedule):
    """The weight pass of a split backward leaves its bf16 gradients in FSDP2's float32
    accumulator at once: DualPipeV, whose stages mix split and full backwards, added a full
    backward's bf16 gradients to them in bf16 (a 1e-3 relative error on the last stage's
    parameters). Each stage's gradients equal one process's, which sums the same micro-batches'
    bf16 gradients in float32."""
    batch = _batch()
    (want,) = run_ranks(_bf16_gradients, 1, batch, None, timeout=300)
    stages = run_ranks(_bf16_gradients, 2, batch, schedule, timeout=300)
    got = {name: grad for rank in stages for name, grad in rank.items()}
    assert set(got) == set(want)
    for name, grad in got.items():
        assert rel_err(torch.from_numpy(grad), torch.from_numpy(want[name])) <= 1e-6, name


def test_dualpipev_is_refused_where_it_cannot_run():
    from moe_ep.parallel import ParallelConfig, PipelineConfig

    with pytest.raises(ValueError, match="at least 2 \\* pp = 4 micro-batches"):
        PipelineConfig(microbatches=3, schedule="dualpipev").check(2, 8)
    with pytest.raises(ValueError, match="reshard_after_forward=True cannot run schedule='dualpipev'"):
        ParallelConfig(pp=2, pipeline=PipelineConfig(microbatches=4, schedule="dualpipev"),
                       reshard_after_forward=True)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
@pytest.mark.parametrize("policy", ["selective", "attention"])
def test_a_split_backward_refuses_the_recompute_policies_that_run_once(schedule, policy):
    """The weight-gradient pass recomputes again: "selective" replays its kept outputs once and
    "attention" torch's checkpoint cannot recompute twice, so both are refused, in parallelize and
    in the planner, which no longer chooses them there; "full" and "none" run."""
    import moe_ep
    from moe_ep.parallel import ParallelConfig, PipelineConfig

    message = (rf"{{name}}='{policy}' cannot run under schedule='{schedule}': its backward runs in two autograd "
               r"passes \(input, then weight gradients\)")
    with pytest.raises(ValueError, match=message.format(name="activation_checkpointing")):
        ParallelConfig(pp=2, pipeline=PipelineConfig(microbatches=4, schedule=schedule),
                       activation_checkpointing=policy)
    for runnable in ("full", "none"):
        ParallelConfig(pp=2, pipeline=PipelineConfig(microbatches=4, schedule=schedule),
                       activation_checkpointing=runnable)
    with pytest.raises(ValueError, match=message.format(name="checkpointing")):
        moe_ep.plan("mixtral-8x7b", cluster="dgx-a100-80gb", nodes=16, schedule=schedule, checkpointing=policy)
    for fixed in ({}, {"schedule": schedule}):
        found = moe_ep.plan("mixtral-8x7b", cluster="dgx-a100-80gb", nodes=16, **fixed)
        layouts = [found.layout, *(candidate.layout for candidate, _ in found.alternatives)]
        assert all(lay.checkpointing in ("none", "full") for lay in layouts if lay.schedule == schedule), layouts


def test_collectives_inside_a_backward_pass_take_the_twin():
    import torch.distributed as dist

    from moe_ep.dispatch import lanes

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        group, twin = dist.new_group([0]), dist.new_group([0])
        lanes.register_twin(group, twin)
        seen = []

        class Probe(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                seen.append(lanes.lane_group(group))
                return x.clone()

            @staticmethod
            def backward(ctx, g):
                seen.append(lanes.lane_group(group))
                return g

        Probe.apply(torch.ones(2, requires_grad=True)).sum().backward()
        assert seen == [group, twin]
        assert lanes.lane_group(None) is None
    finally:
        lanes._TWINS.clear()
        dist.destroy_process_group()
