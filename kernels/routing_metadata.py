"""Routing metadata on the device: per-expert counts, block-padded offsets and the permutation that
groups the routed slots by expert, without a host sync (the idea of vLLM's ``moe_align_block_size``).

Slot ``n = t * K + k`` is the k-th expert choice of token t (``N = T * K`` slots). The grouped GEMMs
work on a *padded layout* of ``P`` rows: expert e owns rows ``[padded_offsets[e], padded_offsets[e+1])``,
its count rounded up to a multiple of ``pad_m``, so every ``pad_m`` block of rows belongs to one
expert. ``P`` comes from a static bound (``(cdiv(N, pad_m) + E) * pad_m``) so no count is ever read
back to the host; blocks past the real end are marked -1 and the GEMM programs there exit at once.

Within an expert, slots keep their original order (a stable sort), which makes every later reduction
deterministic.

A slot may also hold ``E``, "no expert" (the expert-parallel dispatcher hands over its received rows
with one column per local expert a row can carry, the unused ones empty): such a slot gets no
padded row (``slot_pos`` = ``P``, past the end, which the combine leaves out). When the caller knows
that at most ``num_routed`` slots hold a real expert, ``P`` is bounded by that count, not by ``N``.

Three launches: a per-chunk histogram, one program that scans the histograms into offsets and the
block -> expert table, and a per-chunk scatter that writes the permutation and its inverse.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .aot_spec import KernelSpec, pointer
from .runtime import on_device

# [CHUNK, E_TILE] one-hot tiles: 4096 int32 per program, which stays in registers at 4 warps.
CHUNK = 256
E_TILE = 16
# Histogram rows scanned per step, and block-table entries written per step, by the scan program.
C_TILE = 64
B_TILE = 256
NUM_WARPS = 4


class RoutingMetadata(NamedTuple):
    counts_E: torch.Tensor  # int32 [E]: slots routed to each expert
    padded_offsets_E1: torch.Tensor  # int32 [E+1]: first padded row of each expert, then the end
    sorted_slot_P: torch.Tensor  # int32 [P]: slot held by each padded row, -1 on padding rows
    slot_pos_N: torch.Tensor  # int32 [N]: padded row of each slot (the inverse permutation), P for no expert
    block_expert_B: torch.Tensor  # int32 [P / pad_m]: expert owning each block, -1 past the end
    pad_m: int


def padded_rows(num_slots: int, num_experts: int, pad_m: int) -> int:
    """Static upper bound on the padded layout: sum_e cdiv(count_e, pad_m) < cdiv(N, pad_m) + E."""
    if num_slots == 0:
        return 0
    return (triton.cdiv(num_slots, pad_m) + num_experts) * pad_m


# Counts are not specialised: one compiled variant serves every token and expert count (the one the
# AOT check compiles), instead of one per count that is 1 or a multiple of 16.
@triton.jit(do_not_specialize=["num_slots", "num_experts"])
def _histogram_kernel(idx_ptr, chunk_counts_ptr, num_slots, num_experts,
                      CHUNK: tl.constexpr, E_TILE: tl.constexpr):
    chunk = tl.program_id(0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    expert = tl.load(idx_ptr + offs, mask=offs < num_slots, other=-1).to(tl.int32)
    for e0 in range(0, num_experts, E_TILE):
        ids = e0 + tl.arange(0, E_TILE)
        hits = (expert[:, None] == ids[None, :]).to(tl.int32)
        tl.store(chunk_counts_ptr + chunk * num_experts + ids, tl.sum(hits, axis=0), mask=ids < num_experts)


@triton.jit(do_not_specialize=["num_chunks", "num_experts", "pad_m", "num_blocks"])
def _scan_kernel(chunk_counts_ptr, chunk_base_ptr, counts_ptr, padded_offsets_ptr, block_expert_ptr,
                 num_chunks, num_experts, pad_m, num_blocks,
                 C_TILE: tl.constexpr, E_TILE: tl.constexpr, B_TILE: tl.constexpr):
    # One program: the scans are over a few hundred histogram rows, cheaper than another launch.
    padded_end = tl.full((), 0, tl.int32)
    tl.store(padded_offsets_ptr, 0)
    for e0 in range(0, num_experts, E_TILE):
        ids = e0 + tl.arange(0, E_TILE)
        e_ok = ids < num_experts
        running = tl.zeros((E_TILE,), tl.int32)
        for c0 in range(0, num_chunks, C_TILE):
            cs = c0 + tl.arange(0, C_TILE)
            mask = (cs < num_chunks)[:, None] & e_ok[None, :]
            at = cs[:, None] * num_experts + ids[None, :]
            count = tl.load(chunk_counts_ptr + at, mask=mask, other=0)
            # Exclusive prefix over chunks: where this chunk's slots start inside each expert.
            tl.store(chunk_base_ptr + at, tl.cumsum(count, axis=0) - count + running[None, :], mask=mask)
            running += tl.sum(count, axis=0)
        tl.store(counts_ptr + ids, running, mask=e_ok)
        padded = tl.where(e_ok, (running + pad_m - 1) // pad_m * pad_m, 0)
        tl.store(padded_offsets_ptr + 1 + ids, tl.cumsum(padded, axis=0) + padded_end, mask=e_ok)
        padded_end += tl.sum(padded, axis=0)
    # The block table reads the offsets this program just wrote; the barrier makes them visible
    # to every thread of the program.
    tl.debug_barrier()
    for b0 in range(0, num_blocks, B_TILE):
        blocks = b0 + tl.arange(0, B_TILE)
        first_row = blocks * pad_m
        # Ends are non-decreasing, so the owner of a row is the number of experts ending at or before it.
        owner = tl.zeros((B_TILE,), tl.int32)
        for e0 in range(0, num_experts, E_TILE):
            ids = e0 + tl.arange(0, E_TILE)
            ends = tl.load(padded_offsets_ptr + 1 + ids, mask=ids < num_experts, other=2147483647)
            owner += tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
        owner = tl.where(owner < num_experts, owner, -1)
        tl.store(block_expert_ptr + blocks, owner, mask=blocks < num_blocks)


@triton.jit(do_not_specialize=["num_slots", "num_experts", "num_rows"])
def _scatter_kernel(idx_ptr, chunk_base_ptr, padded_offsets_ptr, sorted_slot_ptr, slot_pos_ptr,
                    num_slots, num_experts, num_rows, CHUNK: tl.constexpr, E_TILE: tl.constexpr):
    chunk = tl.program_id(0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    in_range = offs < num_slots
    expert = tl.load(idx_ptr + offs, mask=in_range, other=-1).to(tl.int32)
    # "No expert" (id E) gets no row; neither does a slot beyond the caller's bound on the routed
    # slots (a wrong bound must not write past the layout: it loses those slots instead).
    valid = in_range & (expert < num_experts)
    # Rank of each slot among the slots of the same expert in this chunk, counting itself.
    rank = tl.zeros((CHUNK,), tl.int32)
    for e0 in range(0, num_experts, E_TILE):
        ids = e0 + tl.arange(0, E_TILE)
        hits = (expert[:, None] == ids[None, :]).to(tl.int32)
        rank += tl.sum(tl.cumsum(hits, axis=0) * hits, axis=1)
    safe = tl.where(valid, expert, 0)
    base = tl.load(padded_offsets_ptr + safe, mask=valid, other=0)
    base += tl.load(chunk_base_ptr + chunk * num_experts + safe, mask=valid, other=0)
    pos = base + rank - 1
    placed = valid & (pos < num_rows)
    tl.store(sorted_slot_ptr + pos, offs, mask=placed)
    tl.store(slot_pos_ptr + offs, tl.where(placed, pos, num_rows), mask=in_range)


def routing_metadata(idx: torch.Tensor, num_experts: int, pad_m: int, num_routed: int | None = None
                     ) -> RoutingMetadata:
    """Metadata of the expert choices ``idx`` (any shape, int32 or int64, values in [0, E], E = no
    expert). ``num_routed``: at most this many slots hold a real expert (sizes the padded layout);
    None: any number up to all of them.

    All work is queued on ``idx``'s device; nothing is read back."""
    if idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"idx must be int32 or int64, got {idx.dtype}")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if not isinstance(pad_m, int) or pad_m < 1 or pad_m & (pad_m - 1):
        raise ValueError(f"pad_m must be a power of two, got {pad_m!r}")
    flat_N = idx.reshape(-1).contiguous()
    N, E, device = flat_N.numel(), num_experts, idx.device
    num_routed = check_num_routed(num_routed, N)
    P = padded_rows(num_routed, E, pad_m)
    int32 = dict(dtype=torch.int32, device=device)
    counts_E = torch.zeros(E, **int32)
    padded_offsets_E1 = torch.zeros(E + 1, **int32)
    sorted_slot_P = torch.full((P,), -1, **int32)
    slot_pos_N = torch.empty(N, **int32)
    block_expert_B = torch.empty(P // pad_m, **int32)
    if N > 0:
        with on_device(device):
            num_chunks = triton.cdiv(N, CHUNK)
            chunk_counts = torch.empty(num_chunks, E, **int32)
            chunk_base = torch.empty(num_chunks, E, **int32)
            _histogram_kernel[(num_chunks,)](flat_N, chunk_counts, N, E, CHUNK=CHUNK, E_TILE=E_TILE, num_warps=NUM_WARPS)
            _scan_kernel[(1,)](
                chunk_counts, chunk_base, counts_E, padded_offsets_E1, block_expert_B,
                num_chunks, E, pad_m, P // pad_m,
                C_TILE=C_TILE, E_TILE=E_TILE, B_TILE=B_TILE, num_warps=NUM_WARPS,
            )
            _scatter_kernel[(num_chunks,)](
                flat_N, chunk_base, padded_offsets_E1, sorted_slot_P, slot_pos_N, N, E, P,
                CHUNK=CHUNK, E_TILE=E_TILE, num_warps=NUM_WARPS,
            )
    return RoutingMetadata(counts_E, padded_offsets_E1, sorted_slot_P, slot_pos_N, block_expert_B, pad_m)


def check_num_routed(num_routed, num_slots: int) -> int:
    """``num_routed`` (None: ``num_slots``) as an int in ``[0, num_slots]``."""
    if num_routed is None:
        return num_slots
    if isinstance(num_routed, bool) or not isinstance(num_routed, int) or not 0 <= num_routed <= num_slots:
        raise ValueError(f"num_routed must be None or an int in [0, {num_slots}] (the slots), got {num_routed!r}")
    return num_routed


def aot_specs() -> list[KernelSpec]:
    """The three launches at Mixtral-8x7B's routing (16384 tokens, top-2 of 8 experts, 128-row
    padding), the expert ids as int32 or int64."""
    N, E, pad_m = 16384 * 2, 8, 128
    num_chunks, P = triton.cdiv(N, CHUNK), padded_rows(N, E, pad_m)
    i32 = pointer(torch.int32)
    specs = [KernelSpec(
        name="routing_scan", fn=_scan_kernel,
        args=(i32, i32, i32, i32, i32, num_chunks, E, pad_m, P // pad_m),
        constexprs={"C_TILE": C_TILE, "E_TILE": E_TILE, "B_TILE": B_TILE}, num_warps=NUM_WARPS,
    )]
    for idx_dtype, idx_type in ((torch.int32, "i32"), (torch.int64, "i64")):
        idx = pointer(idx_dtype)
        specs.append(KernelSpec(
            name=f"routing_histogram_{idx_type}", fn=_histogram_kernel, args=(idx, i32, N, E),
            constexprs={"CHUNK": CHUNK, "E_TILE": E_TILE}, num_warps=NUM_WARPS,
        ))
        specs.append(KernelSpec(
            name=f"routing_scatter_{idx_type}", fn=_scatter_kernel, args=(idx, i32, i32, i32, i32, N, E, P),
            constexprs={"CHUNK": CHUNK, "E_TILE": E_TILE}, num_warps=NUM_WARPS,
        ))
    return specs
