"""The named, frozen records that ``dispatch`` returns and ``combine`` consumes. They hold index
tensors, split sizes and the routing weights the source applies itself; nothing in them is
mutable, so one dispatch can be combined exactly once per forward without hidden state in the
dispatcher."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .all_to_all import Splits


@dataclass(frozen=True)
class DispatchLayout:
    """Where every row went, for the way back.

    Rows are packed rank-major: the rows for rank 0, then rank 1, ...; inside a rank, the single
    rows by local expert, then the multi rows, each in token order. ``send_splits[j]`` rows go to
    rank ``j`` and ``recv_splits[j]`` come from it (None in capacity mode, where every rank sends
    ``rows_per_rank`` rows to every rank, padding included).
    """

    group: object  # torch.distributed.ProcessGroup
    num_tokens: int  # T on this (source) rank
    send_splits: Splits
    recv_splits: Splits
    rows_per_rank: int | None  # capacity mode: rows in each rank's padded block; None = dropless
    # Source side: token t's c-th destination (in rank order) went out in, and comes back in, row
    # token_src[t, c] of the exchanges (the number of rows sent = none), [T, C] with
    # C = min(ep, K); the returned row is scaled by source_weights[t, c]: the routing weight of
    # a single row (the expert returned it unweighted), 1 for a multi row. source_reader[s] =
    # t * C + c inverts token_src (T * C = a padding row). source_weights is differentiable
    # in the weights.
    token_src: torch.Tensor
    source_reader: torch.Tensor
    source_weights: torch.Tensor
    # Expert side: slot c of received row s takes pair output row_src[s, c] (num_pairs = none),
    # [S, C] with C = min(K, L); pair_reader[q] = s * C + c inverts it. Both None where the
    # experts got the received rows themselves and summed each row's pairs (``DispatchedTokens``).
    row_src: torch.Tensor | None
    pair_reader: torch.Tensor | None
    num_pairs: int  # Q, the (row, local expert) pairs (capacity mode: a bound)
    num_received: int  # S, the rows received (capacity mode: padding included)
    kept_TK: torch.Tensor | None  # capacity mode: the (token, slot) pairs that were not dropped

    @property
    def num_outputs(self) -> int:
        """The rows of the experts' output that ``combine`` takes: one per pair, or one per
        received row where the experts summed each row's pairs."""
        return self.num_pairs if self.row_src is not None else self.num_received


@dataclass(frozen=True)
class DispatchedTokens:
    """What the local experts compute on, in one of two forms.

    Pairs (``dispatch``'s): one entry per (received row, local expert) pair. ``expert_ids`` are
    local (``[0, L)``) and ``weights`` the weights the expert rank applies, so the expert output
    for pair q is ``weights[q] * expert[expert_ids[q]](hidden_states[q])``, exactly what
    ``moe_experts(hidden_states, expert_ids, weights, gate_up_local, down_local)`` returns. The
    weight is the routing weight for a pair of a multi row and 1 for a single row, whose routing
    weight the source applies in ``combine``. In capacity mode the tail entries are padding: a zero
    weight and expert 0. Shapes ``[Q, H]``, ``[Q, 1]`` int64, ``[Q, 1]`` float32.

    Rows (the expert-parallel layer's own, ``moe_experts_ep``): the received rows themselves,
    ``[S, H]``, with one column per local expert a row can carry, ``[S, C]`` int32 ids (``L``: no
    expert) and float32 weights; at most ``layout.num_pairs`` columns hold an expert. moe_ep's
    experts (``ops.experts.run_experts`` with ``num_routed``) gather each pair's row and sum each
    row's outputs in their own kernels, so no per-pair copy of the rows is made, nor summed."""

    hidden_states: torch.Tensor  # [Q, H] or [S, H], differentiable
    expert_ids: torch.Tensor
    weights: torch.Tensor  # differentiable (constant 1 for single rows)
    layout: DispatchLayout | NodeDispatchLayout


@dataclass(frozen=True)
class NodeDispatchLayout:
    """Where every row went in the node-aware scheme (``moe_ep.dispatch.nodes``), for the way back.

    ``intra``: the second stage, over the node, from the forwarding rank to the expert ranks,
    whose "tokens" are the rows this rank received in the first stage. The rest is the first
    stage's source side, over the inter-node group: ``DispatchLayout``'s fields of the same names,
    with "rank" read as "node" (the rank with this rank's local index on that node)."""

    intra: DispatchLayout
    inter_group: object  # torch.distributed.ProcessGroup
    num_tokens: int
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    token_src: torch.Tensor
    source_reader: torch.Tensor
    source_weights: torch.Tensor

    @property
    def num_pairs(self) -> int:
        return self.intra.num_pairs

    @property
    def num_outputs(self) -> int:
        return self.intra.num_outputs
