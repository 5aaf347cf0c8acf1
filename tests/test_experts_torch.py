import pytest
import torch

import moe_ep
from moe_ep.reference import moe_experts_ref

from conftest import TOLERANCE, rel_err
from moe_cases import CASES

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def run_with_grads(fn, x, idx, w, gate_up, down, dy):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, gate_up, down)]
    xl, wl, gul, dl = leaves
    y = fn(xl, idx, wl, gul, dl)
    grads = torch.autograd.grad(y, leaves, dy.to(y.dtype), allow_unused=True)
    return y.detach(), [g if g is not None else torch.zeros_like(l) for g, l in zip(grads, leaves)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_float64_reference(case, dtype):
    x, idx, w, gate_up, down = case.make(dtype)
    dy = torch.randn(case.T, case.H, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y, grads = run_with_grads(
        lambda *a: moe_ep.moe_experts(*a, backend="torch"), x, idx, w, gate_up, down, dy
    )
    y_ref, grads_ref = run_with_grads(moe_experts_ref, x, idx, w, gate_up, down, dy)
    assert y.dtype == dtype and y.shape == (case.T, case.H)
    tol = TOLERANCE[dtype]
    assert rel_err(y, y_ref) <= tol
    for name, g, g_ref in zip(["hidden_states", "top_k_weights", "gate_up_proj", "down_proj"], grads, grads_ref):
        assert g.shape == g_ref.shape, name
        assert rel_err(g, g_ref) <= tol, name


@pytest.mark.parametrize("case", CASES[:1] + CASES[4:5], ids=lambda c: c.name)
def test_bitwise_deterministic(case):
    x, idx, w, gate_up, down = case.make(torch.bfloat16)
    dy = torch.randn(case.T, case.H, dtype=torch.float64)
    fn = lambda *a: moe_ep.moe_experts(*a, backend="torch")
    y1, g1 = run_with_grads(fn, x, idx, w, gate_up, down, dy)
    y2, g2 = run_with_grads(fn, x, idx, w, gate_up, down, dy)
    assert torch.equal(y1, y2)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


def test_empty_expert_gets_zero_weight_gradient():
    case = CASES[4]
    x, idx, w, gate_up, down = case.make(torch.float32)
    _, (_, _, d_gate_up, d_down) = run_with_grads(
        lambda *a: moe_ep.moe_experts(*a, backend="torch"), x, idx, w, gate_up, down, torch.randn(case.T, case.H)
    )
    assert torch.count_nonzero(d_gate_up[-1]) == 0 and torch.count_nonzero(d_down[-1]) == 0


def test_torch_compile_sees_the_op():
    x, idx, w, gate_up, down = CASES[0].make(torch.float32)
    compiled = torch.compile(lambda *a: moe_ep.moe_experts(*a, backend="torch"), backend="eager", fullgraph=True)
    assert rel_err(compiled(x, idx, w, gate_up, down), moe_experts_ref(x, idx, w, gate_up, down)) <= 1e-5


def test_backend_env_var(monkeypatch):
    x, idx, w, gate_up, down = CASES[0].make(torch.float32)
    monkeypatch.setenv("MOE_EP_BACKEND", "nonsense")
    with pytest.raises(ValueError, match="MOE_EP_BACKEND"):
        moe_ep.moe_experts(x, idx, w, gate_up, down)
    monkeypatch.setenv("MOE_EP_BACKEND", "torch")
    assert moe_ep.moe_experts(x, idx, w, gate_up, down).shape == x.shape
