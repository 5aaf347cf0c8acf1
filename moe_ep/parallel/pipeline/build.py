"""Cutting a Hugging Face decoder-only causal LM into pipeline stages with
torch.distributed.pipelining: ``plan_stages`` chooses the cut (automatically, with the planner's
per-layer costs and ``moe_ep.planner.partition``, or at explicit split points, which need no cost
model) and changes nothing; ``build_stages`` makes this rank's stages. ``build_pipeline`` does
both for a caller outside ``moe_ep.parallelize``, which calls them itself so that the cut is
checked before the model changes and the expert sharding and FSDP2 are applied per stage
(``stage_transform``). The automatic cut keeps stages that share a parameter (a tied LM head) on
one rank (ZB-V puts the first and the last stage on rank 0)."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ...ops.experts_op import set_repeatable_backward
from ...planner.memory import layer_ids
from ...planner.partition import Partition, partition
from ..config import PipelineConfig
from .costs import layer_units, pipeline_unit_costs
from .stage import CausalLMStage, stage_parts
from .stages import PipelineStages


def plan_stages(
    model: nn.Module, pp: int, pipeline: PipelineConfig, *, dp_shard: int = 1, ep: int = 1,
    checkpointing: str | bool = "none",
) -> Partition:
    """The cut of ``model`` into ``pipeline``'s stages over ``pp`` ranks; ``dp_shard``, ``ep`` and
    ``checkpointing`` are what the cost model assumes. Reads the model, changes nothing."""
    base, _ = stage_parts(model)
    num_layers = len(base.layers)
    pipeline.check(pp, num_layers)
    info = pipeline.info
    if pipeline.split_points is not None and pipeline.memory_cap is None:
        costs = layer_units(model, num_layers)
    else:
        costs = pipeline_unit_costs(model, pp, pipeline, dp_shard=dp_shard, ep=ep, checkpointing=checkpointing)
    # Unit i is decoder layer i, so split points index units and decoder layers alike.
    return partition(
        costs, pipeline.num_stages(pp), memory_cap=pipeline.memory_cap, split_points=pipeline.split_points,
        placement=info.placement, stages_per_rank=info.stages_per_rank,
        inflight=info.inflight(pp, pipeline.microbatches),
    )


def build_stages(
    model: nn.Module,
    group: dist.ProcessGroup,
    part: Partition,
    pipeline: PipelineConfig,
    *,
    stage_transform: Callable[[list[nn.Module]], None] | None = None,
    device: torch.device | str | None = None,
) -> PipelineStages:
    """This rank's stages of the cut ``part``: the stage modules, ``stage_transform`` applied to
    them (in stage order) before torch wraps them, on ``device`` (default: the model's, cpu for
    meta). A schedule that splits backwards (ZB-V, DualPipeV) runs the experts' backward of one
    forward in its input- and its weight-gradient pass: the experts keep their saved GEMM-1
    output from then on, in the process (``moe_ep.ops.set_repeatable_backward``), and its
    weight-gradient pass recomputes a checkpointed layer once (``weight_pass``)."""
    from .weight_pass import stage_class

    if pipeline.info.splits_backward:
        set_repeatable_backward(True)

    if device is None:
        device = next(model.parameters()).device
        device = torch.device("cpu") if device.type == "meta" else device
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a torch.device, a device string such as 'cuda:0', or None, "
                         f"got {device!r}") from None
    num_stages = part.num_stages
    stage_ids = part.stages_of_rank(group.rank())
    modules = [
        CausalLMStage(model, layer_ids(part.stage_names(s)), first=s == 0, last=s == num_stages - 1) for s in stage_ids
    ]
    if stage_transform is not None:
        stage_transform(modules)
    wrapper = stage_class(pipeline.info.splits_backward)
    stages = [wrapper(m, s, num_stages, device, group=group) for m, s in zip(modules, stage_ids)]
    return PipelineStages(modules, stages, stage_ids, part, pipeline.schedule, pipeline.microbatches, group)


def build_pipeline(
    model: nn.Module,
    pp_mesh,
    *,
    schedule: str = "1f1b",
    microbatches: int,
    split_points: Sequence[int] | None = None,
    memory_cap: float | None = None,
    seq_len: int | None = None,
    microbatch_size: int | None = None,
    virtual_stages: int | None = None,
    dp_shard: int = 1,
    ep: int = 1,
    checkpointing: str | bool = "none",
    stage_transform: Callable[[list[nn.Module]], None] | None = None,
    device: torch.device | str | None = None,
) -> PipelineStages:
    """Cut ``model`` into pipeline stages and return this rank's.

    Args:
        model: a transformers decoder-only ``*ForCausalLM`` (any device, meta included).
        pp_mesh: the 1-D pipeline DeviceMesh (e.g. ``meshes.world["pp"]``) or a ProcessGroup.
        schedule, microbatches, split_points, memory_cap, seq_len, microbatch_size, virtual_stages: the
            pipeline, as ``moe_ep.parallel.PipelineConfig`` documents them; ``split_points``
            without ``memory_cap`` needs no cost model (any decoder-only family).
        dp_shard, ep: the sharding the cost model assumes.
        checkpointing: the recompute policy the layers will run under (costs and memory only;
            applying it is the caller's, e.g. ``enable_activation_checkpointing``).
        stage_transform: called once with this rank's stage modules (in stage order) before they
            are wrapped (expert sharding, FSDP).
        device: where the stages compute; defaults to the model's parameters' device (cpu for meta).
    """
    if isinstance(pp_mesh, dist.ProcessGroup):
        group = pp_mesh
    elif hasattr(pp_mesh, "get_group") and getattr(pp_mesh, "ndim", 1) == 1:
        group = pp_mesh.get_group()
    else:
        raise TypeError(f"pp_mesh must be a 1-D DeviceMesh or a ProcessGroup, got {type(pp_mesh).__name__}")
    pipeline = PipelineConfig(microbatches=microbatches, schedule=schedule, split_points=split_points,
                              memory_cap=memory_cap, seq_len=seq_len, microbatch_size=microbatch_size,
                              virtual_stages=virtual_stages)
    part = plan_stages(model, group.size(), pipeline, dp_shard=dp_shard, ep=ep, checkpointing=checkpointing)
    return build_stages(model, group, part, pipeline, stage_transform=stage_transform, device=device)
