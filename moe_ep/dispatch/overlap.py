"""The expert-parallel layer with its exchanges hidden behind the experts
(``moe_experts_ep(..., overlap_chunks=n)``, n > 1): the layer's tokens are cut into ``n`` chunks
of consecutive tokens, each dispatched, computed and combined on its own, pipelined on
asynchronous all-to-alls (``all_to_all.start_exchange`` / ``finish_exchange``).

Single-stage:

```
count exchange of every chunk: ONE collective, ONE host sync (as without chunks)
issue dispatch 1, 2, ..., n
wait dispatch 1 -> experts 1 -> issue combine 1     (dispatches 2.. in flight)
wait dispatch 2 -> experts 2 -> issue combine 2     (combine 1 and dispatches 3.. in flight)
...
wait combines 1..n -> y_TH
```

Node-aware (``moe_ep.dispatch.nodes``; S1/C1 cross the network, S2/C2 stay in the node):

```
both stages' counts of every chunk: one collective per group, ONE host sync
issue S1 of every chunk; wait S1 1 -> issue S2 1
for chunk i:  wait S2 i
              wait C2 i-1 -> forwarder's sum -> issue C1 i-1   (C1 i-1 travels during experts i)
              experts i                                        (S1 i+1 in flight)
              issue C2 i; wait S1 i+1 -> issue S2 i+1
wait C2 n -> issue C1 n; wait C1 1..n -> y_TH
```

So with two chunks the network carries chunk 2's dispatch during chunk 1's experts and chunk 1's
combine during chunk 2's, as in the single-stage layer; only the short hops inside the node wait.

Backward, autograd reaches the chunks in the reverse order of their forward sections, and the
same pairing holds: the backward of a wait issues the gradient's exchange and the backward of an
issue waits for it, so one chunk's gradients travel while another chunk's experts run their
backward. Every rank builds the same graph of collectives (autograd runs the ready node created
last first), so every rank issues them in the same order.

Exact: the dispatch and the combine move and sum the same rows in the same fixed order, so with
experts that compute each row alone the outputs and the gradients of the tokens and routing
weights are those of one chunk bit for bit. The expert GEMMs see fewer rows per call (their
blocking, hence their rounding, may depend on it) and an expert's weight gradient is the sum of
the chunks' (another summation order): equal within float32 rounding.

Dropless only: capacity mode's capacity and drops are over the whole layer's tokens
(``capacity_keep_mask`` keeps each expert's heaviest pairs among all of them), so chunks would
drop other pairs."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..ops.experts import run_experts
from .all_to_all import PendingExchange, finish_exchange, start_exchange
from .dispatcher import join_checked
from .layout import DispatchedTokens, DispatchLayout
from .nodes import NodeGroups, exchange_node_counts, node_dispatched_tokens, plan_by_node, plan_forwarding
from .rank_exchange import (
    ExchangeSizes, PackedRows, RowPlan, SentRows, dispatched_tokens, exchange_counts, pack_rows, plan_rows,
    received_rows, rows_of_pairs,
)
from .repeats import merge_repeated_experts
from .row_ops import sum_rows


def check_overlap_chunks(overlap_chunks, capacity_factor) -> None:
    """``overlap_chunks``: a positive int; above 1 only with the dropless dispatch."""
    if isinstance(overlap_chunks, bool) or not isinstance(overlap_chunks, int) or overlap_chunks < 1:
        raise ValueError(
            f"overlap_chunks must be a positive int (1: no overlap; 2: two chunks whose exchanges overlap each "
            f"other's experts), got {overlap_chunks!r}"
        )
    if overlap_chunks > 1 and capacity_factor is not None:
        raise ValueError(
            f"overlap_chunks={overlap_chunks} needs the dropless dispatch, got capacity_factor={capacity_factor!r}: "
            "capacity mode drops each expert's lightest pairs among all the layer's tokens, and chunks would drop "
            "others"
        )


@dataclass(frozen=True)
class _InFlightRows:
    """One exchange of rows (``send_rows``' phases) between its issue and its wait."""

    plan: RowPlan
    packed: PackedRows
    recv_RC: torch.Tensor
    sizes: ExchangeSizes
    rows: tuple[torch.Tensor, PendingExchange]
    routing: tuple[torch.Tensor, PendingExchange] | None


def _issue_rows(x_TH, plan: RowPlan, recv_RC, sizes: ExchangeSizes, group) -> _InFlightRows:
    packed = pack_rows(x_TH, plan, sizes, padded=False)
    rows = start_exchange(packed.x_send, sizes.recv_splits, sizes.send_splits, group)
    routing = None
    if plan.multi:
        routing = start_exchange(packed.w_send, sizes.meta_recv_splits, sizes.meta_send_splits, group,
                                 passenger=packed.ids_send)
    return _InFlightRows(plan, packed, recv_RC, sizes, rows, routing)


def _wait_rows(exchange: _InFlightRows) -> SentRows:
    x_recv = finish_exchange(*exchange.rows)
    w_meta = ids_meta = None
    if exchange.routing is not None:
        received = finish_exchange(*exchange.routing)
        k = exchange.plan.k_max
        w_meta, ids_meta = received[:, :k], received[:, k:].detach().contiguous().view(torch.int32)
    return received_rows(exchange.plan, exchange.packed, exchange.recv_RC, exchange.sizes, x_recv, w_meta, ids_meta)


@dataclass(frozen=True)
class _Return:
    """The way back of one exchange: the source's tables that sum each token's returned rows."""

    group: object
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    token_src: torch.Tensor
    source_reader: torch.Tensor
    source_weights: torch.Tensor

    @classmethod
    def of(cls, layout, group) -> "_Return":
        return cls(group, layout.send_splits, layout.recv_splits, layout.token_src, layout.source_reader,
                   layout.source_weights)

    def issue(self, rows_SH) -> tuple[torch.Tensor, PendingExchange]:
        return start_exchange(rows_SH, self.send_splits, self.recv_splits, self.group)

    def wait(self, returning: tuple[torch.Tensor, PendingExchange]) -> torch.Tensor:
        returned = finish_exchange(*returning)
        return sum_rows(returned, self.token_src, self.source_reader, self.source_weights, padded=False)


def _experts(tokens: DispatchedTokens, layout: DispatchLayout, gate_up_local, down_local, activation: str,
             backend: str, group) -> torch.Tensor:
    """The rows that go back over ``layout``'s exchange: each received row's pairs computed and
    summed by the experts (``tokens`` in the rows form)."""
    out_SH = run_experts(tokens.hidden_states, tokens.expert_ids, tokens.weights, gate_up_local, down_local,
                         activation, backend, group, layout.num_pairs)
    return rows_of_pairs(join_checked(out_SH, tokens), layout)


def moe_experts_overlapped(hidden_states, top_k_index, top_k_weights, gate_up_local, down_local, *, group,
                           num_experts: int, activation: str, backend: str, chunks: int,
                           node_groups: NodeGroups | None = None) -> torch.Tensor:
    """``moe_experts_ep``'s dropless layer in ``chunks`` pipelined chunks (module docstring), on
    arguments ``moe_experts_ep`` validated."""
    top_k_index, top_k_weights = merge_repeated_experts(top_k_index, top_k_weights, num_experts)
    x_chunks = torch.tensor_split(hidden_states, chunks)
    idx_chunks = torch.tensor_split(top_k_index, chunks)
    w_chunks = torch.tensor_split(top_k_weights, chunks)
    experts = functools.partial(_experts, gate_up_local=gate_up_local, down_local=down_local, activation=activation,
                                backend=backend, group=group)
    if node_groups is None:
        return _overlapped_single_stage(x_chunks, idx_chunks, w_chunks, group, num_experts, experts)
    return _overlapped_by_node(x_chunks, idx_chunks, w_chunks, node_groups, num_experts, experts)


def _overlapped_single_stage(x_chunks, idx_chunks, w_chunks, group, num_experts: int, experts):
    """The single-stage layer's schedule of the module docstring."""
    ep = dist.get_world_size(group)
    plans = [plan_rows(idx, w, ep, num_experts) for idx, w in zip(idx_chunks, w_chunks)]
    in_flight = [_issue_rows(x, plan, recv_RC, sizes, group)
                 for x, plan, (recv_RC, sizes) in zip(x_chunks, plans, exchange_counts(plans, group))]
    returning = []
    for x, exchange in zip(x_chunks, in_flight):
        tokens = dispatched_tokens(_wait_rows(exchange), group, x.shape[0], num_experts // ep, rows=True)
        way_back = _Return.of(tokens.layout, group)
        returning.append((way_back, way_back.issue(experts(tokens, tokens.layout))))
    return torch.cat([way_back.wait(exchange) for way_back, exchange in returning])


def _overlapped_by_node(x_chunks, idx_chunks, w_chunks, nodes: NodeGroups, num_experts: int, experts):
    """The node-aware layer's schedule of the module docstring."""
    plans = [plan_by_node(idx, w, nodes, num_experts) for idx, w in zip(idx_chunks, w_chunks)]
    counts = exchange_node_counts(plans, nodes)
    first_in_flight = [_issue_rows(x, plan.first, c.first_recv_RC, c.first, nodes.inter)
                       for x, plan, c in zip(x_chunks, plans, counts)]

    def forward_in_node(i: int):
        first = _wait_rows(first_in_flight[i])
        second = _issue_rows(first.x_recv_SH, plan_forwarding(first, nodes, num_experts), counts[i].second_recv_RC,
                             counts[i].second, nodes.intra)
        return first, second

    def network_return(i: int):
        in_node, returning = in_node_returns[i]
        network = _Return.of(layouts[i], nodes.inter)
        return network, network.issue(in_node.wait(returning))

    forwarding = forward_in_node(0)
    layouts, in_node_returns, network_returns = [], [], []
    for i, x in enumerate(x_chunks):
        first, second = forwarding
        tokens = node_dispatched_tokens(first, _wait_rows(second), nodes, x.shape[0], plans[i].rank_experts,
                                        rows=True)
        layouts.append(tokens.layout)
        if i:
            network_returns.append(network_return(i - 1))
        in_node = _Return.of(tokens.layout.intra, nodes.intra)
        in_node_returns.append((in_node, in_node.issue(experts(tokens, tokens.layout.intra))))
        if i + 1 < len(x_chunks):
            forwarding = forward_in_node(i + 1)
    network_returns.append(network_return(len(x_chunks) - 1))
    return torch.cat([way_back.wait(exchange) for way_back, exchange in network_returns])
