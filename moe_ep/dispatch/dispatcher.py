"""Stateless expert-parallel dispatch and combine over one process group (the ``ep`` group).

Rank ``j`` of the group owns experts ``[j L, (j+1) L)`` with ``L = E / ep``. ``dispatch`` sends
each token ONCE to each rank that owns at least one of its chosen experts (DeepEP's scheme;
transformers' all-to-all sends one copy per chosen expert), together with the local ids and
routing weights of those experts. The expert rank applies the weights and sums a token's partial
outputs before ``combine`` sends one row per (token, rank) back; the source rank sums those rows.
All reductions are fixed-order sums over a padded grid: deterministic, no float atomics.

Two modes:

- dropless (``capacity_factor=None``): uneven splits. The per-layer exchange of row counts is
  the one host sync (the split sizes of ``all_to_all_single`` are host integers).
- capacity (``capacity_factor=c``): the policy of ``moe_ep.dispatch.capacity`` drops pairs beyond
  ``ceil(c T K / E)`` per expert; every buffer has a fixed, padded size and nothing is read back
  to the host.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .._validate import check_float, check_index, check_indices_in_range, check_same_device, check_tensor
from .all_to_all import AllToAllRouting, AllToAllRows
from .capacity import capacity_keep_mask, check_capacity_factor, expert_capacity
from .layout import DispatchedTokens, DispatchLayout


def check_dispatch_args(hidden_states, top_k_index, top_k_weights, group, num_experts) -> int:
    """Validates the public arguments; returns the expert-parallel group size."""
    check_tensor("hidden_states", hidden_states, ndim=2)
    check_tensor("top_k_index", top_k_index, ndim=2)
    check_tensor("top_k_weights", top_k_weights, ndim=2)
    check_float("hidden_states", hidden_states)
    check_float("top_k_weights", top_k_weights)
    check_index("top_k_index", top_k_index)
    check_same_device(hidden_states=hidden_states, top_k_index=top_k_index, top_k_weights=top_k_weights)
    if top_k_index.shape[0] != hidden_states.shape[0] or top_k_weights.shape != top_k_index.shape:
        raise ValueError(
            f"top_k_index and top_k_weights must both have shape [T={hidden_states.shape[0]}, K], got "
            f"{tuple(top_k_index.shape)} and {tuple(top_k_weights.shape)}"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup, got {type(group).__name__}")
    ep = dist.get_world_size(group)
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1 or num_experts % ep:
        raise ValueError(f"num_experts must be a positive multiple of the group size {ep}, got {num_experts!r}")
    if not 1 <= top_k_index.shape[1] <= num_experts:
        raise ValueError(f"top_k_index must choose between 1 and E={num_experts} experts, got {top_k_index.shape[1]}")
    check_indices_in_range("top_k_index", top_k_index, num_experts)
    return ep


def _compact(valid_N: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of the first ``size`` True entries of ``valid_N`` in order, and which of the
    ``size`` outputs are real (the tail is padding, index 0, when fewer are True). A cumsum and a
    scatter, no host sync."""
    n = valid_N.numel()
    device = valid_N.device
    pos_N = torch.cumsum(valid_N, 0) - 1
    target_N = torch.where(valid_N & (pos_N < size), pos_N, size)
    index = torch.zeros(size + 1, dtype=torch.long, device=device)
    index.scatter_(0, target_N, torch.arange(n, device=device))
    real = torch.arange(size, device=device) < valid_N.sum()
    return index[:size], real


def _slot_columns(dest_TK: torch.Tensor) -> torch.Tensor:
    """For each slot, how many earlier slots of the same token go to the same rank: the slot's
    column in that rank's row."""
    K = dest_TK.shape[1]
    earlier_KK = torch.ones(K, K, dtype=torch.bool, device=dest_TK.device).tril(-1)
    return ((dest_TK[:, :, None] == dest_TK[:, None, :]) & earlier_KK).sum(-1)


def _exchange_counts(rows_R: torch.Tensor, pairs_R: torch.Tensor, group, ep: int):
    """Dropless mode's count exchange: the split sizes of both row exchanges and the number of
    (row, expert) pairs this rank will compute."""
    send_counts = torch.stack([rows_R, pairs_R], dim=1)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    # host sync: the one per layer in dropless mode; all_to_all_single takes host split sizes.
    sizes = torch.cat([send_counts, recv_counts]).tolist()
    send_splits = tuple(rows for rows, _ in sizes[:ep])
    recv_splits = tuple(rows for rows, _ in sizes[ep:])
    num_pairs = sum(pairs for _, pairs in sizes[ep:])
    return send_splits, recv_splits, num_pairs


