"""Grouped-GEMM kernels of the expert MLP and their launchers.

All kernels work on the padded layout of ``routing_metadata``: row p of an intermediate tensor
(``h_PI``, ``pre_P2I``, ...) holds slot ``sorted_slot[p]`` (token ``slot // K``), every block of
``pad_m`` rows belongs to one expert and padding rows hold -1. The forward gathers token rows
inside GEMM 1's prologue, so no permuted copy of the hidden states is made there; the backward
makes one copy of dy's rows and, later, one of x's in the padded layout (``gather_rows``), which
its GEMMs then stream through tensor descriptors instead of gathering row by row.

Forward:   ``gather_glu``   x[token] @ gate_up[e]^T, gate and up in one accumulator, the gated
                            activation in the epilogue -> h, pre
           ``rows_matmul``  h @ down[e]^T, routing weight in the epilogue -> out rows
           ``combine``      y[t] = sum_k out[pos(t, k)], a fixed-order sum in float32
Backward:  ``gather_rows``  dy rows in the padded layout -> dy_P
           ``glu_backward`` dy_P @ down[e], the activation recomputed from ``pre``
                            -> d pre, hs = w * act(gate) * up, and d(routing weight) per slot
           ``weight_grad``  per expert dy_P^T @ hs -> d down
           ``rows_matmul``  d pre @ gate_up[e] -> dx rows, then ``combine``
           ``gather_rows``  x rows in the padded layout -> x_P
           ``weight_grad``  per expert d pre^T @ x_P -> d gate_up

Intermediates in the padded layout hold zeros in their padding rows (the kernels that write them
store every live row), so the weight gradients can reduce over whole row blocks, through TMA on
sm_90, without masking them. Where PyTorch's grouped GEMM is sync-free (``library``) it is one more
candidate of every GEMM launch, timed beside the Triton configurations: as it is for dx and the
weight gradients, which are plain grouped GEMMs; for the fused ones completed by an element-wise
pass (``gather_glu``: the rows copied by ``gather_rows`` first, the activation after;
``rows_matmul`` with the routing weight: a scaling pass; ``glu_backward``: its epilogue as a pass
over dh, written over dh's buffer).

There are no atomics: every output element is written by exactly one program and reduced in a
fixed order, so two runs give the same bits. Float32 operands use IEEE dot products (no TF32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import autotune, cost
from .aot_spec import TRITON_TYPES, KernelSpec, pointer
from .autotune import Config
from .cost import MIXTRAL
from .library import GROUPED_MM, Library, grouped_mm, grouped_mm_sync_free
from .routing_metadata import RoutingMetadata, padded_rows
from .runtime import interpreting, on_device, sm_count

ACTIVATIONS = ("silu", "gelu")
# Row blocks of the padded layout grouped along M so that consecutive programs reuse the same
# weight tiles from L2; in the weight gradients, blocks of the weight's rows.
GROUP_M = 8
# The gather-sum (combine, the dispatcher's sums): 8 warps, as 4 spill on sm_90 where rows are
# not 16-byte aligned (each element then carries its own 64-bit address).
COMBINE_BLOCK_T = 32
COMBINE_BLOCK_H = 128
COMBINE_WARPS = 8
# The dispatcher's scaled gather (the sums' backward): a block of rows per program, walking H.
SCALED_GATHER_BLOCK_M = 16
SCALED_GATHER_BLOCK_H = 256
SCALED_GATHER_WARPS = 4
GATHER_BLOCK_R = 32
GATHER_BLOCK_H = 128
GATHER_WARPS = 4
# The element-wise passes that complete PyTorch's grouped GEMM where it stands in for a fused
# kernel (``library``): row blocks divide every pad_m (64 or 128), so a live block is live whole.
EPILOGUE_BLOCK_R = 32
EPILOGUE_BLOCK_C = 64
EPILOGUE_WARPS = 4
GEMM_KERNELS = ("gather_glu", "rows_matmul", "glu_backward", "weight_grad")

_HALF = (torch.bfloat16, torch.float16)


def _space(tiles: list[Config], fp32: list[Config], unaligned: list[Config],
           gelu_tiles: list[Config] | None = None, fp32_unaligned: list[Config] | None = None) -> dict:
    """A kernel's configurations: half types and float32 on aligned rows, and on rows that are not
    (``row_align`` 1), whose element-wise loads need registers for every element's address; and,
    where GELU's longer epilogue (erf) spills in a tile SiLU's does not, the half types' for GELU."""
    space = {"half": tiles, "fp32": fp32, "half_unaligned": unaligned,
             "fp32_unaligned": fp32_unaligned or _FP32_UNALIGNED}
    if gelu_tiles is not None:
        space["half_gelu"] = gelu_tiles
    return space


# Configuration spaces per architecture family, kernel and dtype, best first (the first eligible
# one is used when nothing is timed). BLOCK_M of the row kernels must divide the metadata's pad_m
# (64 or 128, see ``routing_block``), so each row kernel has a 64-row tile too; BLOCK_K of the
# weight gradients steps over an expert's rows and must divide pad_m as well. Launches whose rows
# are 16-byte aligned (``row_align``; the launchers align base addresses) choose from the aligned
# spaces, where TMA configurations live; the others from the unaligned ones. Float32 runs on IEEE
# FMAs, not tensor cores, and is there for accuracy: one small tile. Each tile is the largest that
# compiles without spills and fits shared memory on its architecture under Triton 3.6 and 3.9
# (``python -m moe_ep.kernels.aot``).
_FP32_TILE = [Config(64, 32, 32, num_warps=8, num_stages=2)]
# gather_glu's BLOCK_N counts gate and up columns together: its tiles are twice as wide for the
# same work per column of h.
_FP32_GATHER_GLU = [Config(64, 64, 32, num_warps=8, num_stages=2)]
# glu_backward's epilogue splits the columns in halves: 16-column halves of the float32 tile
# spill 8 bytes, 32-column ones do not.
_FP32_GLU_BWD = [Config(64, 64, 32, num_warps=8, num_stages=2)]
# Rows that are not 16-byte aligned load element by element (no vector loads, no cp.async, no
# TMA): every element of a tile needs its own address registers, so the tiles are small.
# glu_backward's epilogue takes 32 columns, gather_glu 32 of gate and 32 of up.
_UNALIGNED = [Config(64, 64, 32, 8, 2)]
_UNALIGNED_GATHER_GLU = [Config(64, 64, 32, 4, 2)]
_UNALIGNED_GLU_BWD = [Config(64, 32, 32, 4, 2)]
# Float32 on unaligned rows: the aligned tiles' cp.async of single elements spill 8-48 bytes on
# sm_80 and sm_90 (glu_backward, the dx product); a 16-deep reduction step does not.
_FP32_UNALIGNED = [Config(64, 64, 16, 8, 2)]
# ... except the weight gradients, whose two pointer-loaded operands spill 8 B on sm_90 at a
# 16-row step and none at 32.
_FP32_UNALIGNED_WEIGHT_GRAD = [Config(64, 64, 32, 8, 2)]
# sm_90's narrower gather_glu tiles: 64 or 128 rows by 64 gate and 64 up columns.
_SM90_GATHER_GLU_NARROW = [Config(128, 128, 64, 8, 4, tma=True, persistent=True), Config(128, 128, 64, 8, 4),
                           Config(64, 128, 64, 4, 4)]
# sm_90's smaller glu_backward tiles, after the 128x128 one (whose depth depends on the activation).
_SM90_GLU_BWD_SMALL = [Config(64, 128, 64, 8, 3, tma=True, persistent=True), Config(128, 64, 64, 8, 4),
                       Config(64, 64, 64, 4, 4)]
