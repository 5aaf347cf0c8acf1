"""The dispatcher's routing cases, shared by its single-stage and node-aware tests: every rank
builds the data of every rank from one seed, keeps its own slice and computes the float64
reference (``reference``) on all of it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_ep.ops.reference import moe_experts_ref


@dataclass(frozen=True)
class Case:
    name: str
    T: tuple[int, ...] | int  # tokens per rank
    E: int
    K: int
    H: int = 16
    I: int = 12
    routing: str = "random"  # random | first_rank | first_half | one_expert | same_rank | repeated
    capacity_factor: float | None = None
    tied_weights: bool = False
    weights_dtype: torch.dtype = torch.float32  # top_k_weights' (a router's in a bf16 model)

    def tokens(self, world: int) -> list[int]:
        return list(self.T) if isinstance(self.T, tuple) else [self.T] * world

    def make(self, world: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        E, K, L = self.E, self.K, self.E // world
        xs, idxs, ws, dys = [], [], [], []
        for T in self.tokens(world):
            xs.append(torch.randn(T, self.H, generator=g))
            if self.routing in ("random", "repeated"):
                idx = torch.rand(T, E, generator=g).topk(K, -1).indices
                if self.routing == "repeated":  # every other token names its first expert again, last
                    idx[::2, -1] = idx[::2, 0]
            elif self.routing == "first_rank":  # every expert chosen lives on rank 0
                idx = torch.rand(T, L, generator=g).topk(K, -1).indices
            elif self.routing == "first_half":  # every expert chosen lives on the first half of the ranks
                idx = torch.rand(T, E // 2, generator=g).topk(K, -1).indices
            elif self.routing == "one_expert":  # expert E-1 (last rank) in every token
                rest = torch.rand(T, E - 1, generator=g).topk(K - 1, -1).indices
                idx = torch.cat([torch.full((T, 1), E - 1), rest], dim=1)
            elif self.routing == "same_rank":  # all K experts of a token on one rank
                rank = torch.randint(0, world, (T, 1), generator=g)
                idx = rank * L + torch.rand(T, L, generator=g).topk(K, -1).indices
            else:
                raise ValueError(self.routing)
            idxs.append(idx)
            w = torch.rand(T, K, generator=g) + 0.1
            ws.append(((w * 4).round() / 4 if self.tied_weights else w).to(self.weights_dtype))
            dys.append(torch.randn(T, self.H, generator=g))
        gate_up = torch.randn(E, 2 * self.I, self.H, generator=g) / self.H**0.5
        down = torch.randn(E, self.H, self.I, generator=g) / self.I**0.5
        return xs, idxs, ws, dys, gate_up, down


def reference(xs, idxs, ws, dys, gate_up, down, kept=None):
    """Float64 ``moe_experts_ref`` on every rank's tokens at once, and its gradients: (y, dx, dw,
    d gate_up, d down) over the whole batch and every expert. ``kept``: capacity mode's kept
    pairs per rank (a dropped pair contributes nothing, so its weight gets no gradient)."""
    x64 = torch.cat(xs).double().requires_grad_()
    w64 = torch.cat(ws).double().requires_grad_()
    w64_kept = w64 if kept is None else w64 * torch.cat(kept)
    gu64, dn64 = gate_up.double().requires_grad_(), down.double().requires_grad_()
    y64 = moe_experts_ref(x64, torch.cat(idxs), w64_kept, gu64, dn64)
    (y64 * torch.cat(dys).double()).sum().backward()
    return y64.detach(), x64.grad, w64.grad, gu64.grad, dn64.grad
