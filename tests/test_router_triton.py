"""The fused Triton router (moe_ep.kernels.router behind moe_ep.routing_triton) and the torch
router against the float64 reference: logits, weights, exact indices and the gradients of x and
W, for Mixtral's softmax router and DeepSeek-V3's sigmoid / bias / group-limited router. Runs
under the Triton interpreter without CUDA, on the GPU with it."""

from dataclasses import dataclass, field

import pytest
import torch

from markers import requires_cuda
from numerics import TOLERANCE, rel_err
from moe_ep.ops.reference import route_topk_ref
from moe_ep.ops.routing import route_topk
import moe_ep.ops.routing_triton  # noqa: F401  (registers torch.ops.moe_ep.route_topk, whatever ran before)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@dataclass(frozen=True)
class RouterCase:
    name: str
    T: int
    H: int
    E: int
    K: int
    options: dict = field(default_factory=dict)  # score, normalize, n_group, topk_group, scale
    bias: bool = False  # a correction bias, large enough to change the choice

    def kwargs(self, device):
        kw = dict(self.options)
        if self.bias:
            g = torch.Generator().manual_seed(1)
            kw["correction_bias"] = (torch.rand(self.E, generator=g) * 0.5).to(device)
        return kw


CASES = [
    RouterCase("mixtral", T=37, H=24, E=8, K=2),
    RouterCase("odd_h_odd_e", T=29, H=17, E=5, K=3),
    RouterCase("no_renorm", T=21, H=16, E=8, K=2, options=dict(normalize=False)),
    RouterCase("k1", T=19, H=32, E=4, K=1),
    RouterCase("k_eq_e", T=13, H=16, E=6, K=6),
    RouterCase("sigmoid", T=23, H=20, E=8, K=2, options=dict(score="sigmoid", normalize=False, scale=1.5)),
    RouterCase(
        "deepseek_groups", T=31, H=24, E=16, K=4, bias=True,
        options=dict(score="sigmoid", n_group=4, topk_group=2, scale=2.5),
    ),
    RouterCase("e64_groups", T=9, H=40, E=64, K=6, bias=True, options=dict(score="sigmoid", n_group=8, topk_group=3)),
    RouterCase("t1", T=1, H=16, E=8, K=2),
    RouterCase("t0", T=0, H=16, E=8, K=2),
]
GROUPS_OF_ONE = RouterCase("groups_of_one", T=17, H=16, E=8, K=3, options=dict(n_group=8, topk_group=3))
DEEPSEEK_V3 = RouterCase(
    "deepseek_v3_e256", T=5, H=32, E=256, K=8, bias=True,
    options=dict(score="sigmoid", n_group=8, topk_group=4, scale=2.5),
)


