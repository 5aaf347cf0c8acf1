"""FSDP2 / HSDP on the two meshes: each experts module on the experts mesh, each transformer
block and the root on the dense mesh. accelerate's FSDP2 path skips modules that are already
``fully_shard``-ed, so a model prepared here passes through ``accelerator.prepare`` unchanged.

Gradient scale. Every rank's loss is the mean over its own tokens and the training objective is
the mean of those losses over the ``dp = dp_replicate * dp_shard`` ranks. A dense gradient is
averaged over the dense mesh, which is all ``dp`` ranks. An expert's gradient already SUMS the
contributions of every token of its ``ep`` group (the all-to-all backward brings them to the
expert's rank) before FSDP reduces it over ``(dp_replicate, edp)``; averaging there would leave a
factor ``ep``. So both kinds are summed and divided by ``dp`` (``set_gradient_divide_factor``),
which is the gradient of the mean loss.

gloo: its reduce-scatter does not honour ``ReduceOp.AVG`` in every torch release (it sums:
pytorch/pytorch#162338) and rejects ``PREMUL_SUM``, which a divide factor other than the group
size selects. Where the shard group is gloo FSDP is told to reduce with SUM and divide afterwards
(``set_force_sum_reduction_for_comms``), so the result does not depend on the release.

Gathering an expert parameter whole (a full state dict, a gradient norm check) redistributes its
``(_StridedShard, Shard)`` placement over the experts mesh with two all-gathers, and torch 2.13
warns about it on every rank at every gather, saying the results may differ between ranks by
reduction order. All-gathers reduce nothing and the two are required by the layout, so that one
message is dropped (``_StridedGatherNotice``); every other DTensor message stays."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from ..hf.layout import expert_count
from .mesh import MoEMeshes


def _configure_reduction(module: FSDPModule, mesh, divide_factor: int) -> None:
    module.set_gradient_divide_factor(float(divide_factor))
    # The shard dimension is the mesh's last. Forcing SUM where that dimension has one rank would
    # divide twice: FSDP divides in its single-rank copy and again after the reduction.
    shard_group = mesh.get_group(mesh.ndim - 1)
    if dist.get_backend(shard_group) == "gloo" and shard_group.size() > 1:
        module.set_force_sum_reduction_for_comms(True)


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a transformers model: instances of the classes its
    ``_no_split_modules`` names (the decoder layers), found by their bases too, since
    ``fully_shard`` gives a sharded block a subclass (``FSDPMixtralDecoderLayer``)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if any(cls.__name__ in names for cls in type(m).__mro__)]
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} names no transformer block class in _no_split_modules "
            f"({sorted(names)}), so there is nothing to wrap per block for FSDP"
        )
    return blocks


class _StridedGatherNotice(logging.Filter):
    """Drops DTensor's notice that a ``_StridedShard`` placement is gathered by sequential
    all-gathers (the module docstring says why it does not apply)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("_StridedShard" in message and "sequential all_gather operations" in message)


def _drop_strided_gather_notice() -> None:
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    if not any(isinstance(f, _StridedGatherNotice) for f in logger.filters):
        logger.addFilter(_StridedGatherNotice())


def apply_fsdp(
    model: torch.nn.Module,
    meshes: MoEMeshes,
    experts: list[torch.nn.Module],
    *,
    mixed_precision: MixedPrecisionPolicy | None,
    reshard_after_forward: bool,
) -> None:
    dims = meshes.dims
    policy = mixed_precision or MixedPrecisionPolicy()
    experts_per_rank = expert_count(experts[0]) // dims.ep if experts else 0
    # When the local experts do not split evenly over edp, shard the intermediate dimension
    # instead of padding whole experts (as torchtitan does).
    experts_dim = 0 if experts_per_rank % dims.edp == 0 else 1

    def experts_placement(param):
        return Shard(experts_dim)

    if experts:
        _drop_strided_gather_notice()
    for module in experts:
        fully_shard(
            module, mesh=meshes.experts, mp_policy=policy, reshard_after_forward=reshard_after_forward,
            shard_placement_fn=experts_placement,
        )
        _configure_reduction(module, meshes.experts, dims.dp)
    for block in transformer_blocks(model):
        fully_shard(block, mesh=meshes.dense, mp_policy=policy, reshard_after_forward=reshard_after_forward)
        _configure_reduction(block, meshes.dense, dims.dp)
    # The root keeps its parameters gathered after forward: backward needs them at once.
    fully_shard(model, mesh=meshes.dense, mp_policy=policy, reshard_after_forward=False)
    _configure_reduction(model, meshes.dense, dims.dp)
