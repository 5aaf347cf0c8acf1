"""moe_experts on both backends against the float64 reference: torch (one sort and
torch._grouped_mm, on the CPU and, when there is one, on the GPU, where its grouped matmuls run
other kernels) and triton (the fused kernels, under TRITON_INTERPRET=1 on the CPU). Every routing
case and dtype with every gradient, larger grids, GeGLU and half routing weights; bitwise
determinism, an empty expert's exact zero gradient; the custom ops' registration (opcheck,
torch.compile), no gradient built for what the forward only saves, tensors on another GPU, no
host sync on CUDA."""

import pytest
import torch
from torch._library.custom_ops import _maybe_get_opdef
from torch.utils._python_dispatch import TorchDispatchMode

import moe_ep
from markers import requires_cuda
from moe_cases import CASES, Case, run_with_grads
from moe_ep.kernels import autotune
from moe_ep.kernels.grouped_gemm import routing_block
from moe_ep.ops.experts_torch import experts_torch_fwd
from moe_ep.ops.experts_triton import experts_triton_fwd
from moe_ep.ops import selector
from moe_ep.ops.reference import moe_experts_ref
from numerics import TOLERANCE, rel_err

# The numbers, not the selector's measurement (conftest.py).
pytestmark = pytest.mark.usefixtures("no_selector_measurement")

