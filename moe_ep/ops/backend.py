"""Which implementation runs an op: ``"triton"`` on CUDA, ``"torch"`` elsewhere, unless the caller
or the ``MOE_EP_BACKEND`` environment variable says otherwise."""

from __future__ import annotations

import os

import torch

from ..kernels.runtime import interpreting

BACKENDS = ("triton", "torch")
ENV_VAR = "MOE_EP_BACKEND"


def resolve_backend(backend: str | None, device: torch.device) -> str:
    if backend is None:
        backend = os.environ.get(ENV_VAR) or None
        source = ENV_VAR
    else:
        source = "backend"
    if backend is None:
        return "triton" if device.type == "cuda" else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"{source} must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "triton" and device.type != "cuda" and not interpreting():
        raise ValueError(
            f"{source}='triton' needs CUDA tensors or TRITON_INTERPRET=1, got tensors on {device}"
        )
    return backend
