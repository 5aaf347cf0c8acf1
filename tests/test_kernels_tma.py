"""The sm_90 variants of the grouped GEMMs (TMA tensor descriptors for the operands that are not
gathered, persistent grids) against the float64 reference, under the interpreter on the CPU: the
configuration space is swapped for small tiles of those variants, so that programs loop over
several tiles, descriptors clip edge tiles, and padding rows are read unmasked."""

import pytest
import torch

from moe_ep.ops.experts import moe_experts
from moe_ep.kernels import autotune
from moe_ep.kernels import grouped_gemm as gg
from moe_ep.kernels.autotune import Config
from moe_ep.kernels.routing_metadata import routing_metadata
from moe_ep.ops.reference import moe_experts_ref

from numerics import TOLERANCE, rel_err
from moe_cases import CASES, Case, run_with_grads

# The numbers, not the selector's measurement (conftest.py).
pytestmark = pytest.mark.usefixtures("no_selector_measurement")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GRAD_NAMES = ["hidden_states", "top_k_weights", "gate_up_proj", "down_proj"]
# Sizes whose rows are 16-byte multiples in every dtype, so descriptors are used: ragged tiles in
# every dimension, several row blocks per expert, an empty expert.
ALIGNED = [
    Case("aligned", T=45, H=40, I=24, E=3, K=2),
    Case("aligned_k1_empty", T=30, H=24, I=40, E=4, K=1, routing="skip_last"),
    Case("aligned_k_eq_e", T=9, H=16, I=8, E=3, K=3),
]


def _spaces(aligned: list, unaligned: list) -> dict:
    space = {"half": aligned, "fp32": aligned, "half_unaligned": unaligned, "fp32_unaligned": unaligned}
    return {k: space for k in gg.GEMM_KERNELS}


def _small(tma: bool, persistent: bool) -> dict:
    return _spaces([Config(32, 16, 16, 4, 2, tma=tma, persistent=persistent)], [Config(32, 16, 16, 4, 2)])


@pytest.fixture
def variant(request, monkeypatch):
    tma, persistent = request.param
    monkeypatch.setitem(gg.CONFIGS, "default", _small(tma, persistent))
    autotune.clear_cache()
    yield tma, persistent
    autotune.clear_cache()


VARIANTS = [(True, True), (True, False), (False, True)]