BACKENDS = ["torch", "triton"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (backend, device): the torch backend also on the CPU when there is a GPU.
PLACES = [("torch", "cpu")] + ([("torch", "cuda")] if DEVICE == "cuda" else []) + [("triton", DEVICE)]
GRAD_NAMES = ["hidden_states", "top_k_weights", "gate_up_proj", "down_proj"]
# Two row blocks per expert, several reduction steps and column tiles, ragged edges.
MULTI_TILE = Case("multi_tile", T=70, H=72, I=72, E=2, K=2)
# More experts than one metadata tile and more row blocks than one GEMM program group.
MANY_EXPERTS = Case("many_experts", T=40, H=16, I=8, E=20, K=3)
ZERO_FILLS = {"aten.zeros.default", "aten.zeros_like.default", "aten.new_zeros.default", "aten.zero_.default",
              "aten.fill_.Scalar"}
ALLOCATIONS = {"aten.empty.memory_format", "aten.empty_like.default", "aten.new_empty.default",
               "aten.empty_strided.default", "aten.new_empty_strided.default"} | ZERO_FILLS


def experts(backend: str, activation: str = "silu"):
    return lambda x, idx, w, gate_up, down: moe_ep.moe_experts(x, idx, w, gate_up, down, activation=activation,
                                                               backend=backend)


def check_against_reference(backend, device, case, dtype, *, activation="silu", weights_dtype=torch.float32):
    x, idx, w, gate_up, down = case.make(dtype, device=device, weights_dtype=weights_dtype)
    dy = torch.randn(case.T, case.H, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y, grads = run_with_grads(experts(backend, activation), x, idx, w, gate_up, down, dy)
    y_ref, grads_ref = run_with_grads(
        lambda *a: moe_experts_ref(*a, activation=activation), *(t.cpu() for t in (x, idx, w, gate_up, down)), dy
    )
    assert y.dtype == dtype and y.shape == (case.T, case.H) and y.device.type == device
    tol = TOLERANCE[dtype]
    assert rel_err(y.cpu(), y_ref) <= tol, "output"
    for name, g, g_ref, leaf in zip(GRAD_NAMES, grads, grads_ref, (x, w, gate_up, down)):
        assert g.shape == g_ref.shape and g.dtype == leaf.dtype, name
        assert rel_err(g.cpu(), g_ref) <= tol, name


@pytest.mark.slow
@pytest.mark.parametrize("backend, device", PLACES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_float64_reference(case, dtype, backend, device):
    check_against_reference(backend, device, case, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", [MULTI_TILE, MANY_EXPERTS], ids=lambda c: c.name)
def test_larger_grids_match_float64_reference(case, dtype, backend):
    check_against_reference(backend, DEVICE, case, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gelu_matches_float64_reference(dtype, backend):
    check_against_reference(backend, DEVICE, CASES[0], dtype, activation="gelu")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=lambda c: c.name)
def test_half_routing_weights_match_float64_reference(case, dtype, backend):
    check_against_reference(backend, DEVICE, case, dtype, weights_dtype=dtype)


@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_torch_backend_in_row_blocks_matches_float64_and_one_block(dtype, activation, monkeypatch):
    """The torch backend's gated activation, routing weight and combine make their float32
    temporaries a block of rows at a time: with blocks of 3 rows (the last one ragged) it still
    matches float64, and the one-block run bit for bit (each row's arithmetic does not depend on
    the block)."""
    from moe_ep.ops import activations

    case = MULTI_TILE
    check_against_reference("torch", "cpu", case, dtype, activation=activation)
    x, idx, w, gate_up, down = case.make(dtype)
    dy = torch.randn(case.T, case.H, dtype=torch.float64)
    one_block = run_with_grads(experts("torch", activation), x, idx, w, gate_up, down, dy)
    monkeypatch.setattr(activations, "CHUNK_ELEMENTS", 3 * 2 * case.I)
    assert len(activations.row_blocks(case.T * case.K, 2 * case.I)) == -(-case.T * case.K // 3) > 1
    check_against_reference("torch", "cpu", case, dtype, activation=activation)
    y, grads = run_with_grads(experts("torch", activation), x, idx, w, gate_up, down, dy)
    assert torch.equal(y, one_block[0]) and all(torch.equal(a, b) for a, b in zip(grads, one_block[1]))


@pytest.mark.slow
@pytest.mark.parametrize("backend, device", PLACES)
@pytest.mark.parametrize("case", [CASES[0], CASES[4]], ids=lambda c: c.name)
def test_bitwise_deterministic(case, backend, device):
    x, idx, w, gate_up, down = case.make(torch.bfloat16, device=device)
    dy = torch.randn(case.T, case.H, dtype=torch.float64)
    y1, g1 = run_with_grads(experts(backend), x, idx, w, gate_up, down, dy)
    y2, g2 = run_with_grads(experts(backend), x, idx, w, gate_up, down, dy)
    assert torch.equal(y1, y2)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_expert_gets_exactly_zero_weight_gradient(backend):
    case = CASES[4]
    x, idx, w, gate_up, down = case.make(torch.float32, device=DEVICE)
    _, (_, _, d_gate_up, d_down) = run_with_grads(experts(backend), x, idx, w, gate_up, down,
                                                  torch.randn(case.T, case.H))
    assert torch.count_nonzero(d_gate_up[-1]) == 0 and torch.count_nonzero(d_down[-1]) == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("width", ["H", "I"])
def test_an_empty_width_gives_zeros_on_both_backends(backend, width, monkeypatch, tmp_path):
    """H or I of 0 (degenerate, but valid shapes): zero outputs and zero gradients of the right
    shapes, on the grouped GEMM too, whose strides must stay 16-byte aligned. The selector's first
    call measures the degenerate problem too (a fresh cache)."""
    monkeypatch.setenv(autotune.ENV_VAR, "1")
    monkeypatch.setenv(selector.CACHE_ENV_VAR, str(tmp_path / "cache"))
    selector.clear()
    case = Case("empty_width", T=6, H=0 if width == "H" else 8, I=0 if width == "I" else 8, E=3, K=2)
    x, idx, w, gate_up, down = case.make(torch.float32, device=DEVICE)
    y, grads = run_with_grads(experts(backend), x, idx, w, gate_up, down, torch.randn(case.T, case.H))
    assert y.shape == (case.T, case.H) and torch.count_nonzero(y) == 0
    for g, leaf in zip(grads, (x, w, gate_up, down)):
        assert g.shape == leaf.shape and torch.count_nonzero(g) == 0
    assert len(selector.decisions()) == (backend == "triton")
    selector.clear()


def _forward_op(backend, x, idx, w, gate_up, down):
    """The backend's forward custom op and its arguments."""
    if backend == "torch":
        return experts_torch_fwd, (x, idx, w, gate_up, down, "silu")
    return experts_triton_fwd, (x, idx, w, gate_up, down, "silu", routing_block(idx.numel(), gate_up.shape[0]))


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck_forward_and_backward_registration(backend):
    x, idx, w, gate_up, down = CASES[1].make(torch.float32, device=DEVICE)
    op, args = _forward_op(backend, x.requires_grad_(), idx, w.requires_grad_(), gate_up.requires_grad_(),
                           down.requires_grad_())
    # opcheck compares every output of the op, the saved GEMM-1 output too, after a backward: the
    # backward that writes its gradient over it (eager only) would differ from the traced one.
    with moe_ep.ops.repeatable_backward():
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_writes_its_gemm1_gradient_over_the_saved_output(backend):
    """The backward makes no second [rows, 2I] buffer beside the saved GEMM-1 output: it writes
    that output's gradient over it. Under repeatable_backward it makes one and keeps the output."""
    x, idx, w, gate_up, down = (t.requires_grad_() if t.is_floating_point() else t
                                for t in CASES[0].make(torch.float32, device=DEVICE))
    op, args = _forward_op(backend, x, idx, w, gate_up, down)
    made = {}
    for repeatable in (False, True):
        with moe_ep.ops.repeatable_backward(repeatable):
            outputs = op(*args)
        gemm1_out = outputs[-1].clone()
        with _Made(ALLOCATIONS) as allocations:
            outputs[0].sum().backward()
        made[repeatable] = allocations.shapes.count(tuple(gemm1_out.shape))
        assert torch.equal(outputs[-1], gemm1_out) == repeatable
    assert made == {False: 0, True: 1}, made


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_second_backward_over_one_forward_says_to_use_repeatable_backward(backend):
    x, idx, w, gate_up, down = CASES[0].make(torch.float32, device=DEVICE)
    leaves = [t.requires_grad_() for t in (x, w, gate_up, down)]
    # The setting is process-wide (a ZB-V pipeline built by another test sets it): set here.
    with moe_ep.ops.repeatable_backward(False):
        y = experts(backend)(x, idx, w, gate_up, down)
        with moe_ep.ops.repeatable_backward():
            y_kept = experts(backend)(x, idx, w, gate_up, down)
        assert not moe_ep.ops.set_repeatable_backward(False), "the inner block restores the setting"
    dy = torch.randn_like(y)
    first = torch.autograd.grad(y, leaves, dy, retain_graph=True)
    with pytest.raises(RuntimeError, match=r"moe_ep\.ops\.repeatable_backward\(\)"):
        torch.autograd.grad(y, leaves, dy)
    twice = [torch.autograd.grad(y_kept, leaves, dy, retain_graph=True) for _ in range(2)]
    # Bitwise: the same kernels on the same inputs, whether or not the gradient goes over the output.
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(first, *twice))


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_compile_sees_forward_and_backward(backend):
    case = CASES[1]
    x, idx, w, gate_up, down = case.make(torch.float32, device=DEVICE)
    dy = torch.randn(case.T, case.H, dtype=torch.float64)
    compiled = torch.compile(experts(backend), backend="aot_eager", fullgraph=True)
    y, grads = run_with_grads(compiled, x, idx, w, gate_up, down, dy)
    y_ref, grads_ref = run_with_grads(moe_experts_ref, *(t.cpu() for t in (x, idx, w, gate_up, down)), dy)
    assert rel_err(y.cpu(), y_ref) <= TOLERANCE[torch.float32]
    assert all(rel_err(g.cpu(), g_ref) <= TOLERANCE[torch.float32] for g, g_ref in zip(grads, grads_ref))


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_pinned_backend_compiles_once_for_every_token_count(backend):
    """torch.compile(dynamic=True): reading the selector's token bucket for a pinned backend
    specialised the token count, one graph per count until the recompile limit."""
    import torch._dynamo

    for case in (c for c in CASES if c.name in ("odd", "one_expert")):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        compiled = torch.compile(experts(backend), backend="aot_eager", fullgraph=True, dynamic=True)
        x, idx, w, gate_up, down = case.make(torch.float32, device=DEVICE)
        y_ref = moe_experts_ref(*(t.cpu() for t in (x, idx, w, gate_up, down)))
        for T in (3, 5, 7, 11):
            got = compiled(x[:T], idx[:T], w[:T], gate_up, down)
            assert rel_err(got.cpu(), y_ref[:T]) <= TOLERANCE[torch.float32]
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1, case.name


@pytest.mark.parametrize("name", ["odd", "odd_unaligned"])
def test_the_torch_backward_gives_dense_gradients_as_its_fake_says(name):
    """Odd sizes pad the grouped GEMMs' operands; the gradients handed back must still be dense,
    as the fake implementation says, or an inductor-compiled graph around the op fails its
    stride assertion (found compiling a decoder block with the op inside)."""
    case = next(c for c in CASES if c.name == name)
    x, idx, w, gate_up, down = case.make(torch.float32, device=DEVICE)
    y, order, offsets, gate_up_out = experts_torch_fwd(x, idx, w, gate_up, down, "silu")
    grads = torch.ops.moe_ep.experts_torch_bwd(torch.randn_like(y), x, w, gate_up, down, order, offsets, gate_up_out,
                                                "silu")
    assert all(g.is_contiguous() for g in grads), [g.stride() for g in grads]


class _Made(TorchDispatchMode):
    """Shapes of the tensors the ops named in ``funcs`` made while active, inside moe_ep's custom
    ops too."""

    def __init__(self, funcs: set[str]):
        super().__init__()
        self.funcs = funcs
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        opdef = _maybe_get_opdef(func) if func.namespace == "moe_ep" else None
        if opdef is not None:
            with self:  # the op's Python body, under this mode
                return opdef._init_fn(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        if str(func) in self.funcs and isinstance(out, torch.Tensor):
            self.shapes.append(tuple(out.shape))
        return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_fills_no_gradient_for_saved_outputs(backend):
    """The forward ops also return what backward needs (routing metadata, the GEMM-1 output); only
    y is differentiated, so autograd must not allocate and zero a gradient for the others (for
    GEMM 1's output at Mixtral's shapes that would be gigabytes per layer)."""
    x, idx, w, gate_up, down = (t.requires_grad_() if t.is_floating_point() else t
                                for t in CASES[0].make(torch.float32, device=DEVICE))
    op, args = _forward_op(backend, x, idx, w, gate_up, down)
    outputs = op(*args)
    with _Made(ZERO_FILLS) as fills:
        outputs[0].sum().backward()
    saved_shapes = {tuple(t.shape) for t in outputs[1:]}
    assert not saved_shapes & set(fills.shapes), fills.shapes


def test_backend_env_var(monkeypatch):
    x, idx, w, gate_up, down = CASES[0].make(torch.float32)
    monkeypatch.setenv("MOE_EP_BACKEND", "nonsense")
    with pytest.raises(ValueError, match="MOE_EP_BACKEND"):
        moe_ep.moe_experts(x, idx, w, gate_up, down)
    monkeypatch.setenv("MOE_EP_BACKEND", "torch")
    assert moe_ep.moe_experts(x, idx, w, gate_up, down).shape == x.shape


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("backend", BACKENDS)
def test_tensors_on_another_gpu_than_the_current_one(backend):
    """Triton launches on the current device; the launchers must switch to the tensors' one."""
    case = CASES[0]
    x, idx, w, gate_up, down = case.make(torch.bfloat16, device="cuda:1")
    dy = torch.randn(case.T, case.H, dtype=torch.float64)
    with torch.cuda.device(0):
        y, grads = run_with_grads(experts(backend), x, idx, w, gate_up, down, dy)
        _, weights, _ = moe_ep.route_topk(x, gate_up[:, 0, :].contiguous(), 2, backend=backend)
    y_ref, grads_ref = run_with_grads(moe_experts_ref, *(t.cpu() for t in (x, idx, w, gate_up, down)), dy)
    assert y.device == torch.device("cuda:1") and weights.device == torch.device("cuda:1")
    assert rel_err(y.cpu(), y_ref) <= TOLERANCE[torch.bfloat16]
    assert all(rel_err(g.cpu(), g_ref) <= TOLERANCE[torch.bfloat16] for g, g_ref in zip(grads, grads_ref))


@requires_cuda
def test_triton_backend_has_no_host_sync_on_cuda():
    x, idx, w, gate_up, down = CASES[0].make(torch.bfloat16, device="cuda")
    leaves = [t.requires_grad_() for t in (x, w, gate_up, down)]
    dy = torch.randn_like(x)

    def step():
        y = experts("triton")(leaves[0], idx, leaves[1], leaves[2], leaves[3])
        return torch.autograd.grad(y, leaves, dy)

    run_twice_second_without_sync(step)


def run_twice_second_without_sync(step) -> None:
    """``step()`` twice: the first call may decide and autotune, which times kernels and so
    synchronises; the second runs under ``set_sync_debug_mode("error")``, where any sync raises."""
    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@requires_cuda
def test_auto_and_its_stage_choices_have_no_host_sync_on_cuda(tmp_path, monkeypatch):
    """backend="auto" on whatever GPU is lent, with timing on: its first call decides (and may
    sync); every later call, whichever path and per-stage candidates it chose (PyTorch's grouped
    GEMM only where that is sync-free), makes none. On sm_80 neither the grouped-GEMM path nor
    the candidate may have been chosen."""
    from moe_ep.kernels import autotune
    from moe_ep.kernels.library import Library, grouped_mm_sync_free
    from moe_ep.ops import selector

    monkeypatch.setenv(selector.CACHE_ENV_VAR, str(tmp_path))
    monkeypatch.setenv(autotune.ENV_VAR, "1")
    selector.clear()
    case = Case("fine", T=512, H=256, I=128, E=16, K=8)
    x, idx, w, gate_up, down = case.make(torch.bfloat16, device="cuda")
    leaves = [t.requires_grad_() for t in (x, w, gate_up, down)]
    dy = torch.randn_like(x)

    def step():
        y = experts("auto")(leaves[0], idx, leaves[1], leaves[2], leaves[3])
        return torch.autograd.grad(y, leaves, dy)

    run_twice_second_without_sync(step)
    arch = autotune.device_arch(x.device)
    if not grouped_mm_sync_free(arch, torch.bfloat16):
        (table,) = selector.decisions().values()
        assert set(table.paths.values()) == {"triton"} and all(set(t) == {"triton"} for t in table.times.values())
        assert not any(isinstance(c, Library) for c in autotune.chosen_configs().values())
    selector.clear()


def _without_experts(case: Case, dtype, seed: int):
    """``case``'s routing in the dispatcher's received-row form: a random third of the slots, and
    every slot of row 1, hold ``E`` (no expert); and the same routing as the reference sees it
    (expert 0 with weight 0 in those slots)."""
    x, idx, w, gate_up, down = case.make(dtype, device=DEVICE)
    empty = torch.rand(case.T, case.K, generator=torch.Generator().manual_seed(seed)) < 1 / 3
    empty[min(1, case.T - 1)] = True
    idx = torch.where(empty.to(idx.device), case.E, idx)
    return x, idx, w, gate_up, down, empty


# Every bound in float32; bf16, whose path differs only in its rounding, with the exact one.
SLOT_BOUNDS = [(bound, torch.float32) for bound in ("exact", "loose", "every_slot")] + [("exact", torch.bfloat16)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[3], MANY_EXPERTS], ids=lambda c: c.name)
@pytest.mark.parametrize("bound, dtype", SLOT_BOUNDS, ids=lambda v: str(v).removeprefix("torch."))
def test_slots_without_an_expert_add_nothing(case, dtype, backend, bound):
    """``run_experts`` with ``num_routed``: slots holding ``E`` add nothing to their row and get a
    zero weight gradient, a row with no expert at all comes out zero, with ``num_routed`` the exact
    number of routed slots, a bound above it (the capacity mode's) or every slot, against float64."""
    from moe_ep.ops.experts import run_experts

    x, idx, w, gate_up, down, empty = _without_experts(case, dtype, seed=case.T)
    routed = {"exact": int((~empty).sum()), "loose": int((~empty).sum()) + 7, "every_slot": empty.numel()}[bound]
    dy = torch.randn(case.T, case.H, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y, grads = run_with_grads(lambda *a: run_experts(*a, "silu", backend, None, routed), x, idx, w, gate_up, down, dy)
    kept = (~empty).double()
    y_ref, grads_ref = run_with_grads(
        lambda xx, ii, ww, gu, dd: moe_experts_ref(xx, ii, ww * kept, gu, dd),
        *(t.cpu() for t in (x, torch.where(empty, 0, idx.cpu()), w, gate_up, down)), dy)
    tol = TOLERANCE[dtype]
    assert torch.count_nonzero(y[1]) == 0
    assert rel_err(y.cpu(), y_ref) <= tol, "output"
    for name, g, g_ref in zip(GRAD_NAMES, grads, grads_ref):
        assert rel_err(g.cpu(), g_ref) <= tol, name
    assert torch.count_nonzero(grads[1][empty.to(grads[1].device)]) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_routed_slot_at_all(backend):
    """Every slot empty (``num_routed`` 0): zero output and zero gradients, on both backends."""
    from moe_ep.ops.experts import run_experts

    case = CASES[0]
    x, idx, w, gate_up, down = case.make(torch.float32, device=DEVICE)
    idx = torch.full_like(idx, case.E)
    y, grads = run_with_grads(lambda *a: run_experts(*a, "silu", backend, None, 0), x, idx, w, gate_up, down,
                              torch.randn(case.T, case.H))
    assert torch.count_nonzero(y) == 0 and all(torch.count_nonzero(g) == 0 for g in grads)


def _stored(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``t``'s values in another memory layout: ``"expert_inner"`` (the expert dimension
    innermost), ``"column_slice"`` (the first columns of a wider buffer: a row stride that is
    not a multiple of 16 bytes)."""
    if layout == "expert_inner":
        return t.permute(2, 1, 0).contiguous().permute(2, 1, 0)
    return torch.cat([t, t[..., :2]], dim=-1)[..., : t.shape[-1]]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["expert_inner", "column_slice"])
def test_expert_weights_of_any_strides_match_float64_reference(backend, layout):
    case = Case("strided", T=7, H=24, I=40, E=3, K=2)
    x, idx, w, gate_up, down = case.make(torch.float32, device=DEVICE)
    dy = torch.randn(case.T, case.H, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y, grads = run_with_grads(lambda x, idx, w, gu, dn: experts(backend)(x, idx, w, _stored(gu, layout),
                                                                           _stored(dn, layout)),
                              x, idx, w, gate_up, down, dy)
    y_ref, grads_ref = run_with_grads(moe_experts_ref, *(t.cpu() for t in (x, idx, w, gate_up, down)), dy)
    assert rel_err(y.cpu(), y_ref) <= TOLERANCE[torch.float32], "output"
    for name, g, g_ref in zip(GRAD_NAMES, grads, grads_ref):
        assert rel_err(g.cpu(), g_ref) <= TOLERANCE[torch.float32], name
