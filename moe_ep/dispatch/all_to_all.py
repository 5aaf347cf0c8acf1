"""The collectives of the dispatcher as autograd functions of our own over
``torch.distributed.all_to_all_single`` (not the deprecated ``torch.distributed.nn`` wrappers).

The backward of an all-to-all is the all-to-all with the split sizes swapped. Every rank calls
these functions in the same order in forward, so every rank also reaches their backward, in the
reverse order, even when it sends or receives no rows: the empty tensors stay connected to the
graph, and autograd calls a node's backward whatever the size of its tensors."""

from __future__ import annotations

import torch
import torch.distributed as dist

Splits = tuple[int, ...] | None  # rows per peer; None = equal blocks (capacity mode)


def _exchange(rows: torch.Tensor, out_splits: Splits, in_splits: Splits, group) -> torch.Tensor:
    rows = rows.contiguous()
    if out_splits is None:
        out = torch.empty_like(rows)
    else:
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
    dist.all_to_all_single(
        out,
        rows,
        output_split_sizes=None if out_splits is None else list(out_splits),
        input_split_sizes=None if in_splits is None else list(in_splits),
        group=group,
    )
    return out


class AllToAllRows(torch.autograd.Function):
    """Rows ``[sum(in_splits), ...]`` to their ranks; returns ``[sum(out_splits), ...]``."""

    @staticmethod
    def forward(ctx, rows, out_splits: Splits, in_splits: Splits, group):
        ctx.splits = (out_splits, in_splits)
        ctx.group = group
        return _exchange(rows, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad_out):
        out_splits, in_splits = ctx.splits
        return _exchange(grad_out, in_splits, out_splits, ctx.group), None, None, None


class AllToAllRouting(torch.autograd.Function):
    """The routing of each row (its local expert ids and weights) in ONE collective: the int32
    ids travel bit-cast as float32 columns next to the float32 weights. Only the weights are
    differentiable; backward sends their gradient alone."""

    @staticmethod
    def forward(ctx, weights_SC, ids_SC, out_splits: Splits, in_splits: Splits, group):
        ctx.splits = (out_splits, in_splits)
        ctx.group = group
        k = weights_SC.shape[1]
        # A bit-cast, not a conversion: all_to_all copies bytes, so the ids arrive exactly.
        packed = torch.cat([weights_SC.float(), ids_SC.to(torch.int32).view(torch.float32)], dim=1)
        received = _exchange(packed, out_splits, in_splits, group)
        ids = received[:, k:].contiguous().view(torch.int32)
        ctx.mark_non_differentiable(ids)
        return received[:, :k].contiguous(), ids

    @staticmethod
    def backward(ctx, grad_weights, _grad_ids):
        out_splits, in_splits = ctx.splits
        return _exchange(grad_weights, in_splits, out_splits, ctx.group), None, None, None, None
