"""Argument checks shared by the public ops: fail at the boundary with a message that names the
argument, the value received and what was expected, never deep inside a kernel."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_tensor(name: str, value, *, ndim: int | None = None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if ndim is not None and value.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(value.shape)}")
    return value


def check_float(name: str, value: torch.Tensor) -> None:
    if value.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be float32, float16 or bfloat16, got {value.dtype}"
        )


def check_index(name: str, value: torch.Tensor) -> None:
    if value.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must be int64 or int32, got {value.dtype}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"all tensors must be on one device, got {listing}")


def _queued_on_device(t: torch.Tensor) -> bool:
    """Checks of tensor values are queued on the device (``torch._assert_async``) where reading
    them back would be a host sync per layer (CUDA) or a graph break (torch.compile): a failure
    then stops the program at the next synchronisation, never silently."""
    return t.device.type == "cuda" or torch.compiler.is_compiling()


def check_on_device(condition: torch.Tensor, message: str) -> None:
    """Raise ValueError(message) unless the 0-d bool ``condition`` holds; queued on the device
    where that avoids a host sync."""
    if _queued_on_device(condition):
        torch._assert_async(condition, message)
    elif not bool(condition):
        raise ValueError(message)


def check_indices_in_range(name: str, idx: torch.Tensor, num_experts: int) -> None:
    """Expert ids must lie in [0, num_experts); on the CPU the error names the values found."""
    if idx.numel() == 0:
        return
    message = f"{name} must hold expert ids in [0, {num_experts})"
    if _queued_on_device(idx):
        torch._assert_async(((idx >= 0) & (idx < num_experts)).all(), message)
        return
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= num_experts:
        raise ValueError(f"{message}, got values in [{lo}, {hi}]")


def check_routing(hidden_states, top_k_index, top_k_weights, num_experts: int) -> None:
    """Tokens and their routing as the expert ops take them: ``hidden_states [T, H]`` and
    ``top_k_weights [T, K]`` float, ``top_k_index [T, K]`` int ids in ``[0, num_experts)`` with
    ``1 <= K <= num_experts``, on one device."""
    check_tensor("hidden_states", hidden_states, ndim=2)
    check_tensor("top_k_index", top_k_index, ndim=2)
    check_tensor("top_k_weights", top_k_weights, ndim=2)
    check_float("hidden_states", hidden_states)
    check_float("top_k_weights", top_k_weights)
    check_index("top_k_index", top_k_index)
    check_same_device(hidden_states=hidden_states, top_k_index=top_k_index, top_k_weights=top_k_weights)
    if top_k_index.shape[0] != hidden_states.shape[0] or top_k_weights.shape != top_k_index.shape:
        raise ValueError(
            f"top_k_index and top_k_weights must both have shape [T={hidden_states.shape[0]}, K], got "
            f"{tuple(top_k_index.shape)} and {tuple(top_k_weights.shape)}"
        )
    K = top_k_index.shape[1]
    if not 1 <= K <= num_experts:
        raise ValueError(f"top_k_index must choose between 1 and E={num_experts} experts per token, got {K}")
    check_indices_in_range("top_k_index", top_k_index, num_experts)