def _pack_rows(x_TH, idx_TK, w_TK, dest_kept_TK, kept_TK, goes_RT, rows_R, row_pos_RT, num_send, rows_per_rank, L, k_max):
    """The send buffers: one hidden row per (token, destination), rank-major, and for each row
    its routing columns (local expert ids, ``L`` = empty; weights) compacted to ``k_max``."""
    T, ep, device = x_TH.shape[0], goes_RT.shape[0], x_TH.device
    target_RT = torch.where(goes_RT, row_pos_RT, num_send)
    row_token = torch.zeros(num_send + 1, dtype=torch.long, device=device)
    row_token.scatter_(0, target_RT.reshape(-1), torch.arange(T, device=device).repeat(ep))
    x_SH = x_TH[row_token[:num_send]]
    if rows_per_rank is not None:  # padding rows of the fixed-size blocks are zeros
        row_real = (torch.arange(rows_per_rank, device=device)[None, :] < rows_R[:, None]).reshape(-1)
        x_SH = x_SH.masked_fill(~row_real[:, None], 0)

    row_pos_TK = row_pos_RT.t().gather(1, dest_kept_TK.clamp(max=ep - 1))
    kept = torch.ones_like(dest_kept_TK, dtype=torch.bool) if kept_TK is None else kept_TK
    trash = num_send * k_max
    slot_target = torch.where(kept, row_pos_TK * k_max + _slot_columns(dest_kept_TK), trash).reshape(-1)
    ids = torch.full((trash + 1,), L, dtype=torch.int32, device=device)
    ids.scatter_(0, slot_target, (idx_TK % L).reshape(-1).to(torch.int32))
    weights = torch.zeros(trash + 1, dtype=torch.float32, device=device)
    weights = weights.scatter(0, slot_target, w_TK.reshape(-1).float())  # out of place: differentiable
    return x_SH, ids[:trash].view(num_send, k_max), weights[:trash].view(num_send, k_max)


