"""What the ahead-of-time compile check needs to know about one kernel launch.

Every kernel module in this folder exposes ``aot_specs() -> list[KernelSpec]`` listing each
(kernel, dtype, configuration, specialisation) its launchers may launch;
``python -m moe_ep.kernels.aot`` compiles them all for sm_80 and sm_90 on a machine without a GPU.

A spec is an example launch: the arguments a launcher passes, with stand-in tensors for the
pointers and production values for the integers. The check hands them to Triton's own argument
binder, so each is specialised exactly as the JIT would specialise that launch (a pointer or an
integer that is a multiple of 16 gets a divisibility hint, an integer equal to 1 becomes a
constant, any other does neither)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Triton's names of the element types the kernels take, as pointer and scalar signatures spell them.
TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def pointer(dtype: torch.dtype) -> torch.Tensor:
    """A stand-in for a device tensor argument: only its dtype and its (16-byte aligned) address
    matter to the specialisation, as for any freshly allocated CUDA tensor."""
    t = torch.empty(16, dtype=dtype)
    assert t.data_ptr() % 16 == 0
    return t


@dataclass(frozen=True)
class KernelSpec:
    name: str  # human-readable, unique: kernel, dtype, configuration and specialisation
    fn: object  # the @triton.jit function
    args: tuple  # positional arguments of the example launch (``pointer`` stand-ins, ints, floats)
    constexprs: dict  # keyword arguments of the launch (constexprs)
    num_warps: int = 4
    num_stages: int = 3
    uses_dot: bool = False  # GEMMs must lower to mma (sm_80) / wgmma (sm_90)
    tma: bool = False  # must load through TMA tensor descriptors where compiled for sm_90
    archs: tuple = field(default=(80, 90))
    # Position of the configuration in its space: 0 is the one launched when nothing is timed.
    rank: int = 0
    # Also launched when nothing is timed: the first configuration whose tile divides the 64-row
    # padding of experts with few rows (``grouped_gemm.routing_block``), where it is not rank 0.
    untuned: bool = False
    # Whether the quick check (``--quick``, run in CI) compiles this launch when rank is 0: False
    # for specialisations that another quick spec of the same kernel already exercises.
    quick: bool = True
    # The static cost model's description of this launch at the reference shapes (see
    # ``moe_ep.kernels.cost``), or None where the spec is not one the estimate is made for.
    cost: object = None
