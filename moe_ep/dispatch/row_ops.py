"""The two row movements of the dispatcher, as a pair of autograd functions that are each
other's backward, so that both directions are deterministic and free of float atomics (an
indexing backward would scatter-add on the GPU):

- ``gather_rows``: copies of rows, ``out[i] = x[index[i]]``. A row may be copied several times;
  its gradient is the fixed-order sum of its copies' gradients, a ``sum_rows``.
- ``sum_rows``: ``out[g] = sum_c scale[g, c] * rows[src[g, c]]``, where every row is read by at
  most one ``(g, c)``. Its gradient is a scaled gather, a ``gather_rows``.

Index tensors use ``len(source)`` for "none": a missing term of a sum, a row nobody reads.
Row gathers use ``index_select`` (on the CPU 2-3x faster than advanced indexing on [N, H] rows)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _sum(rows_IH, src_GC, target_I, scale_GC=None, reader_I=None, *, padded: bool) -> torch.Tensor:
    """``out[g] = sum_c scale[g, c] * rows[src[g, c]]`` accumulated in float32, the terms given
    both ways: ``src_GC`` (term -> row) and ``target_I`` (row -> its ``g``, ``G`` = read by none)
    with ``reader_I`` (row -> its flat term, for the scale). ``padded``: some rows are read by no
    term (capacity mode's padding); without it every row is read."""
    if rows_IH.device.type == "cpu":
        return _sum_by_rows(rows_IH, target_I, src_GC.shape[0], scale_GC, reader_I, padded=padded)
    return _sum_by_columns(rows_IH, src_GC, scale_GC)


def _sum_by_rows(rows_IH, target_I, G: int, scale_GC=None, reader_I=None, *, padded: bool = True) -> torch.Tensor:
    """``index_add_``, deterministic on the CPU (it adds in row order): one pass over the rows,
    whatever the number of terms. On a GPU it would add with atomics. Unread rows go to a spare
    output row, cut off with a copy: the result must not be a view (FSDP2 warns about module
    outputs that are, since an in-place op on one would skip its gradient hook)."""
    terms_IH = rows_IH.float()
    if scale_GC is not None:
        scale_I = F.pad(scale_GC.reshape(-1).float(), (0, 1))[reader_I]
        terms_IH = terms_IH * scale_I[:, None]
    out_GH = torch.zeros(G + padded, rows_IH.shape[1], dtype=torch.float32, device=rows_IH.device)
    out_GH.index_add_(0, target_I, terms_IH)
    return out_GH[:G].to(rows_IH.dtype, copy=True) if padded else out_GH.to(rows_IH.dtype)


def _sum_by_columns(rows_IH, src_GC, scale_GC=None) -> torch.Tensor:
    """Column by column, one gather and one fused multiply-add each (padding terms included):
    the deterministic order on a GPU."""
    valid_GC = src_GC < rows_IH.shape[0]
    scale_GC = valid_GC.float() if scale_GC is None else torch.where(valid_GC, scale_GC.float(), 0.0)
    if rows_IH.shape[0] == 0:
        rows_IH = rows_IH.new_zeros(1, rows_IH.shape[1])
    src_GC = torch.where(valid_GC, src_GC, 0)
    out_GH = torch.mul(rows_IH.index_select(0, src_GC[:, 0]), scale_GC[:, :1])
    for c in range(1, src_GC.shape[1]):
        out_GH.addcmul_(rows_IH.index_select(0, src_GC[:, c]), scale_GC[:, c:c + 1])
    return out_GH.to(rows_IH.dtype)


def _gather(x_JH: torch.Tensor, index_I: torch.Tensor, *, padded: bool) -> torch.Tensor:
    """``x[index]``; with ``padded``, zero rows where ``index == len(x)`` (without, every index
    is a row of ``x``)."""
    if not padded:
        return x_JH.index_select(0, index_I)
    valid_I = index_I < x_JH.shape[0]
    if x_JH.shape[0] == 0:
        x_JH = x_JH.new_zeros(1, x_JH.shape[1])
    return x_JH.index_select(0, torch.where(valid_I, index_I, 0)).masked_fill_(~valid_I[:, None], 0)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_JH, index_I, copies_JC, padded):
        ctx.padded = padded
        # Rows of out that are nobody's listed copy (capacity padding) pass no gradient.
        num_out = index_I.shape[0]
        listed = torch.zeros(num_out + 1, dtype=torch.bool, device=index_I.device)
        listed = listed.index_fill_(0, copies_JC.reshape(-1), True)[:num_out]
        ctx.save_for_backward(copies_JC, torch.where(listed, index_I, x_JH.shape[0]))
        return x_JH.index_select(0, index_I)

    @staticmethod
    def backward(ctx, grad_IH):
        copies_JC, target_I = ctx.saved_tensors
        return _sum(grad_IH, copies_JC, target_I, padded=ctx.padded), None, None, None


class _SumRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows_IH, src_GC, scale_GC, reader_I, padded):
        # The rows are needed again only for the gradient of the scale.
        keep = rows_IH if ctx.needs_input_grad[2] else None
        ctx.save_for_backward(keep, src_GC, scale_GC, reader_I)
        ctx.padded = padded
        G, width = src_GC.shape
        target_I = torch.where(reader_I < G * width, reader_I // width, G)
        return _sum(rows_IH, src_GC, target_I, scale_GC, reader_I, padded=padded)

    @staticmethod
    def backward(ctx, grad_GH):
        rows_IH, src_GC, scale_GC, reader_I = ctx.saved_tensors
        G, width = src_GC.shape
        read_I = reader_I < G * width
        # grad_I[i] = grad[g] for the term (g, c) that reads row i: one gather in row order.
        grad_I = _gather(grad_GH, torch.where(read_I, reader_I // width, G), padded=ctx.padded)
        if scale_GC is None:
            return grad_I, None, None, None, None
        flat_scale = F.pad(scale_GC.reshape(-1).float(), (0, 1))
        grad_rows = (grad_I * flat_scale[reader_I][:, None]).to(grad_GH.dtype)
        grad_scale = None
        if ctx.needs_input_grad[2]:
            # d scale[g, c] = <grad[g], rows[src[g, c]]>: a row-wise dot in row order, then put
            # where the term sits (every term reads a distinct row).
            dots_I = (grad_I.float() * rows_IH.float()).sum(-1)
            grad_scale = torch.zeros(G * width + 1, dtype=torch.float32, device=grad_GH.device)
            grad_scale = grad_scale.index_copy(0, reader_I, dots_I)[: G * width].view(G, width).to(scale_GC.dtype)
        return grad_rows, None, grad_scale, None, None


def gather_rows(x_JH: torch.Tensor, index_I: torch.Tensor, copies_JC: torch.Tensor, *, padded: bool) -> torch.Tensor:
    """``x[index]``, where ``copies[j]`` lists the positions of ``out`` that copy row ``j``
    (``len(index)`` = none); ``padded``: some rows of ``out`` are listed nowhere (they get no
    gradient); without it every row is some row's copy."""
    return _GatherRows.apply(x_JH, index_I, copies_JC, padded)


def sum_rows(rows_IH, src_GC, reader_I, scale_GC=None, *, padded: bool) -> torch.Tensor:
    """``out[g] = sum_c scale[g, c] * rows[src[g, c]]`` (``scale`` defaults to 1), where
    ``reader[i] = g * C + c`` is the one term that reads row ``i`` (``G * C`` = none; only when
    ``padded``). Differentiable in ``rows`` and ``scale``."""
    return _SumRows.apply(rows_IH, src_GC, scale_GC, reader_I, padded)
