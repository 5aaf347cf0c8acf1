"""Bytes an expert-parallel dispatch and combine put on the wire in one forward pass, computed
from one rank's routing alone (experts are laid out contiguously: expert e lives on rank
``e // (E / ep)``). Rows a rank sends to itself are local copies and are not counted.

Two schemes:

- transformers' ``AllToAllEP``: one row per (token, chosen expert) to the expert's rank and one
  row per pair back; the sender applies the routing weights and sums. Before the rows, the
  per-expert counts are exchanged (one int64 per expert of the receiving rank) so that receivers
  know which expert each row is for.
- ours (DeepEP's scheme, DESIGN.md): one row per (token, destination rank), however many of the
  token's experts live there, carrying for each of those experts its routing weight (float32)
  and, when a rank holds more than one expert, its local id (int32); the expert rank applies the weights and sums the token's partial outputs, so
  one row per (token, rank) comes back. Dropless mode exchanges one int64 row count per peer.

The backward pass moves the same rows in the opposite directions (plus, in ours, a float32
weight gradient per pair), so the forward figures are the ones compared."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WireBytes:
    dispatch_rows: int  # token rows sent to other ranks
    combine_rows: int  # output rows sent back to other ranks
    dispatch_bytes: int  # rows, per-row metadata and the count exchange
    combine_bytes: int

    @property
    def rows(self) -> int:
        return self.dispatch_rows + self.combine_rows

    @property
    def bytes(self) -> int:
        return self.dispatch_bytes + self.combine_bytes

    def __add__(self, other: "WireBytes") -> "WireBytes":
        return WireBytes(*(a + b for a, b in zip(
            (self.dispatch_rows, self.combine_rows, self.dispatch_bytes, self.combine_bytes),
            (other.dispatch_rows, other.combine_rows, other.dispatch_bytes, other.combine_bytes),
        )))


def check_layout(num_experts: int, ep: int, rank: int) -> int:
    if ep < 1 or num_experts % ep:
        raise ValueError(f"ep must be a positive divisor of num_experts={num_experts}, got {ep}")
    if not 0 <= rank < ep:
        raise ValueError(f"rank must be in [0, ep={ep}), got {rank}")
    return num_experts // ep


def owner_rank(idx_TK: torch.Tensor, num_experts: int, ep: int) -> torch.Tensor:
    return idx_TK // (num_experts // ep)


def hf_all_to_all_bytes(idx_TK: torch.Tensor, num_experts: int, ep: int, rank: int, row_bytes: int) -> WireBytes:
    """transformers' ``AllToAllEP`` from rank ``rank`` holding ``idx_TK`` (global expert ids)."""
    local_experts = check_layout(num_experts, ep, rank)
    remote_pairs = int((owner_rank(idx_TK, num_experts, ep) != rank).sum())
    counts = (ep - 1) * local_experts * 8
    return WireBytes(remote_pairs, remote_pairs, remote_pairs * row_bytes + counts, remote_pairs * row_bytes)


def dedup_bytes(idx_TK: torch.Tensor, num_experts: int, ep: int, rank: int, row_bytes: int) -> WireBytes:
    """Our scheme from rank ``rank`` holding ``idx_TK``: a token goes once to each other rank that
    owns any of its experts, and comes back once from it."""
    local_experts = check_layout(num_experts, ep, rank)
    owner_TK = owner_rank(idx_TK, num_experts, ep)
    goes_to_TR = torch.zeros(idx_TK.shape[0], ep, dtype=torch.bool).scatter_(1, owner_TK.cpu(), True)
    goes_to_TR[:, rank] = False
    remote_rows = int(goes_to_TR.sum())
    remote_pairs = int((owner_TK != rank).sum())
    per_pair = 4 + (4 if local_experts > 1 else 0)
    dispatch = remote_rows * row_bytes + remote_pairs * per_pair + (ep - 1) * 8
    return WireBytes(remote_rows, remote_rows, dispatch, remote_rows * row_bytes)