def well_separated(x, w, case, kwargs, gap):
    """Rows whose choice has no near-tie at any position that decides the indices (float64)."""
    logits = x.double() @ w.double().t()
    probs = logits.softmax(-1) if kwargs.get("score", "softmax") == "softmax" else logits.sigmoid()
    choice = probs if "correction_bias" not in kwargs else probs + kwargs["correction_bias"].double().cpu()
    ok = torch.ones(x.shape[0], dtype=torch.bool)
    n_group, topk_group = kwargs.get("n_group", 1), kwargs.get("topk_group", 1)
    if n_group > 1:
        grouped = choice.view(x.shape[0], n_group, -1)
        group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        ranked = group_score.sort(-1, descending=True).values
        if topk_group < n_group:
            ok &= ranked[:, topk_group - 1] - ranked[:, topk_group] > gap
        keep = group_score >= ranked[:, topk_group - 1 : topk_group]
        choice = choice.masked_fill(~keep.repeat_interleave(case.E // n_group, dim=1), float("-inf"))
    ranked = choice.sort(-1, descending=True).values
    for j in range(min(case.K, case.E - 1)):
        ok &= ranked[:, j] - ranked[:, j + 1] > gap
    return ok


def make_inputs(case, dtype, device=DEVICE, seed=0, gap=1e-3):
    """x_TH, W_EH in ``dtype`` whose T rows are drawn from more candidates, keeping only rows
    without near-ties, so that every correct router must pick exactly the reference's experts."""
    g = torch.Generator().manual_seed(seed)
    kwargs = case.kwargs("cpu")
    w = (torch.randn(case.E, case.H, generator=g) * 2 / case.H**0.5).to(dtype)
    x = torch.randn(max(64 * case.T, 256), case.H, generator=g).to(dtype)
    keep = well_separated(x, w, case, kwargs, gap).nonzero().flatten()[: case.T]
    assert keep.numel() == case.T, f"only {keep.numel()} well-separated rows for {case.name}"
    return x[keep].to(device), w.to(device), case.kwargs(device)


def reference(x, w, k, **kwargs):
    """route_topk_ref on the CPU in float64."""
    kwargs = {n: v.cpu() if torch.is_tensor(v) else v for n, v in kwargs.items()}
    return route_topk_ref(x.cpu().double(), w.cpu().double(), k, **kwargs)


def backend_fn(backend):
    if backend == "reference":
        return reference
    return lambda *a, **kw: route_topk(*a, backend=backend, **kw)


def run_router(x, w, k, kwargs, backend):
    """Route, then a loss touching weights and logits with random coefficients (the logits term
    plays an auxiliary / z loss), and backward. Returns outputs and the gradients of x and W."""
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    logits, weights, indices = backend_fn(backend)(x, w, k, **kwargs)
    g = torch.Generator().manual_seed(7)
    c_w = torch.randn(weights.shape, generator=g, dtype=torch.float64).to(weights.device)
    c_l = torch.randn(logits.shape, generator=g, dtype=torch.float64).to(logits.device)
    loss = (weights.double() * c_w).sum() + 0.1 * (logits.double() * c_l).sum()
    loss.backward()
    return logits, weights, indices, x.grad, w.grad


def check_against(case, dtype, backend, router_dtype=None):
    """``router_dtype``: the router weight's dtype when it differs from the hidden states'."""
    x, w, kwargs = make_inputs(case, dtype)
    w = w.to(router_dtype or dtype)
    logits, weights, indices, dx, dw = run_router(x, w, case.K, kwargs, backend)
    ref = run_router(x.double(), w.double(), case.K, kwargs, "reference")
    assert logits.dtype == torch.float32 and weights.dtype == torch.float32 and indices.dtype == torch.int64
    assert logits.shape == (case.T, case.E) and weights.shape == indices.shape == (case.T, case.K)
    assert dx.dtype == x.dtype and dw.dtype == w.dtype
    assert torch.equal(indices.cpu(), ref[2].cpu())
    # Promoted to the wider dtype, the outputs are that dtype's; each gradient lands in its own.
    tol = TOLERANCE[torch.promote_types(x.dtype, w.dtype)]
    got = dict(logits=logits, weights=weights, grad_x=dx, grad_w=dw)
    want = dict(logits=ref[0], weights=ref[1], grad_x=ref[3], grad_w=ref[4])
    tols = dict(logits=tol, weights=tol, grad_x=max(tol, TOLERANCE[x.dtype]), grad_w=max(tol, TOLERANCE[w.dtype]))
    for name in got:
        err = rel_err(got[name].cpu(), want[name].cpu())
        assert err <= tols[name], f"{name}: relative error {err:.2e} > {tols[name]:.0e}"


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_triton_router_matches_reference(case, dtype):
    check_against(case, dtype, "triton")


def test_triton_router_deepseek_v3_shape():
    """256 experts in 8 groups, top-4 groups, top-8 experts: the widest tile the kernel has."""
    check_against(DEEPSEEK_V3, torch.bfloat16, "triton")


def test_triton_router_groups_of_one_expert():
    check_against(GROUPS_OF_ONE, torch.float32, "triton")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_float32_router_over_bfloat16_hidden_states(backend):
    """Mixed dtypes promote to float32 on both backends, the same experts are chosen, and each
    gradient comes back in its input's dtype."""
    check_against(CASES[6], torch.bfloat16, backend, router_dtype=torch.float32)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_an_enclosing_autocast_leaves_the_routing_in_float32(backend):
    """Under torch.autocast the torch backend's logits GEMM ran in bf16 (42 of 4096 tokens routed
    otherwise than in float64): both backends give float32 logits and weights, and float64's
    choice."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(512, 64, generator=g), torch.randn(32, 64, generator=g)
    want_logits, want_weights, want_idx = route_topk_ref(x.double(), w.double(), 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, weights, idx = route_topk(x, w, 4, backend=backend)
    assert logits.dtype == weights.dtype == torch.float32
    assert torch.equal(idx, want_idx)
    assert rel_err(logits, want_logits) <= TOLERANCE[torch.float32]
    assert rel_err(weights, want_weights) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_torch_router_matches_reference(case, dtype):
    check_against(case, dtype, "torch")


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_ties_go_to_the_lowest_expert(backend):
    # Experts 1 and 3 (and 0 and 2) have identical weights: equal logits in every row.
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]], device=DEVICE)
    x = torch.tensor([[0.5, 2.0], [3.0, -1.0]], device=DEVICE)
    _, weights, indices = route_topk(x, w, 3, backend=backend)
    assert indices.tolist() == [[1, 3, 0], [0, 2, 1]]
    assert torch.allclose(weights[:, 0], weights[:, 1])


@pytest.mark.parametrize("options", [{}, dict(score="sigmoid", n_group=4, topk_group=2)], ids=["softmax", "groups"])
def test_both_backends_choose_alike_on_tied_scores(options):
    """Padding rows (all zeros: every score equal), a zero router and duplicated router rows tie
    experts, and groups; both backends take the lowest ids, in the same order."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 16, generator=g)
    x[::3] = 0
    w = torch.randn(16, 16, generator=g)
    w[9], w[12] = w[2], w[5]
    for router in (w, torch.zeros_like(w)):
        got = [route_topk(x.to(DEVICE), router.to(DEVICE), 4, backend=b, **options) for b in ("triton", "torch")]
        assert torch.equal(got[0][2], got[1][2])
        assert rel_err(got[0][1].cpu(), got[1][1].cpu()) <= TOLERANCE[torch.float32]
    zeros = route_topk(torch.zeros(2, 16, device=DEVICE), w.to(DEVICE), 4, backend="torch", **options)[2]
    assert zeros.tolist() == [[0, 1, 2, 3]] * 2


def test_gradient_through_logits_only_and_weights_only():
    """Either output alone carries the gradient; the other arrives as zeros."""
    case = CASES[0]
    x, w, _ = make_inputs(case, torch.float32)
    for use in ("logits", "weights"):
        grads = []
        for backend in ("triton", "reference"):
            xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
            logits, weights, _ = backend_fn(backend)(xx, ww, case.K)
            out = logits.logsumexp(-1).square() if use == "logits" else weights[:, :1] * 3
            out.sum().backward()
            grads.append((xx.grad, ww.grad))
        for got, want in zip(*grads):
            assert rel_err(got.cpu(), want.cpu()) <= TOLERANCE[torch.float32]


def test_t0_gives_empty_outputs_and_zero_weight_gradient():
    x = torch.randn(0, 16, device=DEVICE, requires_grad=True)
    w = torch.randn(8, 16, device=DEVICE, requires_grad=True)
    logits, weights, indices = route_topk(x, w, 2, backend="triton")
    assert logits.shape == (0, 8) and weights.shape == indices.shape == (0, 2)
    (weights.sum() + logits.sum()).backward()
    assert x.grad.shape == (0, 16) and torch.equal(w.grad, torch.zeros_like(w))


def test_two_runs_are_bitwise_equal():
    case = CASES[6]
    x, w, kwargs = make_inputs(case, torch.bfloat16)
    first = run_router(x, w, case.K, kwargs, "triton")
    second = run_router(x, w, case.K, kwargs, "triton")
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_torch_compile_traces_the_op_in_one_graph():
    case = CASES[6]
    x, w, kwargs = make_inputs(case, torch.float32)

    def step(x, w):
        logits, weights, indices = route_topk(x, w, case.K, backend="triton", **kwargs)
        return logits, weights, indices

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
    xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
    outs_c, outs_e = compiled(xc, wc), step(xe, we)
    for a, b in zip(outs_c, outs_e):
        assert torch.equal(a, b)
    (outs_c[1].square().sum() + outs_c[0].sum()).backward()
    (outs_e[1].square().sum() + outs_e[0].sum()).backward()
    assert torch.equal(xc.grad, xe.grad) and torch.equal(wc.grad, we.grad)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_float_defaults_trace_in_one_graph_under_dynamic_shapes(backend):
    """torch.compile(dynamic=True) makes a float argument left at its default (``scale``)
    symbolic: the argument checks trace on it, with no graph break and the eager results."""
    import torch._dynamo.testing

    case = CASES[0]
    x, w, _ = make_inputs(case, torch.float32)
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(lambda x, w: route_topk(x, w, case.K, backend=backend), backend=counter, dynamic=True)
    for a, b in zip(compiled(x, w), route_topk(x, w, case.K, backend=backend)):
        assert torch.equal(a, b)
    assert counter.frame_count == 1
    with pytest.raises(ValueError, match="scale must be a finite number"):
        torch.compile(lambda x, w: route_topk(x, w, case.K, scale=float("nan")), backend=counter, dynamic=True)(x, w)


def test_opcheck_fake_and_autograd_registration():
    case = CASES[6]
    x, w, kwargs = make_inputs(case, torch.float32)
    args = (x.requires_grad_(), w.requires_grad_(), case.K, "sigmoid", True, kwargs["correction_bias"], 4, 2, 2.5)
    torch.library.opcheck(torch.ops.moe_ep.route_topk.default, args)


def test_triton_router_rejects_too_many_experts():
    x = torch.randn(4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="router_weight.*256"):
        route_topk(x, torch.randn(257, 16, device=DEVICE), 2, backend="triton")


def test_auto_routes_more_than_256_experts_on_the_torch_path():
    """"auto" (the default on CUDA) takes the torch router where the Triton one cannot hold the
    scores: 384 experts, as the largest fine-grained models have."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(9, 16, generator=g).to(DEVICE), torch.randn(384, 16, generator=g).to(DEVICE)
    logits, weights, indices = route_topk(x, w, 8, backend="auto")
    want = route_topk_ref(x.double(), w.double(), 8)
    assert torch.equal(indices, want[2].to(indices.device))
    assert rel_err(weights.cpu(), want[1].cpu()) <= TOLERANCE[torch.float32]


@requires_cuda
def test_no_host_sync_on_cuda():
    case = CASES[6]
    x, w, kwargs = make_inputs(case, torch.bfloat16)
    run_router(x, w, case.K, kwargs, "triton")  # compile outside the checked region
    torch.cuda.set_sync_debug_mode("error")
    try:
        x = x.clone().requires_grad_()
        w = w.clone().requires_grad_()
        logits, weights, _ = route_topk(x, w, case.K, backend="triton", **kwargs)
        (weights.sum() + logits.sum()).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
