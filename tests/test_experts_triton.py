"""The Triton backend of moe_experts against the float64 reference: under TRITON_INTERPRET=1 on
the CPU, on the GPU when there is one."""

import pytest
import torch

from moe_ep.experts import moe_experts
from moe_ep.experts_triton import experts_triton_fwd
from moe_ep.kernels import grouped_gemm as gg
from moe_ep.kernels.routing_metadata import routing_metadata
from moe_ep.reference import moe_experts_ref

from conftest import TOLERANCE, rel_err, requires_cuda
from moe_cases import CASES, Case, run_with_grads

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GRAD_NAMES = ["hidden_states", "top_k_weights", "gate_up_proj", "down_proj"]
# Two row blocks per expert, several reduction steps and column tiles, ragged edges.
MULTI_TILE = Case("multi_tile", T=70, H=72, I=72, E=2, K=2)
# More experts than one metadata tile and more row blocks than one GEMM program group.
MANY_EXPERTS = Case("many_experts", T=40, H=16, I=8, E=20, K=3)


def triton_experts(x, idx, w, gate_up, down, activation="silu"):
    return moe_experts(x, idx, w, gate_up, down, activation=activation, backend="triton")


def check_against_reference(case, dtype, activation="silu"):
    x, idx, w, gate_up, down = case.make(dtype, device=DEVICE)
    dy = torch.randn(case.T, case.H, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y, grads = run_with_grads(
        lambda *a: triton_experts(*a, activation=activation), x, idx, w, gate_up, down, dy
    )
    y_ref, grads_ref = run_with_grads(
        lambda *a: moe_experts_ref(*a, activation=activation),
        *(t.cpu() for t in (x, idx, w, gate_up, down)), dy,
    )
    assert y.dtype == dtype and y.shape == (case.T, case.H) and y.device.type == DEVICE
    tol = TOLERANCE[dtype]
    assert rel_err(y.cpu(), y_ref) <= tol, "output"
    for name, g, g_ref, leaf in zip(GRAD_NAMES, grads, grads_ref, (x, w, gate_up, down)):
        assert g.shape == g_ref.shape and g.dtype == leaf.dtype, name
        assert rel_err(g.cpu(), g_ref) <= tol, name


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_float64_reference(case, dtype):
    check_against_reference(case, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", [MULTI_TILE, MANY_EXPERTS], ids=lambda c: c.name)
def test_larger_grids_match_float64_reference(case, dtype):
    check_against_reference(case, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gelu_matches_float64_reference(dtype):
    check_against_reference(CASES[0], dtype, activation="gelu")


@pytest.mark.parametrize("case", [CASES[0], CASES[4]], ids=lambda c: c.name)
def test_bitwise_deterministic(case):
    x, idx, w, gate_up, down = case.make(torch.bfloat16, device=DEVICE)
    dy = torch.randn(case.T, case.H, dtype=torch.float64)
    y1, g1 = run_with_grads(triton_experts, x, idx, w, gate_up, down, dy)
    y2, g2 = run_with_grads(triton_experts, x, idx, w, gate_up, down, dy)
    assert torch.equal(y1, y2)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


def test_empty_expert_gets_exactly_zero_weight_gradient():
    case = CASES[4]
    x, idx, w, gate_up, down = case.make(torch.float32, device=DEVICE)
    _, (_, _, d_gate_up, d_down) = run_with_grads(
        triton_experts, x, idx, w, gate_up, down, torch.randn(case.T, case.H)
    )
    assert torch.count_nonzero(d_gate_up[-1]) == 0 and torch.count_nonzero(d_down[-1]) == 0


def test_opcheck_forward_and_backward_registration():
    x, idx, w, gate_up, down = CASES[1].make(torch.float32, device=DEVICE)
    args = (x.requires_grad_(), idx, w.requires_grad_(), gate_up.requires_grad_(), down.requires_grad_(), "silu", 64)
    torch.library.opcheck(experts_triton_fwd, args)


def test_torch_compile_sees_forward_and_backward():
    case = CASES[1]
    x, idx, w, gate_up, down = case.make(torch.float32, device=DEVICE)
    dy = torch.randn(case.T, case.H, dtype=torch.float64)
    compiled = torch.compile(triton_experts, backend="aot_eager", fullgraph=True)
    y, grads = run_with_grads(compiled, x, idx, w, gate_up, down, dy)
    y_ref, grads_ref = run_with_grads(moe_experts_ref, *(t.cpu() for t in (x, idx, w, gate_up, down)), dy)
    assert rel_err(y.cpu(), y_ref) <= 1e-5
    assert all(rel_err(g.cpu(), g_ref) <= 1e-5 for g, g_ref in zip(grads, grads_ref))


def test_launcher_errors_name_the_argument():
    case = CASES[1]
    x, idx, w, gate_up, down = case.make(torch.float32, device=DEVICE)
    meta = routing_metadata(idx, case.E, 64)
    with pytest.raises(ValueError, match="activation must be one of .* got 'relu'"):
        gg.gather_glu(x, gate_up, meta, case.K, "relu")
    with pytest.raises(ValueError, match=r"gate_up_E2IH must be a torch.float32 tensor of shape"):
        gg.gather_glu(x, gate_up.half(), meta, case.K, "silu")
    with pytest.raises(ValueError, match="gate_up_E2IH must be contiguous"):
        gg.gather_glu(x, gate_up.transpose(1, 2).contiguous().transpose(1, 2), meta, case.K, "silu")
    with pytest.raises(ValueError, match="w_layout must be 'nk' or 'kn', got 'nn'"):
        gg.rows_matmul(x, down, meta, w_layout="nn")
    with pytest.raises(TypeError, match="rows_PH must be float32, float16 or bfloat16, got torch.int32"):
        gg.combine(torch.zeros(4, 4, dtype=torch.int32, device=DEVICE), meta, case.T, case.K)


def test_aot_specs_cover_every_launchable_config():
    names = [s.name for s in gg.aot_specs()]
    assert len(names) == len(set(names))
    for family in gg.CONFIGS:
        for kernel in gg.GEMM_KERNELS:
            for dtype, ty in ((torch.bfloat16, "bf16"), (torch.float16, "fp16"), (torch.float32, "fp32")):
                for aligned in (True, False):
                    for c in gg.configs_for(kernel, dtype, family, aligned=aligned):
                        assert any(n.startswith(kernel) and f"_{ty}_{family}_{c}_{'' if aligned else 'un'}aligned" in n
                                   for n in names), (kernel, ty, c, aligned)
    for family in gg.CONFIGS:
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            for pad_m in (64, 128):
                for kernel in gg.GEMM_KERNELS:
                    assert gg.configs_for(kernel, dtype, family, pad_m), (kernel, dtype, pad_m)


@requires_cuda
def test_no_host_sync_on_cuda():
    x, idx, w, gate_up, down = CASES[0].make(torch.bfloat16, device="cuda")
    leaves = [t.requires_grad_() for t in (x, w, gate_up, down)]
    dy = torch.randn_like(x)

    def step():
        y = triton_experts(leaves[0], idx, leaves[1], leaves[2], leaves[3])
        return torch.autograd.grad(y, leaves, dy)

    step()  # the first call may autotune, which times kernels and so synchronises
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