CONFIGS = {
    # H100: 227 KB of shared memory per block, wgmma with the accumulator in registers, TMA. Where a
    # kernel is unchanged since the sweep, the order is what an H100 80GB HBM3 measured at
    # Mixtral-8x7B shapes (T=16384, bf16; 2026-11-25, scripts/sweep_configs.py,
    # benchmarks/results/sweep_configs_*): the fastest that does not spill first. The one-accumulator
    # gather_glu, glu_backward with dy through TMA and the weight gradients over padded copies are
    # newer than that sweep: their first tiles are the rows_matmul shape (128x256x64, the kernel at
    # cuBLAS's rate), chosen by the AOT check and the cost model, not yet measured.
    "sm_90": {
        # 128 gate and 128 up columns in one 128x256 accumulator, the weights through TMA. (With two
        # accumulators, 128x64 each, cp.async measured faster than TMA: 16.6 against 18.6 ms.)
        # GELU's epilogue (erf) spills 56 B in the 128x256 tile: it starts at 128x128.
        "gather_glu": _space([Config(128, 256, 64, 8, 4, tma=True, persistent=True), *_SM90_GATHER_GLU_NARROW],
                             _FP32_GATHER_GLU, _UNALIGNED_GATHER_GLU,
                             gelu_tiles=_SM90_GATHER_GLU_NARROW),
        "rows_matmul": _space([Config(128, 256, 64, 8, 4, tma=True, persistent=True),
                               Config(64, 256, 64, 4, 4, tma=True, persistent=True),
                               Config(128, 128, 64, 8, 4), Config(64, 128, 64, 4, 3)], _FP32_TILE, _UNALIGNED),
        # With dy through TMA too, four stages; the sweep measured four at 8.7 ms, three at 9.7.
        "glu_backward": _space([Config(128, 128, 64, 8, 4, tma=True, persistent=True),
                                Config(128, 128, 64, 8, 3, tma=True, persistent=True), *_SM90_GLU_BWD_SMALL],
                               _FP32_GLU_BWD, _UNALIGNED_GLU_BWD,
                               gelu_tiles=[Config(128, 128, 64, 8, 2, tma=True, persistent=True),
                                           *_SM90_GLU_BWD_SMALL]),
        # Both operands through TMA: the rows_matmul tile first; then the 32-row steps five deep
        # that were fastest with one operand gathered (16.9 and 8.5 ms).
        "weight_grad": _space([Config(128, 256, 64, 8, 4, tma=True, persistent=True),
                               Config(256, 128, 32, 8, 5, tma=True, persistent=True),
                               Config(128, 256, 32, 8, 5, tma=True, persistent=True),
                               Config(128, 256, 32, 8, 5)], _FP32_TILE, _UNALIGNED,
                              fp32_unaligned=_FP32_UNALIGNED_WEIGHT_GRAD),
    },
    # A100: 163 KB of shared memory per block, mma.sync with operands in registers, cp.async.
    "sm_80": {
        # mma.sync keeps its operands in registers too: 128x256 gate/up and 128x256 dx spill.
        "gather_glu": _space([Config(128, 128, 32, 8, 4), Config(64, 256, 32, 4, 4)], _FP32_GATHER_GLU,
                             _UNALIGNED_GATHER_GLU),
        "rows_matmul": _space([Config(128, 128, 32, 8, 4), Config(64, 128, 32, 4, 4)], _FP32_TILE, _UNALIGNED),
        "glu_backward": _space([Config(128, 128, 32, 8, 3), Config(64, 128, 32, 8, 4)], _FP32_GLU_BWD,
                               _UNALIGNED_GLU_BWD),
        "weight_grad": _space([Config(128, 256, 32, 8, 4)], _FP32_TILE, _UNALIGNED,
                              fp32_unaligned=_FP32_UNALIGNED_WEIGHT_GRAD),
    },
    # Any other GPU (sm_86 and sm_89 have 99 KB of shared memory per block), and the interpreter.
    "default": {
        "gather_glu": _space([Config(64, 128, 64, 4, 3), Config(128, 128, 64, 8, 3)], _FP32_GATHER_GLU,
                             _UNALIGNED_GATHER_GLU),
        "rows_matmul": _space([Config(64, 128, 64, 4, 3), Config(128, 128, 64, 8, 3)], _FP32_TILE, _UNALIGNED),
        "glu_backward": _space([Config(64, 64, 64, 4, 3), Config(128, 64, 64, 8, 3)], _FP32_GLU_BWD,
                               _UNALIGNED_GLU_BWD),
        "weight_grad": _space([Config(128, 128, 64, 8, 3)], _FP32_TILE, _UNALIGNED,
                              fp32_unaligned=_FP32_UNALIGNED_WEIGHT_GRAD),
    },
}
# The compute capability each family is compiled for by the AOT check.
FAMILY_ARCHS = {"sm_90": (90,), "sm_80": (80,), "default": (80, 90)}


def routing_block(num_slots: int, num_experts: int) -> int:
    """Padding of each expert's rows (the metadata's ``pad_m``): 128-row tiles once experts get
    enough rows for them, else 64, the smallest M at which Hopper's wgmma is used."""
    return 128 if num_slots >= 256 * num_experts else 64


def arch_family(device: torch.device) -> str:
    """The configuration space for ``device``: "sm_90", "sm_80" or "default"."""
    arch = autotune.device_arch(device)
    return arch if arch in ("sm_90", "sm_80") else "default"


def configs_for(kernel: str, dtype: torch.dtype, family: str = "default", pad_m: int | None = None,
                aligned: bool = True, gelu: bool = False) -> list[Config]:
    """The configurations ``kernel`` may launch with: those of the space for ``dtype``, for aligned
    rows (``row_align`` > 1) or not and, where the space has its own, for GELU; less those whose
    tile does not divide ``pad_m``."""
    spaces = CONFIGS[family][kernel]
    name = ("half" if dtype in _HALF else "fp32") + ("" if aligned else "_unaligned")
    space = spaces.get(name + "_gelu", spaces[name]) if gelu else spaces[name]
    return [c for c in space
            if pad_m is None or pad_m % (c.BLOCK_K if kernel == "weight_grad" else c.BLOCK_M) == 0]


# ----------------------------------------------------------------------------------------------
# Triton helpers


# INTERPRETED (a constexpr, True only under TRITON_INTERPRET=1) works around two bugs of the
# Triton 3.9 interpreter: tl.dot on bfloat16 multiplies raw bit patterns (so operands are upcast
# to float32 first), and float32 -> bfloat16 conversions truncate instead of rounding to nearest
# even (see _downcast). Dots are written out in place rather than through a helper: the
# interpreter re-patches triton.language on every helper call, which dominates its run time in
# an inner loop. input_precision="ieee" only matters for float32 operands (no TF32); half types
# still lower to mma / wgmma.


@triton.jit
def _downcast(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """float32 -> dtype, rounding to nearest even."""
    if INTERPRETED and dtype == tl.bfloat16:
        # Round the float32 bits at bfloat16 precision, so the interpreter's truncation is exact.
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _aligned(size, ALIGN: tl.constexpr):
    """``size``, a multiple of ALIGN, spelled so that the compiler knows it (see "Specialisation")."""
    if ALIGN > 1:
        size = size // ALIGN * ALIGN
    return size


@triton.jit
def _act(g, GELU: tl.constexpr):
    """act(g) in float32: GELU (erf form, as torch's default) or SiLU."""
    if GELU:
        a = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
    else:
        a = g / (1.0 + tl.exp(-g))
    return a


@triton.jit
def _act_and_grad(g, GELU: tl.constexpr):
    """(act(g), d act / d g) in float32."""
    if GELU:
        cdf = 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))
        a = g * cdf
        da = cdf + g * 0.3989422804014327 * tl.exp(-0.5 * g * g)
    else:
        sig = 1.0 / (1.0 + tl.exp(-g))
        a = g * sig
        da = sig * (1.0 + g * (1.0 - sig))
    return a, da


# ----------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _tile(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of tile number ``tile``, GROUP_M row blocks at a time."""
    per_group = GROUP_M * num_pid_n
    first_m = (tile // per_group) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % group_m
    pid_n = (tile % per_group) // group_m
    return pid_m, pid_n


# Every GEMM loops over its tiles with a stride of the grid size: one tile per program when the
# grid covers every tile, a persistent loop when the launcher gives it one program per SM. The
# row kernels read how many padded rows are live from the metadata (padded_offsets[E]), so the
# static bound on P costs nothing beyond the real end.
#
# Specialisation: the JIT compiles one variant per constexpr value and per integer argument that
# is 1 or a multiple of 16, and each must compile without spills (the AOT check compiles exactly
# those the launchers can launch). So the sizes and counts are not specialised (do_not_specialize;
# top_k only for 1, a real gain); instead ALIGN, a constexpr that the launcher sets from the sizes
# (``row_align``), tells the compiler that every row starts 16-byte aligned (``_aligned``), and
# pointers are always 16-byte aligned (the launchers copy a view that is not).
#
# TMA (a constexpr) loads the operands that are not gathered through tensor descriptors: the
# expert weights (one descriptor over all experts, the expert as its leading coordinate, so an
# edge tile reads zeros past the expert's own rows instead of its neighbour's) and the row
# operands already in the padded layout. Gathered token rows stay on pointer loads (cp.async).


@triton.jit
def _split_columns(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The left and right halves of an accumulator's columns, each [BLOCK_M, BLOCK_N // 2]."""
    return tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))


@triton.jit
def _glu_forward_epilogue(gate, up, rows, cols, pre_ptr, h_ptr, I, GELU: tl.constexpr, INTERPRETED: tl.constexpr):
    """Stores pre (gate and up at ``cols``) and h = act(gate) * up for one sub-tile of columns."""
    out_mask = (cols < I)[None, :]
    pre_ptrs = pre_ptr + rows[:, None].to(tl.int64) * (2 * I) + cols[None, :]
    tl.store(pre_ptrs, _downcast(gate, pre_ptr.dtype.element_ty, INTERPRETED), mask=out_mask)
    tl.store(pre_ptrs + I, _downcast(up, pre_ptr.dtype.element_ty, INTERPRETED), mask=out_mask)
    h_ptrs = h_ptr + rows[:, None].to(tl.int64) * I + cols[None, :]
    tl.store(h_ptrs, _downcast(_act(gate, GELU) * up, h_ptr.dtype.element_ty, INTERPRETED), mask=out_mask)


