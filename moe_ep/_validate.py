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


def check_indices_in_range(name: str, idx: torch.Tensor, num_experts: int) -> None:
    """Expert ids must lie in [0, num_experts).

    On the CPU this is an ordinary check. On CUDA reading the values back would be a host sync
    per layer, and under torch.compile a graph break, so there the check is queued on the device
    instead (``torch._assert_async``): a bad id stops the program at the next synchronisation,
    never silently."""
    if idx.numel() == 0:
        return
    message = f"{name} must hold expert ids in [0, {num_experts})"
    if idx.device.type == "cuda" or torch.compiler.is_compiling():
        torch._assert_async(((idx >= 0) & (idx < num_experts)).all(), message)
        return
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= num_experts:
        raise ValueError(f"{message}, got values in [{lo}, {hi}]")
