"""The single-stage exchange over one process group: each token goes ONCE to each rank that owns
one of its chosen experts (DeepEP's scheme; transformers sends one copy per chosen expert).

Rank ``j`` owns experts ``[j L, (j+1) L)`` with ``L = E / ep``. A *single* row (one of the
token's experts on that rank, the common case) carries nothing else: within each destination's
block single rows are sorted by local expert and the per-expert counts ride in the count
exchange, and the source applies the routing weight when the row comes back. A *multi* row
(several) carries its local ids and weights (``min(K, L)`` int32 + float32 columns), after the
single rows; the expert rank weights and sums its outputs, so one row comes back. So we never
send more bytes than transformers once a row is at least ``4 min(K, L)`` bytes
(``wire_bytes``). Reductions are fixed-order: no float atomics.

Dropless mode exchanges the counts with one host sync (``all_to_all_single`` takes host split
sizes). Capacity mode (``moe_ep.dispatch.capacity``) has fixed padded buffers and no host sync.
``send_rows`` is one exchange of rows; ``dispatch_to_ranks`` / ``combine_to_ranks`` are the
whole single-stage dispatch and combine, and the node-aware scheme (``moe_ep.dispatch.nodes``)
chains two exchanges. ``send_rows``' phases are public for that scheme and for the overlapped
layer (``moe_ep.dispatch.overlap``), which run them with other collectives in between:
``plan_rows`` (what a source knows before the counts), ``exchange_counts`` (the counts of several
exchanges in one collective) and ``ExchangeSizes.dropless`` (their sizes, read with one host sync
for them all), ``pack_rows``, the exchange, ``received_rows`` (or ``send_planned_rows`` for the
three); then ``dispatched_tokens`` and, on the way back, ``rows_of_pairs``. ARCHITECTURE.md draws
the whole flow, forward and backward."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..ops.validate import check_on_device
from .all_to_all import AllToAllRouting, AllToAllRows, Splits
from .capacity import capacity_keep_mask, expert_capacity
from .lanes import lane_group
from .layout import DispatchedTokens, DispatchLayout
from .row_ops import gather_rows, sum_rows


def _compact(valid: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of the first ``size`` True entries of the 1-D ``valid`` in order, and which of the
    ``size`` outputs are real (the tail is padding, index 0, when fewer are True). A cumsum and a
    scatter, no host sync."""
    n = valid.numel()
    device = valid.device
    pos = torch.cumsum(valid, 0) - 1
    target = torch.where(valid & (pos < size), pos, size)
    index = torch.zeros(size + 1, dtype=torch.long, device=device)
    index.scatter_(0, target, torch.arange(n, device=device))
    real = torch.arange(size, device=device) < valid.sum()
    return index[:size], real


def _slot_columns(dest_TK: torch.Tensor) -> torch.Tensor:
    """For each slot, how many earlier slots of the same token go to the same rank: the slot's
    column in that rank's row."""
    K = dest_TK.shape[1]
    earlier_KK = torch.ones(K, K, dtype=torch.bool, device=dest_TK.device).tril(-1)
    return ((dest_TK[:, :, None] == dest_TK[:, None, :]) & earlier_KK).sum(-1)


def _row_keys(dest_kept_TK: torch.Tensor, local_TK: torch.Tensor, ep: int, L: int):
    """Per (token, rank): how many of the token's kept pairs live there, and the row's key: the
    local expert of a single row, ``L`` for a multi row, ``L + 1`` when no row goes there."""
    T, device = dest_kept_TK.shape[0], dest_kept_TK.device
    slots_TR = torch.zeros(T, ep + 1, dtype=torch.long, device=device)
    slots_TR.scatter_add_(1, dest_kept_TK, torch.ones_like(dest_kept_TK))
    # amin is deterministic; only single rows (one writer) use the value.
    expert_TR = torch.full((T, ep + 1), L, dtype=torch.long, device=device)
    expert_TR.scatter_reduce_(1, dest_kept_TK, local_TK, reduce="amin")
    slots_TR, expert_TR = slots_TR[:, :ep], expert_TR[:, :ep]
    key_TR = torch.where(slots_TR == 1, expert_TR, torch.where(slots_TR > 1, L, L + 1))
    return slots_TR, key_TR


