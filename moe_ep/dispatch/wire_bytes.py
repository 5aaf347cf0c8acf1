"""Bytes an expert-parallel layer puts on the wire, for our dispatcher and for transformers'
``AllToAllEP``, computed from one rank's routing alone (a pure function, no process group).

- moe_ep: one row per (token, destination rank), however many of the token's experts live on that
  rank, each carrying ``min(K, L)`` (local id int32, weight float32) columns; one row per
  (token, rank) comes back, already reduced on the expert rank.
- transformers: one row per (token, chosen expert) each way; the weights stay on the sender.

Forward only (backward moves the same rows the other way, plus our float32 weight gradients).
Not counted: the per-layer count exchange, which does not grow with the tokens (moe_ep: 2 int64
per peer; transformers: one int64 per expert of the peer)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._validate import check_index, check_tensor

_ROUTING_COLUMN_BYTES = 8  # int32 local expert id + float32 routing weight


@dataclass(frozen=True)
class WireBytes:
    num_tokens: int
    moe_ep_rows: int  # rows dispatched (the same number comes back in combine)
    transformers_rows: int
    moe_ep_payload: int  # hidden-state bytes, dispatch + combine
    moe_ep_metadata: int  # routing columns sent with the rows
    transformers_payload: int

    @property
    def moe_ep_bytes(self) -> int:
        return self.moe_ep_payload + self.moe_ep_metadata

    @property
    def transformers_bytes(self) -> int:
        return self.transformers_payload

    def per_token(self) -> tuple[float, float]:
        """(moe_ep, transformers) bytes per token; 0 for no tokens."""
        n = max(self.num_tokens, 1)
        return self.moe_ep_bytes / n, self.transformers_bytes / n


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
    for name, value in (("experts_per_rank", experts_per_rank), ("hidden_size", hidden_size), ("element_size", element_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    T, K = idx_TK.shape
    dest_TK = idx_TK.long() // experts_per_rank
    num_ranks = int(dest_TK.max()) + 1 if T else 1
    goes_TR = torch.zeros(T, num_ranks, dtype=torch.bool).scatter_(1, dest_TK.cpu(), True)
    pair_remote_TK = torch.ones(T, K, dtype=torch.bool)
    if source_rank is not None:
        goes_TR[:, source_rank:source_rank + 1] = False
        pair_remote_TK = dest_TK.cpu() != source_rank
    ours_rows, their_rows = int(goes_TR.sum()), int(pair_remote_TK.sum())
    row_bytes = hidden_size * element_size
    return WireBytes(
        num_tokens=T,
        moe_ep_rows=ours_rows,
        transformers_rows=their_rows,
        moe_ep_payload=2 * ours_rows * row_bytes,
        moe_ep_metadata=ours_rows * min(K, experts_per_rank) * _ROUTING_COLUMN_BYTES,
        transformers_payload=2 * their_rows * row_bytes,
    )
