"""The Triton backend of ``moe_experts``: routing metadata on the device, GEMM 1 with the token
gather and the gated activation fused, GEMM 2 with the routing weight fused, a deterministic
combine; the backward recomputes the activation from the saved GEMM-1 output.

Registered with ``torch.library`` so ``torch.compile`` and FSDP2 treat it as one opaque op. Nothing
on this path reads a device value back to the host (kernel configurations are timed only on a
problem's first call, see ``moe_ep.ops.selector``)."""

from __future__ import annotations

from typing import Optional

import torch

from ..kernels import grouped_gemm as gg
from ..kernels.routing_metadata import RoutingMetadata, padded_rows, routing_metadata
from .experts_op import register_experts_autograd


@torch.library.custom_op("moe_ep::experts_triton_fwd", mutates_args=())
def experts_triton_fwd(
    x_TH: torch.Tensor,
    idx_TK: torch.Tensor,
    w_TK: torch.Tensor,
    gate_up_E2IH: torch.Tensor,
    down_EHI: torch.Tensor,
    activation: str,
    pad_m: int,
    num_routed: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (y_TH, counts_E, padded_offsets_E1, sorted_slot_P, slot_pos_N, block_expert_B,
    pre_P2I); all but y are saved for backward. ``num_routed``: see ``run_experts``."""
    T, K = idx_TK.shape
    E = gate_up_E2IH.shape[0]
    meta = routing_metadata(idx_TK, E, pad_m, num_routed)
    w_N = w_TK.reshape(-1).float().contiguous()
    h_PI, pre_P2I = gg.gather_glu(x_TH.contiguous(), gate_up_E2IH.contiguous(), meta, K, activation)
    out_PH = gg.rows_matmul(h_PI, down_EHI.contiguous(), meta, w_layout="nk", scale_N=w_N)
    y_TH = gg.combine(out_PH, meta, T, K)
    return (y_TH, meta.counts_E, meta.padded_offsets_E1, meta.sorted_slot_P, meta.slot_pos_N,
            meta.block_expert_B, pre_P2I)


@experts_triton_fwd.register_fake
def _(x_TH, idx_TK, w_TK, gate_up_E2IH, down_EHI, activation, pad_m, num_routed=None):
    N = idx_TK.numel()
    E, two_I, _ = gate_up_E2IH.shape
    P = padded_rows(N if num_routed is None else num_routed, E, pad_m)
    int32 = dict(dtype=torch.int32)
    return (
        x_TH.new_empty(x_TH.shape),
        idx_TK.new_empty((E,), **int32),
        idx_TK.new_empty((E + 1,), **int32),
        idx_TK.new_empty((P,), **int32),
        idx_TK.new_empty((N,), **int32),
        idx_TK.new_empty((P // pad_m,), **int32),
        x_TH.new_empty((P, two_I)),
    )


@torch.library.custom_op("moe_ep::experts_triton_bwd", mutates_args=())
def experts_triton_bwd(
    dy_TH: torch.Tensor,
    x_TH: torch.Tensor,
    w_TK: torch.Tensor,
    gate_up_E2IH: torch.Tensor,
    down_EHI: torch.Tensor,
    counts_E: torch.Tensor,
    padded_offsets_E1: torch.Tensor,
    sorted_slot_P: torch.Tensor,
    slot_pos_N: torch.Tensor,
    block_expert_B: torch.Tensor,
    pre_P2I: torch.Tensor,
    activation: str,
    pad_m: int,
    num_routed: Optional[int] = None,
    overwrite_saved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dx_TH, dw_TK, d_gate_up_E2IH, d_down_EHI); ``overwrite_saved``: GEMM 1's output
    gradient is written over ``pre_P2I`` (see ``experts_op``). ``num_routed`` sized the padded
    layout in the forward; the saved metadata carries that size here."""
    T, K = w_TK.shape
    meta = RoutingMetadata(counts_E, padded_offsets_E1, sorted_slot_P, slot_pos_N, block_expert_B, pad_m)
    dy_TH = dy_TH.to(x_TH.dtype).contiguous()
    x_TH = x_TH.contiguous()
    gate_up_E2IH = gate_up_E2IH.contiguous()
    down_EHI = down_EHI.contiguous()
    w_N = w_TK.reshape(-1).float().contiguous()
    # dy's rows in the padded layout, once: glu_backward and the down gradient stream them.
    dy_PH = gg.gather_rows(dy_TH, meta, K)
    dpre_P2I, dw_N, hs_PI = gg.glu_backward(dy_PH, down_EHI, pre_P2I, w_N, meta, activation,
                                            overwrite_pre=overwrite_saved)
    # hs (P x I, the activation times the routing weight) lives only from here to the down
    # gradient: nothing more is saved from the forward than pre.
    d_down_EHI = gg.weight_grad(dy_PH, hs_PI, meta)
    del hs_PI, dy_PH
    dx_PH = gg.rows_matmul(dpre_P2I, gate_up_E2IH, meta, w_layout="kn")
    dx_TH = gg.combine(dx_PH, meta, T, K)
    del dx_PH
    # x's rows in the padded layout only now, after dy's copy is freed: the two never coexist.
    d_gate_up_E2IH = gg.weight_grad(dpre_P2I, gg.gather_rows(x_TH, meta, K), meta)
    return dx_TH, dw_N.view(T, K).to(w_TK.dtype), d_gate_up_E2IH, d_down_EHI


register_experts_autograd(experts_triton_fwd, experts_triton_bwd)


def experts_triton(x_TH, idx_TK, w_TK, gate_up_E2IH, down_EHI, activation, num_routed=None):
    """``run_experts`` on the Triton kernels; arguments are already validated by its caller."""
    routed = idx_TK.numel() if num_routed is None else num_routed
    pad_m = gg.routing_block(routed, gate_up_E2IH.shape[0])
    return experts_triton_fwd(x_TH, idx_TK, w_TK, gate_up_E2IH, down_EHI, activation, pad_m, num_routed)[0]