def _count_columns(key_TR: torch.Tensor, slots_TR: torch.Tensor, L: int, multi: bool) -> torch.Tensor:
    """``[ep, C]`` int32 counts for each destination: single rows per local expert, then (when
    rows can be multi) multi rows and the pairs they carry. int32 keeps the exchange no larger than
    transformers' one int64 per expert."""
    ep = key_TR.shape[1]
    keyed_RT = key_TR.t() + torch.arange(ep, device=key_TR.device)[:, None] * (L + 2)
    counts = torch.zeros(ep * (L + 2), dtype=torch.long, device=key_TR.device)
    counts.scatter_add_(0, keyed_RT.reshape(-1), torch.ones_like(keyed_RT.reshape(-1)))
    counts_RC = counts.view(ep, L + 2)
    if not multi:
        return counts_RC[:, :L].to(torch.int32)
    multi_pairs_R = (slots_TR * (key_TR == L)).sum(0)
    return torch.cat([counts_RC[:, : L + 1], multi_pairs_R[:, None]], dim=1).to(torch.int32)


def all_to_all_counts(send_RC: torch.Tensor, group) -> torch.Tensor:
    """Row ``j`` of ``send_RC`` to rank ``j`` of ``group``; returns what each rank sent this one.
    On the device: no host sync (the split sizes are equal)."""
    recv_RC = torch.empty_like(send_RC)
    dist.all_to_all_single(recv_RC, send_RC, group=lane_group(group))
    return recv_RC


def _exchange_counts_checking_tokens(send_RC: torch.Tensor, T: int, group) -> torch.Tensor:
    """Capacity mode's count exchange, with each rank's token count riding along: the padded
    blocks are sized from T, so every rank of the group must have the same T or the row exchange
    would not line up (a crash or a hang instead of an error). On the CPU the check raises here,
    on every rank, before the rows move; on CUDA it is queued on the device and fires only at the
    next synchronisation, after the mismatched row exchange was launched (see ``dispatch``)."""
    tokens = torch.full((send_RC.shape[0], 1), T, dtype=send_RC.dtype, device=send_RC.device)
    recv = all_to_all_counts(torch.cat([send_RC, tokens], dim=1), group)
    check_on_device(
        (recv[:, -1] == T).all(),
        f"capacity mode needs the same number of tokens on every rank of the expert-parallel group "
        f"(its padded buffers are sized from it); this rank has T={T}: pad the batches to one length "
        f"or use capacity_factor=None",
    )
    return recv[:, :-1]


