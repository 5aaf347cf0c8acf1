"""Bytes an expert-parallel layer puts on the wire, for our dispatcher and for transformers'
``AllToAllEP``, computed from one rank's routing alone (a pure function, no process group).

- moe_ep: one row per (token, destination rank), however many of the token's experts live on that
  rank (an expert a token names twice counts once: ``moe_ep.dispatch.repeats``); a row carrying
  ``m >= 2`` of them also carries ``min(K, L)`` (local id int32, weight
  float32) columns; one row per (token, rank) comes back, already reduced on the expert rank.
  The count exchange sends ``L`` int32 per peer, ``L + 2`` when rows can carry several experts.
- transformers: one row per (token, chosen expert) each way; the weights stay on the sender and
  the count exchange sends one int64 per expert of each peer.

So, per (token, rank) with ``m`` experts there, we send ``2 row`` bytes (+ ``8 min(K, L)`` when
``m >= 2``) against transformers' ``2 m row``: never more when ``row >= 4 min(K, L)`` bytes,
strictly fewer when ``row > 4 min(K, L)`` and some token has two experts on one remote rank; the
count exchange is never larger either. Forward only (backward moves the same rows the other
way, plus our float32 weight gradients of the multi rows)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.validate import check_index, check_tensor
from .repeats import repeated_slots

_ROUTING_COLUMN_BYTES = 8  # int32 local expert id + float32 routing weight


@dataclass(frozen=True)
class WireBytes:
    num_tokens: int
    moe_ep_rows: int  # rows dispatched (the same number comes back in combine)
    transformers_rows: int
    moe_ep_payload: int  # hidden-state bytes, dispatch + combine
    moe_ep_metadata: int  # routing columns of the multi rows
    transformers_payload: int

    @property
    def moe_ep_bytes(self) -> int:
        return self.moe_ep_payload + self.moe_ep_metadata

    @property
    def transformers_bytes(self) -> int:
        return self.transformers_payload


def _check_positive(**values) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def wire_bytes(
    idx_TK: torch.Tensor,
    experts_per_rank: int,
    hidden_size: int,
    *,
    element_size: int = 2,
    source_rank: int | None = None,
) -> WireBytes:
    """Forward bytes of one layer for the routing ``idx_TK [T, K]`` (global expert ids, expert e on
    rank ``e // experts_per_rank``) with hidden rows of ``hidden_size * element_size`` bytes.
    With ``source_rank``, rows the rank keeps for itself are local copies and not counted."""
    check_tensor("idx_TK", idx_TK, ndim=2)
    check_index("idx_TK", idx_TK)
    _check_positive(experts_per_rank=experts_per_rank, hidden_size=hidden_size, element_size=element_size)
    T, K = idx_TK.shape
    dest_TK = idx_TK.long().cpu() // experts_per_rank
    num_ranks = int(dest_TK.max()) + 1 if T else 1
    # transformers sends a copy per slot; moe_ep merges a token's repeated expert first (repeats).
    slots_TR = torch.zeros(T, num_ranks, dtype=torch.long).scatter_add_(1, dest_TK, torch.ones_like(dest_TK))
    distinct_TK = (~repeated_slots(idx_TK.cpu())).long()
    experts_TR = torch.zeros(T, num_ranks, dtype=torch.long).scatter_add_(1, dest_TK, distinct_TK)
    if source_rank is not None:
        slots_TR[:, source_rank:source_rank + 1] = 0
        experts_TR[:, source_rank:source_rank + 1] = 0
    ours_rows, their_rows = int((experts_TR > 0).sum()), int(slots_TR.sum())
    multi_rows = int((experts_TR > 1).sum())
    row_bytes = hidden_size * element_size
    return WireBytes(
        num_tokens=T,
        moe_ep_rows=ours_rows,
        transformers_rows=their_rows,
        moe_ep_payload=2 * ours_rows * row_bytes,
        moe_ep_metadata=multi_rows * min(K, experts_per_rank) * _ROUTING_COLUMN_BYTES,
        transformers_payload=2 * their_rows * row_bytes,
    )


@dataclass(frozen=True)
class CountExchangeBytes:
    """Bytes one rank sends to its peers in a layer's count exchange, for each scheme."""

    moe_ep_bytes: int
    transformers_bytes: int


def count_columns(experts_per_rank: int, top_k: int) -> int:
    """The int32 counts a dropless exchange sends each peer: single rows per local expert, then,
    when a row can carry several experts, the multi rows and the pairs they carry."""
    return experts_per_rank + 2 if min(top_k, experts_per_rank) > 1 else experts_per_rank


def count_exchange_bytes(num_experts: int, ep: int, top_k: int) -> CountExchangeBytes:
    """Both schemes' count exchange of one layer, which does not grow with the tokens."""
    _check_positive(num_experts=num_experts, ep=ep, top_k=top_k)
    L = num_experts // ep
    ours_per_peer = 4 * count_columns(L, top_k)
    return CountExchangeBytes(moe_ep_bytes=(ep - 1) * ours_per_peer, transformers_bytes=(ep - 1) * 8 * L)


@dataclass(frozen=True)
class NodeWireBytes:
    """Bytes one rank sends in one layer's node-aware dispatch and combine (forward), over each
    of its two groups (``moe_ep.dispatch.nodes``), the count exchanges apart
    (``node_count_exchange_bytes``)."""

    inter_rows: int  # its tokens' rows to other nodes, and the combined rows it returns to them
    inter_metadata: int  # routing columns of its rows carrying several of a node's experts
    intra_rows: int  # rows it forwards to the other ranks of its node, and the outputs it returns
    intra_metadata: int
    row_bytes: int

    @property
    def inter_bytes(self) -> int:
        return self.inter_rows * self.row_bytes + self.inter_metadata

    @property
    def intra_bytes(self) -> int:
        return self.intra_rows * self.row_bytes + self.intra_metadata


def node_wire_bytes(
    idx_by_rank: list[torch.Tensor],
    experts_per_rank: int,
    hidden_size: int,
    node_size: int,
    *,
    element_size: int = 2,
) -> list[NodeWireBytes]:
    """Forward bytes of one layer of the node-aware dispatch for every rank of an ep group, from
    every rank's routing ``idx_by_rank[r] [T_r, K]`` (a forwarding rank sends what others routed).
    Rank ``n node_size + g`` is on node ``n``. Stage 1 sends a token's row once to each other node
    holding one of its experts (``min(K, node_size L)`` routing columns when it holds several);
    stage 2 forwards each received row, the rank's own node's included, once to each other rank
    of the node holding one of its experts (``min(K, node_size L, L)`` columns when several); each
    row comes back the way it went."""
    _check_positive(experts_per_rank=experts_per_rank, hidden_size=hidden_size, node_size=node_size,
                    element_size=element_size)
    ep, L, G = len(idx_by_rank), experts_per_rank, node_size
    if ep % G:
        raise ValueError(f"node_size={node_size} must divide the {ep} ranks of idx_by_rank")
    for r, idx_TK in enumerate(idx_by_rank):
        check_tensor(f"idx_by_rank[{r}]", idx_TK, ndim=2)
        check_index(f"idx_by_rank[{r}]", idx_TK)
    K = idx_by_rank[0].shape[1]
    k_inter, k_intra = min(K, G * L), min(K, L)
    sums = {name: [0] * ep for name in ("inter_rows", "inter_metadata", "intra_rows", "intra_metadata")}
    for source, idx_TK in enumerate(idx_by_rank):
        dest_TK = idx_TK.long().cpu() // L
        experts_TR = torch.zeros(idx_TK.shape[0], ep, dtype=torch.long)
        experts_TR.scatter_add_(1, dest_TK, (~repeated_slots(idx_TK.cpu())).long())
        experts_TN = experts_TR.view(-1, ep // G, G).sum(-1)
        home, local = divmod(source, G)
        for node in range(ep // G):
            forwarder = node * G + local
            if node != home:
                rows = int((experts_TN[:, node] > 0).sum())
                sums["inter_rows"][source] += rows
                sums["inter_metadata"][source] += int((experts_TN[:, node] > 1).sum()) * k_inter * _ROUTING_COLUMN_BYTES
                sums["inter_rows"][forwarder] += rows  # the node's combined rows come back
            for expert_rank in range(node * G, (node + 1) * G):
                if expert_rank == forwarder:
                    continue
                rows = int((experts_TR[:, expert_rank] > 0).sum())
                sums["intra_rows"][forwarder] += rows
                sums["intra_metadata"][forwarder] += (
                    int((experts_TR[:, expert_rank] > 1).sum()) * k_intra * _ROUTING_COLUMN_BYTES)
                sums["intra_rows"][expert_rank] += rows
    row_bytes = hidden_size * element_size
    return [NodeWireBytes(**{name: values[r] for name, values in sums.items()}, row_bytes=row_bytes) for r in range(ep)]


def node_count_exchange_bytes(num_experts: int, ep: int, top_k: int, node_size: int) -> tuple[int, int]:
    """What one rank sends in the node-aware dispatch's two count exchanges of one layer: (over
    the inter-node group, over the intra-node group); each is the single-stage exchange of its
    stage (the node's ``node_size L`` experts for stage 1, a forwarded row's ``min(K, node_size
    L)`` columns for stage 2), and stage 1's also carries, per node, the stage-2 counts of each of
    its ``node_size`` ranks (``moe_ep.dispatch.nodes.plan_by_node``)."""
    _check_positive(num_experts=num_experts, ep=ep, top_k=top_k, node_size=node_size)
    nodes = ep // node_size
    forwarded = (nodes - 1) * 4 * node_size * count_columns(num_experts // ep, top_k)
    inter = count_exchange_bytes(num_experts, nodes, top_k).moe_ep_bytes + forwarded
    intra = count_exchange_bytes(num_experts // nodes, node_size, min(top_k, num_experts // nodes)).moe_ep_bytes
    return inter, intra
