"""The pure-PyTorch backend of ``moe_experts``: one sort of the routed slots, ``torch._grouped_mm``
for the four expert GEMMs, the gated activation recomputed in backward, a deterministic combine.

It is the default on the CPU and the fallback users can pick anywhere. It makes no host sync of
its own: the per-expert offsets stay on the device and go straight into ``_grouped_mm``. On sm_90
in bfloat16 and float16 that is the whole story; torch's grouped GEMM in float32 (seen on an H100
with torch 2.11), and in every dtype on sm_80 (torch 2.9-2.11), falls back to a loop over the
groups that reads the offsets back (``kernels.library.grouped_mm_sync_free``): ``moe_experts``
warns once when this path is pinned there, and ``backend="auto"`` never times or runs it there."""

from __future__ import annotations

from typing import Optional

import torch

from ..kernels.library import grouped_mm as _grouped_mm
from .activations import glu_bwd, glu_fwd, row_blocks
from .experts_op import register_experts_autograd


def routing_order(idx_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots sorted by expert (stable, so ties keep token order; the slots without an expert, id
    ``E``, last) and the end offset of each expert's rows, both computed on the device."""
    flat_N = idx_TK.reshape(-1)
    order_N = torch.sort(flat_N, stable=True).indices
    # scatter_add rather than bincount: bincount reads the max back to the host on CUDA.
    counts_E = torch.zeros(num_experts + 1, dtype=torch.int32, device=idx_TK.device)
    counts_E.scatter_add_(0, flat_N.long(), torch.ones_like(flat_N, dtype=torch.int32))
    return order_N, torch.cumsum(counts_E[:num_experts], 0, dtype=torch.int32)


def _routed(order_N: torch.Tensor, offsets_E: torch.Tensor, num_routed: int | None):
    """The sorted slots the GEMMs take (the first ``num_routed``; those with an expert sort first)
    and which of them have one (None: all, without ``num_routed``): where ``num_routed`` is only a
    bound, slots without an expert can be left at the tail, and their GEMM rows, past the last
    offset, are never written."""
    if num_routed is None:
        return order_N, None
    return order_N[:num_routed], torch.arange(num_routed, device=order_N.device) < offsets_E[-1]


def _zero_unrouted_(rows_Q: torch.Tensor, routed_Q: torch.Tensor | None) -> torch.Tensor:
    """``rows_Q`` (rows or one value per sorted slot) zeroed in place where no expert computed it."""
    if routed_Q is None:
        return rows_Q
    return rows_Q.masked_fill_(~routed_Q.view(-1, *(1,) * (rows_Q.dim() - 1)), 0)


# PyTorch's grouped GEMM needs 16-byte aligned strides; 8 elements covers every supported dtype.
_ALIGN = 8


def _pad_to(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    missing = size - t.shape[dim]
    if missing == 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [0, missing]
    return torch.nn.functional.pad(t, pad)


def _aligned(n: int) -> int:
    """``n`` rounded up to the alignment; at least one block, so an empty width (H or I of 0)
    still gives the GEMM aligned strides."""
    return max(-(-n // _ALIGN), 1) * _ALIGN


def _gemm_operand(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself where PyTorch's grouped GEMM takes its layout (one of its last two dimensions
    of stride 1, the other's stride at least that dimension's size and a multiple of 16 bytes, a
    16-byte aligned start), else a contiguous copy. The op accepts any strided tensor (a weight
    with the expert dimension innermost, a column slice of a wider buffer): without the copy
    ``grouped_mm`` refused them with "Invalid strides/sizes" or "strides should be multiple of 16
    bytes". A no-op for the contiguous weights of real models and their transposes."""
    align = 16 // t.element_size()
    rows, cols = t.shape[-2:]
    s_rows, s_cols = t.stride()[-2:]
    row_major = s_cols == 1 and s_rows >= max(1, cols) and s_rows % align == 0
    col_major = s_rows == 1 and s_cols >= max(1, rows) and s_cols % align == 0
    if (row_major or col_major) and t.storage_offset() % align == 0:
        return t
    return t.contiguous()


def grouped_linear(a_ND: torch.Tensor, w_EFD: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """Row block of expert e times ``w_EFD[e]^T`` -> ``[N, F]``; sizes that are not a multiple of
    8 are zero-padded (a copy only for such odd shapes, which real models do not have)."""
    F, D = w_EFD.shape[1:]
    Fp, Dp = _aligned(F), _aligned(D)
    w = _pad_to(_pad_to(w_EFD, 2, Dp), 1, Fp)
    return _grouped_mm(_gemm_operand(_pad_to(a_ND, 1, Dp)), _gemm_operand(w.transpose(1, 2)),
                       offs=offsets_E)[:, :F]


def grouped_outer(a_NF: torch.Tensor, b_ND: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """Per expert, ``a[rows]^T @ b[rows]`` -> ``[E, F, D]``: the weight gradient."""
    F, D = a_NF.shape[1], b_ND.shape[1]
    a = _pad_to(a_NF, 1, _aligned(F))
    b = _pad_to(b_ND, 1, _aligned(D))
    return _grouped_mm(_gemm_operand(a.t()), _gemm_operand(b), offs=offsets_E)[:, :F, :D]


def _scale_rows_(rows_NH: torch.Tensor, w_N: torch.Tensor) -> None:
    """``rows[n] *= w[n]`` in place, multiplied in float32, a block of rows at a time."""
    for rows in row_blocks(*rows_NH.shape):
        rows_NH[rows] = rows_NH[rows].float().mul_(w_N[rows, None])


def _unsort_sum(rows_Q: torch.Tensor, order_Q: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """Put sorted rows back into (token, slot) order and sum each token's slots in float32, rounded
    to the rows' dtype a block of tokens at a time (float32 copies of a block only). With fewer
    rows than slots (slots without an expert, which add nothing) each block gathers its tokens'
    rows instead: a copy of all slots would be mostly empty (the dispatcher's rows carry one
    column per local expert a row can hold)."""
    Q, H = rows_Q.shape
    N = num_tokens * top_k
    sum_TH = rows_Q.new_empty((num_tokens, H))
    if Q == N:
        slots_QH = torch.empty_like(rows_Q, memory_format=torch.contiguous_format).index_copy_(0, order_Q, rows_Q)
        slots_TKH = slots_QH.view(num_tokens, top_k, H)
        for tokens in row_blocks(num_tokens, top_k * H):
            sum_TH[tokens] = slots_TKH[tokens].sum(1, dtype=torch.float32)
        return sum_TH
    if Q == 0:
        return sum_TH.zero_()
    row_of_slot_TK = torch.full((N,), Q, dtype=torch.long, device=rows_Q.device)
    row_of_slot_TK = row_of_slot_TK.index_copy_(0, order_Q, torch.arange(Q, device=rows_Q.device)).view(-1, top_k)
    for tokens in row_blocks(num_tokens, top_k * H):
        row_TK = row_of_slot_TK[tokens]  # a block of tokens
        empty_TK = row_TK == Q
        terms_TKH = rows_Q.index_select(0, row_TK.masked_fill(empty_TK, 0).reshape(-1)).view(*row_TK.shape, H)
        sum_TH[tokens] = terms_TKH.masked_fill_(empty_TK[..., None], 0).sum(1, dtype=torch.float32)
    return sum_TH


def _forward_impl(x_TH, idx_TK, w_TK, gate_up_E2IH, down_EHI, activation, num_routed):
    T, K = idx_TK.shape
    E = gate_up_E2IH.shape[0]
    order_N, offsets_E = routing_order(idx_TK, E)
    order_Q, routed_Q = _routed(order_N, offsets_E, num_routed)
    x_QH = x_TH[order_Q // K]
    gate_up_Q2I = grouped_linear(x_QH, gate_up_E2IH, offsets_E)
    h_QI = glu_fwd(gate_up_Q2I, activation, x_TH.dtype)
    out_QH = _zero_unrouted_(grouped_linear(h_QI, down_EHI, offsets_E), routed_Q)
    _scale_rows_(out_QH, w_TK.reshape(-1)[order_Q].float())
    y_TH = _unsort_sum(out_QH, order_Q, T, K)
    # Odd intermediate sizes leave a view of the padded product: the op's outputs must be dense,
    # as its fake implementation says (a no-op for the aligned sizes of real models).
    return y_TH, order_N, offsets_E, gate_up_Q2I.contiguous()


@torch.library.custom_op("moe_ep::experts_torch_fwd", mutates_args=())
def experts_torch_fwd(
    x_TH: torch.Tensor,
    idx_TK: torch.Tensor,
    w_TK: torch.Tensor,
    gate_up_E2IH: torch.Tensor,
    down_EHI: torch.Tensor,
    activation: str,
    num_routed: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (y_TH, order_N, offsets_E, gate_up_Q2I); the last three are saved for backward.
    ``num_routed``: see ``run_experts``."""
    return _forward_impl(x_TH, idx_TK, w_TK, gate_up_E2IH, down_EHI, activation, num_routed)


@experts_torch_fwd.register_fake
def _(x_TH, idx_TK, w_TK, gate_up_E2IH, down_EHI, activation, num_routed=None):
    N = idx_TK.numel()
    E, two_I, _ = gate_up_E2IH.shape
    return (
        x_TH.new_empty(x_TH.shape),
        idx_TK.new_empty((N,), dtype=torch.int64),
        idx_TK.new_empty((E,), dtype=torch.int32),
        x_TH.new_empty((N if num_routed is None else num_routed, two_I)),
    )


@torch.library.custom_op("moe_ep::experts_torch_bwd", mutates_args=())
def experts_torch_bwd(
    dy_TH: torch.Tensor,
    x_TH: torch.Tensor,
    w_TK: torch.Tensor,
    gate_up_E2IH: torch.Tensor,
    down_EHI: torch.Tensor,
    order_N: torch.Tensor,
    offsets_E: torch.Tensor,
    gate_up_Q2I: torch.Tensor,
    activation: str,
    num_routed: Optional[int] = None,
    overwrite_saved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dx_TH, dw_TK, d_gate_up_E2IH, d_down_EHI); ``overwrite_saved``: GEMM 1's output
    gradient is written over ``gate_up_Q2I`` (see ``experts_op``)."""
    T, K = w_TK.shape
    dtype = x_TH.dtype
    order_Q, routed_Q = _routed(order_N, offsets_E, num_routed)
    token_Q = order_Q // K
    w_Q = w_TK.reshape(-1)[order_Q].float()
    # Each [Q, H] or [Q, I] intermediate is freed after its last reader, so that the backward holds
    # at most the output gradient's rows and two [Q, I] buffers, or two [Q, H] ones, at a time.
    dy_QH = dy_TH.to(dtype)[token_Q]
    # Gradient of the unweighted expert output w.r.t. h: dy @ down[e]. Since
    # d w_n = <dy_t, down[e] h_n> = <dy_t @ down[e], h_n>, the expert output need not be kept.
    dh_raw_QI = grouped_linear(dy_QH, down_EHI.transpose(1, 2), offsets_E)
    dw_Q, wh_QI, d_gate_up_Q2I = glu_bwd(gate_up_Q2I, dh_raw_QI, w_Q, activation, overwrite=overwrite_saved)
    del dh_raw_QI
    dw_Q = _zero_unrouted_(dw_Q, routed_Q)
    # Zeros only where some slot has no row (no expert): their weights get no gradient.
    dw_N = dw_Q.new_empty(T * K) if order_Q.numel() == T * K else dw_Q.new_zeros(T * K)
    dw_TK = dw_N.index_copy_(0, order_Q, dw_Q).view(T, K).to(w_TK.dtype)
    # d down[e] = sum_n (w_n dy_n)^T h_n = sum_n dy_n^T (w_n h_n): the weight goes on h.
    d_down_EHI = grouped_outer(dy_QH, wh_QI, offsets_E)
    del dy_QH, wh_QI
    dx_QH = _zero_unrouted_(grouped_linear(d_gate_up_Q2I, gate_up_E2IH.transpose(1, 2), offsets_E), routed_Q)
    dx_TH = _unsort_sum(dx_QH, order_Q, T, K)
    d_gate_up_E2IH = grouped_outer(d_gate_up_Q2I, x_TH[token_Q], offsets_E)
    # Odd sizes leave views of the padded products; the fake implementation (and so a compiled
    # graph around the op) expects dense gradients. A no-op for the aligned sizes of real models.
    return dx_TH, dw_TK, d_gate_up_E2IH.contiguous(), d_down_EHI.contiguous()


register_experts_autograd(experts_torch_fwd, experts_torch_bwd)
