"""Routing that names one expert in several of a token's K slots. ``moe_experts`` sums such slots
(a routing need not come from a top-k), but the exchanges plan at most ``L`` pairs per (token,
rank) for a rank of ``L`` experts (``rank_exchange``'s rows of ``min(K, L)`` columns), and
capacity mode ranks each expert's pairs as if a token held it once. So before the exchanges a
token's repeated expert becomes one pair: its first slot carries the summed weight, and the
later slots name expert ``E``, which lies past every rank and so goes nowhere (the ``ep``
destination every row plan already has for pairs that go nowhere)."""

from __future__ import annotations

import torch


def repeated_slots(idx_TK: torch.Tensor) -> torch.Tensor:
    """``[T, K]`` bool: the slots whose expert an earlier slot of the same token names."""
    K = idx_TK.shape[1]
    earlier_KK = torch.ones(K, K, dtype=torch.bool, device=idx_TK.device).tril(-1)
    return ((idx_TK[:, :, None] == idx_TK[:, None, :]) & earlier_KK).any(-1)


def merge_repeated_experts(idx_TK: torch.Tensor, w_TK: torch.Tensor, num_experts: int
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(idx_TK, w_TK)`` with each token's repeated expert merged into its first slot. The same
    output: ``(w1 + w2) f(x)`` for ``w1 f(x) + w2 f(x)``; and the same gradient for each of the
    repeated weights, which reaches them through the sum. Exactly the inputs where a token's
    experts are distinct (a sum with zeros); fixed shapes, no host sync."""
    if idx_TK.shape[1] == 1:
        return idx_TK, w_TK
    same_TKK = idx_TK[:, :, None] == idx_TK[:, None, :]
    # Summed in float32 at least, as moe_experts applies the weights: a bf16 sum rounds (1 + 2^-9
    # to 1), which moved outputs by 1e-3 and could drop the heavier pair in capacity mode.
    w32_TK = w_TK.to(torch.promote_types(w_TK.dtype, torch.float32))
    merged_w_TK = torch.where(same_TKK, w32_TK[:, None, :], 0).sum(-1)
    return torch.where(repeated_slots(idx_TK), num_experts, idx_TK), merged_w_TK
