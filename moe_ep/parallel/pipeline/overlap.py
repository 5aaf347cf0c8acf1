"""One micro-batch's forward beside another's backward: what the overlapped F&B actions
(``OVERLAP_F_B``, a forward of one of the rank's stages and the full backward of another) run
under ``schedule="dualpipev"`` (DualPipeV's own) and ``schedule="interleaved-1f1b-overlap"``
(interleaved 1F1B's steady state, merged by ``overlap_steady_state``, as Megatron-Core's
all-to-all overlap pairs them). torch's runtime runs the two one after the other; here the
forward runs on the calling thread and the backward on a second thread, so that while one waits
for its exchanges (the count exchange's host sync, an all-to-all) the other computes, as
DeepSeek's DualPipe overlaps them.

The two lanes never share a process group: the dispatcher's collectives inside a backward pass
go over the backward twins of its groups (``moe_ep.dispatch.lanes``), which
``create_backward_lanes`` creates for every expert-parallel group (and its node groups) and every
data-parallel group (the global aux loss's statistics, recomputed inside a backward under
activation checkpointing). Every rank of a group runs the same actions of the same schedule, so
each lane issues its collectives in one order on every rank. Nothing else in the two passes
communicates: the pipeline's sends and receives are their own actions, issued by the schedule
before and after, FSDP2's gathers and reductions are the schedule's UNSHARD and REDUCE_GRAD
actions (a stage keeps its weights gathered through its step: ``reshard_after_forward`` False),
and the kernel selector decides each problem at its first call, a plain forward of DualPipeV's
warm-up, which runs before any overlapped action.

Exact: the forward and the backward are of different micro-batches and different stages, so they
share no tensor but the parameters, which the forward reads and the backward does not write
(gradients accumulate into ``.grad`` in the same micro-batch order as without overlap). Losses
and gradients equal torch's sequential runtime bit for bit."""

from __future__ import annotations

import inspect
import threading

import torch
from torch.distributed.pipelining import schedules as torch_schedules

from ...dispatch.lanes import create_twins, register_twin
from ...dispatch.nodes import split_by_node
from ..mesh import MoEMeshes


def _local_stages(schedule) -> dict:
    return {stage.stage_index: stage for stage in schedule._stages}


def _forward(schedule, stages: dict, action, ctx) -> None:
    """torch's runtime's FORWARD action (``_PipelineScheduleRuntime._step_microbatches``)."""
    stage, mb = stages[action.stage_index], action.microbatch_index
    if not stage.is_first and action.stage_index - 1 not in stages:
        torch_schedules._wait_batch_p2p(schedule.fwd_recv_ops.pop((action.stage_index, mb)))
    output = stage.forward_one_chunk(mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb])
    loss_args = (stage, output, ctx.target_mbs, mb)
    if "loss_kwargs" in inspect.signature(schedule._maybe_compute_loss).parameters:
        loss_args += (None,)
    schedule._maybe_compute_loss(*loss_args)
    if action.stage_index + 1 in stages:
        stages[action.stage_index + 1].set_local_fwd_input(output, mb)


def _full_backward(schedule, stages: dict, action) -> None:
    """torch's runtime's FULL_BACKWARD action."""
    stage, mb = stages[action.stage_index], action.microbatch_index
    if not stage.is_last and action.stage_index + 1 not in stages:
        torch_schedules._wait_batch_p2p(schedule.bwd_recv_ops.pop((action.stage_index, mb)))
    loss = schedule._maybe_get_loss(stage, mb)
    schedule.backward_counter[action.stage_index] += 1
    last_backward = schedule.backward_counter[action.stage_index] == schedule._n_microbatches
    stage.backward_one_chunk(mb, loss=loss, full_backward=True, last_backward=last_backward)
    if action.stage_index - 1 in stages:
        stages[action.stage_index - 1].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)


def overlapped_forward_backward(action, ctx) -> None:
    """The custom function of ``OVERLAP_F_B``: its forward here, its backward on a second thread,
    both done (or the first error raised) before the schedule's next action."""
    schedule = ctx.schedule_ref
    forward, backward = action.sub_actions
    if (forward.computation_type, backward.computation_type) != (torch_schedules.FORWARD,
                                                                   torch_schedules.FULL_BACKWARD):
        raise RuntimeError(f"an overlapped action runs a forward and a full backward, got {action.sub_actions}")
    stages = _local_stages(schedule)
    for sub in (forward, backward):
        schedule._assert_unsharded(stages[sub.stage_index])
    failure: list[BaseException] = []
    # The current CUDA device is per thread: the backward's allocations go to the rank's GPU.
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

    def run_backward():
        try:
            if device is not None:
                torch.cuda.set_device(device)
            _full_backward(schedule, stages, backward)
        except BaseException as err:  # re-raised on the schedule's thread
            failure.append(err)

    # A daemon: if the forward fails, its error is raised at once rather than after a backward
    # that may wait on peers that stopped too (fail_fast then ends the process).
    worker = threading.Thread(target=run_backward, name=f"moe_ep-backward-{backward}", daemon=True)
    worker.start()
    _forward(schedule, stages, forward, ctx)
    worker.join()
    if failure:
        raise failure[0]


def create_backward_lanes(meshes: MoEMeshes) -> None:
    """The backward twins of every group a decoder layer's forward may communicate over: the
    expert-parallel groups (and their node groups) and the data-parallel groups. A collective:
    every rank calls it with the same meshes."""
    dims, ranks = meshes.dims, meshes.world.mesh
    ep_groups = ranks.reshape(-1, dims.ep).tolist()
    if dims.ep > 1:
        create_twins(ep_groups, meshes.ep.get_group())
    if meshes.ep_nodes is not None:
        twins = split_by_node(ep_groups, dims.ep_node_size)
        register_twin(meshes.ep_nodes.inter, twins.inter)
        register_twin(meshes.ep_nodes.intra, twins.intra)
    create_twins(ranks.reshape(dims.pp, -1).tolist(), meshes.dp_group)


def enable_overlap(schedule) -> None:
    """Run ``schedule``'s overlapped actions on two threads."""
    schedule.register_custom_function(torch_schedules.OVERLAP_F_B, overlapped_forward_backward)


def merge_steady_state(actions: list) -> list:
    """One rank's compute-only interleaved 1F1B order with each forward directly followed by a
    full backward of another stage (the steady state's pairs) merged into one ``OVERLAP_F_B``.
    A pair of one stage stays two actions: both passes would go through the same modules (their
    FSDP state, the stage's caches), which one thread at a time owns."""
    merged, i = [], 0
    while i < len(actions):
        forward, backward = actions[i], actions[i + 1] if i + 1 < len(actions) else None
        if (forward is not None and backward is not None
                and forward.computation_type == torch_schedules.FORWARD
                and backward.computation_type == torch_schedules.FULL_BACKWARD
                and forward.stage_index != backward.stage_index):
            merged.append(torch_schedules._Action(-1, torch_schedules.OVERLAP_F_B, None, (forward, backward)))
            i += 2
        else:
            merged.append(forward)
            i += 1
    return merged


def overlap_steady_state(schedule) -> None:
    """Run ``schedule``'s (a ScheduleInterleaved1F1B) steady state as overlapped actions
    (``merge_steady_state`` on every rank's order), its order with communication lowered again
    from the merged one. What each rank then overlaps is the planner's
    ``ScheduleInfo.overlapped_share``."""
    schedule.pipeline_order = {rank: merge_steady_state(actions) for rank, actions in schedule.pipeline_order.items()}
    schedule._prepare_schedule_with_comms(schedule.pipeline_order)