def _expert_pairs(x_recv, w_recv, ids_recv, L: int, num_pairs: int, padded: bool):
    """One entry per (received row, local expert), in row order, and for each (row, column) slot
    the entry that fills it (``num_pairs`` = none), which ``combine`` sums per row."""
    ids_N = ids_recv.reshape(-1)
    pair_slot, pair_real = _compact(ids_N < L, num_pairs)
    expert_P = ids_N[pair_slot].long()
    weight_P = w_recv.reshape(-1)[pair_slot]
    if padded:  # capacity mode's tail entries: expert 0, weight 0, output exactly 0
        expert_P = torch.where(pair_real, expert_P, 0)
        weight_P = torch.where(pair_real, weight_P, 0.0)
    n_slots = ids_N.numel()
    row_src = torch.full((n_slots + 1,), num_pairs, dtype=torch.long, device=ids_N.device)
    row_src.scatter_(0, torch.where(pair_real, pair_slot, n_slots), torch.arange(num_pairs, device=ids_N.device))
    hidden_PH = x_recv[pair_slot // ids_recv.shape[1]]
    return hidden_PH, expert_P[:, None], weight_P[:, None], row_src[:n_slots]


def _return_slots(goes_TR: torch.Tensor, row_pos_RT: torch.Tensor, r_max: int, num_send: int) -> torch.Tensor:
    """For token t's c-th destination (rank order), the row of the combine exchange holding its
    partial output: the row it was sent in. ``num_send`` = no such destination."""
    T, device = goes_TR.shape[0], goes_TR.device
    column_TR = torch.cumsum(goes_TR, 1) - 1
    target = torch.where(goes_TR, torch.arange(T, device=device)[:, None] * r_max + column_TR, T * r_max)
    token_src = torch.full((T * r_max + 1,), num_send, dtype=torch.long, device=device)
    token_src.scatter_(0, target.reshape(-1), row_pos_RT.t().reshape(-1))
    return token_src[: T * r_max]


def dispatch(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    num_experts: int,
    capacity_factor: float | None = None,
) -> DispatchedTokens:
    """Send this rank's tokens ``[T, H]`` to the ranks owning their chosen experts.

    ``top_k_index [T, K]`` holds global expert ids, ``top_k_weights [T, K]`` their weights. Returns
    the (row, local expert) pairs this rank's experts must compute and the layout ``combine``
    needs. Every rank of ``group`` must call it (collective), whatever its number of tokens.
    Differentiable in ``hidden_states`` and ``top_k_weights``."""
    ep = check_dispatch_args(hidden_states, top_k_index, top_k_weights, group, num_experts)
    check_capacity_factor(capacity_factor)
    device = hidden_states.device
    T, K = top_k_index.shape
    L = num_experts // ep
    k_max, r_max = min(K, L), min(K, ep)
    idx_TK = top_k_index.long()
    dest_TK = idx_TK // L

    if capacity_factor is None:
        kept_TK, dest_kept_TK = None, dest_TK
    else:
        capacity = expert_capacity(T, K, num_experts, capacity_factor)
        kept_TK = capacity_keep_mask(idx_TK, top_k_weights, num_experts, capacity)
        dest_kept_TK = torch.where(kept_TK, dest_TK, ep)  # ep = "nowhere"
    goes_TR = torch.zeros(T, ep + 1, dtype=torch.bool, device=device).scatter_(1, dest_kept_TK, True)[:, :ep]
    goes_RT = goes_TR.t()
    rows_R = goes_RT.sum(1)
    rank_in_dest_RT = torch.cumsum(goes_RT, 1) - 1

    if kept_TK is None:
        pairs_R = torch.zeros(ep, dtype=torch.long, device=device).scatter_add_(
            0, dest_TK.reshape(-1), torch.ones(T * K, dtype=torch.long, device=device)
        )
        send_splits, recv_splits, num_pairs = _exchange_counts(rows_R, pairs_R, group, ep)
        rows_per_rank = None
        num_send = sum(send_splits)
        row_pos_RT = (torch.cumsum(rows_R, 0) - rows_R)[:, None] + rank_in_dest_RT
    else:
        # Each destination gets at most min(T, L * capacity) rows: a row carries >= 1 kept pair.
        rows_per_rank = min(T, L * capacity)
        send_splits = recv_splits = None
        num_send = ep * rows_per_rank
        # At most `capacity` pairs per expert from each of the ep sources.
        num_pairs = min(num_send * k_max, ep * L * capacity)
        row_pos_RT = torch.arange(ep, device=device)[:, None] * rows_per_rank + rank_in_dest_RT

    x_send, ids_send, w_send = _pack_rows(
        hidden_states, idx_TK, top_k_weights, dest_kept_TK, kept_TK, goes_RT, rows_R, row_pos_RT, num_send,
        rows_per_rank, L, k_max,
    )
    x_recv = AllToAllRows.apply(x_send, recv_splits, send_splits, group)
    w_recv, ids_recv = AllToAllRouting.apply(w_send, ids_send, recv_splits, send_splits, group)
    hidden_PH, expert_P1, weight_P1, row_src = _expert_pairs(
        x_recv, w_recv, ids_recv, L, num_pairs, padded=kept_TK is not None
    )
    layout = DispatchLayout(
        group=group,
        num_tokens=T,
        num_experts=num_experts,
        experts_per_rank=L,
        top_k=K,
        send_splits=send_splits,
        recv_splits=recv_splits,
        rows_per_rank=rows_per_rank,
        token_src=_return_slots(goes_TR, row_pos_RT, r_max, num_send),
        max_ranks_per_token=r_max,
        row_src=row_src,
        max_slots_per_row=k_max,
        num_pairs=num_pairs,
        kept_TK=kept_TK,
    )
    return DispatchedTokens(hidden_states=hidden_PH, expert_ids=expert_P1, weights=weight_P1, layout=layout)


def _sum_groups(rows: torch.Tensor, src: torch.Tensor, groups: int, width: int) -> torch.Tensor:
    """``out[g] = sum_c rows[src[g * width + c]]`` in float32, fixed order; index ``len(rows)``
    reads a zero row."""
    padded = F.pad(rows, (0, 0, 0, 1))
    return padded[src].view(groups, width, rows.shape[1]).sum(1, dtype=torch.float32).to(rows.dtype)


def combine(expert_output: torch.Tensor, layout: DispatchLayout) -> torch.Tensor:
    """The weighted expert outputs ``[P, H]`` of ``dispatch``'s pairs back to their tokens:
    ``[T, H]`` on the source rank, in the dtype of ``expert_output``. Collective, differentiable."""
    check_tensor("expert_output", expert_output, ndim=2)
    if not isinstance(layout, DispatchLayout):
        raise TypeError(f"layout must be the DispatchLayout returned by dispatch, got {type(layout).__name__}")
    if expert_output.shape[0] != layout.num_pairs:
        raise ValueError(
            f"expert_output must have one row per dispatched pair ({layout.num_pairs}), "
            f"got shape {tuple(expert_output.shape)}"
        )
    num_recv = layout.row_src.numel() // layout.max_slots_per_row
    rows_SH = _sum_groups(expert_output, layout.row_src, num_recv, layout.max_slots_per_row)
    returned = AllToAllRows.apply(rows_SH, layout.send_splits, layout.recv_splits, layout.group)
    return _sum_groups(returned, layout.token_src, layout.num_tokens, layout.max_ranks_per_token)
