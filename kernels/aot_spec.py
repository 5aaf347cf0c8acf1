"""What the ahead-of-time compile check needs to know about one kernel configuration.

Every kernel module in this folder exposes ``aot_specs() -> list[KernelSpec]`` listing each
(kernel, dtype, configuration) its launcher may choose; ``python -m moe_ep.kernels.aot``
compiles them all for sm_80 and sm_90 on a machine without a GPU."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Triton's names of the element types the kernels take, as pointer and scalar signatures spell them.
TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class KernelSpec:
    name: str  # human-readable, unique: kernel, dtype and configuration
    fn: object  # the @triton.jit function
    signature: dict  # argument name -> Triton type string ("*bf16", "i32", "fp32", "constexpr")
    constexprs: dict  # constexpr argument name -> value
    num_warps: int = 4
    num_stages: int = 3
    uses_dot: bool = False  # GEMMs must lower to mma (sm_80) / wgmma (sm_90)
    # Integer arguments whose real values are not multiples of 16 (top-k, expert counts): compiled
    # without the divisibility hint Triton's JIT would only give a multiple of 16.
    unaligned: tuple = ()
    archs: tuple = field(default=(80, 90))
