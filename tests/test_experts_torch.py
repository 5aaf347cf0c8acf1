"""The torch backend of moe_experts against the float64 reference, on the CPU and, when there is
one, on the GPU (where its grouped matmuls run on other kernels)."""

import pytest
import torch

import moe_ep
from moe_ep.ops.experts_torch import experts_torch_fwd
from moe_ep.ops.reference import moe_experts_ref

from conftest import TOLERANCE, rel_err
from moe_cases import CASES, run_with_grads

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICES = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
GRAD_NAMES = ["hidden_states", "top_k_weights", "gate_up_proj", "down_proj"]


def torch_experts(x, idx, w, gate_up, down):
    return moe_ep.moe_experts(x, idx, w, gate_up, down, backend="torch")


def reference_of(x, idx, w, gate_up, down, dy):
    return run_with_grads(moe_experts_ref, *(t.cpu() for t in (x, idx, w, gate_up, down)), dy)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_float64_reference(case, dtype, device):
    x, idx, w, gate_up, down = case.make(dtype, device=device)
    dy = torch.randn(case.T, case.H, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y, grads = run_with_grads(torch_experts, x, idx, w, gate_up, down, dy)
    y_ref, grads_ref = reference_of(x, idx, w, gate_up, down, dy)
    assert y.dtype == dtype and y.shape == (case.T, case.H) and y.device.type == device
    tol = TOLERANCE[dtype]
    assert rel_err(y.cpu(), y_ref) <= tol
    for name, g, g_ref, leaf in zip(GRAD_NAMES, grads, grads_ref, (x, w, gate_up, down)):
        assert g.shape == g_ref.shape and g.dtype == leaf.dtype, name
        assert rel_err(g.cpu(), g_ref) <= tol, name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES[:1] + CASES[4:5], ids=lambda c: c.name)
def test_bitwise_deterministic(case, device):
    x, idx, w, gate_up, down = case.make(torch.bfloat16, device=device)
    dy = torch.randn(case.T, case.H, dtype=torch.float64)
    y1, g1 = run_with_grads(torch_experts, x, idx, w, gate_up, down, dy)
    y2, g2 = run_with_grads(torch_experts, x, idx, w, gate_up, down, dy)
    assert torch.equal(y1, y2)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


def test_empty_expert_gets_zero_weight_gradient():
    case = CASES[4]
    x, idx, w, gate_up, down = case.make(torch.float32)
    _, (_, _, d_gate_up, d_down) = run_with_grads(torch_experts, x, idx, w, gate_up, down, torch.randn(case.T, case.H))
    assert torch.count_nonzero(d_gate_up[-1]) == 0 and torch.count_nonzero(d_down[-1]) == 0


def test_opcheck_forward_and_backward_registration():
    x, idx, w, gate_up, down = CASES[1].make(torch.float32)
    args = (x.requires_grad_(), idx, w.requires_grad_(), gate_up.requires_grad_(), down.requires_grad_(), "silu")
    torch.library.opcheck(experts_torch_fwd, args)


def test_torch_compile_sees_forward_and_backward():
    case = CASES[0]
    x, idx, w, gate_up, down = case.make(torch.float32)
    dy = torch.randn(case.T, case.H, dtype=torch.float64)
    compiled = torch.compile(torch_experts, backend="aot_eager", fullgraph=True)
    y, grads = run_with_grads(compiled, x, idx, w, gate_up, down, dy)
    y_ref, grads_ref = reference_of(x, idx, w, gate_up, down, dy)
    assert rel_err(y, y_ref) <= 1e-5
    assert all(rel_err(g, g_ref) <= 1e-5 for g, g_ref in zip(grads, grads_ref))


def test_backend_env_var(monkeypatch):
    x, idx, w, gate_up, down = CASES[0].make(torch.float32)
    monkeypatch.setenv("MOE_EP_BACKEND", "nonsense")
    with pytest.raises(ValueError, match="MOE_EP_BACKEND"):
        moe_ep.moe_experts(x, idx, w, gate_up, down)
    monkeypatch.setenv("MOE_EP_BACKEND", "torch")
    assert moe_ep.moe_experts(x, idx, w, gate_up, down).shape == x.shape