def check(case, dtype, activation="silu"):
    x, idx, w, gate_up, down = case.make(dtype, device=DEVICE)
    dy = torch.randn(case.T, case.H, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    fn = lambda *a: moe_experts(*a, activation=activation, backend="triton")  # noqa: E731
    y, grads = run_with_grads(fn, x, idx, w, gate_up, down, dy)
    y_ref, grads_ref = run_with_grads(lambda *a: moe_experts_ref(*a, activation=activation),
                                      *(t.cpu() for t in (x, idx, w, gate_up, down)), dy)
    tol = TOLERANCE[dtype]
    assert rel_err(y.cpu(), y_ref) <= tol, "output"
    for name, g, g_ref in zip(GRAD_NAMES, grads, grads_ref):
        assert rel_err(g.cpu(), g_ref) <= tol, name
    return y, grads


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS, indirect=True, ids=lambda v: f"tma{int(v[0])}_persistent{int(v[1])}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ALIGNED, ids=lambda c: c.name)
def test_variants_match_float64_reference(variant, case, dtype):
    check(case, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("variant", [(True, True)], indirect=True, ids=["tma_persistent"])
def test_gelu_fp16_and_determinism(variant):
    case = ALIGNED[0]
    check(case, torch.float16, activation="gelu")
    y1, g1 = check(case, torch.bfloat16)
    y2, g2 = check(case, torch.bfloat16)
    assert torch.equal(y1, y2) and all(torch.equal(a, b) for a, b in zip(g1, g2))


@pytest.mark.slow
@pytest.mark.parametrize("case", [ALIGNED[0], CASES[1]], ids=lambda c: c.name)
def test_descriptors_only_where_rows_are_16_byte_aligned(case, monkeypatch):
    """Rows of 17 or 9 bf16 elements cannot be described: the launchers choose from the unaligned
    space (ALIGN 1) instead, and the results still match."""
    monkeypatch.setitem(gg.CONFIGS, "default", _spaces([Config(32, 16, 16, 4, 2, tma=True, persistent=True)],
                                                       [Config(32, 16, 16, 4, 2)]))
    autotune.clear_cache()
    check(case, torch.bfloat16)
    aligned = case in ALIGNED
    chosen = autotune.chosen_configs()
    assert chosen and all(c.tma == aligned for c in chosen.values()), chosen
    # The alignment is part of each key: it selects the space and the kernels' ALIGN.
    assert all(key[1][-1] == (8 if aligned else 1) for key in chosen), list(chosen)
    autotune.clear_cache()


def test_row_align():
    assert gg.row_align(torch.bfloat16, 4096, 14336) == 8 and gg.row_align(torch.float32, 4096, 12) == 4
    assert gg.row_align(torch.bfloat16, 4096, 14340) == 1 and gg.row_align(torch.float32, 4097) == 1


def test_every_space_has_a_pointer_load_configuration_for_every_pad_m():
    for family in gg.CONFIGS:
        for kernel in gg.GEMM_KERNELS:
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                for pad_m in (64, 128):
                    unaligned = gg.configs_for(kernel, dtype, family, pad_m, aligned=False)
                    assert unaligned and not any(c.tma for c in unaligned), (family, kernel, dtype, pad_m)
                    assert gg.configs_for(kernel, dtype, family, pad_m), (family, kernel, dtype, pad_m)


def test_operands_at_unaligned_addresses_are_copied_not_misread(monkeypatch):
    """The kernels are compiled for 16-byte aligned base pointers: the launchers pass an aligned
    copy of a view that starts one element into its storage, with the same results."""
    monkeypatch.setitem(gg.CONFIGS, "default", _small(True, True))
    autotune.clear_cache()
    case = ALIGNED[0]
    x, idx, w, gate_up, down = case.make(torch.bfloat16, device=DEVICE)
    meta = routing_metadata(idx, case.E, 64)
    shifted = torch.empty(x.numel() + 1, dtype=x.dtype, device=DEVICE)[1:].view_as(x).copy_(x)
    assert shifted.data_ptr() % 16 != 0 and shifted.is_contiguous()
    # (The interpreter reads any address: what the compiled kernels need is the launcher's copy.)
    passed = gg._check("x_TH", shifted, x.shape, x.dtype)
    assert passed.data_ptr() % 16 == 0 and torch.equal(passed, shifted)
    assert gg._check("x_TH", x, x.shape, x.dtype) is x
    h, pre = gg.gather_glu(x, gate_up, meta, case.K, "silu")
    h_shifted, pre_shifted = gg.gather_glu(shifted, gate_up, meta, case.K, "silu")
    live = int(meta.padded_offsets_E1[-1])  # host sync: test only; h past the live rows is never written
    assert torch.equal(h[:live], h_shifted[:live]) and torch.equal(pre, pre_shifted)
    autotune.clear_cache()


def test_padding_rows_of_backward_intermediates_are_zero():
    """The weight gradients read hs, d pre and the padded copies of dy and x through descriptors
    without masking padding rows."""
    case = ALIGNED[1]
    x, idx, w, gate_up, down = case.make(torch.bfloat16, device=DEVICE)
    meta = routing_metadata(idx, case.E, 64)
    w_N = w.reshape(-1).float().contiguous()
    _, pre = gg.gather_glu(x, gate_up, meta, case.K, "silu")
    dy = torch.randn(case.T, case.H, dtype=torch.bfloat16, device=DEVICE)
    dy_padded = gg.gather_rows(dy, meta, case.K)
    dpre, _, hs = gg.glu_backward(dy_padded, down, pre, w_N, meta, "silu")
    live = int(meta.padded_offsets_E1[-1])  # host sync: test only
    slot = meta.sorted_slot_P[:live].cpu()
    padding = slot < 0
    assert padding.any()
    for t in (hs, dpre, dy_padded):
        assert torch.count_nonzero(t[:live][padding]) == 0
    assert torch.count_nonzero(pre[live:]) == 0
    # The live rows of the padded copy are the token rows, bit for bit.
    assert torch.equal(dy_padded[:live][~padding].cpu(), dy.cpu()[slot[~padding].long() // case.K])
