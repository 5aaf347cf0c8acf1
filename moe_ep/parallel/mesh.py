"""The parallel degrees and the device meshes of ARCHITECTURE.md ("Parallel layout").

One world mesh ``(pp, dp_replicate, edp, ep)``, ``ep`` fastest-varying so an expert group is a
block of consecutive ranks (one node, on GPUs) and ``pp`` slowest, so each pipeline rank owns a
block of ``world / pp`` consecutive ranks. Within one pipeline rank, two views:

- dense parameters: ``(dp_replicate, dp_shard)`` with ``dp_shard = edp * ep`` flattened;
- expert parameters: DTensor ``Shard(0)`` over ``ep``, then FSDP over ``(dp_replicate, edp)``.

The ranks of one pipeline (same data-parallel coordinates, every ``pp``) form ``world["pp"]``."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..dispatch.dispatcher import check_num_experts
from ..dispatch.nodes import NodeGroups, split_by_node

DENSE_DIMS = ("pp", "dp_replicate", "dp_shard")


@dataclass(frozen=True)
class ParallelDims:
    pp: int
    dp_replicate: int
    dp_shard: int
    ep: int
    ep_node_size: int | None = None  # the node-aware dispatch's node size; None: single-stage

    @property
    def edp(self) -> int:
        """Ranks that hold the same experts and FSDP-shard them: ``dp_shard / ep``."""
        return self.dp_shard // self.ep

    @property
    def dp(self) -> int:
        """Ranks that see different data: ``dp_replicate * dp_shard``."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp


def check_degree(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def resolve_dims(
    world_size: int,
    *,
    ep: int = 1,
    dp_replicate: int = 1,
    dp_shard: int | None = None,
    pp: int = 1,
    num_experts: int | None = None,
    ep_node_size: int | None = None,
) -> ParallelDims:
    """Check the degrees against each other, the world size and the number of experts.
    ``dp_shard=None`` takes what the world leaves: ``world_size / (pp * dp_replicate)``.
    ``ep_node_size``: the node-aware dispatch's node size (``moe_ep.dispatch.nodes.node_size_for``),
    None for the single-stage dispatch."""
    for name, value in (("ep", ep), ("dp_replicate", dp_replicate), ("pp", pp)):
        check_degree(name, value)
    if dp_shard is None:
        if world_size % (pp * dp_replicate):
            raise ValueError(
                f"world size {world_size} is not divisible by pp * dp_replicate = {pp} * {dp_replicate}, so dp_shard "
                "cannot be derived; pass degrees whose product is the world size"
            )
        dp_shard = world_size // (pp * dp_replicate)
    check_degree("dp_shard", dp_shard)
    if pp * dp_replicate * dp_shard != world_size:
        raise ValueError(
            f"the degrees pp * dp_replicate * dp_shard = {pp} * {dp_replicate} * {dp_shard} = "
            f"{pp * dp_replicate * dp_shard} do not match the world size {world_size}"
        )
    if dp_shard % ep:
        raise ValueError(
            f"dp_shard={dp_shard} must be divisible by ep={ep}: experts are spread over ep ranks inside each "
            f"dp_shard group (edp = dp_shard / ep)"
        )
    if num_experts is not None:
        check_num_experts(num_experts, ep, name="the model's expert count")
    return ParallelDims(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, ep=ep, ep_node_size=ep_node_size)


@dataclass(frozen=True)
class MoEMeshes:
    dims: ParallelDims
    world: DeviceMesh  # (pp, dp_replicate, edp, ep)
    dense: DeviceMesh  # FSDP/HSDP of dense parameters: (dp_replicate, dp_shard), or (dp_shard,)
    experts: DeviceMesh  # FSDP/HSDP of expert parameters: (dp_replicate, edp), or (edp,)
    ep: DeviceMesh  # experts are Shard(0) over it; tokens are dispatched within it
    dp: DeviceMesh  # every rank that sees different data, flattened: the group of global losses
    ep_nodes: NodeGroups | None = None  # the ep group split by node for the node-aware dispatch

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.dp.get_group()


def build_meshes(dims: ParallelDims, device_type: str) -> MoEMeshes:
    """Create the meshes (a collective: every rank must call it with the same ``dims``). The
    expert view unflattens ``dp_shard`` of the dense view, so both share one root mesh, which
    FSDP2 needs to combine the ``edp`` and ``ep`` dimensions of an expert parameter. With
    ``dims.ep_node_size``, every ep group is also split by node (``moe_ep.dispatch.split_by_node``)."""
    world_size = dist.get_world_size()
    if dims.world_size != world_size:
        raise ValueError(f"{dims} covers {dims.world_size} ranks, the process group has {world_size}")
    dense_world = init_device_mesh(
        device_type, (dims.pp, dims.dp_replicate, dims.dp_shard), mesh_dim_names=DENSE_DIMS
    )
    world = dense_world._unflatten("dp_shard", (dims.edp, dims.ep), ("edp", "ep"))
    # A 2-D mesh makes FSDP2 do HSDP; with no replication the 1-D mesh gives plain FSDP.
    hsdp = dims.dp_replicate > 1
    dp_2d = dense_world["dp_replicate", "dp_shard"]
    return MoEMeshes(
        dims=dims,
        world=world,
        dense=dp_2d if hsdp else dense_world["dp_shard"],
        experts=world["dp_replicate", "edp"] if hsdp else world["edp"],
        ep=world["ep"],
        dp=dp_2d._flatten("dp"),
        ep_nodes=None if dims.ep_node_size is None else split_by_node(
            world.mesh.reshape(-1, dims.ep).tolist(), dims.ep_node_size),
    )
