"""Capacity mode: a fixed number of routed slots per expert, so every buffer has a size known
before the routing is, and nothing is read back to the host.

The policy, exactly (Megatron-Core's ``drop_policy="probs"`` with ``pad_to_capacity``):

- ``capacity = ceil(capacity_factor * T * K / E)`` slots per expert and per source rank, where
  ``T`` is the number of tokens on that rank (the same on every rank of the expert-parallel
  group: the padded buffers of all ranks must have one size).
- For each expert, the (token, slot) pairs routed to it on this rank are ranked by routing
  weight, highest first; equal weights rank the lower token index first (a token's slots that
  name one expert count as one pair of their summed weight, ``moe_ep.dispatch.repeats``, so
  that is a total order). The first ``capacity`` pairs are kept, the rest dropped.
- A dropped pair contributes nothing: the token's output is the sum of its kept pairs, with the
  routing weights unchanged (not renormalised). A token whose pairs are all dropped gets a zero
  expert output (the residual connection carries it), and no gradient reaches its dropped
  weights.
"""

from __future__ import annotations

import math

import torch

from ..ops.validate import check_number


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Slots per expert on one source rank: ``ceil(capacity_factor * T * K / E)``."""
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def check_capacity_factor(capacity_factor) -> None:
    check_number("capacity_factor", capacity_factor, above=0, or_none=True)


def capacity_keep_mask(idx_TK: torch.Tensor, w_TK: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """``[T, K]`` bool: which (token, slot) pairs the policy above keeps. On the device, fixed
    shapes, no host sync: two stable sorts give each pair its rank within its expert. The routing
    as the dispatch plans it: a token's repeated expert merged into its first slot, the later
    slots naming expert ``num_experts``, which go nowhere (``merge_repeated_experts``)."""
    T, K = idx_TK.shape
    flat_e = idx_TK.reshape(-1).long()
    # Stable sorts: by weight descending (ties keep flat order, i.e. lower token first), then by
    # expert, which keeps that order inside each expert.
    by_weight = torch.sort(w_TK.detach().reshape(-1).float(), descending=True, stable=True).indices
    by_expert = torch.sort(flat_e[by_weight], stable=True).indices
    order = by_weight[by_expert]
    counts_E = torch.zeros(num_experts + 1, dtype=torch.long, device=idx_TK.device)
    counts_E.scatter_add_(0, flat_e, torch.ones_like(flat_e))
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    rank_in_expert = torch.arange(T * K, device=idx_TK.device) - starts_E[flat_e[order]]
    keep = torch.empty(T * K, dtype=torch.bool, device=idx_TK.device)
    keep[order] = (rank_in_expert < capacity) & (flat_e[order] < num_experts)
    return keep.view(T, K)
