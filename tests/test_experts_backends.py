"""What both backends of moe_experts must do alike: routing weights in any float dtype, and a
backward that builds no gradient for the tensors the forward only saves."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import moe_ep
from moe_ep.ops.experts_torch import experts_torch_fwd
from moe_ep.ops.experts_triton import experts_triton_fwd
from moe_ep.kernels.grouped_gemm import routing_block
from moe_ep.ops.reference import moe_experts_ref

from conftest import TOLERANCE, rel_err
from moe_cases import CASES, run_with_grads

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["torch", "triton"]
ZERO_FILLS = {"aten.zeros.default", "aten.zeros_like.default", "aten.new_zeros.default", "aten.zero_.default",
              "aten.fill_.Scalar"}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=lambda c: c.name)
def test_half_routing_weights_match_float64_reference(case, dtype, backend):
    x, idx, w, gate_up, down = case.make(dtype, device=DEVICE, weights_dtype=dtype)
    dy = torch.randn(case.T, case.H, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y, grads = run_with_grads(
        lambda *a: moe_ep.moe_experts(*a, backend=backend), x, idx, w, gate_up, down, dy
    )
    y_ref, grads_ref = run_with_grads(moe_experts_ref, *(t.cpu() for t in (x, idx, w, gate_up, down)), dy)
    assert rel_err(y.cpu(), y_ref) <= TOLERANCE[dtype]
    for name, g, g_ref, leaf in zip(["hidden_states", "top_k_weights", "gate_up_proj", "down_proj"],
                                    grads, grads_ref, (x, w, gate_up, down)):
        assert g.dtype == leaf.dtype, name
        assert rel_err(g.cpu(), g_ref) <= TOLERANCE[dtype], name


class _ZeroFills(TorchDispatchMode):
    """Shapes of the zero-filled tensors made while active."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func) in ZERO_FILLS and isinstance(out, torch.Tensor):
            self.shapes.append(tuple(out.shape))
        return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_fills_no_gradient_for_saved_outputs(backend):
    """The forward ops also return what backward needs (routing metadata, the GEMM-1 output); only
    y is differentiated, so autograd must not allocate and zero a gradient for the others (for
    GEMM 1's output at Mixtral's shapes that would be gigabytes per layer)."""
    x, idx, w, gate_up, down = (t.requires_grad_() if t.is_floating_point() else t
                                for t in CASES[0].make(torch.float32, device=DEVICE))
    if backend == "torch":
        outputs = experts_torch_fwd(x, idx, w, gate_up, down, "silu")
    else:
        outputs = experts_triton_fwd(x, idx, w, gate_up, down, "silu", routing_block(idx.numel(), gate_up.shape[0]))
    with _ZeroFills() as fills:
        outputs[0].sum().backward()
    saved_shapes = {tuple(t.shape) for t in outputs[1:]}
    assert not saved_shapes & set(fills.shapes), fills.shapes


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("backend", BACKENDS)
def test_tensors_on_another_gpu_than_the_current_one(backend):
    """Triton launches on the current device; the launchers must switch to the tensors' one."""
    case = CASES[0]
    x, idx, w, gate_up, down = case.make(torch.bfloat16, device="cuda:1")
    dy = torch.randn(case.T, case.H, dtype=torch.float64)
    with torch.cuda.device(0):
        y, grads = run_with_grads(lambda *a: moe_ep.moe_experts(*a, backend=backend), x, idx, w, gate_up, down, dy)
        _, weights, _ = moe_ep.route_topk(x, gate_up[:, 0, :].contiguous(), 2, backend=backend)
    y_ref, grads_ref = run_with_grads(moe_experts_ref, *(t.cpu() for t in (x, idx, w, gate_up, down)), dy)
    assert y.device == torch.device("cuda:1") and weights.device == torch.device("cuda:1")
    assert rel_err(y.cpu(), y_ref) <= TOLERANCE[torch.bfloat16]
    assert all(rel_err(g.cpu(), g_ref) <= TOLERANCE[torch.bfloat16] for g, g_ref in zip(grads, grads_ref))