@triton.jit(do_not_specialize=["num_rows", "H", "I", "num_experts", "pad_m"], do_not_specialize_on_alignment=["top_k"])
def _gather_glu_kernel(
    x_ptr, w_ptr, padded_offsets_ptr, block_expert_ptr, sorted_slot_ptr, h_ptr, pre_ptr,
    num_rows, H, I, num_experts, top_k, pad_m,
    GELU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, TMA: tl.constexpr, ALIGN: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """pre[p] = gate_up[e] @ x[token(p)]; h[p] = act(pre gate half) * pre up half.

    One accumulator of BLOCK_N columns holds BLOCK_N / 2 gate columns and the same BLOCK_N / 2 up
    columns side by side (gate rows c and I + c of the weight as one B tile), so each reduction
    step is one wide MMA, as in ``_rows_matmul_kernel``, rather than two narrow ones; the epilogue
    splits it into the two halves and works on one quarter of the columns at a time."""
    H = _aligned(H, ALIGN)
    I = _aligned(I, ALIGN)
    HALF_N: tl.constexpr = BLOCK_N // 2
    num_pid_n = tl.cdiv(I, HALF_N)
    live_m = tl.load(padded_offsets_ptr + num_experts) // BLOCK_M
    if TMA:
        # gate_up as [E, 2, I, H]: one box covers HALF_N gate rows and the matching up rows.
        w_desc = tl.make_tensor_descriptor(
            w_ptr, shape=[num_experts, 2, I, H], strides=[2 * I * H, I * H, H, 1],
            block_shape=[1, 2, HALF_N, BLOCK_K],
        )
    ks = tl.arange(0, BLOCK_K)
    # Column j of the accumulator is weight row (j // HALF_N) * I + first column + j % HALF_N.
    j = tl.arange(0, BLOCK_N)
    for tile in range(tl.program_id(0), live_m * num_pid_n, tl.num_programs(0)):
        pid_m, pid_n = _tile(tile, live_m, num_pid_n, GROUP_M)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        expert = tl.load(block_expert_ptr + pid_m * BLOCK_M // pad_m)
        slot = tl.load(sorted_slot_ptr + rows)
        valid = slot >= 0
        # Row base pointers only; the tile addresses are rebuilt each step, which keeps the state
        # carried across iterations (and so the registers) small.
        x_rows = x_ptr + tl.where(valid, slot // top_k, 0).to(tl.int64) * H
        w_col = pid_n * HALF_N + j % HALF_N
        # Offsets inside one expert's weight fit in int32 (the launcher checks its size).
        w_rows = w_ptr + expert.to(tl.int64) * 2 * I * H + ((j // HALF_N) * I + w_col) * H
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, H, BLOCK_K):
            kk = k0 + ks
            k_ok = kk < H
            a = tl.load(x_rows[:, None] + kk[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
            if TMA:
                b = w_desc.load([expert, 0, pid_n * HALF_N, k0]).reshape(BLOCK_N, BLOCK_K).T
            else:
                b = tl.load(w_rows[None, :] + kk[:, None], mask=k_ok[:, None] & (w_col < I)[None, :], other=0.0)
            if INTERPRETED:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision="ieee")
        # Padding rows (slot -1) read zeros, so they store zeros: the kernels that read h and pre
        # through tensor descriptors see zero rows there. The epilogue holds gate, up and act per
        # element besides the accumulator: a quarter of the columns at a time keeps it in registers.
        gate, up = _split_columns(acc, BLOCK_M, BLOCK_N)
        gate_lo, gate_hi = _split_columns(gate, BLOCK_M, HALF_N)
        up_lo, up_hi = _split_columns(up, BLOCK_M, HALF_N)
        cols = pid_n * HALF_N + tl.arange(0, HALF_N // 2)
        _glu_forward_epilogue(gate_lo, up_lo, rows, cols, pre_ptr, h_ptr, I, GELU, INTERPRETED)
        _glu_forward_epilogue(gate_hi, up_hi, rows, cols + HALF_N // 2, pre_ptr, h_ptr, I, GELU, INTERPRETED)
    # Rows past the live end: pre is returned (and saved for backward), so give them zeros.
    dead_m = num_rows // BLOCK_M - live_m
    zeros = tl.zeros((BLOCK_M, HALF_N), pre_ptr.dtype.element_ty)
    for tile in range(tl.program_id(0), dead_m * num_pid_n, tl.num_programs(0)):
        rows = (live_m + tile // num_pid_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (tile % num_pid_n) * HALF_N + tl.arange(0, HALF_N)
        pre_ptrs = pre_ptr + rows[:, None].to(tl.int64) * (2 * I) + cols[None, :]
        tl.store(pre_ptrs, zeros, mask=(cols < I)[None, :])
        tl.store(pre_ptrs + I, zeros, mask=(cols < I)[None, :])


@triton.jit(do_not_specialize=["num_rows", "n_out", "k_red", "num_experts", "pad_m"])
def _rows_matmul_kernel(
    a_ptr, w_ptr, padded_offsets_ptr, block_expert_ptr, sorted_slot_ptr, scale_ptr, out_ptr,
    num_rows, n_out, k_red, num_experts, pad_m,
    W_NK: tl.constexpr, SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, TMA: tl.constexpr, ALIGN: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """out[p] = w[e] @ a[p] (W_NK: w[e] is [n_out, k_red]) or a[p] @ w[e] (w[e] is [k_red, n_out]),
    times scale[slot(p)] when SCALE."""
    n_out = _aligned(n_out, ALIGN)
    k_red = _aligned(k_red, ALIGN)
    num_pid_n = tl.cdiv(n_out, BLOCK_N)
    live_m = tl.load(padded_offsets_ptr + num_experts) // BLOCK_M
    if TMA:
        # Row m of the output depends on row m of a only, so whatever a padding row holds stays
        # in rows that are never stored.
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[num_rows, k_red], strides=[k_red, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
        if W_NK:
            w_desc = tl.make_tensor_descriptor(
                w_ptr, shape=[num_experts, n_out, k_red], strides=[n_out * k_red, k_red, 1],
                block_shape=[1, BLOCK_N, BLOCK_K],
            )
        else:
            w_desc = tl.make_tensor_descriptor(
                w_ptr, shape=[num_experts, k_red, n_out], strides=[k_red * n_out, n_out, 1],
                block_shape=[1, BLOCK_K, BLOCK_N],
            )
    ks = tl.arange(0, BLOCK_K)
    for tile in range(tl.program_id(0), live_m * num_pid_n, tl.num_programs(0)):
        pid_m, pid_n = _tile(tile, live_m, num_pid_n, GROUP_M)
        expert = tl.load(block_expert_ptr + pid_m * BLOCK_M // pad_m)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        slot = tl.load(sorted_slot_ptr + rows)
        valid = slot >= 0
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n_out
        a_rows = a_ptr + rows.to(tl.int64) * k_red
        # Offsets inside one expert's weight fit in int32 (the launcher checks its size).
        w_base = w_ptr + expert.to(tl.int64) * n_out * k_red
        if W_NK:
            w_cols = w_base + cols * k_red
        else:
            w_cols = w_base + cols
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, k_red, BLOCK_K):
            if TMA:
                a = a_desc.load([pid_m * BLOCK_M, k0])
                if W_NK:
                    b = w_desc.load([expert, pid_n * BLOCK_N, k0]).reshape(BLOCK_N, BLOCK_K).T
                else:
                    b = w_desc.load([expert, k0, pid_n * BLOCK_N]).reshape(BLOCK_K, BLOCK_N)
            else:
                kk = k0 + ks
                k_ok = kk < k_red
                a = tl.load(a_rows[:, None] + kk[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
                if W_NK:
                    b_ptrs = w_cols[None, :] + kk[:, None]
                else:
                    b_ptrs = w_cols[None, :] + kk[:, None] * n_out
                b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if INTERPRETED:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision="ieee")
        if SCALE:
            acc *= tl.load(scale_ptr + slot, mask=valid, other=0.0)[:, None]
        out_ptrs = out_ptr + rows[:, None].to(tl.int64) * n_out + cols[None, :]
        tl.store(out_ptrs, _downcast(acc, out_ptr.dtype.element_ty, INTERPRETED),
                 mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _glu_backward_epilogue(dh, rows, cols, weight, pre_ptr, dpre_ptr, hs_ptr, I,
                           GELU: tl.constexpr, INTERPRETED: tl.constexpr):
    """The activation's backward on ``dh``, the float32 gradient of the unweighted expert output at
    (``rows``, ``cols``): writes d pre and hs there and returns the columns' share of d w. Padding
    rows (weight 0, pre 0) write zeros. ``_glu_backward_kernel``'s epilogue, one half of its tile's
    columns at a time, and ``_glu_backward_rows_kernel``'s body."""
    col_ok = (cols < I)[None, :]
    offs = rows[:, None].to(tl.int64) * (2 * I) + cols[None, :]
    gate = tl.load(pre_ptr + offs, mask=col_ok, other=0.0).to(tl.float32)
    up = tl.load(pre_ptr + offs + I, mask=col_ok, other=0.0).to(tl.float32)
    act, d_act = _act_and_grad(gate, GELU)
    h = act * up
    dw = tl.sum(h * dh, axis=1)
    w_dh = dh * weight[:, None]
    tl.store(dpre_ptr + offs, _downcast(w_dh * up * d_act, dpre_ptr.dtype.element_ty, INTERPRETED), mask=col_ok)
    tl.store(dpre_ptr + offs + I, _downcast(w_dh * act, dpre_ptr.dtype.element_ty, INTERPRETED), mask=col_ok)
    hs_offs = rows[:, None].to(tl.int64) * I + cols[None, :]
    tl.store(hs_ptr + hs_offs, _downcast(h * weight[:, None], hs_ptr.dtype.element_ty, INTERPRETED), mask=col_ok)
    return dw


@triton.jit(do_not_specialize=["num_rows", "H", "I", "num_experts", "pad_m"])
def _glu_backward_kernel(
    dy_ptr, w_ptr, pre_ptr, scale_ptr, padded_offsets_ptr, block_expert_ptr, sorted_slot_ptr,
    dpre_ptr, hs_ptr, dw_part_ptr,
    num_rows, H, I, num_experts, pad_m,
    GELU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, TMA: tl.constexpr, ALIGN: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """dh = dy[p] @ down[e] (the gradient of the unweighted expert output w.r.t. h; dy's rows in
    the padded layout, ``gather_rows``); then, with act recomputed from pre and w the slot's
    routing weight: d pre = (w dh * up * act'(gate), w dh * act(gate)), hs = w * act(gate) * up
    (the operand of d down), and the partial d w = <h, dh> over this tile's columns. Every live
    row is written, padding rows with zeros: the weight gradients reduce over them."""
    H = _aligned(H, ALIGN)
    I = _aligned(I, ALIGN)
    num_pid_n = tl.cdiv(I, BLOCK_N)
    live_m = tl.load(padded_offsets_ptr + num_experts) // BLOCK_M
    if TMA:
        dy_desc = tl.make_tensor_descriptor(dy_ptr, shape=[num_rows, H], strides=[H, 1],
                                            block_shape=[BLOCK_M, BLOCK_K])
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[num_experts, H, I], strides=[H * I, I, 1],
                                           block_shape=[1, BLOCK_K, BLOCK_N])
    ks = tl.arange(0, BLOCK_K)
    for tile in range(tl.program_id(0), live_m * num_pid_n, tl.num_programs(0)):
        pid_m, pid_n = _tile(tile, live_m, num_pid_n, GROUP_M)
        expert = tl.load(block_expert_ptr + pid_m * BLOCK_M // pad_m)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        slot = tl.load(sorted_slot_ptr + rows)
        valid = slot >= 0
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        dy_rows = dy_ptr + rows.to(tl.int64) * H
        # down[e] is [H, I]: the reduction runs over H, its rows.
        w_cols = w_ptr + expert.to(tl.int64) * H * I + cols
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, H, BLOCK_K):
            if TMA:
                # Padding rows of dy are zero, so they need no mask.
                a = dy_desc.load([pid_m * BLOCK_M, k0])
                b = w_desc.load([expert, k0, pid_n * BLOCK_N]).reshape(BLOCK_K, BLOCK_N)
            else:
                kk = k0 + ks
                k_ok = kk < H
                a = tl.load(dy_rows[:, None] + kk[None, :], mask=k_ok[None, :], other=0.0)
                b = tl.load(w_cols[None, :] + kk[:, None] * I, mask=k_ok[:, None] & (cols < I)[None, :], other=0.0)
            if INTERPRETED:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision="ieee")
        # The epilogue holds gate, up, act and act' per element besides the accumulator: done one
        # half of the columns at a time, so a 128x128 tile fits in registers.
        weight = tl.load(scale_ptr + slot, mask=valid, other=0.0)
        acc_lo, acc_hi = _split_columns(acc, BLOCK_M, BLOCK_N)
        half = pid_n * BLOCK_N + tl.arange(0, BLOCK_N // 2)
        dw = _glu_backward_epilogue(acc_lo, rows, half, weight, pre_ptr, dpre_ptr, hs_ptr, I, GELU, INTERPRETED)
        dw += _glu_backward_epilogue(acc_hi, rows, half + BLOCK_N // 2, weight, pre_ptr, dpre_ptr, hs_ptr, I,
                                     GELU, INTERPRETED)
        tl.store(dw_part_ptr + rows.to(tl.int64) * num_pid_n + pid_n, dw, mask=valid)


@triton.jit(do_not_specialize=["num_rows", "M", "N", "num_experts"])
def _weight_grad_kernel(
    a_ptr, b_ptr, padded_offsets_ptr, out_ptr,
    num_rows, M, N, num_experts,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, TMA: tl.constexpr, ALIGN: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """out[e] = sum over expert e's padded rows p of a[p]^T b[p], [M, N] per expert: a grouped GEMM
    whose reduction (the expert's rows) is ragged. Both operands are in the padded layout and at
    least one of them has zero padding rows, so no row is masked: with TMA both stream through
    tensor descriptors."""
    M = _aligned(M, ALIGN)
    N = _aligned(N, ALIGN)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_expert = num_pid_m * num_pid_n
    if TMA:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[num_rows, M], strides=[M, 1],
                                           block_shape=[BLOCK_K, BLOCK_M])
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[num_rows, N], strides=[N, 1],
                                           block_shape=[BLOCK_K, BLOCK_N])
    ks = tl.arange(0, BLOCK_K)
    for tile in range(tl.program_id(0), num_experts * per_expert, tl.num_programs(0)):
        expert = tile // per_expert
        pid_m, pid_n = _tile(tile % per_expert, num_pid_m, num_pid_n, GROUP_M)
        start = tl.load(padded_offsets_ptr + expert)
        end = tl.load(padded_offsets_ptr + expert + 1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = offs_m < M
        n_ok = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        # An expert without rows runs no iteration and writes zeros. Its row count is a multiple
        # of pad_m, which BLOCK_K divides.
        for r0 in range(start, end, BLOCK_K):
            if TMA:
                a = a_desc.load([r0, pid_m * BLOCK_M])
                b = b_desc.load([r0, pid_n * BLOCK_N])
            else:
                rows = (r0 + ks).to(tl.int64)
                a = tl.load(a_ptr + rows[:, None] * M + offs_m[None, :], mask=m_ok[None, :], other=0.0)
                b = tl.load(b_ptr + rows[:, None] * N + offs_n[None, :], mask=n_ok[None, :], other=0.0)
            if INTERPRETED:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(tl.trans(a), b, acc, input_precision="ieee")
        out_ptrs = out_ptr + expert.to(tl.int64) * M * N + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(out_ptrs, _downcast(acc, out_ptr.dtype.element_ty, INTERPRETED), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["H", "num_experts"], do_not_specialize_on_alignment=["top_k"])
def _gather_rows_kernel(src_ptr, padded_offsets_ptr, sorted_slot_ptr, out_ptr, H, num_experts, top_k,
                        BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, ALIGN: tl.constexpr):
    """out[p] = src[token(p)] for the live padded rows, zeros in padding rows; rows past the live
    end are left as they are (no kernel reads them)."""
    H = _aligned(H, ALIGN)
    live = tl.load(padded_offsets_ptr + num_experts)
    if tl.program_id(0) * BLOCK_R < live:
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        row_ok = rows < live
        h_ok = (hs < H)[None, :]
        slot = tl.load(sorted_slot_ptr + rows, mask=row_ok, other=-1)
        valid = slot >= 0
        src = src_ptr + tl.where(valid, slot // top_k, 0).to(tl.int64)[:, None] * H + hs[None, :]
        values = tl.load(src, mask=valid[:, None] & h_ok, other=0.0)
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * H + hs[None, :], values, mask=row_ok[:, None] & h_ok)


@triton.jit(do_not_specialize=["num_rows", "I", "num_experts"])
def _glu_rows_kernel(pre_ptr, h_ptr, padded_offsets_ptr, num_rows, I, num_experts,
                     GELU: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ALIGN: tl.constexpr,
                     INTERPRETED: tl.constexpr):
    """h = act(gate) * up over the live rows of pre, a grouped GEMM's output in the padded layout;
    pre's rows past the live end set to zero, as ``_gather_glu_kernel`` leaves them."""
    I = _aligned(I, ALIGN)
    live = tl.load(padded_offsets_ptr + num_experts)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = (cols < I)[None, :]
    offs = rows[:, None].to(tl.int64) * (2 * I) + cols[None, :]
    if tl.program_id(0) * BLOCK_R < live:
        gate = tl.load(pre_ptr + offs, mask=col_ok, other=0.0).to(tl.float32)
        up = tl.load(pre_ptr + offs + I, mask=col_ok, other=0.0).to(tl.float32)
        h_ptrs = h_ptr + rows[:, None].to(tl.int64) * I + cols[None, :]
        tl.store(h_ptrs, _downcast(_act(gate, GELU) * up, h_ptr.dtype.element_ty, INTERPRETED), mask=col_ok)
    else:
        dead = col_ok & (rows < num_rows)[:, None]
        zeros = tl.zeros((BLOCK_R, BLOCK_C), pre_ptr.dtype.element_ty)
        tl.store(pre_ptr + offs, zeros, mask=dead)
        tl.store(pre_ptr + offs + I, zeros, mask=dead)


@triton.jit
def _weighted_block(scale_ptr, sorted_slot_ptr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """(rows, cols, valid, weight) of this program's block of a live row block in the padded
    layout: valid marks the slots' rows, weight their routing weight (0 on padding rows)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    slot = tl.load(sorted_slot_ptr + rows)
    valid = slot >= 0
    return rows, cols, valid, tl.load(scale_ptr + slot, mask=valid, other=0.0)


@triton.jit(do_not_specialize=["I", "num_experts"])
def _glu_backward_rows_kernel(dh_ptr, pre_ptr, scale_ptr, padded_offsets_ptr, sorted_slot_ptr, dpre_ptr, hs_ptr,
                              dw_part_ptr, I, num_experts,
                              GELU: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                              ALIGN: tl.constexpr, INTERPRETED: tl.constexpr):
    """``_glu_backward_kernel``'s epilogue over its GEMM's output ``dh`` (a grouped GEMM's, in the
    padded layout): d pre, hs and the partial d w per column block, for the live rows. ``hs_ptr``
    may be ``dh_ptr``: each element's dh is read before its hs is written, by the same program."""
    I = _aligned(I, ALIGN)
    if tl.program_id(0) * BLOCK_R < tl.load(padded_offsets_ptr + num_experts):
        rows, cols, valid, weight = _weighted_block(scale_ptr, sorted_slot_ptr, BLOCK_R, BLOCK_C)
        dh = tl.load(dh_ptr + rows[:, None].to(tl.int64) * I + cols[None, :], mask=(cols < I)[None, :], other=0.0)
        dw = _glu_backward_epilogue(dh.to(tl.float32), rows, cols, weight, pre_ptr, dpre_ptr, hs_ptr, I, GELU,
                                    INTERPRETED)
        tl.store(dw_part_ptr + rows.to(tl.int64) * tl.num_programs(1) + tl.program_id(1), dw, mask=valid)


@triton.jit(do_not_specialize=["H", "num_experts"])
def _scale_rows_kernel(rows_ptr, scale_ptr, padded_offsets_ptr, sorted_slot_ptr, H, num_experts,
                       BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ALIGN: tl.constexpr, INTERPRETED: tl.constexpr):
    """rows[p] *= scale[slot(p)] in place over the live slots' rows, multiplied in float32."""
    H = _aligned(H, ALIGN)
    if tl.program_id(0) * BLOCK_R < tl.load(padded_offsets_ptr + num_experts):
        rows, cols, valid, weight = _weighted_block(scale_ptr, sorted_slot_ptr, BLOCK_R, BLOCK_C)
        mask = valid[:, None] & (cols < H)[None, :]
        ptrs = rows_ptr + rows[:, None].to(tl.int64) * H + cols[None, :]
        values = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) * weight[:, None]
        tl.store(ptrs, _downcast(values, rows_ptr.dtype.element_ty, INTERPRETED), mask=mask)


@triton.jit(do_not_specialize=["G", "H", "M"], do_not_specialize_on_alignment=["C"])
def _sum_rows_kernel(rows_ptr, src_ptr, scale_ptr, out_ptr, G, H, C, M, HAS_SCALE: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, ALIGN: tl.constexpr, INTERPRETED: tl.constexpr):
    """out[g] = sum_c scale[g, c] * rows[src[g, c]] over the terms with src[g, c] < M (M: none),
    in float32 and in c order; without HAS_SCALE every scale is 1."""
    H = _aligned(H, ALIGN)
    gs = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    g_ok = gs < G
    h_ok = hs < H
    acc = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
    for c in range(0, C):
        term = gs.to(tl.int64) * C + c
        pos = tl.load(src_ptr + term, mask=g_ok, other=M).to(tl.int64)
        read = pos < M  # rows past G read as M: none
        values = tl.load(rows_ptr + pos[:, None] * H + hs[None, :], mask=read[:, None] & h_ok[None, :],
                         other=0.0).to(tl.float32)
        if HAS_SCALE:
            values *= tl.load(scale_ptr + term, mask=read, other=0.0)[:, None]
        acc += values
    out_ptrs = out_ptr + gs[:, None].to(tl.int64) * H + hs[None, :]
    tl.store(out_ptrs, _downcast(acc, out_ptr.dtype.element_ty, INTERPRETED), mask=g_ok[:, None] & h_ok[None, :])


@triton.jit(do_not_specialize=["M", "H", "G"])
def _scaled_gather_kernel(grad_ptr, index_ptr, scale_ptr, rows_ptr, out_ptr, dot_ptr, M, H, G,
                          WITH_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
                          ALIGN: tl.constexpr, INTERPRETED: tl.constexpr):
    """out[m] = scale[m] * grad[index[m]] (zero where index[m] >= G: none) and, WITH_DOT,
    dot[m] = <grad[index[m]], rows[m]> in float32: the backward of a scaled gather-sum, one pass
    over the rows. Each program walks the whole row, so its dot adds the blocks in column order."""
    H = _aligned(H, ALIGN)
    ms = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = ms < M
    src = tl.load(index_ptr + ms, mask=m_ok, other=G).to(tl.int64)
    read = src < G
    scale = tl.load(scale_ptr + ms, mask=m_ok, other=0.0)
    dot = tl.zeros((BLOCK_M,), tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        h_ok = hs < H
        grad = tl.load(grad_ptr + src[:, None] * H + hs[None, :], mask=read[:, None] & h_ok[None, :],
                       other=0.0).to(tl.float32)
        at = ms[:, None].to(tl.int64) * H + hs[None, :]
        tl.store(out_ptr + at, _downcast(grad * scale[:, None], out_ptr.dtype.element_ty, INTERPRETED),
                 mask=m_ok[:, None] & h_ok[None, :])
        if WITH_DOT:
            rows = tl.load(rows_ptr + at, mask=m_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
            dot += tl.sum(grad * rows, axis=1)
    if WITH_DOT:
        tl.store(dot_ptr + ms, dot, mask=m_ok)


# ----------------------------------------------------------------------------------------------
# Launchers: validate, allocate, choose the configuration and the grid.


def _gelu_flag(activation: str) -> bool:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    return activation == "gelu"


def _check(name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """``t`` validated, at a 16-byte aligned address: the kernels are compiled for aligned base
    pointers only (see "Specialisation"), so a view that starts elsewhere is copied."""
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise ValueError(f"{name} must be a {dtype} tensor of shape {tuple(shape)}, got {t.dtype} {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _check_expert_size(name: str, w_E: torch.Tensor) -> None:
    # The kernels index inside one expert's weight with int32 offsets.
    if w_E[0].numel() >= 2**31:
        raise ValueError(f"{name} must have fewer than 2**31 elements per expert, got shape {tuple(w_E.shape)}")


def _check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in TRITON_TYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def row_align(dtype: torch.dtype, *sizes: int) -> int:
    """The ALIGN constexpr of a launch whose row lengths are ``sizes``: the elements in 16 bytes
    when every size is a multiple of them (rows start 16-byte aligned: vector loads, cp.async and
    tensor descriptors), else 1."""
    vector = 16 // torch.empty(0, dtype=dtype).element_size()
    return vector if all(s % vector == 0 for s in sizes) else 1


def _descriptor_scratch(size: int, alignment: int, stream):
    # Global memory Triton asks for at launch to build the kernels' tensor descriptors in. The
    # launch is queued on the current stream, where this allocation is ordered too.
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _run(kernel, config: Config, tiles: int, device: torch.device, *args, **constexprs):
    """Launch ``kernel`` over ``tiles`` tiles: one program per tile, or one per SM when the
    configuration is persistent. Returns what Triton's launch returns (the compiled kernel, whose
    registers and spills ``scripts/sweep_configs.py`` records)."""
    grid = (min(tiles, sm_count(device)) if config.persistent else tiles,)
    launch = lambda: kernel[grid](  # noqa: E731
        *args, INTERPRETED=interpreting(), **config.constexprs(), **config.launch_options(), **constexprs
    )
    if not config.tma or interpreting():
        return launch()
    # Triton's allocator is a context variable, unset in the autograd engine's threads: set it for
    # this launch only, and give the caller's back.
    from triton.runtime import _allocation

    previous = _allocation._allocator.get()
    triton.set_allocator(_descriptor_scratch)
    try:
        return launch()
    finally:
        triton.set_allocator(previous)


def _tuned(kernel: str, meta: RoutingMetadata, dtype, device, shapes: tuple, align: int, launch,
           gelu: bool = False, library=None, before_kept=None):
    """Choose ``kernel``'s configuration (timing on first sight of the key) and launch with it:
    the one place where a configuration is picked. ``launch(config)`` passes ``align`` as ALIGN.
    ``library()``, where given, computes the same launch with PyTorch's grouped GEMM: a candidate
    after the Triton configurations on a GPU where that is sync-free and the rows are aligned (its
    operands need 16-byte strides), so a tuned launch is never slower than the better of the two.
    Not under the interpreter: there the kernels run to be tested, and its host-clock timings, which
    mean nothing, would hand their launches to the library. ``before_kept()``, where given, is
    called between the timed launches and the one whose result is returned."""
    num_rows = meta.slot_pos_N.numel()
    arch = autotune.device_arch(device)
    candidates = configs_for(kernel, dtype, arch_family(device), meta.pad_m, aligned=align > 1, gelu=gelu)
    if library is not None and align > 1 and arch != "interpreter" and grouped_mm_sync_free(arch, dtype):
        candidates = [*candidates, GROUPED_MM]

    def run(c):
        return library() if isinstance(c, Library) else launch(c)

    with on_device(device):
        config = autotune.choose(kernel, candidates, shapes=shapes + (meta.pad_m, align), dtype=dtype, device=device,
                                 num_rows=num_rows, launch=run)
        if before_kept is not None:
            before_kept()
        return run(config)


def _made_once(make):
    """``make()`` at the first call, the same tensor at every later one: a launcher's output buffer,
    made only when a Triton launch runs. The library's GEMM makes its own, and a buffer made for
    nothing beside it would double the launch's output at its peak (a whole weight gradient)."""
    made = []

    def get() -> torch.Tensor:
        if not made:
            made.append(make())
        return made[0]

    return get


def _row_tiles(config: Config, num_rows: int, n_out: int) -> int:
    return num_rows // config.BLOCK_M * triton.cdiv(n_out, config.BLOCK_N)


def gather_glu(x_TH: torch.Tensor, gate_up_E2IH: torch.Tensor, meta: RoutingMetadata, top_k: int,
               activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """GEMM 1 with the token gather and the gated activation fused: (h_PI, pre_P2I)."""
    _check_float("x_TH", x_TH)
    gelu = _gelu_flag(activation)
    T, H = x_TH.shape
    E, two_I, _ = gate_up_E2IH.shape
    I = two_I // 2
    x_TH = _check("x_TH", x_TH, (T, H), x_TH.dtype)
    gate_up_E2IH = _check("gate_up_E2IH", gate_up_E2IH, (E, two_I, H), x_TH.dtype)
    _check_expert_size("gate_up_E2IH", gate_up_E2IH)
    P = meta.sorted_slot_P.numel()
    if P == 0:
        return x_TH.new_empty(P, I), x_TH.new_empty(P, two_I)

    def launch(c: Config):
        h_PI, pre_P2I = x_TH.new_empty(P, I), x_TH.new_empty(P, two_I)
        _run(_gather_glu_kernel, c, _row_tiles(c, P, 2 * I), x_TH.device,
             x_TH, gate_up_E2IH, meta.padded_offsets_E1, meta.block_expert_B, meta.sorted_slot_P, h_PI, pre_P2I,
             P, H, I, E, top_k, meta.pad_m, GELU=gelu, GROUP_M=GROUP_M, ALIGN=align)
        return h_PI, pre_P2I

    def library():
        # The token rows copied into the padded order first (zero padding rows, so zero pre there),
        # the activation a pass over pre after the GEMM.
        pre_P2I = grouped_mm(gather_rows(x_TH, meta, top_k), gate_up_E2IH.transpose(1, 2),
                             offs=meta.padded_offsets_E1[1:])
        return _glu_rows(pre_P2I, meta, gelu, align), pre_P2I

    align = row_align(x_TH.dtype, H, I)
    return _tuned("gather_glu", meta, x_TH.dtype, x_TH.device, (H, I, E, gelu), align, launch, gelu,
                  library=library)


def _epilogue_grid(num_rows: int, num_cols: int) -> tuple[int, int]:
    return triton.cdiv(num_rows, EPILOGUE_BLOCK_R), triton.cdiv(num_cols, EPILOGUE_BLOCK_C)


def _glu_rows(pre_P2I: torch.Tensor, meta: RoutingMetadata, gelu: bool, align: int) -> torch.Tensor:
    """h_PI from ``pre_P2I`` (``_glu_rows_kernel``); zeros ``pre``'s rows past the live end."""
    P, two_I = pre_P2I.shape
    h_PI = pre_P2I.new_empty(P, two_I // 2)
    _glu_rows_kernel[_epilogue_grid(P, two_I // 2)](
        pre_P2I, h_PI, meta.padded_offsets_E1, P, two_I // 2, meta.counts_E.numel(), GELU=gelu,
        BLOCK_R=EPILOGUE_BLOCK_R, BLOCK_C=EPILOGUE_BLOCK_C, ALIGN=align, INTERPRETED=interpreting(),
        num_warps=EPILOGUE_WARPS)
    return h_PI


def rows_matmul(a_PD: torch.Tensor, w_E: torch.Tensor, meta: RoutingMetadata, *, w_layout: str,
                scale_N: torch.Tensor | None = None) -> torch.Tensor:
    """Per padded row p of expert e: ``w[e] @ a[p]`` for ``w_layout="nk"`` (w_E is [E, n_out, k])
    or ``a[p] @ w[e]`` for ``"kn"`` (w_E is [E, k, n_out]); times ``scale_N[slot(p)]`` if given."""
    _check_float("a_PD", a_PD)
    if w_layout not in ("nk", "kn"):
        raise ValueError(f"w_layout must be 'nk' or 'kn', got {w_layout!r}")
    P, k_red = a_PD.shape
    E = w_E.shape[0]
    n_out = w_E.shape[1] if w_layout == "nk" else w_E.shape[2]
    a_PD = _check("a_PD", a_PD, (meta.sorted_slot_P.numel(), k_red), a_PD.dtype)
    w_E = _check("w_E", w_E, (E, n_out, k_red) if w_layout == "nk" else (E, k_red, n_out), a_PD.dtype)
    _check_expert_size("w_E", w_E)
    if scale_N is not None:
        scale_N = _check("scale_N", scale_N, (meta.slot_pos_N.numel(),), torch.float32)
    if P == 0:
        return a_PD.new_empty(P, n_out)
    # The pointer is never read without SCALE; any float32 tensor keeps the signature fixed.
    scale = scale_N if scale_N is not None else a_PD.new_empty(0, dtype=torch.float32)
    out = _made_once(lambda: a_PD.new_empty(P, n_out))

    def launch(c: Config):
        _run(_rows_matmul_kernel, c, _row_tiles(c, P, n_out), a_PD.device,
             a_PD, w_E, meta.padded_offsets_E1, meta.block_expert_B, meta.sorted_slot_P, scale, out(),
             P, n_out, k_red, E, meta.pad_m, W_NK=w_layout == "nk", SCALE=scale_N is not None, GROUP_M=GROUP_M,
             ALIGN=align)
        return out()

    def library():
        # Rows past the last expert's end are not written, as by the kernel; the routing weight is
        # a pass over the rows after the GEMM.
        out_PF = grouped_mm(a_PD, w_E.transpose(1, 2) if w_layout == "nk" else w_E, offs=meta.padded_offsets_E1[1:])
        if scale_N is not None:
            _scale_rows_kernel[_epilogue_grid(P, n_out)](
                out_PF, scale_N, meta.padded_offsets_E1, meta.sorted_slot_P, n_out, E,
                BLOCK_R=EPILOGUE_BLOCK_R, BLOCK_C=EPILOGUE_BLOCK_C, ALIGN=align, INTERPRETED=interpreting(),
                num_warps=EPILOGUE_WARPS)
        return out_PF

    shapes = (n_out, k_red, E, w_layout, scale_N is not None)
    align = row_align(a_PD.dtype, n_out, k_red)
    return _tuned("rows_matmul", meta, a_PD.dtype, a_PD.device, shapes, align, launch, library=library)


def gather_rows(src_TH: torch.Tensor, meta: RoutingMetadata, top_k: int) -> torch.Tensor:
    """The token rows of ``src_TH`` in the padded layout: row p holds ``src[sorted_slot[p] // K]``,
    padding rows hold zeros, rows past the live end are not written. One pass over the rows, so
    that the backward kernels stream their operands through tensor descriptors instead of
    gathering them row by row inside the GEMM (the weight gradients were latency-bound on that)."""
    _check_float("src_TH", src_TH)
    T, H = src_TH.shape
    src_TH = _check("src_TH", src_TH, (T, H), src_TH.dtype)
    P = meta.sorted_slot_P.numel()
    out_PH = src_TH.new_empty(P, H)
    if P == 0:
        return out_PH
    grid = (triton.cdiv(P, GATHER_BLOCK_R), triton.cdiv(H, GATHER_BLOCK_H))
    with on_device(src_TH.device):
        _gather_rows_kernel[grid](src_TH, meta.padded_offsets_E1, meta.sorted_slot_P, out_PH, H,
                                  meta.counts_E.numel(), top_k, BLOCK_R=GATHER_BLOCK_R, BLOCK_H=GATHER_BLOCK_H,
                                  ALIGN=row_align(src_TH.dtype, H), num_warps=GATHER_WARPS)
    return out_PH


def glu_backward(dy_PH: torch.Tensor, down_EHI: torch.Tensor, pre_P2I: torch.Tensor, w_N: torch.Tensor,
                 meta: RoutingMetadata, activation: str, *,
                 overwrite_pre: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d pre_P2I, d w_N, hs_PI): gradients of the GEMM-1 output and of each slot's routing weight,
    and ``hs = w * act(gate) * up``, the operand of ``down_weight_grad``; ``dy_PH`` is the output
    gradient in the padded layout (``gather_rows``). Padding rows of d pre and hs are zero.
    ``overwrite_pre``: d pre is written over ``pre_P2I`` (returned as d pre): each element of d pre
    is made from the elements of pre at its own place alone, which its tile reads first."""
    _check_float("dy_PH", dy_PH)
    gelu = _gelu_flag(activation)
    E, H, I = down_EHI.shape
    P = meta.sorted_slot_P.numel()
    N = meta.slot_pos_N.numel()
    dy_PH = _check("dy_PH", dy_PH, (P, H), dy_PH.dtype)
    down_EHI = _check("down_EHI", down_EHI, (E, H, I), dy_PH.dtype)
    _check_expert_size("down_EHI", down_EHI)
    pre_P2I = _check("pre_P2I", pre_P2I, (P, 2 * I), dy_PH.dtype)
    w_N = _check("w_N", w_N, (N,), torch.float32)
    dpre_P2I = pre_P2I if overwrite_pre else torch.empty_like(pre_P2I)
    if P == 0:
        return dpre_P2I, w_N.new_zeros(N), pre_P2I.new_empty(P, I)
    # Where launches write d pre. Over pre, the configurations timed on a problem's first call
    # write a scratch buffer instead: pre must reach the launch whose result is kept intact.
    scratch = _made_once(lambda: torch.empty_like(pre_P2I))
    timing = [overwrite_pre]

    def dpre_out() -> torch.Tensor:
        return scratch() if timing[0] else dpre_P2I

    def keep() -> None:
        timing[0] = False

    def launch(c: Config):
        hs_PI = pre_P2I.new_empty(P, I)
        # Each column tile writes its own partial sum of d w; summed below in a fixed order.
        dw_part = _dw_parts(w_N, P, triton.cdiv(I, c.BLOCK_N))
        _run(_glu_backward_kernel, c, _row_tiles(c, P, I), dy_PH.device,
             dy_PH, down_EHI, pre_P2I, w_N, meta.padded_offsets_E1, meta.block_expert_B, meta.sorted_slot_P,
             dpre_out(), hs_PI, dw_part, P, H, I, E, meta.pad_m, GELU=gelu, GROUP_M=GROUP_M, ALIGN=align)
        return hs_PI, dw_part

    def library():
        # dh lands in the buffer that then holds hs (the epilogue pass overwrites it element by
        # element), so this path holds no more than the fused kernel.
        hs_PI = grouped_mm(dy_PH, down_EHI, offs=meta.padded_offsets_E1[1:])
        grid = _epilogue_grid(P, I)
        dw_part = _dw_parts(w_N, P, grid[1])
        _glu_backward_rows_kernel[grid](
            hs_PI, pre_P2I, w_N, meta.padded_offsets_E1, meta.sorted_slot_P, dpre_out(), hs_PI, dw_part, I, E,
            GELU=gelu, BLOCK_R=EPILOGUE_BLOCK_R, BLOCK_C=EPILOGUE_BLOCK_C, ALIGN=align, INTERPRETED=interpreting(),
            num_warps=EPILOGUE_WARPS)
        return hs_PI, dw_part

    align = row_align(dy_PH.dtype, H, I)
    hs_PI, dw_part = _tuned("glu_backward", meta, dy_PH.dtype, dy_PH.device, (H, I, E, gelu), align, launch, gelu,
                            library=library, before_kept=keep)
    # Padding rows of dw_part are never written; only the slots' own rows are read, and the zero
    # row P by the slots without an expert.
    dw_N = dw_part.index_select(0, meta.slot_pos_N).sum(1)
    return dpre_P2I, dw_N, hs_PI


def _dw_parts(w_N: torch.Tensor, P: int, parts: int) -> torch.Tensor:
    """The partial routing-weight gradients of the P padded rows, and a zero row P: the one that
    the slots without an expert (``slot_pos`` = P) read."""
    dw_part = w_N.new_empty(P + 1, parts)
    dw_part[P].zero_()
    return dw_part


def weight_grad(a_PF: torch.Tensor, b_PD: torch.Tensor, meta: RoutingMetadata) -> torch.Tensor:
    """``out[e] = sum over e's padded rows p of a[p]^T b[p]`` -> ``[E, F, D]``: a weight gradient
    (``d down = weight_grad(dy_PH, hs_PI)``, ``d gate_up = weight_grad(d pre_P2I, x_PH)``). Both
    operands are in the padded layout and one of them has zero padding rows (``gather_rows``'s
    copies, and ``glu_backward``'s outputs, have)."""
    _check_float("a_PF", a_PF)
    P = meta.sorted_slot_P.numel()
    F, D = a_PF.shape[1], b_PD.shape[1]
    E = meta.counts_E.numel()
    a_PF = _check("a_PF", a_PF, (P, F), a_PF.dtype)
    b_PD = _check("b_PD", b_PD, (P, D), a_PF.dtype)
    if P == 0:
        return a_PF.new_zeros(E, F, D)
    out = _made_once(lambda: a_PF.new_empty(E, F, D))

    def launch(c: Config):
        tiles = E * triton.cdiv(F, c.BLOCK_M) * triton.cdiv(D, c.BLOCK_N)
        _run(_weight_grad_kernel, c, tiles, a_PF.device,
             a_PF, b_PD, meta.padded_offsets_E1, out(), P, F, D, E, GROUP_M=GROUP_M, ALIGN=align)
        return out()

    def library():
        # The expert's rows are the reduction: the 2-D x 2-D form, one [F, D] product per group.
        return grouped_mm(a_PF.t(), b_PD, offs=meta.padded_offsets_E1[1:])

    align = row_align(a_PF.dtype, F, D)
    return _tuned("weight_grad", meta, a_PF.dtype, a_PF.device, (F, D, E), align, launch, library=library)


def combine(rows_PH: torch.Tensor, meta: RoutingMetadata, num_tokens: int, top_k: int) -> torch.Tensor:
    """y[t] = sum_k rows[padded row of slot t * K + k], summed in float32 in slot order."""
    _check_float("rows_PH", rows_PH)
    rows_PH = _check("rows_PH", rows_PH, (meta.sorted_slot_P.numel(), rows_PH.shape[-1]), rows_PH.dtype)
    if meta.slot_pos_N.numel() != num_tokens * top_k:
        raise ValueError(
            f"metadata holds {meta.slot_pos_N.numel()} slots, expected num_tokens * top_k = {num_tokens * top_k}"
        )
    return sum_rows(rows_PH, meta.slot_pos_N.view(num_tokens, top_k))


_INDEX_TYPES = (torch.int32, torch.int64)


def sum_rows(rows_MH: torch.Tensor, src_GC: torch.Tensor, scale_GC: torch.Tensor | None = None) -> torch.Tensor:
    """out[g] = sum_c scale[g, c] * rows[src[g, c]] ([G, H], the rows' dtype), summed in float32
    in c order, a term with src[g, c] >= len(rows) left out (scale defaults to 1): a deterministic
    gather-sum, each output row written once (no atomics), each row read by its terms only. The
    terms are not checked on the host (that would sync): they must not be negative."""
    _check_float("rows_MH", rows_MH)
    if rows_MH.dim() != 2:
        raise ValueError(f"rows_MH must be 2-D [rows, H], got shape {tuple(rows_MH.shape)}")
    M, H = rows_MH.shape
    if src_GC.dim() != 2 or src_GC.dtype not in _INDEX_TYPES:
        raise ValueError(f"src_GC must be a 2-D int32 or int64 tensor [G, C], got {src_GC.dtype} "
                         f"{tuple(src_GC.shape)}")
    G, C = src_GC.shape
    rows_MH = _check("rows_MH", rows_MH, (M, H), rows_MH.dtype)
    src_GC = src_GC.contiguous()
    if scale_GC is not None:
        scale_GC = _check("scale_GC", scale_GC.contiguous(), (G, C), torch.float32)
    out_GH = rows_MH.new_empty(G, H)
    if G == 0 or H == 0:
        return out_GH
    if M == 0 or C == 0:
        return out_GH.zero_()
    grid = (triton.cdiv(G, COMBINE_BLOCK_T), triton.cdiv(H, COMBINE_BLOCK_H))
    with on_device(rows_MH.device):
        # Without a scale its pointer is never read: the rows stand in for it.
        _sum_rows_kernel[grid](
            rows_MH, src_GC, rows_MH if scale_GC is None else scale_GC, out_GH, G, H, C, M,
            HAS_SCALE=scale_GC is not None, BLOCK_T=COMBINE_BLOCK_T, BLOCK_H=COMBINE_BLOCK_H,
            ALIGN=row_align(rows_MH.dtype, H), INTERPRETED=interpreting(), num_warps=COMBINE_WARPS,
        )
    return out_GH


def scaled_gather(grad_GH: torch.Tensor, index_M: torch.Tensor, scale_M: torch.Tensor,
                  rows_MH: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``out[m] = scale[m] * grad[index[m]]`` ([M, H], the gradient's dtype; zero where ``index[m]
    >= len(grad)``) and, given ``rows_MH``, ``dot[m] = <grad[index[m]], rows[m]>`` in float32: the
    backward of ``sum_rows`` with a scale (the gradients of its rows and of its scale) in one pass
    that reads each gathered gradient row and each row once and writes each output row once. The
    indices are not checked on the host (that would sync): they must not be negative."""
    _check_float("grad_GH", grad_GH)
    if grad_GH.dim() != 2:
        raise ValueError(f"grad_GH must be 2-D [rows, H], got shape {tuple(grad_GH.shape)}")
    G, H = grad_GH.shape
    if index_M.dim() != 1 or index_M.dtype not in _INDEX_TYPES:
        raise ValueError(f"index_M must be a 1-D int32 or int64 tensor, got {index_M.dtype} {tuple(index_M.shape)}")
    M = index_M.shape[0]
    grad_GH = _check("grad_GH", grad_GH, (G, H), grad_GH.dtype)
    scale_M = _check("scale_M", scale_M.contiguous(), (M,), torch.float32)
    if rows_MH is not None:
        rows_MH = _check("rows_MH", rows_MH, (M, H), grad_GH.dtype)
    out_MH = grad_GH.new_empty(M, H)
    dot_M = None if rows_MH is None else scale_M.new_empty(M)
    if M == 0:
        return out_MH, dot_M
    if G == 0 or H == 0:
        return out_MH.zero_(), None if dot_M is None else dot_M.zero_()
    with on_device(grad_GH.device):
        # Without rows (or dot) their pointers are never read: the output stands in for them.
        _scaled_gather_kernel[(triton.cdiv(M, SCALED_GATHER_BLOCK_M),)](
            grad_GH, index_M.contiguous(), scale_M, out_MH if rows_MH is None else rows_MH, out_MH,
            scale_M if dot_M is None else dot_M, M, H, G, WITH_DOT=rows_MH is not None,
            BLOCK_M=SCALED_GATHER_BLOCK_M, BLOCK_H=SCALED_GATHER_BLOCK_H, ALIGN=row_align(grad_GH.dtype, H),
            INTERPRETED=interpreting(), num_warps=SCALED_GATHER_WARPS,
        )
    return out_MH, dot_M


# ----------------------------------------------------------------------------------------------
# Ahead-of-time compile list

# The reference shapes of the AOT check (Mixtral-8x7B: H 4096, I 14336, 8 experts, top-2) and
# odd sizes, whose rows are not 16-byte aligned in any dtype (``row_align`` 1). The sizes are not
# specialised (only ALIGN is), so these two stand for every size of their class.
_SIZES = {"aligned": (MIXTRAL.H, MIXTRAL.I), "unaligned": (MIXTRAL.H + 1, MIXTRAL.I + 1)}
# (sizes, top_k, activation) of each specialisation: top-k 1 becomes a constant in the JIT's
# specialisation of gather_glu (the one GEMM that gathers token rows) and GeGLU is another
# epilogue. The quick check (CI) takes top-2 SwiGLU and top-1 GeGLU of gather_glu.
_VARIANTS = [(sizes, top_k, activation) for sizes in _SIZES for top_k in (2, 1) for activation in ACTIVATIONS]
_TAKES_TOP_K = ("gather_glu",)
_TAKES_ACTIVATION = ("gather_glu", "glu_backward")


def gemm_costs(p: cost.Problem) -> dict:
    """The static cost model's description of each launch (cost.Gemm) at problem ``p``, by role:
    (step name, Gemm). gather_glu's tile holds gate and up columns side by side: 2I output columns,
    of which it writes pre (2I) and h (I)."""
    return {
        "gather_glu": ("fwd gemm1 (gather, gate_up, act)", cost.Gemm("rows", n=2 * p.I, k=p.H, epilogue_write=1.5)),
        "rows_matmul_nk_scaled": ("fwd gemm2 (down, routing weight)", cost.Gemm("rows", n=p.H, k=p.I)),
        "glu_backward": ("bwd dy @ down (d pre, hs, d w)", cost.Gemm("rows", n=p.I, k=p.H, epilogue_read=2,
                                                                     epilogue_write=3)),
        "rows_matmul_kn": ("bwd dx (d pre @ gate_up)", cost.Gemm("rows", n=p.H, k=2 * p.I)),
        "weight_grad_down": ("bwd d down (dy^T hs)", cost.Gemm("weight", m=p.H, n=p.I)),
        "weight_grad_gate_up": ("bwd d gate_up (d pre^T x)", cost.Gemm("weight", m=2 * p.I, n=p.H)),
    }


def _gemm_launches(kernel: str, dtype, H: int, I: int, top_k: int, gelu: bool, P: int) -> list:
    """(role, args, constexprs) of each launch of ``kernel``, as its launcher passes them."""
    E = MIXTRAL.E
    x, i32, f32 = pointer(dtype), pointer(torch.int32), pointer(torch.float32)
    if kernel == "gather_glu":
        return [("gather_glu", (x, x, i32, i32, i32, x, x, P, H, I, E, top_k, 128),
                 {"GELU": gelu, "ALIGN": row_align(dtype, H, I)})]
    if kernel == "rows_matmul":
        return [("rows_matmul_nk_scaled", (x, x, i32, i32, i32, f32, x, P, H, I, E, 128),
                 {"W_NK": True, "SCALE": True, "ALIGN": row_align(dtype, H, I)}),
                ("rows_matmul_kn", (x, x, i32, i32, i32, f32, x, P, H, 2 * I, E, 128),
                 {"W_NK": False, "SCALE": False, "ALIGN": row_align(dtype, H, 2 * I)})]
    if kernel == "glu_backward":
        return [("glu_backward", (x, x, x, f32, i32, i32, i32, x, x, f32, P, H, I, E, 128),
                 {"GELU": gelu, "ALIGN": row_align(dtype, H, I)})]
    return [("weight_grad_down", (x, x, i32, x, P, H, I, E), {"ALIGN": row_align(dtype, H, I)}),
            ("weight_grad_gate_up", (x, x, i32, x, P, 2 * I, H, E), {"ALIGN": row_align(dtype, 2 * I, H)})]


_KERNEL_FNS = {"gather_glu": _gather_glu_kernel, "rows_matmul": _rows_matmul_kernel,
               "glu_backward": _glu_backward_kernel, "weight_grad": _weight_grad_kernel}


def aot_specs() -> list[KernelSpec]:
    """Every (kernel, dtype, configuration, specialisation) the launchers above may launch on a
    GPU, in each architecture family's space: what ``configs_for`` gives each alignment class."""
    specs = []
    for family in CONFIGS:
        for dtype, ty in TRITON_TYPES.items():
            # IEEE float32 dot products run on FMAs: only the half types must reach tensor cores.
            on_tensor_cores = dtype in _HALF
            for kernel in GEMM_KERNELS:
                uses_activation = kernel in _TAKES_ACTIVATION
                uses_top_k = kernel in _TAKES_TOP_K
                seen = set()
                for sizes, top_k, activation in _VARIANTS:
                    # Kernels that take no activation or top-k compile each size class once.
                    key = (sizes, top_k if uses_top_k else 0, activation if uses_activation else "")
                    if key in seen:
                        continue
                    seen.add(key)
                    H, I = _SIZES[sizes]
                    tag = "_".join(str(v) for v in key if v not in ("", 0))
                    P = padded_rows(MIXTRAL.T * top_k, MIXTRAL.E, 128)
                    configs = configs_for(kernel, dtype, family, aligned=sizes == "aligned",
                                          gelu=uses_activation and activation == "gelu")
                    # Without timing, experts with few rows (64-row padding) launch the first
                    # configuration that divides it.
                    small = configs_for(kernel, dtype, family, pad_m=64, aligned=sizes == "aligned",
                                        gelu=uses_activation and activation == "gelu")[:1]
                    reference = ty == "bf16" and key == ("aligned", 2 if uses_top_k else 0,
                                                         "silu" if uses_activation else "")
                    for rank, c in enumerate(configs):
                        for role, args, flags in _gemm_launches(kernel, dtype, H, I, top_k, activation == "gelu", P):
                            specs.append(KernelSpec(
                                name=f"{role}_{ty}_{family}_{c}_{tag}", fn=_KERNEL_FNS[kernel], args=args,
                                constexprs={**flags, **c.constexprs(), "GROUP_M": GROUP_M, "INTERPRETED": False},
                                uses_dot=on_tensor_cores, tma=c.tma, archs=FAMILY_ARCHS[family], rank=rank,
                                untuned=c in small,
                                cost=(family, rank, role, c.persistent, gemm_costs) if reference else None,
                                quick=not (uses_top_k and uses_activation) or (top_k == 1) == (activation == "gelu"),
                                **c.launch_options(),
                            ))
    for dtype, ty in TRITON_TYPES.items():
        for sizes in _SIZES:
            for top_k in (2, 1):
                H = _SIZES[sizes][0]
                x, i32 = pointer(dtype), pointer(torch.int32)
                # The experts' combine (int32 slots, no scale) and the dispatcher's sums (int64
                # terms, a float32 scale, up to top-k ranks per token).
                for role, index, has_scale in (("combine", i32, False), ("sum_rows", pointer(torch.int64), True)):
                    specs.append(KernelSpec(
                        name=f"{role}_{ty}_{sizes}_k{top_k}", fn=_sum_rows_kernel,
                        args=(x, index, pointer(torch.float32) if has_scale else x, x, MIXTRAL.T, H, top_k,
                              MIXTRAL.T * top_k),
                        constexprs={"HAS_SCALE": has_scale, "BLOCK_T": COMBINE_BLOCK_T, "BLOCK_H": COMBINE_BLOCK_H,
                                    "ALIGN": row_align(dtype, H), "INTERPRETED": False},
                        num_warps=COMBINE_WARPS,
                    ))
                if top_k == 2:
                    for with_dot in (True, False):
                        specs.append(KernelSpec(
                            name=f"scaled_gather_{ty}_{sizes}{'_dot' if with_dot else ''}", fn=_scaled_gather_kernel,
                            args=(x, pointer(torch.int64), pointer(torch.float32), x, x, pointer(torch.float32),
                                  MIXTRAL.T * top_k, H, MIXTRAL.T),
                            constexprs={"WITH_DOT": with_dot, "BLOCK_M": SCALED_GATHER_BLOCK_M,
                                        "BLOCK_H": SCALED_GATHER_BLOCK_H, "ALIGN": row_align(dtype, H),
                                        "INTERPRETED": False},
                            num_warps=SCALED_GATHER_WARPS,
                            quick=with_dot,  # the variant without the dot drops a branch, adds nothing
                        ))
                specs.append(KernelSpec(
                    name=f"gather_rows_{ty}_{sizes}_k{top_k}", fn=_gather_rows_kernel,
                    args=(x, i32, i32, x, H, MIXTRAL.E, top_k),
                    constexprs={"BLOCK_R": GATHER_BLOCK_R, "BLOCK_H": GATHER_BLOCK_H, "ALIGN": row_align(dtype, H)},
                    num_warps=GATHER_WARPS,
                ))
    specs += _library_epilogue_specs()
    return specs


def _library_epilogue_specs() -> list[KernelSpec]:
    """The passes that complete PyTorch's grouped GEMM where it stands in for a fused kernel: only
    where it is sync-free (sm_90, the half types) and the rows aligned, so for those alone."""
    specs = []
    H, I = _SIZES["aligned"]
    P = padded_rows(MIXTRAL.T * MIXTRAL.K, MIXTRAL.E, 128)
    for dtype in _HALF:
        ty = TRITON_TYPES[dtype]
        x, i32, f32 = pointer(dtype), pointer(torch.int32), pointer(torch.float32)
        flags = {"BLOCK_R": EPILOGUE_BLOCK_R, "BLOCK_C": EPILOGUE_BLOCK_C, "INTERPRETED": False}
        for activation in ACTIVATIONS:
            gelu = {"GELU": activation == "gelu"}
            specs.append(KernelSpec(
                name=f"glu_rows_{ty}_{activation}", fn=_glu_rows_kernel, args=(x, x, i32, P, I, MIXTRAL.E),
                constexprs={**flags, **gelu, "ALIGN": row_align(dtype, I)}, num_warps=EPILOGUE_WARPS, archs=(90,),
            ))
            specs.append(KernelSpec(
                name=f"glu_backward_rows_{ty}_{activation}", fn=_glu_backward_rows_kernel,
                args=(x, x, f32, i32, i32, x, x, f32, I, MIXTRAL.E),
                constexprs={**flags, **gelu, "ALIGN": row_align(dtype, H, I)}, num_warps=EPILOGUE_WARPS, archs=(90,),
            ))
        specs.append(KernelSpec(
            name=f"scale_rows_{ty}", fn=_scale_rows_kernel, args=(x, f32, i32, i32, H, MIXTRAL.E),
            constexprs={**flags, "ALIGN": row_align(dtype, H, I)}, num_warps=EPILOGUE_WARPS, archs=(90,),
        ))
    return specs
