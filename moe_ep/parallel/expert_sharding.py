"""Expert parallelism on a transformers model: each experts module keeps this rank's
``L = E / ep`` experts as DTensors ``Shard(0)`` over the ``ep`` mesh (global shape, HF name), and
is bound to a dispatcher (``moe_ep.hf.binding``) that the ``"moe_ep"`` experts implementation
hands its forward."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard

from ..dispatch import ExpertParallelDispatcher
from ..hf.binding import bind
from ..hf.layout import experts_activation, experts_modules, num_experts_of
from ..hf.registry import EXPERTS_IMPLEMENTATION

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def check_experts_implementation(name: str, module: torch.nn.Module) -> None:
    implementation = getattr(getattr(module, "config", None), "_experts_implementation", None)
    if implementation != EXPERTS_IMPLEMENTATION:
        raise ValueError(
            f"expert parallelism needs the {EXPERTS_IMPLEMENTATION!r} experts implementation on {name!r}, found "
            f"{implementation!r}: load the model with experts_implementation={EXPERTS_IMPLEMENTATION!r} or call "
            "moe_ep.hf.patch(model) first (any other implementation would run on this rank's experts only)"
        )


def _shard(param: torch.nn.Parameter, ep_mesh) -> torch.nn.Parameter:
    """This rank's rows of ``param`` as a DTensor ``Shard(0)`` over ``ep_mesh``; copies them so the
    full tensor can be freed. Meta tensors stay on meta (materialise after parallelize)."""
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    rows = param.shape[0] // ep
    local = param.detach()[rank * rows:(rank + 1) * rows].clone()
    return torch.nn.Parameter(
        DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=param.shape, stride=param.stride()),
        requires_grad=param.requires_grad,
    )


def shard_experts(
    model: torch.nn.Module,
    ep_mesh,
    *,
    capacity_factor: float | None = None,
    backend: str | None = None,
    node_groups=None,
    overlap_chunks: int = 1,
) -> list[tuple[str, torch.nn.Module]]:
    """Shard every experts module over ``ep_mesh`` and install its dispatcher (node-aware with
    ``node_groups``, ``moe_ep.dispatch.NodeGroups``; ``overlap_chunks`` as ``moe_experts_ep``'s).
    Checks every module before changing any.
    Returns the experts modules."""
    modules = experts_modules(model)
    num_experts = num_experts_of(modules)
    activations = {}
    for name, module in modules:
        check_experts_implementation(name, module)
        activations[name] = experts_activation(module)
        for weight in EXPERT_WEIGHTS:
            if isinstance(getattr(module, weight), DTensor):
                raise ValueError(f"{name}.{weight} is already a DTensor: the model was parallelized before")
    group = ep_mesh.get_group()
    for name, module in modules:
        for weight in EXPERT_WEIGHTS:
            setattr(module, weight, _shard(getattr(module, weight), ep_mesh))
        dispatcher = ExpertParallelDispatcher(
            group, num_experts, activation=activations[name], capacity_factor=capacity_factor, backend=backend,
            node_groups=node_groups, overlap_chunks=overlap_chunks,
        )
        bind(module, dispatcher=dispatcher)
    return modules
