"""Synthetic routings the benchmarks share, so every implementation sees the identical
``idx_TK`` and ``w_TK``.

- ``uniform``: each token picks ``K`` distinct experts uniformly at random (a balanced router).
- ``skewed``: expert popularity follows a Zipf law of exponent ``SKEW_EXPONENT``; with E=8, k=2
  the hottest expert receives about 40% of the routed rows, the coldest about 3%, the load
  imbalance a poorly balanced router produces early in training."""

from __future__ import annotations

import torch

ROUTINGS = ("uniform", "skewed")
SKEW_EXPONENT = 1.5


def make_routing(
    routing: str, num_tokens: int, num_experts: int, top_k: int, *, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(idx_TK int64, w_TK float32)`` on the CPU; weights are positive and sum to 1 per token."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
    g = torch.Generator().manual_seed(seed)
    if routing == "uniform":
        popularity_E = torch.ones(num_experts)
    else:
        popularity_E = torch.arange(1, num_experts + 1, dtype=torch.float64).pow(-SKEW_EXPONENT).float()
    if num_tokens == 0:
        idx_TK = torch.empty(0, top_k, dtype=torch.long)
    else:
        idx_TK = torch.multinomial(popularity_E.expand(num_tokens, -1), top_k, replacement=False, generator=g)
    w_TK = torch.rand(num_tokens, top_k, generator=g) + 0.05
    return idx_TK, w_TK / w_TK.sum(-1, keepdim=True)


def max_load_share(idx_TK: torch.Tensor, num_experts: int) -> float:
    """Fraction of the routed rows that go to the busiest expert."""
    if idx_TK.numel() == 0:
        return 0.0
    counts_E = torch.bincount(idx_TK.reshape(-1).cpu(), minlength=num_experts)
    return counts_E.max().item() / idx_TK.numel()
