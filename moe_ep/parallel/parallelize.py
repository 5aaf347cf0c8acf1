"""``parallelize``: expert parallelism, FSDP2/HSDP and pipeline stages on a transformers MoE
model, the one entry point for every layout."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

from ..dispatch.capacity import check_capacity_factor
from .expert_sharding import check_experts_implementation, experts_modules, num_experts_of, shard_experts
from .fsdp import apply_fsdp
from .mesh import MoEMeshes, ParallelDims, build_meshes, check_degree, resolve_dims

if TYPE_CHECKING:
    from .pipeline import PipelineStages

MESHES_ATTRIBUTE = "moe_ep_meshes"
# Set instead of MESHES_ATTRIBUTE when the model was cut into pipeline stages: this rank holds
# only some stages' shards, so the model as a whole is no longer one (state dicts, meshes_of).
PIPELINE_MESHES_ATTRIBUTE = "moe_ep_pipeline_meshes"
DEFAULT_SCHEDULE = "1f1b"


def parallelize(
    model: torch.nn.Module,
    *,
    ep: int = 1,
    dp_replicate: int = 1,
    dp_shard: int | None = None,
    pp: int = 1,
    schedule: str | None = None,
    microbatches: int | None = None,
    split_points: Sequence[int] | None = None,
    memory_cap: float | None = None,
    seq_len: int | None = None,
    microbatch_size: int | None = None,
    mixed_precision: MixedPrecisionPolicy | None = None,
    activation_checkpointing: bool = False,
    capacity_factor: float | None = None,
    reshard_after_forward: bool | None = None,
    experts_backend: str | None = None,
) -> torch.nn.Module | PipelineStages:
    """Spread ``model`` over the default process group; returns what ``moe_ep.training.TrainStep``
    takes, so the training loop is the same for every layout::

        target = moe_ep.parallelize(model, ep=2, pp=pp, microbatches=4 if pp > 1 else None)
        step = TrainStep(target, torch.optim.AdamW(target.parameters()), microbatches=4)
        for batch in batches:
            loss = step(batch)

    - ``pp == 1``: ``model`` itself, sharded in place (an ``nn.Module``; its meshes on
      ``model.moe_ep_meshes``, see ``meshes_of``). Also usable without TrainStep, with any
      optimizer and loop, and with ``full_state_dict``.
    - ``pp > 1``: this rank's ``moe_ep.parallel.PipelineStages`` (``.parameters()`` for the
      optimizer, the meshes on ``.meshes``). Stages run only under their schedule, which
      TrainStep drives; the model object is cut and must not be called or saved as a whole.

    Degrees:

    - ``ep``: experts are split over ``ep`` ranks (DTensor ``Shard(0)``, global shapes and HF names
      kept) and tokens reach them through moe_ep's all-to-all dispatcher; needs the ``"moe_ep"``
      experts implementation (``moe_ep.hf.patch(model)``) when ``ep > 1``.
    - ``dp_replicate`` x ``dp_shard``: FSDP2 over ``dp_shard`` ranks, HSDP replicas over
      ``dp_replicate``; ``dp_shard=None`` uses the rest of the world. Experts are FSDP-sharded over
      ``edp = dp_shard / ep`` and replicated over ``dp_replicate``.
    - ``pp``: pipeline stages (``moe_ep.parallel.pipeline.parallelize_pipeline``). ``schedule`` is
      ``"gpipe"``, ``"1f1b"`` (the default), ``"interleaved-1f1b"`` or ``"zbv"``; ``microbatches``
      (required, at least ``pp``) is the number of micro-batches per step; ``split_points`` the
      decoder-layer indices that start stages 1..S-1 (default: an automatic cut that balances the
      planner's per-layer costs). The automatic cut keeps every rank under ``memory_cap`` bytes
      (planner's memory model; None: no cap) for micro-batches of ``microbatch_size`` sequences
      (default 1) of ``seq_len`` tokens (default: the model's context, at most 4096). All six
      are refused with ``pp=1``, where there is no pipeline (gradient accumulation without a
      pipeline: ``TrainStep(microbatches=...)``).

    Options:

    - ``mixed_precision``: an FSDP2 ``MixedPrecisionPolicy`` for every unit, or None (no casting).
    - ``activation_checkpointing``: recompute each transformer block in backward (transformers'
      gradient checkpointing, non-reentrant); the dispatcher's collectives are re-run in the
      same order on every rank.
    - ``capacity_factor``: None = dropless dispatch, else capacity mode (no host sync); needs
      ``ep > 1``.
    - ``reshard_after_forward``: FSDP2's; None means True without a pipeline and False with one
      (a pipeline would otherwise regather the weights for every micro-batch).

    Every rank must call it (collective). Gradients are those of the mean of the data-parallel
    ranks' losses (TrainStep makes that the mean over all their tokens); clip them with
    ``moe_ep.parallel.clip_grad_norm_``. Model parameters may live on the meta device (shards are
    created there; materialise with ``to_empty`` and ``load_full_state_dict``)."""
    check_degree("pp", pp)
    if pp > 1:
        from .pipeline import parallelize_pipeline

        if microbatches is None:
            raise ValueError(f"pp={pp} needs microbatches: the micro-batches of one step (at least pp)")
        return parallelize_pipeline(
            model, pp=pp, ep=ep, dp_replicate=dp_replicate, dp_shard=dp_shard,
            schedule=DEFAULT_SCHEDULE if schedule is None else schedule, microbatches=microbatches,
            split_points=split_points, memory_cap=memory_cap, seq_len=seq_len, microbatch_size=microbatch_size,
            mixed_precision=mixed_precision,
            activation_checkpointing=activation_checkpointing, capacity_factor=capacity_factor,
            reshard_after_forward=False if reshard_after_forward is None else reshard_after_forward,
            experts_backend=experts_backend,
        )
    pipeline_only = (("schedule", schedule), ("microbatches", microbatches), ("split_points", split_points),
                     ("memory_cap", memory_cap), ("seq_len", seq_len), ("microbatch_size", microbatch_size))
    for name, value in pipeline_only:
        if value is not None:
            raise ValueError(
                f"{name}={value!r} describes pipeline stages and needs pp > 1, got pp=1 (gradient accumulation "
                "without a pipeline: TrainStep(microbatches=...))"
            )
    reshard_after_forward = True if reshard_after_forward is None else reshard_after_forward
    experts, meshes = prepare(
        model, "parallelize", pp=1, ep=ep, dp_replicate=dp_replicate, dp_shard=dp_shard,
        mixed_precision=mixed_precision, activation_checkpointing=activation_checkpointing,
        capacity_factor=capacity_factor, reshard_after_forward=reshard_after_forward, require_experts=True,
    )
    if meshes.dims.ep > 1:
        shard_experts(model, meshes.ep, capacity_factor=capacity_factor, backend=experts_backend)
    apply_fsdp(
        model, meshes, [m for _, m in experts], mixed_precision=mixed_precision,
        reshard_after_forward=reshard_after_forward,
    )
    setattr(model, MESHES_ATTRIBUTE, meshes)
    return model


def prepare(
    model: torch.nn.Module,
    caller: str,
    *,
    pp: int,
    ep: int,
    dp_replicate: int,
    dp_shard: int | None,
    mixed_precision,
    activation_checkpointing: bool,
    capacity_factor: float | None,
    reshard_after_forward: bool,
    require_experts: bool,
) -> tuple[list[tuple[str, torch.nn.Module]], MoEMeshes]:
    """What every layout checks before changing anything (a refused model is left as it was),
    then the meshes (collective) and, if asked for, activation checkpointing. Returns the
    model's experts modules and the meshes."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecisionPolicy):
        raise TypeError(
            f"mixed_precision must be a torch.distributed.fsdp.MixedPrecisionPolicy or None, got "
            f"{type(mixed_precision).__name__}"
        )
    for name, value in (("activation_checkpointing", activation_checkpointing),
                        ("reshard_after_forward", reshard_after_forward)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    check_capacity_factor(capacity_factor)
    if not dist.is_initialized():
        raise RuntimeError(f"{caller} needs an initialised default process group (torch.distributed.init_process_group)")
    if hasattr(model, MESHES_ATTRIBUTE) or hasattr(model, PIPELINE_MESHES_ATTRIBUTE):
        raise ValueError("model was already parallelized (it has moe_ep_meshes or moe_ep_pipeline_meshes)")
    experts = experts_modules(model)
    if require_experts and not experts:
        raise ValueError(f"{type(model).__name__} has no transformers experts module to parallelize")
    dims: ParallelDims = resolve_dims(
        dist.get_world_size(), ep=ep, dp_replicate=dp_replicate, dp_shard=dp_shard, pp=pp,
        num_experts=num_experts_of(experts) if experts else None,
    )
    if capacity_factor is not None and dims.ep == 1:
        raise ValueError(f"capacity_factor={capacity_factor} applies to the expert-parallel dispatcher; ep=1 has none")
    if dims.ep > 1:
        for name, module in experts:
            check_experts_implementation(name, module)
    if activation_checkpointing and not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"activation_checkpointing=True: {type(model).__name__} does not support gradient checkpointing")
    device = next(model.parameters()).device
    meshes = build_meshes(dims, "cuda" if device.type == "cuda" else "cpu")
    if activation_checkpointing:
        enable_activation_checkpointing(model)
    return experts, meshes


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """transformers' non-reentrant checkpointing of every block; the method was renamed in 5.2x
    (``gradient_checkpointing_enable`` remains as a deprecated alias until v6)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def meshes_of(model: torch.nn.Module) -> MoEMeshes:
    """The meshes of a model that ``parallelize`` prepared with ``pp=1``; pipeline stages keep
    theirs on ``PipelineStages.meshes``."""
    meshes = getattr(model, MESHES_ATTRIBUTE, None)
    if meshes is None:
        if hasattr(model, PIPELINE_MESHES_ATTRIBUTE):
            raise ValueError(
                f"{type(model).__name__} was cut into pipeline stages; their meshes are on the PipelineStages "
                "that parallelize returned (.meshes)"
            )
        raise ValueError(f"{type(model).__name__} was not prepared by moe_ep.parallel.parallelize")
    return meshes
