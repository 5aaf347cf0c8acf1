"""What FSDP2 holds under pipeline stages, measured on the CPU against the planner's constants
(``moe_ep.planner.memory``: ``PP_HELD_BYTES``, ``PP_TRANSIENT_BYTES``). torch's schedule runs a
stage's micro-batches without gradient sync or resharding after backward, then reduces the stage
once (its REDUCE_GRAD action, ``_PipelineStageBase.perform_reduce_grad``: each FSDP group's
``post_backward``). Live bytes are every storage a Python tensor holds (``gc``), the moment the
reduction has allocated a group's float32 reduce-scatter input (it copies the accumulated
gradients in, then frees them) and after each group; on 1 rank (an expert group not sharded:
its reduce-scatter output is full size) and on 2 gloo ranks (a sharded dense group)."""

import gc

import pytest

from dist_utils import run_ranks
from moe_ep.planner.memory import PP_HELD_BYTES, PP_TRANSIENT_BYTES

HIDDEN, LAYERS = 256, 3


def _live_bytes() -> int:
    import torch
    from torch.distributed.tensor import DTensor

    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            local = obj.to_local() if isinstance(obj, DTensor) else obj
            storage = local.untyped_storage()
            if storage.nbytes():
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _stage_reduction(rank, world_size):
    import torch
    from torch import nn
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    torch.manual_seed(0)
    # What the process held before the model (the modules the test's process server imported, a
    # previous test's leftovers awaiting collection): not the stage's.
    gc.collect()
    baseline = _live_bytes()
    model = nn.Sequential(*[nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(LAYERS)])
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    # The float32 shards (between steps the parameters are these DTensors).
    shards = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    if world_size > 1:
        model.set_force_sum_reduction_for_comms(True)  # gloo (moe_ep.parallel.fsdp does the same)
    # The schedule's micro-batches: no sync, weights kept gathered between them.
    model.set_requires_gradient_sync(False)
    model.set_reshard_after_backward(False)
    model.set_is_last_backward(False)
    x = torch.randn(8, HIDDEN)
    for _ in range(2):
        model(x).float().sum().backward()
    del x
    gc.collect()
    before = _live_bytes()
    marks = []
    copy_in = _fsdp_collectives.foreach_reduce_scatter_copy_in

    def spy(*args, **kwargs):
        marks.append(_live_bytes() - before)
        return copy_in(*args, **kwargs)

    _fsdp_collectives.foreach_reduce_scatter_copy_in = spy
    try:
        # perform_reduce_grad's FSDP part, as torch's pipeline stage runs it.
        model.set_is_last_backward(True)
        model.set_reshard_after_backward(True)
        model.set_requires_gradient_sync(True)
        state = fully_shard.state(model)
        for group_state in state._state_ctx.all_states:
            for group in group_state._fsdp_param_groups:
                group.post_backward()
                marks.append(_live_bytes() - before)
        state._root_post_backward_final_callback()
    finally:
        _fsdp_collectives.foreach_reduce_scatter_copy_in = copy_in
    return before - shards - baseline, marks


@pytest.mark.parametrize("world_size", [1, 2])
def test_stage_holds_6_bytes_per_gathered_parameter_and_its_reduction_2_more(world_size):
    held, marks = run_ranks(_stage_reduction, world_size)[0]
    gathered_layer = HIDDEN * HIDDEN
    # bf16 weights gathered and float32 gradients accumulated, beside the float32 shards (and a
    # few scalars: up to a few dozen bytes).
    assert held == pytest.approx(PP_HELD_BYTES * LAYERS * gathered_layer, abs=256)
    # The reduction frees a layer's bf16 weights before it allocates the float32 input: 2 bytes
    # per gathered parameter of one layer above what was held, at most.
    assert max(marks) == pytest.approx(PP_TRANSIENT_BYTES * gathered_layer, abs=256), marks
