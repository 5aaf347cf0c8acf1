"""The grouped-GEMM launchers of moe_ep.kernels.grouped_gemm: errors that name the argument, and
an AOT spec for every configuration a launcher may choose. Their numbers are checked through
moe_experts in test_experts_backends.py."""

import dataclasses

import pytest
import torch

from live_bytes import LiveBytes
from moe_cases import CASES, Case
from moe_ep.kernels import autotune
from moe_ep.kernels import grouped_gemm as gg
from moe_ep.kernels.routing_metadata import routing_metadata

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


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
                    for gelu in (False, True):
                        for c in gg.configs_for(kernel, dtype, family, aligned=aligned, gelu=gelu):
                            # GELU only changes the spaces of the kernels that take an activation.
                            suffix = "_gelu" if gelu and kernel in ("gather_glu", "glu_backward") else ""
                            assert any(n.startswith(kernel) and f"_{ty}_{family}_{c}_{'' if aligned else 'un'}aligned" in n
                                       and n.endswith(suffix) for n in names), (kernel, ty, c, aligned, gelu)
    for family in gg.CONFIGS:
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            for pad_m in (64, 128):
                for kernel in gg.GEMM_KERNELS:
                    assert gg.configs_for(kernel, dtype, family, pad_m), (kernel, dtype, pad_m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_glu_backward_over_pre_times_its_configurations_on_a_copy(dtype, monkeypatch):
    """d pre written over pre: the configurations timed on a problem's first call must leave pre
    intact for the launch whose result is kept, which then equals the one into a new buffer."""
    configs_for = gg.configs_for

    def two_configs(kernel, *args, **kwargs):
        found = configs_for(kernel, *args, **kwargs)
        # The interpreter's spaces hold one configuration for these sizes: a second one, to time
        # (another warp count: it compiles wherever the first does).
        return [*found, dataclasses.replace(found[0], num_warps=4 if found[0].num_warps == 8 else 8)]

    monkeypatch.setattr(gg, "configs_for", two_configs)
    case = CASES[0]
    x, idx, w, gate_up, down = case.make(dtype, device=DEVICE)
    meta = routing_metadata(idx, case.E, gg.routing_block(idx.numel(), case.E))
    _, pre = gg.gather_glu(x, gate_up, meta, case.K, "silu")
    dy_PH = gg.gather_rows(torch.randn_like(x), meta, case.K)
    w_N = w.reshape(-1).float()
    over = pre.clone()
    with autotune.tuning() as session:
        dpre, dw, hs = gg.glu_backward(dy_PH, down, over, w_N, meta, "silu", overwrite_pre=True)
        kept = gg.glu_backward(dy_PH, down, pre, w_N, meta, "silu")
    timed = [t for key, t in session.timings.items() if key[0] == "glu_backward"]
    assert len(timed) == 1 and len(timed[0]) > 1, session.timings
    assert dpre.data_ptr() == over.data_ptr() and kept[0].data_ptr() != pre.data_ptr()
    live = int(meta.padded_offsets_E1[-1])  # the rows past the experts' blocks are never written
    assert torch.equal(dw, kept[1])
    for a, b in ((dpre, kept[0]), (hs, kept[2])):
        assert torch.equal(a[:live], b[:live])


@pytest.mark.parametrize("stage", ["rows_matmul", "weight_grad"])
def test_a_stage_on_the_library_makes_no_unused_output_buffer(stage, monkeypatch):
    """Where the library's grouped GEMM runs a stage (chosen per stage on sm_90) it makes its own
    output: the Triton launch's buffer must not be made beside it (for a weight gradient, a whole
    gradient more at the backward's peak)."""
    monkeypatch.setattr(gg, "_tuned", lambda *args, library, before_kept=None, **kwargs: library())
    case = Case("aligned", T=64, H=32, I=48, E=4, K=2)
    x, idx, w, gate_up, down = case.make(torch.bfloat16, device=DEVICE)
    meta = routing_metadata(idx, case.E, gg.routing_block(idx.numel(), case.E))
    x_PH = gg.gather_rows(x, meta, case.K)
    with LiveBytes() as live:
        if stage == "rows_matmul":
            out = gg.rows_matmul(x_PH, gate_up, meta, w_layout="nk")
        else:
            out = gg.weight_grad(x_PH, x_PH, meta)
    assert live.peak() == out.untyped_storage().nbytes()
