"""Routing rules the distributed tests apply to both sides of a comparison: the documented
capacity policy as a plain loop, and hooks that force hard routings onto a model's experts."""

import torch


def keep_mask_reference(idx_TK, w_TK, num_experts: int, capacity: int) -> torch.Tensor:
    """The documented capacity policy as a plain loop: per expert, highest weight first, lower
    token index first among equal weights, keep ``capacity``. A token that names the expert in
    several slots is one pair of their summed weight, and each of those slots gets its verdict."""
    T, K = idx_TK.shape
    keep = torch.zeros(T, K, dtype=torch.bool)
    for e in range(num_experts):
        pairs = [(t, [k for k in range(K) if idx_TK[t, k] == e]) for t in range(T)]
        pairs = [(t, slots) for t, slots in pairs if slots]
        pairs.sort(key=lambda p: (-sum(float(w_TK[p[0], k]) for k in p[1]), p[0]))
        for t, slots in pairs[:capacity]:
            keep[t, slots] = True
    return keep


def first_slots(idx_TK) -> torch.Tensor:
    """``[T, K]`` bool: the slots whose expert no earlier slot of the token names (those that
    carry a pair through the exchange)."""
    T, K = idx_TK.shape
    return torch.tensor([[int(idx_TK[t, k]) not in idx_TK[t, :k].tolist() for k in range(K)] for t in range(T)],
                        dtype=torch.bool).view(T, K)


def remap_routing(routing: str, num_experts: int, ep: int):
    """A pre-hook on each experts module that rewrites the chosen experts (top-2), applied the
    same way to the parallel model and the reference: the routing weights still come from the
    router, so every gradient path stays live."""
    L = num_experts // ep

    def first_rank_only(idx):  # every chosen expert lives on rank 0: rank 1.. receive nothing
        first = idx[:, 0] % L
        second = idx[:, 1] % L
        second = torch.where(second == first, (first + 1) % L, second)
        return torch.stack([first, second], dim=1)

    def one_expert_all(idx):  # expert E-1 is in every token's top-2
        last = torch.full_like(idx[:, 0], num_experts - 1)
        other = torch.where(idx[:, 1] == num_experts - 1, idx[:, 0], idx[:, 1])
        return torch.stack([last, other], dim=1)

    remap = {"first_rank_only": first_rank_only, "one_expert_all": one_expert_all}[routing]

    def hook(module, args):
        hidden, idx, weights = args
        return hidden, remap(idx), weights

    return hook
