"""Which implementation runs an op: the op's own choice (``"auto"``) on CUDA, ``"torch"`` elsewhere,
unless the caller or the ``MOE_EP_BACKEND`` environment variable pins ``"triton"`` or ``"torch"``."""

from __future__ import annotations

import os

import torch

from ..kernels.runtime import interpreting

BACKENDS = ("auto", "triton", "torch")
ENV_VAR = "MOE_EP_BACKEND"


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """"auto", "triton" or "torch". None (after ``MOE_EP_BACKEND``) is "auto" on CUDA and "torch"
    elsewhere; "auto" lets the op choose (``moe_experts`` measures, see ``moe_ep.ops.selector``; the
    router takes Triton) and is "torch" where Triton cannot run."""
    if backend is None:
        backend = os.environ.get(ENV_VAR) or None
        source = ENV_VAR
    else:
        source = "backend"
    if backend is None:
        return "auto" if device.type == "cuda" else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"{source} must be one of {BACKENDS} or None, got {backend!r}")
    if device.type != "cuda" and not interpreting():
        if backend == "triton":
            raise ValueError(
                f"{source}='triton' needs CUDA tensors or TRITON_INTERPRET=1, got tensors on {device}"
            )
        return "torch"
    return backend
