"""The two row movements of the dispatcher, as a pair of autograd functions that are each
other's backward, so that both directions are deterministic and free of float atomics (an
indexing backward would scatter-add on the GPU):

- ``gather_rows``: copies of rows, ``out[g] = x[index[g]]``. A row may be copied several times;
  its gradient is the fixed-order sum of its copies' gradients, a ``sum_rows``.
- ``sum_rows``: ``out[g] = sum_c scale[g, c] * rows[src[g, c]]``, where every row is read by at
  most one ``(g, c)``. Its gradient is a scaled gather, a ``gather_rows``.

Index tensors use ``len(source)`` for "none": a missing term of a sum, a row nobody reads.
Shapes: ``M`` rows read, ``G`` rows written, ``C`` terms (or copies) per row.
Row gathers use ``index_select`` (on the CPU 2-3x faster than advanced indexing on [rows, H]). On a
GPU the sums are one Triton gather-sum (``kernels.grouped_gemm.sum_rows``): each output row
written once, each row read by its one term, in float32 and term order; a scaled sum's backward
is one Triton pass too (``kernels.grouped_gemm.scaled_gather``: the gathered gradient scaled, and
its dot with the row for the scale's gradient)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import grouped_gemm as gg
from ..kernels.aot_spec import TRITON_TYPES


def _sum(rows_MH, src_GC, target_M, scale_GC=None, reader_M=None, *, padded: bool) -> torch.Tensor:
    """``out[g] = sum_c scale[g, c] * rows[src[g, c]]`` accumulated in float32, the terms given
    both ways: ``src_GC`` (term -> row) and ``target_M`` (row -> its ``g``, ``G`` = read by none)
    with ``reader_M`` (row -> its flat term, for the scale). ``padded``: some rows are read by no
    term (capacity mode's padding); without it every row is read."""
    if rows_MH.device.type == "cpu":
        return _sum_by_rows(rows_MH, target_M, src_GC.shape[0], scale_GC, reader_M, padded=padded)
    if rows_MH.dtype in TRITON_TYPES:
        return gg.sum_rows(rows_MH.contiguous(), src_GC, None if scale_GC is None else scale_GC.float())
    return _sum_by_columns(rows_MH, src_GC, scale_GC)


def _sum_by_rows(rows_MH, target_M, G: int, scale_GC=None, reader_M=None, *, padded: bool = True) -> torch.Tensor:
    """``index_add_``, deterministic on the CPU (it adds in row order): one pass over the rows,
    whatever the number of terms. On a GPU it would add with atomics. Unread rows go to a spare
    output row, cut off with a copy: the result must not be a view (FSDP2 warns about module
    outputs that are, since an in-place op on one would skip its gradient hook)."""
    terms_MH = rows_MH.float()
    if scale_GC is not None:
        scale_M = F.pad(scale_GC.reshape(-1).float(), (0, 1))[reader_M]
        terms_MH = terms_MH * scale_M[:, None]
    out_GH = torch.zeros(G + padded, rows_MH.shape[1], dtype=torch.float32, device=rows_MH.device)
    out_GH.index_add_(0, target_M, terms_MH)
    return out_GH[:G].to(rows_MH.dtype, copy=True) if padded else out_GH.to(rows_MH.dtype)


def _sum_by_columns(rows_MH, src_GC, scale_GC=None) -> torch.Tensor:
    """Column by column, one gather and one fused multiply-add each (padding terms included): the
    deterministic order on a GPU for the dtypes the Triton gather-sum does not take (float64)."""
    valid_GC = src_GC < rows_MH.shape[0]
    scale_GC = valid_GC.float() if scale_GC is None else torch.where(valid_GC, scale_GC.float(), 0.0)
    if rows_MH.shape[0] == 0:
        rows_MH = rows_MH.new_zeros(1, rows_MH.shape[1])
    src_GC = torch.where(valid_GC, src_GC, 0)
    out_GH = torch.mul(rows_MH.index_select(0, src_GC[:, 0]), scale_GC[:, :1])
    for c in range(1, src_GC.shape[1]):
        out_GH.addcmul_(rows_MH.index_select(0, src_GC[:, c]), scale_GC[:, c:c + 1])
    return out_GH.to(rows_MH.dtype)


def _gather(x_MH: torch.Tensor, index_G: torch.Tensor, *, padded: bool) -> torch.Tensor:
    """``x[index]``; with ``padded``, zero rows where ``index == len(x)`` (without, every index
    is a row of ``x``)."""
    if not padded:
        return x_MH.index_select(0, index_G)
    valid_G = index_G < x_MH.shape[0]
    if x_MH.shape[0] == 0:
        x_MH = x_MH.new_zeros(1, x_MH.shape[1])
    return x_MH.index_select(0, torch.where(valid_G, index_G, 0)).masked_fill_(~valid_G[:, None], 0)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MH, index_G, copies_MC, padded):
        ctx.padded = padded
        # Rows of out that are nobody's listed copy (capacity padding) pass no gradient.
        num_out = index_G.shape[0]
        listed = torch.zeros(num_out + 1, dtype=torch.bool, device=index_G.device)
        listed = listed.index_fill_(0, copies_MC.reshape(-1), True)[:num_out]
        ctx.save_for_backward(copies_MC, torch.where(listed, index_G, x_MH.shape[0]))
        return x_MH.index_select(0, index_G)

    @staticmethod
    def backward(ctx, grad_GH):
        copies_MC, target_G = ctx.saved_tensors
        return _sum(grad_GH, copies_MC, target_G, padded=ctx.padded), None, None, None


