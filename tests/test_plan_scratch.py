"""The planner's backward scratch of the experts (``planner.activations.experts_scratch``) against
the bytes ``moe_experts``' backward allocates on the CPU (``live_bytes.LiveBytes``: every storage
its ops make, from the op that makes it until it is freed), for both backends, with GEMM 1's
gradient over its saved output and without (``repeatable_backward``): never below what the op
holds, and at most 2% above; on a GPU, when there is one, never below, and the caching
allocator's peak within the count."""

import pytest
import torch

from live_bytes import LiveBytes
from markers import requires_cuda
from moe_cases import Case
from moe_ep.kernels.grouped_gemm import routing_block
from moe_ep.kernels.runtime import interpreting
from moe_ep.ops import activations
from moe_ep.ops.experts_torch import experts_torch_fwd
from moe_ep.ops.experts_triton import experts_triton_fwd
from moe_ep.planner.activations import experts_scratch

# Sizes of real models are multiples of 8 (the torch backend pads others, a copy the planner does
# not count); top-1, top-k = E, an expert with no token, more experts than tile rows.
SHAPES = [
    Case("top2", T=256, H=128, I=192, E=4, K=2),
    Case("top4_of_8", T=200, H=256, I=96, E=8, K=4),
    Case("top1_wide_I", T=300, H=64, I=320, E=6, K=1),
    Case("k_eq_e", T=96, H=64, I=64, E=4, K=4),
    Case("empty_expert", T=160, H=128, I=64, E=6, K=2, routing="skip_last"),
]


def _forward(backend: str, case: Case, idx: torch.Tensor):
    """The backend's forward op and its options."""
    if backend == "torch":
        return experts_torch_fwd, ("silu",)
    return experts_triton_fwd, ("silu", routing_block(idx.numel(), case.E))


def measured_scratch(backend: str, case: Case, overwrite: bool) -> int:
    x, idx, w, gate_up, down = case.make(torch.bfloat16)
    fwd, options = _forward(backend, case, idx)
    outputs = fwd(x, idx, w, gate_up, down, *options)
    bwd = getattr(torch.ops.moe_ep, f"experts_{backend}_bwd")
    dy = torch.randn_like(outputs[0])
    with LiveBytes() as live:
        grads = bwd(dy, x, w, gate_up, down, *outputs[1:], *options, overwrite_saved=overwrite)
    return live.peak(excluding=grads)


# On the CPU: the Triton kernels under the interpreter (on a GPU machine the interpreter is off,
# and a launch may allocate what the count would see and the GPU run does not need: skipped).
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not interpreting(), reason="counts the Triton kernels' buffers under the interpreter, on the CPU"))]


@pytest.mark.parametrize("repeatable", [False, True], ids=["over_gemm1_output", "repeatable"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", SHAPES, ids=lambda c: c.name)
def test_the_experts_backward_holds_what_the_planner_charges(case, backend, repeatable):
    measured = measured_scratch(backend, case, overwrite=not repeatable)
    planned = experts_scratch(case.T * case.K, case.H, case.I, case.E, backend, repeatable)
    assert measured <= planned <= 1.02 * measured, (measured, planned)


@pytest.mark.parametrize("case", SHAPES[:2], ids=lambda c: c.name)
def test_the_torch_backwards_float32_blocks_bound_its_scratch(case, monkeypatch):
    """With blocks of a few rows the float32 temporaries no longer dominate: the input gradient's
    rows and their token-order copy can make the peak, which the planner charges too."""
    monkeypatch.setattr(activations, "CHUNK_ELEMENTS", 4 * 2 * case.I)
    monkeypatch.setattr("moe_ep.planner.activations.CHUNK_ELEMENTS", 4 * 2 * case.I)
    measured = measured_scratch("torch", case, overwrite=True)
    planned = experts_scratch(case.T * case.K, case.H, case.I, case.E, "torch")
    assert measured <= planned <= 1.02 * measured, (measured, planned)


@requires_cuda
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_experts_backward_on_cuda_holds_what_the_planner_charges(backend):
    """The same count on the GPU's kernels, and the caching allocator's peak against it: the
    backward allocates nothing the count misses (beyond the allocator's rounding and a launch's
    small workspaces, 8 MiB in all)."""
    case = Case("gpu", T=4096, H=1024, I=512, E=8, K=2)
    x, idx, w, gate_up, down = case.make(torch.bfloat16, device="cuda")
    fwd, options = _forward(backend, case, idx)
    outputs = fwd(x, idx, w, gate_up, down, *options)
    dy = torch.randn_like(outputs[0])
    bwd = getattr(torch.ops.moe_ep, f"experts_{backend}_bwd")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with LiveBytes() as live:
        grads = bwd(dy, x, w, gate_up, down, *outputs[1:], *options, overwrite_saved=True)
    torch.cuda.synchronize()
    planned = experts_scratch(case.T * case.K, case.H, case.I, case.E, backend)
    assert live.peak(excluding=grads) <= planned, (live.peak(excluding=grads), planned)
    assert torch.cuda.max_memory_allocated() - base <= live.peak() + 8 * 2**20
