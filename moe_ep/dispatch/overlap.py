"""The single-stage expert-parallel layer with its exchanges hidden behind the experts
(``moe_experts_ep(..., overlap_chunks=n)``, n > 1): the layer's tokens are cut into ``n`` chunks
of consecutive tokens, each dispatched, computed and combined on its own, pipelined on
asynchronous all-to-alls (``all_to_all.start_exchange`` / ``finish_exchange``):

```
count exchange of every chunk: ONE collective, ONE host sync (as without chunks)
issue dispatch 1, 2, ..., n
wait dispatch 1 -> experts 1 -> issue combine 1     (dispatches 2.. in flight)
wait dispatch 2 -> experts 2 -> issue combine 2     (combine 1 and dispatches 3.. in flight)
...
wait combines 1..n -> y_TH
```

Backward, autograd reaches the chunks in the reverse order of their forward sections, and the
same pairing holds: the backward of a wait issues the gradient's exchange and the backward of an
issue waits for it, so chunk 1's combine gradient travels while chunk 2's experts run their
backward, and chunk 2's dispatch gradient while chunk 1's do. Every rank builds the same graph
of collectives (autograd runs the ready node created last first), so every rank issues them in
the same order.

Exact: the dispatch and the combine move and sum the same rows in the same fixed order, so with
experts that compute each row alone the outputs and the gradients of the tokens and routing
weights are those of one chunk bit for bit. The expert GEMMs see fewer rows per call (their
blocking, hence their rounding, may depend on it) and an expert's weight gradient is the sum of
the chunks' (another summation order): equal within float32 rounding.

Dropless and single-stage only: capacity mode's capacity and drops are over the whole layer's
tokens (``capacity_keep_mask`` keeps each expert's heaviest pairs among all of them), so chunks
would drop other pairs; the node-aware scheme's second count exchange depends on its first
exchange's rows, so its chunks could not share one host sync (2n instead of 2 per layer)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..ops.experts import run_experts
from .all_to_all import PendingExchange, finish_exchange, start_exchange
from .dispatcher import join_checked
from .layout import DispatchedTokens, DispatchLayout
from .rank_exchange import (
    ExchangeSizes, PackedRows, RowPlan, dispatched_tokens, exchange_counts, pack_rows, plan_rows, received_rows,
    rows_of_pairs,
)
from .row_ops import sum_rows


def check_overlap_chunks(overlap_chunks, capacity_factor, node_groups) -> None:
    """``overlap_chunks``: a positive int; above 1 only with the dropless single-stage dispatch."""
    if isinstance(overlap_chunks, bool) or not isinstance(overlap_chunks, int) or overlap_chunks < 1:
        raise ValueError(
            f"overlap_chunks must be a positive int (1: no overlap; 2: two chunks whose exchanges overlap each "
            f"other's experts), got {overlap_chunks!r}"
        )
    if overlap_chunks == 1:
        return
    if capacity_factor is not None:
        raise ValueError(
            f"overlap_chunks={overlap_chunks} needs the dropless dispatch, got capacity_factor={capacity_factor!r}: "
            "capacity mode drops each expert's lightest pairs among all the layer's tokens, and chunks would drop "
            "others"
        )
    if node_groups is not None:
        raise ValueError(
            f"overlap_chunks={overlap_chunks} needs the single-stage dispatch (node_groups=None): the node-aware "
            "dispatch's second count exchange depends on its first exchange's rows, so each chunk would add two "
            "host syncs"
        )


@dataclass(frozen=True)
class _InFlightDispatch:
    """One chunk's dispatch between its issue and its wait."""

    plan: RowPlan
    packed: PackedRows
    recv_RC: torch.Tensor
    sizes: ExchangeSizes
    num_tokens: int
    rows: tuple[torch.Tensor, PendingExchange]
    routing: tuple[torch.Tensor, PendingExchange] | None


def _issue_dispatch(x_TH, plan: RowPlan, recv_RC, sizes: ExchangeSizes, group) -> _InFlightDispatch:
    packed = pack_rows(x_TH, plan, sizes, padded=False)
    rows = start_exchange(packed.x_send, sizes.recv_splits, sizes.send_splits, group)
    routing = None
    if plan.multi:
        routing = start_exchange(packed.w_send, sizes.meta_recv_splits, sizes.meta_send_splits, group,
                                 passenger=packed.ids_send)
    return _InFlightDispatch(plan, packed, recv_RC, sizes, x_TH.shape[0], rows, routing)


def _wait_dispatch(chunk: _InFlightDispatch, group) -> DispatchedTokens:
    x_recv = finish_exchange(*chunk.rows)
    w_meta = ids_meta = None
    if chunk.routing is not None:
        received = finish_exchange(*chunk.routing)
        k = chunk.plan.k_max
        w_meta, ids_meta = received[:, :k], received[:, k:].detach().contiguous().view(torch.int32)
    sent = received_rows(chunk.plan, chunk.packed, chunk.recv_RC, chunk.sizes, x_recv, w_meta, ids_meta)
    return dispatched_tokens(sent, group, chunk.num_tokens, chunk.plan.experts_per_rank)


def _issue_combine(expert_output_QH, layout: DispatchLayout):
    rows_SH = rows_of_pairs(expert_output_QH, layout)
    return layout, start_exchange(rows_SH, layout.send_splits, layout.recv_splits, layout.group)


def _wait_combine(layout: DispatchLayout, returning: tuple[torch.Tensor, PendingExchange]) -> torch.Tensor:
    returned = finish_exchange(*returning)
    return sum_rows(returned, layout.token_src, layout.source_reader, layout.source_weights, padded=False)


def moe_experts_overlapped(hidden_states, top_k_index, top_k_weights, gate_up_local, down_local, *, group,
                           num_experts: int, activation: str, backend: str, chunks: int) -> torch.Tensor:
    """``moe_experts_ep``'s dropless single-stage layer in ``chunks`` pipelined chunks (module
    docstring), on arguments ``moe_experts_ep`` validated."""
    ep = dist.get_world_size(group)
    x_chunks = torch.tensor_split(hidden_states, chunks)
    idx_chunks = torch.tensor_split(top_k_index, chunks)
    w_chunks = torch.tensor_split(top_k_weights, chunks)
    plans = [plan_rows(idx, w, ep, num_experts) for idx, w in zip(idx_chunks, w_chunks)]
    counts = exchange_counts(plans, group)
    in_flight = [_issue_dispatch(x, plan, recv_RC, sizes, group)
                 for x, plan, (recv_RC, sizes) in zip(x_chunks, plans, counts)]
    returning = []
    for chunk in in_flight:
        tokens = _wait_dispatch(chunk, group)
        out_QH = run_experts(tokens.hidden_states, tokens.expert_ids, tokens.weights, gate_up_local, down_local,
                             activation, backend, group)
        returning.append(_issue_combine(join_checked(out_QH, tokens), tokens.layout))
    return torch.cat([_wait_combine(layout, exchange) for layout, exchange in returning])