class _SumRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows_MH, src_GC, scale_GC, reader_M, padded):
        # The rows are needed again only for the gradient of the scale.
        keep = rows_MH if ctx.needs_input_grad[2] else None
        ctx.save_for_backward(keep, src_GC, scale_GC, reader_M)
        ctx.padded = padded
        G, width = src_GC.shape
        target_M = torch.where(reader_M < G * width, reader_M // width, G)
        return _sum(rows_MH, src_GC, target_M, scale_GC, reader_M, padded=padded)

    @staticmethod
    def backward(ctx, grad_GH):
        rows_MH, src_GC, scale_GC, reader_M = ctx.saved_tensors
        G, width = src_GC.shape
        read_M = reader_M < G * width
        # grad_M[m] = grad[g] for the term (g, c) that reads row m: one gather in row order.
        target_M = torch.where(read_M, reader_M // width, G)
        if scale_GC is None:
            return _gather(grad_GH, target_M, padded=ctx.padded), None, None, None, None
        scale_M = F.pad(scale_GC.reshape(-1).float(), (0, 1))[reader_M]
        # d scale[g, c] = <grad[g], rows[src[g, c]]>: a row-wise dot in row order, then put where
        # the term sits (every term reads a distinct row).
        wants_dots = ctx.needs_input_grad[2]
        if grad_GH.device.type == "cuda" and grad_GH.dtype in TRITON_TYPES:
            # One pass: the gathered gradient scaled, and its dot with the row.
            grad_rows, dots_M = gg.scaled_gather(grad_GH.contiguous(), target_M, scale_M,
                                                 rows_MH.contiguous() if wants_dots else None)
        else:
            grad_M = _gather(grad_GH, target_M, padded=ctx.padded)
            grad_rows = (grad_M * scale_M[:, None]).to(grad_GH.dtype)
            dots_M = (grad_M.float() * rows_MH.float()).sum(-1) if wants_dots else None
        grad_scale = None
        if wants_dots:
            grad_scale = torch.zeros(G * width + 1, dtype=torch.float32, device=grad_GH.device)
            grad_scale = grad_scale.index_copy(0, reader_M, dots_M)[: G * width].view(G, width).to(scale_GC.dtype)
        return grad_rows, None, grad_scale, None, None


def gather_rows(x_MH: torch.Tensor, index_G: torch.Tensor, copies_MC: torch.Tensor, *, padded: bool) -> torch.Tensor:
    """``x[index]``, where ``copies[m]`` lists the positions of ``out`` that copy row ``m``
    (``len(index)`` = none); ``padded``: some rows of ``out`` are listed nowhere (they get no
    gradient); without it every row is some row's copy."""
    return _GatherRows.apply(x_MH, index_G, copies_MC, padded)


def sum_rows(rows_MH, src_GC, reader_M, scale_GC=None, *, padded: bool) -> torch.Tensor:
    """``out[g] = sum_c scale[g, c] * rows[src[g, c]]`` (``scale`` defaults to 1), where
    ``reader[m] = g * C + c`` is the one term that reads row ``m`` (``G * C`` = none; only when
    ``padded``). Differentiable in ``rows`` and ``scale``."""
    return _SumRows.apply(rows_MH, src_GC, scale_GC, reader_M, padded)
