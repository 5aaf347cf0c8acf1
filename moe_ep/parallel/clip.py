"""Gradient-norm clipping across the two meshes. ``torch.nn.utils.clip_grad_norm_`` stacks the
per-parameter norms, which fails for DTensors on different meshes (dense grads live on
``(dp_replicate, dp_shard)``, expert grads on ``(dp_replicate, edp, ep)``). Here each mesh's norm
is reduced by DTensor over that mesh (replicated dimensions counted once; the inf-norm by hand,
which tolerates empty local shards); every rank then holds
every mesh's norm as an ordinary tensor and combines them the same way."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _mesh_key(grad: torch.Tensor):
    return grad.device_mesh if isinstance(grad, DTensor) else None


def _norm(grad: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The norm of one gradient in float32 (float64 gradients in float64, then float32: a float32
    reduction of them would narrow)."""
    if grad.dtype != torch.float64:
        return torch.linalg.vector_norm(grad, norm_type, dtype=torch.float32)
    return torch.linalg.vector_norm(grad, norm_type).float()


def _max_norm(mesh, members: list[torch.Tensor]) -> torch.Tensor:
    """The inf-norm of ``members`` (gradients on ``mesh``, or plain tensors when it is None).
    Not through DTensor: FSDP leaves a rank an empty shard when a dimension has fewer rows than
    ranks (a [6, H] router over 4 ranks), and the inf-norm of an empty tensor is an error. Here
    an empty shard contributes 0 (the identity of max over norms), and the local maxima are
    reduced over every mesh dimension: max counts a replicated dimension once by itself."""
    locals_ = [g.to_local() if isinstance(g, DTensor) else g for g in members]
    maxima = [torch.linalg.vector_norm(t, math.inf, dtype=torch.float32) for t in locals_ if t.numel()]
    norm = torch.stack(maxima).amax() if maxima else torch.zeros((), dtype=torch.float32, device=locals_[0].device)
    if mesh is not None:
        for dim in range(mesh.ndim):
            dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
    return norm


def grad_norm(parameters: torch.nn.Module | Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The global ``norm_type`` norm of the gradients of ``parameters`` (a module or an iterable of
    tensors) across every mesh that holds one: a plain float32 tensor equal on every rank, non-finite
    when any gradient element is (0 on the parameters' device when none has a gradient).
    Collective over every mesh that holds a gradient: call it on every rank, in the same order."""
    parameters = _as_list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    if not (norm_type > 0):
        raise ValueError(f"norm_type must be positive (or inf), got {norm_type}")
    # Groups in first-seen order: the same on every rank, so the collectives line up.
    groups: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(_mesh_key(g), []).append(g)
    group_norms = []
    for mesh, members in groups.items():
        if math.isinf(norm_type):
            group_norms.append(_max_norm(mesh, members))
            continue
        norms = [_norm(g, norm_type) for g in members]
        norm = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        group_norms.append(norm.full_tensor() if mesh is not None else norm)
    if not group_norms:
        # No gradient: a zero norm on the parameters' device (the CPU without parameters).
        device = parameters[0].device if parameters else torch.device("cpu")
        return torch.zeros((), dtype=torch.float32, device=device)
    device = group_norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in group_norms]), norm_type)


def scale_grads_(parameters: torch.nn.Module | Iterable[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply every gradient of ``parameters`` (each rank's local shard) by the 0-d ``factor``."""
    for g in (p.grad for p in _as_list(parameters) if p.grad is not None):
        local = g.to_local() if isinstance(g, DTensor) else g
        local.mul_(factor.to(device=local.device, dtype=local.dtype))


def clip_grad_norm_(
    parameters: torch.nn.Module | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip the gradients of ``parameters`` (a module or an iterable of tensors) in place so that
    their global ``norm_type`` norm is at most ``max_norm``; returns the norm before clipping,
    ``grad_norm``'s. Collective: call it on every rank, in the same order."""
    parameters = _as_list(parameters)
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or max_norm < 0:
        raise ValueError(f"max_norm must be a non-negative number, got {max_norm!r}")
    total = grad_norm(parameters, norm_type)
    # host sync: only on request, to raise before touching the gradients.
    if error_if_nonfinite and not math.isfinite(total.item()):
        raise RuntimeError(f"the total {float(norm_type)}-norm of the gradients is {total.item()}; not clipping")
    clip_grads_(parameters, total, max_norm)
    return total


def clip_grads_(
    parameters: torch.nn.Module | Iterable[torch.Tensor], total_norm: torch.Tensor, max_norm: float
) -> None:
    """Scale the gradients so that their global norm ``total_norm`` (already computed, e.g. over
    every pipeline stage) becomes at most ``max_norm``."""
    scale_grads_(parameters, torch.clamp(max_norm / (total_norm + 1e-6), max=1.0))


def _as_list(parameters) -> list[torch.Tensor]:
    if isinstance(parameters, torch.nn.Module):
        return list(parameters.parameters())
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
