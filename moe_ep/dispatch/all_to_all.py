"""The collectives of the dispatcher as autograd functions of our own over
``torch.distributed.all_to_all_single`` (not the deprecated ``torch.distributed.nn`` wrappers).

The backward of an all-to-all is the all-to-all with the split sizes swapped. Every rank calls
these functions in the same order in forward, so every rank also reaches their backward, in the
reverse order, even when it sends or receives no rows: the empty tensors stay connected to the
graph, and autograd calls a node's backward whatever the size of its tensors.

``start_exchange`` / ``finish_exchange`` split ``AllToAllRows`` in two around an asynchronous
all-to-all (``async_op=True``), so that the overlapped layer (``moe_ep.dispatch.overlap``) can
compute between them, in the backward too.

Each is differentiable once (``once_differentiable``): its backward's exchange is not in the
graph, so a double backward (a gradient penalty) raises rather than silently leave out every
term that crosses an exchange."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from .lanes import lane_group

Splits = tuple[int, ...] | None  # rows per peer; None = equal blocks (capacity mode)


def _all_to_all(rows: torch.Tensor, out_splits: Splits, in_splits: Splits, group, async_op: bool):
    """The exchange's receive buffer, its ``Work`` (None unless ``async_op``) and the contiguous
    send buffer, which must live until the exchange is done."""
    rows = rows.contiguous()
    if out_splits is None:
        out = torch.empty_like(rows)
    else:
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
    work = dist.all_to_all_single(
        out,
        rows,
        output_split_sizes=None if out_splits is None else list(out_splits),
        input_split_sizes=None if in_splits is None else list(in_splits),
        group=lane_group(group),
        async_op=async_op,
    )
    return out, work, rows


def _exchange(rows: torch.Tensor, out_splits: Splits, in_splits: Splits, group) -> torch.Tensor:
    return _all_to_all(rows, out_splits, in_splits, group, async_op=False)[0]


class AllToAllRows(torch.autograd.Function):
    """Rows ``[sum(in_splits), ...]`` to their ranks; returns ``[sum(out_splits), ...]``."""

    @staticmethod
    def forward(ctx, rows, out_splits: Splits, in_splits: Splits, group):
        ctx.splits = (out_splits, in_splits)
        ctx.group = group
        return _exchange(rows, out_splits, in_splits, group)

    @staticmethod
    @once_differentiable
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
    @once_differentiable
    def backward(ctx, grad_weights, _grad_ids):
        out_splits, in_splits = ctx.splits
        return _exchange(grad_weights, in_splits, out_splits, ctx.group), None, None, None, None


class PendingExchange:
    """One all-to-all issued with ``async_op=True`` whose result is not waited for yet, forward
    and backward: ``start_exchange`` issues it and ``finish_exchange`` waits, and their backwards
    do the same in reverse (the finish's backward issues the gradient's exchange, the start's
    waits for it), so whatever autograd runs between the two overlaps the exchange both ways."""

    def __init__(self, splits: tuple[Splits, Splits], group, grad_columns: int | None):
        self.splits = splits  # (out_splits, in_splits) of the forward exchange
        self.group = group
        self.grad_columns = grad_columns  # leading columns that carry a gradient (None: all)
        self.work = None
        self.sent = None  # the send buffer, alive until the exchange is done
        self.grad_work = None
        self.grad_sent = None
        self.grad = None  # the backward exchange's receive buffer


class _StartExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, passenger, pending: PendingExchange):
        ctx.pending = pending
        out_splits, in_splits = pending.splits
        # One collective for both: all_to_all copies bytes, so a bit-cast passenger arrives exactly.
        packed = rows if passenger is None else torch.cat([rows, passenger.view(rows.dtype)], dim=1)
        out, pending.work, pending.sent = _all_to_all(packed, out_splits, in_splits, pending.group, async_op=True)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, _grad_placeholder):
        pending = ctx.pending
        pending.grad_work.wait()
        grad = pending.grad
        pending.grad = pending.grad_work = pending.grad_sent = None
        return grad, None, None


class _FinishExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, received, pending: PendingExchange):
        ctx.pending = pending
        pending.work.wait()
        pending.work = pending.sent = None
        return received.view_as(received)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_received):
        pending = ctx.pending
        out_splits, in_splits = pending.splits
        grad = grad_received if pending.grad_columns is None else grad_received[:, : pending.grad_columns]
        pending.grad, pending.grad_work, pending.grad_sent = _all_to_all(grad, in_splits, out_splits, pending.group,
                                                                         async_op=True)
        # The gradient travels in ``pending``: the start's backward waits for it and hands it on.
        return grad_received, None


def start_exchange(rows: torch.Tensor, out_splits: tuple[int, ...], in_splits: tuple[int, ...], group,
                   passenger: torch.Tensor | None = None) -> tuple[torch.Tensor, PendingExchange]:
    """Issues ``AllToAllRows``' exchange of ``rows`` without waiting; returns its receive buffer
    (to read only after ``finish_exchange``) and the pending exchange. ``passenger``: columns of
    the same element size sent in the same collective, bit-cast, without a gradient (the multi
    rows' int32 expert ids beside their float32 weights); the gradient's exchange carries only
    ``rows``' columns. Dropless split sizes only."""
    pending = PendingExchange((out_splits, in_splits), group, None if passenger is None else rows.shape[1])
    return _StartExchange.apply(rows, passenger, pending), pending


def finish_exchange(received: torch.Tensor, pending: PendingExchange) -> torch.Tensor:
    """Waits for ``pending`` and returns ``received``, now filled (differentiable)."""
    return _FinishExchange.apply(received, pending)
