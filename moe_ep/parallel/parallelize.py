"""``parallelize``: expert parallelism plus FSDP2/HSDP on a transformers MoE model."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

from ..dispatch.capacity import check_capacity_factor
from .expert_sharding import experts_modules, num_experts_of, shard_experts
from .fsdp import apply_fsdp
from .mesh import MoEMeshes, build_meshes, resolve_dims

MESHES_ATTRIBUTE = "moe_ep_meshes"


def parallelize(
    model: torch.nn.Module,
    *,
    ep: int = 1,
    dp_replicate: int = 1,
    dp_shard: int | None = None,
    pp: int = 1,
    mixed_precision: MixedPrecisionPolicy | None = None,
    activation_checkpointing: bool = False,
    capacity_factor: float | None = None,
    reshard_after_forward: bool = True,
    experts_backend: str | None = None,
) -> torch.nn.Module:
    """Spread ``model`` over the default process group and return it, ready for any optimizer.

    - ``ep``: experts are split over ``ep`` ranks (DTensor ``Shard(0)``, global shapes and HF names
      kept) and tokens reach them through moe_ep's all-to-all dispatcher; needs the ``"moe_ep"``
      experts implementation (``moe_ep.hf.patch(model)``) when ``ep > 1``.
    - ``dp_replicate`` x ``dp_shard``: FSDP2 over ``dp_shard`` ranks, HSDP replicas over
      ``dp_replicate``; ``dp_shard=None`` uses the rest of the world. Experts are FSDP-sharded over
      ``edp = dp_shard / ep`` and replicated over ``dp_replicate``.
    - ``pp``: must be 1 until pipeline stages exist (NotImplementedError otherwise).
    - ``mixed_precision``: an FSDP2 ``MixedPrecisionPolicy`` for every unit, or None (no casting).
    - ``activation_checkpointing``: recompute each transformer block in backward (transformers'
      gradient checkpointing, non-reentrant); the dispatcher's collectives are re-run in the
      same order on every rank.
    - ``capacity_factor``: None = dropless dispatch, else capacity mode (no host sync).

    Every rank must call it (collective). Gradients are those of the mean of the ranks' losses;
    clip them with ``moe_ep.parallel.clip_grad_norm_``. The meshes are kept on
    ``model.moe_ep_meshes``. Model parameters may live on the meta device (shards are created
    there; materialise with ``to_empty`` and ``load_full_state_dict``)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecisionPolicy):
        raise TypeError(
            f"mixed_precision must be a torch.distributed.fsdp.MixedPrecisionPolicy or None, got "
            f"{type(mixed_precision).__name__}"
        )
    if not isinstance(activation_checkpointing, bool):
        raise TypeError(f"activation_checkpointing must be a bool, got {type(activation_checkpointing).__name__}")
    check_capacity_factor(capacity_factor)
    if not dist.is_initialized():
        raise RuntimeError("parallelize needs an initialised default process group (torch.distributed.init_process_group)")
    if hasattr(model, MESHES_ATTRIBUTE):
        raise ValueError("model was already parallelized (it has moe_ep_meshes)")
    experts = experts_modules(model)
    if not experts:
        raise ValueError(f"{type(model).__name__} has no transformers experts module to parallelize")
    dims = resolve_dims(
        dist.get_world_size(), ep=ep, dp_replicate=dp_replicate, dp_shard=dp_shard, pp=pp,
        num_experts=num_experts_of(experts),
    )
    if activation_checkpointing and not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"activation_checkpointing=True: {type(model).__name__} does not support gradient checkpointing")

    device = next(model.parameters()).device
    meshes = build_meshes(dims, "cuda" if device.type == "cuda" else "cpu")
    if dims.ep > 1:
        shard_experts(model, meshes.ep, capacity_factor=capacity_factor, backend=experts_backend)
    elif capacity_factor is not None:
        raise ValueError(f"capacity_factor={capacity_factor} applies to the expert-parallel dispatcher; ep=1 has none")
    if activation_checkpointing:
        enable_activation_checkpointing(model)
    apply_fsdp(
        model, meshes, [m for _, m in experts], mixed_precision=mixed_precision,
        reshard_after_forward=reshard_after_forward,
    )
    setattr(model, MESHES_ATTRIBUTE, meshes)
    return model


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """transformers' non-reentrant checkpointing of every block; the method was renamed in 5.2x
    (``gradient_checkpointing_enable`` remains as a deprecated alias until v6)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def meshes_of(model: torch.nn.Module) -> MoEMeshes:
    meshes = getattr(model, MESHES_ATTRIBUTE, None)
    if meshes is None:
        raise ValueError(f"{type(model).__name__} was not prepared by moe_ep.parallel.parallelize")
    return meshes