def _exclusive_cumsum(n_R: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(n_R, 0) - n_R


@dataclass(frozen=True)
class ExchangeSizes:
    """Host-side sizes of one layer's exchanges: exact split sizes in dropless mode, fixed padded
    blocks (every split None) in capacity mode."""

    send_splits: Splits  # hidden rows to each peer
    recv_splits: Splits
    meta_send_splits: Splits  # multi rows' routing columns to each peer
    meta_recv_splits: Splits
    num_send: int
    num_recv: int
    num_meta_send: int
    num_pairs: int  # (received row, local expert) pairs this rank computes
    rows_per_rank: int | None = None  # capacity mode's block sizes
    meta_per_rank: int | None = None

    @classmethod
    def dropless(cls, counts: list[tuple[torch.Tensor, torch.Tensor, int, bool]]) -> list["ExchangeSizes"]:
        """The sizes of each of several exchanges (``overlap_chunks``' chunks, the node-aware
        scheme's two stages), read at once; ``counts``: each exchange's ``(send_RC, recv_RC,
        experts_per_rank, multi)``."""
        # host sync: the one of a dropless layer (single-stage or node-aware, with or without
        # overlap_chunks); all_to_all_single takes host split sizes.
        tables = [table for send_RC, recv_RC, _, _ in counts for table in (send_RC, recv_RC)]
        host = torch.cat([table.reshape(-1) for table in tables]).tolist()
        sizes, start = [], 0
        for send_RC, _, L, multi in counts:
            peers, width = send_RC.shape
            block = [host[start + p * width:start + (p + 1) * width] for p in range(2 * peers)]
            sizes.append(cls._of_counts(block[:peers], block[peers:], L, multi))
            start += 2 * peers * width
        return sizes

    @classmethod
    def _of_counts(cls, send_host: list[list[int]], recv_host: list[list[int]], L: int, multi: bool
                   ) -> "ExchangeSizes":
        send_splits = tuple(sum(c[: L + 1]) for c in send_host)
        recv_splits = tuple(sum(c[: L + 1]) for c in recv_host)
        meta_send_splits = tuple(c[L] for c in send_host) if multi else ()
        meta_recv_splits = tuple(c[L] for c in recv_host) if multi else ()
        return cls(
            send_splits, recv_splits, meta_send_splits, meta_recv_splits,
            num_send=sum(send_splits), num_recv=sum(recv_splits), num_meta_send=sum(meta_send_splits),
            num_pairs=sum(sum(c[:L]) + (c[L + 1] if multi else 0) for c in recv_host),
        )

    @classmethod
    def padded(cls, T: int, L: int, k_max: int, ep: int, capacity: int) -> "ExchangeSizes":
        # A row carries >= 1 kept pair (a multi row >= 2), of at most L * capacity per destination.
        rows_per_rank, meta_per_rank = min(T, L * capacity), min(T, L * capacity // 2)
        return cls(
            None, None, None, None,
            num_send=ep * rows_per_rank, num_recv=ep * rows_per_rank, num_meta_send=ep * meta_per_rank,
            num_pairs=min(ep * rows_per_rank * k_max, ep * L * capacity),
            rows_per_rank=rows_per_rank, meta_per_rank=meta_per_rank,
        )


@dataclass(frozen=True)
class _Blocks:
    """One side's view of the row exchange: for each peer, where its block of rows (and of multi
    rows' routing columns) starts in the buffer, and how many single rows open it."""

    row_base_R: torch.Tensor
    meta_base_R: torch.Tensor
    singles_R: torch.Tensor
    rows_R: torch.Tensor

    @classmethod
    def of(cls, counts_RC: torch.Tensor, L: int, sizes: ExchangeSizes) -> "_Blocks":
        counts_RC = counts_RC.long()
        singles_R = counts_RC[:, :L].sum(1)
        multi_R = counts_RC[:, L] if counts_RC.shape[1] > L else torch.zeros_like(singles_R)
        rows_R = singles_R + multi_R
        if sizes.rows_per_rank is None:
            row_base_R, meta_base_R = _exclusive_cumsum(rows_R), _exclusive_cumsum(multi_R)
        else:
            peers_R = torch.arange(counts_RC.shape[0], device=counts_RC.device)
            row_base_R, meta_base_R = peers_R * sizes.rows_per_rank, peers_R * sizes.meta_per_rank
        return cls(row_base_R, meta_base_R, singles_R, rows_R)


def _row_positions(key_TR: torch.Tensor, blocks: _Blocks, L: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each (token, rank) row goes in the send buffer, and (multi rows) its routing row.
    Inside a destination's block: single rows by local expert, then multi rows; token order
    within each (one stable sort; rows that go nowhere sort last)."""
    T, ep = key_TR.shape
    device = key_TR.device
    valid_RT = key_TR.t() <= L
    sort_key = torch.where(valid_RT, torch.arange(ep, device=device)[:, None] * (L + 1) + key_TR.t(), ep * (L + 1))
    order = torch.sort(sort_key.reshape(-1), stable=True).indices
    sorted_pos = torch.empty_like(order)
    sorted_pos[order] = torch.arange(order.numel(), device=device)
    in_block_RT = sorted_pos.view(ep, T) - _exclusive_cumsum(blocks.rows_R)[:, None]
    row_pos_RT = blocks.row_base_R[:, None] + in_block_RT
    meta_pos_RT = blocks.meta_base_R[:, None] + in_block_RT - blocks.singles_R[:, None]
    return row_pos_RT, meta_pos_RT


def _pack_rows(x_TH, token_src_TC, source_reader_S, padded: bool) -> torch.Tensor:
    """One hidden row per (token, destination), at the positions ``_return_slots`` gives them.
    Capacity mode's padding rows repeat row 0; no pair reads them and they pass no gradient."""
    T, r_max = token_src_TC.shape
    row_token_S = torch.where(source_reader_S < T * r_max, source_reader_S // r_max, 0)
    return gather_rows(x_TH, row_token_S, token_src_TC, padded=padded)


def _pack_routing(idx_TK, w_TK, dest_kept_TK, key_TR, meta_pos_RT, L: int, k_max: int, num_meta: int):
    """The routing columns of the multi rows: local expert ids (``L`` = empty) and weights."""
    ep = key_TR.shape[1]
    dest_TK = dest_kept_TK.clamp(max=ep - 1)
    multi_TK = (dest_kept_TK < ep) & (key_TR.gather(1, dest_TK) == L)
    meta_pos_TK = meta_pos_RT.t().gather(1, dest_TK)
    trash = num_meta * k_max
    slot_target = torch.where(multi_TK, meta_pos_TK * k_max + _slot_columns(dest_kept_TK), trash).reshape(-1)
    ids = torch.full((trash + 1,), L, dtype=torch.int32, device=idx_TK.device)
    ids.scatter_(0, slot_target, (idx_TK % L).reshape(-1).to(torch.int32))
    weights = torch.zeros(trash + 1, dtype=torch.float32, device=idx_TK.device)
    weights = weights.scatter(0, slot_target, w_TK.reshape(-1).float())  # out of place: differentiable
    return weights[:trash].view(num_meta, k_max), ids[:trash].view(num_meta, k_max)


def _received_slots(recv_RC, blocks: _Blocks, sizes: ExchangeSizes, w_meta, ids_meta, L: int, k_max: int):
    """``[S, k_max]`` local expert ids (``L`` = empty) and weights of every received row: a single
    row's expert comes from the counts (weight 1: the source applies the routing weight), a multi
    row's columns from the routing exchange; capacity mode's padding rows are empty."""
    ep, device, num_recv = recv_RC.shape[0], recv_RC.device, sizes.num_recv
    per_block = recv_RC[:, : L + 1].long()
    if sizes.rows_per_rank is not None:
        per_block = torch.cat([per_block, sizes.rows_per_rank - blocks.rows_R[:, None]], dim=1)
    key_values = torch.arange(per_block.shape[1], device=device).repeat(ep)
    key_S = torch.repeat_interleave(key_values, per_block.reshape(-1), output_size=num_recv)
    single_S = key_S < L
    ids_SC = torch.full((num_recv, k_max), L, dtype=torch.int32, device=device)
    ids_SC[:, 0] = torch.where(single_S, key_S, L).to(torch.int32)
    w_SC = torch.zeros(num_recv, k_max, dtype=torch.float32, device=device)
    w_SC[:, 0] = single_S.float()
    if w_meta is None:
        return w_SC, ids_SC
    block_S = torch.repeat_interleave(torch.arange(ep, device=device), per_block.sum(1), output_size=num_recv)
    s = torch.arange(num_recv, device=device)
    meta_S = blocks.meta_base_R[block_S] + s - blocks.row_base_R[block_S] - blocks.singles_R[block_S]
    multi_S = key_S == L
    meta_S = torch.where(multi_S, meta_S, w_meta.shape[0])  # the padding row appended below
    ids_pad = F.pad(ids_meta, (0, 0, 0, 1), value=L)
    w_pad = F.pad(w_meta, (0, 0, 0, 1))
    return torch.where(multi_S[:, None], w_pad[meta_S], w_SC), torch.where(multi_S[:, None], ids_pad[meta_S], ids_SC)


def _expert_pairs(x_recv, w_recv, ids_recv, L: int, num_pairs: int, padded: bool):
    """One entry per (received row, local expert), in row order; for each (row, column) slot the
    entry that fills it (``num_pairs`` = none), which ``combine`` sums per row; and for each entry
    its slot (``S * k_max`` = none: capacity mode's padding)."""
    S, k_max = ids_recv.shape
    ids_flat = ids_recv.reshape(-1)  # slot s * k_max + c of the [S, C] table
    pair_slot, pair_real = _compact(ids_flat < L, num_pairs)
    expert_Q = ids_flat[pair_slot].long()
    weight_Q = w_recv.reshape(-1)[pair_slot]
    if padded:  # capacity mode's tail entries: expert 0, weight 0, output exactly 0
        expert_Q = torch.where(pair_real, expert_Q, 0)
        weight_Q = torch.where(pair_real, weight_Q, 0.0)
    pair_reader = torch.where(pair_real, pair_slot, S * k_max)
    row_src = torch.full((S * k_max + 1,), num_pairs, dtype=torch.long, device=ids_flat.device)
    row_src.scatter_(0, pair_reader, torch.arange(num_pairs, device=ids_flat.device))
    row_src_SC = row_src[: S * k_max].view(S, k_max)
    if _pairs_are_rows(num_pairs, S, padded):
        hidden_QH = x_recv  # no copy: pair q is row q
    else:
        hidden_QH = gather_rows(x_recv, pair_slot // k_max, row_src_SC, padded=padded)
    return hidden_QH, expert_Q[:, None], weight_Q[:, None], row_src_SC, pair_reader


def _pairs_are_rows(num_pairs: int, num_rows: int, padded: bool) -> bool:
    """Whether the pairs are the received rows themselves, in order: in dropless mode every row
    carries at least one pair and a multi row two, so as many pairs as rows means every row is
    single. Always so with one expert per rank (Mixtral-8x7B over ep=8) or top-1 routing; then
    neither the pairs' gather in ``dispatch`` nor the per-row sum in ``combine`` is needed."""
    return not padded and num_pairs == num_rows


def _return_slots(slots_TR, row_pos_RT, w_TK, dest_kept_TK, r_max: int, num_send: int):
    """For token t's c-th destination (rank order), the row of both exchanges that carries it
    (``num_send`` = no such destination) and the factor the source applies to the returned row:
    the routing weight for a single row (returned unweighted), 1 for a multi row (weighted and
    summed on the expert rank). Also, for each row, its (token, column) as ``t * r_max + c``
    (``T * r_max`` = a padding row)."""
    T, ep = slots_TR.shape
    device = slots_TR.device
    goes_TR = slots_TR > 0
    # A single row's (token, rank) cell receives exactly one weight; dropped pairs go to column ep.
    single_w_TR = torch.zeros(T, ep + 1, dtype=torch.float32, device=device)
    single_w_TR = single_w_TR.scatter_add(1, dest_kept_TK, w_TK.float())[:, :ep]
    factor_TR = torch.where(slots_TR == 1, single_w_TR, 1.0)
    column_TR = torch.cumsum(goes_TR, 1) - 1
    target = torch.where(goes_TR, torch.arange(T, device=device)[:, None] * r_max + column_TR, T * r_max).reshape(-1)
    token_src = torch.full((T * r_max + 1,), num_send, dtype=torch.long, device=device)
    token_src.scatter_(0, target, row_pos_RT.t().reshape(-1))
    token_src_TC = token_src[: T * r_max].view(T, r_max)
    source_reader = torch.full((num_send + 1,), T * r_max, dtype=torch.long, device=device)
    source_reader.scatter_(0, token_src_TC.reshape(-1), torch.arange(T * r_max, device=device))
    factor = torch.ones(T * r_max + 1, dtype=torch.float32, device=device).scatter(0, target, factor_TR.reshape(-1))
    return token_src_TC, source_reader[:num_send], factor[: T * r_max].view(T, r_max)


@dataclass(frozen=True)
class SentRows:
    """One exchange of rows seen from both sides: on the destination, the received rows with
    their routing (``[S, C]`` local expert ids, ``L`` = empty, and the weights the destination
    applies); on the source, the sizes and the ``[T, C]`` tables that bring each token's rows
    back (``DispatchLayout``'s fields of the same names)."""

    x_recv_SH: torch.Tensor
    w_recv_SC: torch.Tensor
    ids_recv_SC: torch.Tensor
    sizes: ExchangeSizes
    token_src: torch.Tensor
    source_reader: torch.Tensor
    source_weights: torch.Tensor


@dataclass(frozen=True)
class RowPlan:
    """What a source knows of one exchange before the counts are exchanged: each (token, rank)
    row's key and pair count, and the ``[ep, C]`` counts it sends."""

    idx_TK: torch.Tensor  # int64 global expert ids
    w_TK: torch.Tensor
    dest_kept_TK: torch.Tensor  # the destination rank of each kept pair, ep = nowhere
    slots_TR: torch.Tensor
    key_TR: torch.Tensor
    send_RC: torch.Tensor
    experts_per_rank: int
    # Rows can carry several experts: the same on every rank, so every rank enters the routing
    # exchange or none.
    multi: bool

    @property
    def k_max(self) -> int:
        return min(self.idx_TK.shape[1], self.experts_per_rank)


def plan_rows(idx_TK, w_TK, ep: int, num_experts: int, kept_TK=None) -> RowPlan:
    """One row per (token, destination rank); pairs outside ``kept_TK`` go nowhere."""
    L = num_experts // ep
    idx_TK = idx_TK.long()
    dest_TK = idx_TK // L
    dest_kept_TK = dest_TK if kept_TK is None else torch.where(kept_TK, dest_TK, ep)  # ep = "nowhere"
    slots_TR, key_TR = _row_keys(dest_kept_TK, idx_TK % L, ep, L)
    multi = min(idx_TK.shape[1], L) > 1
    send_RC = _count_columns(key_TR, slots_TR, L, multi)
    return RowPlan(idx_TK, w_TK, dest_kept_TK, slots_TR, key_TR, send_RC, L, multi)


def exchange_counts(plans: list[RowPlan], group) -> list[tuple[torch.Tensor, ExchangeSizes]]:
    """Dropless: the counts of several exchanges over ``group`` in one collective, and for each its
    received counts and exact sizes, read with one host sync for them all."""
    widths = [plan.send_RC.shape[1] for plan in plans]
    recv = all_to_all_counts(torch.cat([plan.send_RC for plan in plans], dim=1), group)
    recv_RCs = recv.split(widths, dim=1)
    sizes = ExchangeSizes.dropless([(plan.send_RC, recv_RC, plan.experts_per_rank, plan.multi)
                                    for plan, recv_RC in zip(plans, recv_RCs)])
    return list(zip(recv_RCs, sizes))


@dataclass(frozen=True)
class PackedRows:
    """A source's send buffers of one exchange (rows, and the multi rows' routing columns) and
    the tables that bring each token's rows back."""

    x_send: torch.Tensor
    w_send: torch.Tensor | None
    ids_send: torch.Tensor | None
    token_src: torch.Tensor
    source_reader: torch.Tensor
    source_weights: torch.Tensor


def pack_rows(hidden_states, plan: RowPlan, sizes: ExchangeSizes, padded: bool) -> PackedRows:
    """The send buffers of ``plan`` at the positions the exchanged counts give them."""
    L, k_max = plan.experts_per_rank, plan.k_max
    send_blocks = _Blocks.of(plan.send_RC, L, sizes)
    row_pos_RT, meta_pos_RT = _row_positions(plan.key_TR, send_blocks, L)
    r_max = min(plan.idx_TK.shape[1], plan.key_TR.shape[1])
    token_src_TC, source_reader_S, source_weights_TC = _return_slots(
        plan.slots_TR, row_pos_RT, plan.w_TK, plan.dest_kept_TK, r_max, sizes.num_send
    )
    x_send = _pack_rows(hidden_states, token_src_TC, source_reader_S, padded=padded)
    w_send = ids_send = None
    if plan.multi:
        w_send, ids_send = _pack_routing(plan.idx_TK, plan.w_TK, plan.dest_kept_TK, plan.key_TR, meta_pos_RT, L,
                                         k_max, sizes.num_meta_send)
    return PackedRows(x_send, w_send, ids_send, token_src_TC, source_reader_S, source_weights_TC)


def received_rows(plan: RowPlan, packed: PackedRows, recv_RC, sizes: ExchangeSizes, x_recv, w_meta, ids_meta
                  ) -> SentRows:
    """The exchange seen from both sides once the rows (and routing columns) arrived."""
    L = plan.experts_per_rank
    recv_blocks = _Blocks.of(recv_RC, L, sizes)
    w_recv, ids_recv = _received_slots(recv_RC, recv_blocks, sizes, w_meta, ids_meta, L, plan.k_max)
    return SentRows(x_recv, w_recv, ids_recv, sizes, packed.token_src, packed.source_reader, packed.source_weights)


def send_rows(hidden_states, idx_TK, w_TK, group, num_experts: int, kept_TK=None, capacity: int | None = None
              ) -> SentRows:
    """One row per (token, destination rank) of ``group``, with the routing of the rows that
    carry several experts. Pairs outside ``kept_TK`` go nowhere (capacity mode's drops, or a
    forwarded row's empty columns); ``capacity``: capacity mode's fixed padded blocks, else exact
    sizes (the one host sync of the exchange)."""
    ep = dist.get_world_size(group)
    plan = plan_rows(idx_TK, w_TK, ep, num_experts, kept_TK)
    if capacity is None:
        [(recv_RC, sizes)] = exchange_counts([plan], group)
    else:
        recv_RC = _exchange_counts_checking_tokens(plan.send_RC, idx_TK.shape[0], group)
        sizes = ExchangeSizes.padded(idx_TK.shape[0], plan.experts_per_rank, plan.k_max, ep, capacity)
    return send_planned_rows(hidden_states, plan, recv_RC, sizes, group, padded=capacity is not None)


def send_planned_rows(hidden_states, plan: RowPlan, recv_RC, sizes: ExchangeSizes, group, *, padded: bool
                      ) -> SentRows:
    """``send_rows`` once the counts are exchanged: the rows (and routing columns) packed, sent
    and seen from both sides."""
    packed = pack_rows(hidden_states, plan, sizes, padded=padded)
    x_recv = AllToAllRows.apply(packed.x_send, sizes.recv_splits, sizes.send_splits, group)
    w_meta = ids_meta = None
    if plan.multi:
        w_meta, ids_meta = AllToAllRouting.apply(packed.w_send, packed.ids_send, sizes.meta_recv_splits,
                                                 sizes.meta_send_splits, group)
    return received_rows(plan, packed, recv_RC, sizes, x_recv, w_meta, ids_meta)


def dispatch_to_ranks(hidden_states, top_k_index, top_k_weights, group, num_experts: int,
                      capacity_factor: float | None, kept_TK=None, *, rows: bool = False) -> DispatchedTokens:
    """The single-stage dispatch over ``group``; ``kept_TK`` (dropless only) masks pairs that go
    nowhere, as the node-aware scheme's forwarded rows' empty columns do; ``rows``: the rows form
    of ``DispatchedTokens``."""
    T, K = top_k_index.shape
    capacity = None
    if capacity_factor is not None:
        capacity = expert_capacity(T, K, num_experts, capacity_factor)
        kept_TK = capacity_keep_mask(top_k_index.long(), top_k_weights, num_experts, capacity)
    sent = send_rows(hidden_states, top_k_index, top_k_weights, group, num_experts, kept_TK, capacity)
    return dispatched_tokens(sent, group, T, num_experts // dist.get_world_size(group),
                             kept_TK if capacity is not None else None, rows=rows)


def dispatched_tokens(sent: SentRows, group, num_tokens: int, L: int, capacity_kept_TK=None, *,
                      rows: bool = False) -> DispatchedTokens:
    """What the local experts compute on (the pairs of an exchange, or with ``rows`` its received
    rows, see ``DispatchedTokens``) and the layout; ``capacity_kept_TK``: capacity mode's kept
    pairs, None in dropless mode."""
    padded = capacity_kept_TK is not None
    if rows:
        hidden, expert_ids, weights = sent.x_recv_SH, sent.ids_recv_SC, sent.w_recv_SC
        row_src_SC = pair_reader_Q = None
    else:
        hidden, expert_ids, weights, row_src_SC, pair_reader_Q = _expert_pairs(
            sent.x_recv_SH, sent.w_recv_SC, sent.ids_recv_SC, L, sent.sizes.num_pairs, padded=padded
        )
    layout = DispatchLayout(
        group=group,
        num_tokens=num_tokens,
        send_splits=sent.sizes.send_splits,
        recv_splits=sent.sizes.recv_splits,
        rows_per_rank=sent.sizes.rows_per_rank,
        token_src=sent.token_src,
        source_reader=sent.source_reader,
        source_weights=sent.source_weights,
        row_src=row_src_SC,
        pair_reader=pair_reader_Q,
        num_pairs=sent.sizes.num_pairs,
        num_received=sent.x_recv_SH.shape[0],
        kept_TK=capacity_kept_TK,
    )
    return DispatchedTokens(hidden_states=hidden, expert_ids=expert_ids, weights=weights, layout=layout)


def combine_to_ranks(expert_output: torch.Tensor, layout: DispatchLayout) -> torch.Tensor:
    """The single-stage combine: ``rows_of_pairs``, then ``return_rows``."""
    return return_rows(rows_of_pairs(expert_output, layout), layout.group, layout.send_splits, layout.recv_splits,
                       layout.token_src, layout.source_reader, layout.source_weights,
                       padded=layout.rows_per_rank is not None)


def rows_of_pairs(expert_output: torch.Tensor, layout: DispatchLayout) -> torch.Tensor:
    """Each received row's pairs summed on the expert rank: the rows that go back (the experts'
    output itself where they got the rows and summed them)."""
    padded = layout.rows_per_rank is not None
    if layout.row_src is None or _pairs_are_rows(layout.num_pairs, layout.row_src.shape[0], padded):
        return expert_output
    return sum_rows(expert_output, layout.row_src, layout.pair_reader, padded=padded)


def return_rows(rows_SH, group, send_splits: Splits, recv_splits: Splits, token_src_TC, source_reader_S,
                source_weights_TC, *, padded: bool) -> torch.Tensor:
    """One row per received row back to its source (the exchange of ``send_rows`` reversed),
    where each token sums its returned rows, scaled by ``source_weights``, in float32."""
    returned = AllToAllRows.apply(rows_SH, send_splits, recv_splits, group)
    return sum_rows(returned, token_src_TC, source_reader_S, source_weights_TC, padded=padded)
