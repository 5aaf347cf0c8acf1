"""``moe_experts``: the expert MLPs of one MoE layer applied to routed tokens, with transformers'
fused weight layout (``gate_up_proj [E, 2I, H]``, gate half first; ``down_proj [E, H, I]``)."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from .activations import check_activation
from .backend import resolve_backend
from .experts_torch import experts_torch_fwd
from .validate import check_routing, check_same_device, check_tensor


def check_expert_weights(hidden_states, gate_up_proj, down_proj, *, names=("gate_up_proj", "down_proj")) -> int:
    """``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` for ``hidden_states [T, H]``: 3-D,
    its dtype and device, consistent shapes. ``names`` are the arguments' names in the caller's
    signature. Returns ``E``. ``hidden_states`` must already be a checked 2-D tensor."""
    gate_up_name, down_name = names
    check_tensor(gate_up_name, gate_up_proj, ndim=3)
    check_tensor(down_name, down_proj, ndim=3)
    for name, weight in ((gate_up_name, gate_up_proj), (down_name, down_proj)):
        if weight.dtype != hidden_states.dtype:
            raise TypeError(f"{name} must have the dtype of hidden_states ({hidden_states.dtype}), got {weight.dtype}")
    check_same_device(hidden_states=hidden_states, **{gate_up_name: gate_up_proj, down_name: down_proj})
    H = hidden_states.shape[1]
    E, two_I, H_gu = gate_up_proj.shape
    if H_gu != H:
        raise ValueError(
            f"{gate_up_name} must have shape [E, 2I, H={H}] to match hidden_states {tuple(hidden_states.shape)}, "
            f"got {tuple(gate_up_proj.shape)}"
        )
    if two_I % 2:
        raise ValueError(f"{gate_up_name}.shape[1] must be even (gate and up halves), got {two_I}")
    if tuple(down_proj.shape) != (E, H, two_I // 2):
        raise ValueError(
            f"{down_name} must have shape [E={E}, H={H}, I={two_I // 2}] to match {gate_up_name} "
            f"{tuple(gate_up_proj.shape)}, got {tuple(down_proj.shape)}"
        )
    return E


def check_experts_args(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj) -> None:
    check_tensor("gate_up_proj", gate_up_proj, ndim=3)
    check_routing(hidden_states, top_k_index, top_k_weights, gate_up_proj.shape[0])
    check_expert_weights(hidden_states, gate_up_proj, down_proj)


def moe_experts(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    activation: str = "silu",
    backend: str | None = None,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """``y[t] = sum_k w[t,k] * down[e] @ (act(gate[e] @ x[t]) * (up[e] @ x[t]))`` with ``e = idx[t,k]``.

    Args:
        hidden_states: ``[T, H]`` float32, float16 or bfloat16. A 3-D input is rejected: flatten
            the batch and sequence dimensions first (transformers' MoE blocks already do).
        top_k_index: ``[T, K]`` int64 or int32 expert ids in ``[0, E)``.
        top_k_weights: ``[T, K]`` routing weights, float32, float16 or bfloat16 (used in float32).
        gate_up_proj: ``[E, 2I, H]``, gate rows first, dtype of ``hidden_states``.
        down_proj: ``[E, H, I]``, dtype of ``hidden_states``.
        activation: ``"silu"`` (SwiGLU) or ``"gelu"`` (GeGLU).
        backend: ``"auto"`` (the faster of the Triton kernels and the grouped-GEMM path, measured
            once per problem, see ``moe_ep.ops.selector``), ``"triton"``, ``"torch"`` (the
            grouped-GEMM path) or None (``MOE_EP_BACKEND``, else "auto" on CUDA and torch
            elsewhere).
        group: the process group whose ranks must make the same choices (path and kernel
            configurations): each problem is decided on its first call with one collective over
            it, which every rank of the group must make. ``moe_experts_ep`` passes its
            expert-parallel group. None: this process decides alone.

    Differentiable in ``hidden_states``, ``top_k_weights``, ``gate_up_proj`` and ``down_proj``.
    Returns ``[T, H]`` in the dtype of ``hidden_states``.
    """
    check_experts_args(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj)
    check_activation(activation)
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    backend = resolve_backend(backend, hidden_states.device)
    return run_experts(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation, backend,
                       group)


def run_experts(x_TH, idx_TK, w_TK, gate_up_E2IH, down_EHI, activation: str, backend: str,
                group: dist.ProcessGroup | None = None, num_routed: int | None = None) -> torch.Tensor:
    """``moe_experts`` on arguments its caller validated, ``backend`` resolved ("auto", "triton" or
    "torch") and ``group`` as there: for callers that checked them once already (the
    expert-parallel layer).

    ``num_routed`` (an int): ``idx_TK`` may also hold ``E``, "no expert", a slot that adds nothing
    to its row (nor gets a weight gradient), and at most ``num_routed`` slots hold a real expert:
    the experts' buffers are sized for that many rows, not for every slot. A wrong bound loses
    slots. The dispatcher hands its received rows over this way, one column per local expert a
    row can carry, so that the experts gather and sum each row's pairs themselves."""
    args = (x_TH, idx_TK, w_TK, gate_up_E2IH, down_EHI, activation, num_routed)
    if backend == "torch" and x_TH.device.type == "cuda":
        _warn_if_torch_path_syncs(x_TH)
    if backend != "torch":
        from .selector import choose

        backend = choose(*args, pinned=None if backend == "auto" else backend, group=group)
    if backend == "triton":
        from .experts_triton import experts_triton

        return experts_triton(*args)
    return experts_torch_fwd(*args)[0]


_SYNC_WARNED: set[tuple] = set()


def _warn_if_torch_path_syncs(x_TH: torch.Tensor) -> None:
    """The grouped-GEMM path pinned where PyTorch's grouped GEMM reads its offsets back to the host
    (sm_80, float32): said once per architecture and dtype, since it breaks CUDA graphs and stalls
    every layer."""
    from ..kernels.autotune import device_arch
    from ..kernels.library import grouped_mm_sync_free

    key = (device_arch(x_TH.device), x_TH.dtype)
    if key not in _SYNC_WARNED and not grouped_mm_sync_free(*key):
        _SYNC_WARNED.add(key)
        warnings.warn(
            f"moe_ep: backend='torch' on {key[0]} in {key[1]}: torch's grouped_mm has no sync-free kernel there, "
            f"so every expert layer reads its offsets back to the host (a host sync per GEMM); "
            f"backend='triton' (or 'auto') has none", RuntimeWarning, stacklevel=3)
