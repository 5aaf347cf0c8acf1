"""PyTorch's grouped GEMM (``torch.nn.functional.grouped_mm``; CUTLASS on sm_90 and later), where it
is sync-free: what the grouped-GEMM path of ``moe_experts`` runs on, and a candidate beside the
Triton configurations of every GEMM launch of the Triton path (``grouped_gemm._tuned``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The public name where the installed torch has one (a wrapper of the private op in 2.13).
grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm


def grouped_mm_sync_free(arch: str, dtype: torch.dtype) -> bool:
    """Whether ``grouped_mm`` runs on ``arch`` ("sm_90", ..., or "interpreter") and ``dtype``
    without reading its offsets back to the host. On sm_90 and sm_100 in the half types it does
    (CUTLASS kernels). On sm_80, torch 2.9-2.11 has no bf16 kernel: it calls ``offs.cpu()`` and
    loops over the groups with one cuBLAS matmul each (pytorch#161407; pytorch#186620 plans no
    sync-free Ampere version), and float32 takes that loop on every GPU (seen on an H100 with
    torch 2.11). Under the Triton interpreter the tensors are on the CPU: nothing to sync with."""
    if arch == "interpreter":
        return True
    major = int(arch.removeprefix("sm_")) // 10
    return major in (9, 10) and dtype in (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Library:
    """A candidate of a launch that is not a Triton configuration: a library call that computes
    the same result, timed, agreed and cached by name like a configuration (``autotune``)."""

    name: str
    tma: bool = False
    persistent: bool = False

    def __str__(self) -> str:
        return self.name


GROUPED_MM = Library("grouped_mm")
