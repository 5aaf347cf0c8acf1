"""Grouped-GEMM kernels of the expert MLP and their launchers.

All kernels work on the padded layout of ``routing_metadata``: row p of an intermediate tensor
(``h_PI``, ``pre_P2I``, ...) holds slot ``sorted_slot[p]`` (token ``slot // K``), every block of
``pad_m`` rows belongs to one expert and padding rows hold -1. Token rows are gathered inside the
GEMM prologues, so no permuted copy of the hidden states is ever made.

Forward:   ``gather_glu``   x[token] @ gate_up[e]^T, gated activation in the epilogue -> h, pre
           ``rows_matmul``  h @ down[e]^T, routing weight in the epilogue -> out rows
           ``combine``      y[t] = sum_k out[pos(t, k)], a fixed-order sum in float32
Backward:  ``glu_backward`` dy[token] @ down[e], the activation recomputed from ``pre``
                            -> d pre, and d(routing weight) per slot
           ``rows_matmul``  d pre @ gate_up[e] -> dx rows, then ``combine``
           ``down_weight_grad``, ``gate_up_weight_grad``: per-expert sums over the expert's rows

There are no atomics: every output element is written by exactly one program and reduced in a
fixed order, so two runs give the same bits. Float32 operands use IEEE dot products (no TF32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import autotune
from .aot_spec import TRITON_TYPES, KernelSpec
from .autotune import Config
from .runtime import interpreting, on_device
from .routing_metadata import RoutingMetadata

ACTIVATIONS = ("silu", "gelu")
# Row blocks of the padded layout grouped along M so that consecutive programs reuse the same
# weight tiles from L2.
GROUP_M = 8
COMBINE_BLOCK_T = 32
COMBINE_BLOCK_H = 128
COMBINE_WARPS = 4

_HALF = (torch.bfloat16, torch.float16)

# Configuration spaces, per kernel and dtype. BLOCK_M of the row-blocked kernels must divide the
# metadata's pad_m (64 or 128, see ``routing_block``). Float32 runs on IEEE FMAs, not tensor
# cores, and is there for accuracy, so it gets a single small tile.
_FP32_TILE = [Config(64, 32, 32, num_warps=8, num_stages=2)]
CONFIGS = {
    # Two accumulators (gate and up) per tile: keep the tile at 64 columns.
    "gather_glu": {"half": [Config(64, 64, 64, 4, 3), Config(128, 64, 64, 8, 3)], "fp32": _FP32_TILE},
    "rows_matmul": {"half": [Config(64, 128, 64, 4, 3), Config(128, 128, 64, 8, 3)], "fp32": _FP32_TILE},
    "glu_backward": {"half": [Config(64, 64, 64, 4, 3), Config(128, 64, 64, 8, 3)], "fp32": _FP32_TILE},
    # Weight gradients: M and N tile the weight, K steps over the expert's rows. One tile: d down
    # recomputes the activation inside its loop, and a 4-warp tile of it spills.
    "weight_grad": {"half": [Config(128, 128, 64, 8, 3)], "fp32": _FP32_TILE},
}


def routing_block(num_slots: int, num_experts: int) -> int:
    """Padding of each expert's rows (the metadata's ``pad_m``): 128-row tiles once experts get
    enough rows for them, else 64, the smallest M at which Hopper's wgmma is used."""
    return 128 if num_slots >= 256 * num_experts else 64


def configs_for(kernel: str, dtype: torch.dtype, pad_m: int | None = None) -> list[Config]:
    space = CONFIGS[kernel]["half" if dtype in _HALF else "fp32"]
    if pad_m is None:
        return list(space)
    return [c for c in space if pad_m % c.BLOCK_M == 0]


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
def _act(g, gelu):
    """act(g) in float32: GELU (erf form, as torch's default) or SiLU."""
    if gelu:
        a = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
    else:
        a = g / (1.0 + tl.exp(-g))
    return a


@triton.jit
def _act_and_grad(g, gelu):
    """(act(g), d act / d g) in float32."""
    if gelu:
        cdf = 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))
        a = g * cdf
        da = cdf + g * 0.3989422804014327 * tl.exp(-0.5 * g * g)
    else:
        sig = 1.0 / (1.0 + tl.exp(-g))
        a = g * sig
        da = sig * (1.0 + g * (1.0 - sig))
    return a, da


@triton.jit
def _tile(num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of this program, GROUP_M row blocks at a time."""
    pid = tl.program_id(0)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    return pid_m, pid_n


# ----------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _gather_glu_kernel(
    x_ptr, w_ptr, block_expert_ptr, sorted_slot_ptr, h_ptr, pre_ptr,
    num_rows, H, I, top_k, pad_m, gelu,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """pre[p] = gate_up[e] @ x[token(p)]; h[p] = act(pre gate half) * pre up half."""
    pid_m, pid_n = _tile(num_rows // BLOCK_M, tl.cdiv(I, BLOCK_N), GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < I
    pre_ptrs = pre_ptr + rows[:, None].to(tl.int64) * (2 * I) + cols[None, :]
    expert = tl.load(block_expert_ptr + pid_m * BLOCK_M // pad_m)
    if expert < 0:
        # Past the real end. pre is returned (and saved for backward), so give every row a
        # value; padding rows inside an expert's blocks get zeros below.
        zeros = tl.zeros((BLOCK_M, BLOCK_N), pre_ptr.dtype.element_ty)
        tl.store(pre_ptrs, zeros, mask=col_ok[None, :])
        tl.store(pre_ptrs + I, zeros, mask=col_ok[None, :])
        return
    slot = tl.load(sorted_slot_ptr + rows)
    valid = slot >= 0
    token = tl.where(valid, slot // top_k, 0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    # Row base pointers only; the tile addresses are rebuilt each step, which keeps the state
    # carried across iterations (and so the registers) small.
    x_rows = x_ptr + token * H
    # gate_up[e] is [2I, H]: the tile's gate rows are `cols`, its up rows `I + cols`. Offsets
    # inside one expert's weight fit in int32 (the launcher checks its size).
    g_rows = w_ptr + expert.to(tl.int64) * 2 * I * H + cols * H
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + ks
        k_ok = kk < H
        a = tl.load(x_rows[:, None] + kk[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        b_mask = k_ok[:, None] & col_ok[None, :]
        b_g = tl.load(g_rows[None, :] + kk[:, None], mask=b_mask, other=0.0)
        b_u = tl.load(g_rows[None, :] + (kk[:, None] + I * H), mask=b_mask, other=0.0)
        if INTERPRETED:
            a = a.to(tl.float32)
            b_g = b_g.to(tl.float32)
            b_u = b_u.to(tl.float32)
        acc_g = tl.dot(a, b_g, acc_g, input_precision="ieee")
        acc_u = tl.dot(a, b_u, acc_u, input_precision="ieee")
    # Padding rows (slot -1) read zeros, so they store zeros.
    out_mask = col_ok[None, :]
    tl.store(pre_ptrs, _downcast(acc_g, pre_ptr.dtype.element_ty, INTERPRETED), mask=out_mask)
    tl.store(pre_ptrs + I, _downcast(acc_u, pre_ptr.dtype.element_ty, INTERPRETED), mask=out_mask)
    h = _act(acc_g, gelu) * acc_u
    h_ptrs = h_ptr + rows[:, None].to(tl.int64) * I + cols[None, :]
    tl.store(h_ptrs, _downcast(h, h_ptr.dtype.element_ty, INTERPRETED), mask=out_mask)


@triton.jit
def _rows_matmul_kernel(
    a_ptr, w_ptr, block_expert_ptr, sorted_slot_ptr, scale_ptr, out_ptr,
    num_rows, n_out, k_red, pad_m,
    W_NK: tl.constexpr, SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """out[p] = w[e] @ a[p] (W_NK: w[e] is [n_out, k_red]) or a[p] @ w[e] (w[e] is [k_red, n_out]),
    times scale[slot(p)] when SCALE."""
    pid_m, pid_n = _tile(num_rows // BLOCK_M, tl.cdiv(n_out, BLOCK_N), GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m * BLOCK_M // pad_m)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(sorted_slot_ptr + rows)
    valid = slot >= 0
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    ks = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + rows.to(tl.int64) * k_red
    # Offsets inside one expert's weight fit in int32 (the launcher checks its size).
    w_base = w_ptr + expert.to(tl.int64) * n_out * k_red
    if W_NK:
        w_cols = w_base + cols * k_red
    else:
        w_cols = w_base + cols
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, k_red, BLOCK_K):
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
    tl.store(out_ptrs, _downcast(acc, out_ptr.dtype.element_ty, INTERPRETED), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _glu_backward_kernel(
    dy_ptr, w_ptr, pre_ptr, scale_ptr, block_expert_ptr, sorted_slot_ptr, dpre_ptr, dw_part_ptr,
    num_rows, H, I, top_k, pad_m, gelu,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """dh = dy[token(p)] @ down[e] (the gradient of the unweighted expert output w.r.t. h); then,
    with act recomputed from pre: d pre = (w dh * up * act'(gate), w dh * act(gate)) and the
    partial d w = <h, dh> over this tile's columns (w: the slot's routing weight)."""
    num_pid_n = tl.cdiv(I, BLOCK_N)
    pid_m, pid_n = _tile(num_rows // BLOCK_M, num_pid_n, GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m * BLOCK_M // pad_m)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(sorted_slot_ptr + rows)
    valid = slot >= 0
    token = tl.where(valid, slot // top_k, 0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < I
    ks = tl.arange(0, BLOCK_K)
    dy_rows = dy_ptr + token * H
    # down[e] is [H, I]: the reduction runs over H, its rows.
    w_cols = w_ptr + expert.to(tl.int64) * H * I + cols
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + ks
        k_ok = kk < H
        a = tl.load(dy_rows[:, None] + kk[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_cols[None, :] + kk[:, None] * I, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if INTERPRETED:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision="ieee")
    tile_mask = valid[:, None] & col_ok[None, :]
    pre_ptrs = pre_ptr + rows[:, None].to(tl.int64) * (2 * I) + cols[None, :]
    gate = tl.load(pre_ptrs, mask=tile_mask, other=0.0).to(tl.float32)
    up = tl.load(pre_ptrs + I, mask=tile_mask, other=0.0).to(tl.float32)
    act, d_act = _act_and_grad(gate, gelu)
    tl.store(dw_part_ptr + rows.to(tl.int64) * num_pid_n + pid_n, tl.sum(act * up * acc, axis=1), mask=valid)
    dh = acc * tl.load(scale_ptr + slot, mask=valid, other=0.0)[:, None]
    dpre_ptrs = dpre_ptr + rows[:, None].to(tl.int64) * (2 * I) + cols[None, :]
    tl.store(dpre_ptrs, _downcast(dh * up * d_act, dpre_ptr.dtype.element_ty, INTERPRETED), mask=tile_mask)
    tl.store(dpre_ptrs + I, _downcast(dh * act, dpre_ptr.dtype.element_ty, INTERPRETED), mask=tile_mask)


@triton.jit
def _weight_grad_kernel(
    a_ptr, b_ptr, scale_ptr, padded_offsets_ptr, sorted_slot_ptr, out_ptr,
    M, N, top_k, gelu,
    A_GATHER: tl.constexpr, A_SCALE: tl.constexpr, B_GATHER: tl.constexpr, B_GLU: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """out[e] = sum over expert e's rows p of A(p)^T B(p), an [M, N] tile per program.

    A(p) is a_ptr's row p, or its row token(p) when A_GATHER, times scale[slot(p)] when A_SCALE.
    B(p) is b_ptr's row p, or row token(p) when B_GATHER, or, when B_GLU, act(gate) * up
    recomputed from the [P, 2N] pre-activation."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    expert = pid // (num_pid_m * num_pid_n)
    pid_m = (pid // num_pid_n) % num_pid_m
    pid_n = pid % num_pid_n
    start = tl.load(padded_offsets_ptr + expert)
    end = tl.load(padded_offsets_ptr + expert + 1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    # An expert without rows runs no iteration and writes zeros.
    for r0 in range(start, end, BLOCK_K):
        rows = r0 + ks
        slot = tl.load(sorted_slot_ptr + rows, mask=rows < end, other=-1)
        valid = slot >= 0
        token = tl.where(valid, slot // top_k, 0).to(tl.int64)
        if A_GATHER:
            a_rows = token
        else:
            a_rows = rows.to(tl.int64)
        a = tl.load(a_ptr + a_rows[:, None] * M + offs_m[None, :], mask=valid[:, None] & m_ok[None, :], other=0.0)
        if A_SCALE:
            weight = tl.load(scale_ptr + slot, mask=valid, other=0.0)
            a = _downcast(a.to(tl.float32) * weight[:, None], a_ptr.dtype.element_ty, INTERPRETED)
        b_mask = valid[:, None] & n_ok[None, :]
        if B_GLU:
            pre_ptrs = b_ptr + rows[:, None].to(tl.int64) * (2 * N) + offs_n[None, :]
            gate = tl.load(pre_ptrs, mask=b_mask, other=0.0).to(tl.float32)
            up = tl.load(pre_ptrs + N, mask=b_mask, other=0.0).to(tl.float32)
            b = _downcast(_act(gate, gelu) * up, b_ptr.dtype.element_ty, INTERPRETED)
        else:
            if B_GATHER:
                b_rows = token
            else:
                b_rows = rows.to(tl.int64)
            b = tl.load(b_ptr + b_rows[:, None] * N + offs_n[None, :], mask=b_mask, other=0.0)
        if INTERPRETED:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(tl.trans(a), b, acc, input_precision="ieee")
    out_ptrs = out_ptr + expert.to(tl.int64) * M * N + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out_ptrs, _downcast(acc, out_ptr.dtype.element_ty, INTERPRETED), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _combine_kernel(rows_ptr, slot_pos_ptr, out_ptr, T, H, top_k,
                    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, INTERPRETED: tl.constexpr):
    """out[t] = sum_k rows[slot_pos[t * K + k]], in float32 and in slot order."""
    ts = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok = ts < T
    mask = t_ok[:, None] & (hs < H)[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
    for k in range(0, top_k):
        pos = tl.load(slot_pos_ptr + ts.to(tl.int64) * top_k + k, mask=t_ok, other=0).to(tl.int64)
        acc += tl.load(rows_ptr + pos[:, None] * H + hs[None, :], mask=mask, other=0.0).to(tl.float32)
    out_ptrs = out_ptr + ts[:, None].to(tl.int64) * H + hs[None, :]
    tl.store(out_ptrs, _downcast(acc, out_ptr.dtype.element_ty, INTERPRETED), mask=mask)


# ----------------------------------------------------------------------------------------------
# Launchers: validate, allocate, choose the configuration and the grid.


def _gelu_flag(activation: str) -> int:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    return int(activation == "gelu")


def _check(name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype) -> None:
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise ValueError(f"{name} must be a {dtype} tensor of shape {tuple(shape)}, got {t.dtype} {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_expert_size(name: str, w_E: torch.Tensor) -> None:
    # The kernels index inside one expert's weight with int32 offsets.
    if w_E[0].numel() >= 2**31:
        raise ValueError(f"{name} must have fewer than 2**31 elements per expert, got shape {tuple(w_E.shape)}")


def _check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in TRITON_TYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def _row_grid(config: Config, num_rows: int, n_out: int) -> tuple:
    return (num_rows // config.BLOCK_M * triton.cdiv(n_out, config.BLOCK_N),)


def _tuned(kernel: str, meta: RoutingMetadata, dtype, device, shapes: tuple, launch):
    """Choose a configuration (timing on first sight of the key) and launch with it."""
    num_rows = meta.slot_pos_N.numel()
    with on_device(device):
        config = autotune.choose(
            kernel, configs_for(kernel, dtype, meta.pad_m if kernel != "weight_grad" else None),
            shapes=shapes + (meta.pad_m,), dtype=dtype, device=device, num_rows=num_rows, launch=launch,
        )
        return launch(config)


def gather_glu(x_TH: torch.Tensor, gate_up_E2IH: torch.Tensor, meta: RoutingMetadata, top_k: int,
               activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """GEMM 1 with the token gather and the gated activation fused: (h_PI, pre_P2I)."""
    _check_float("x_TH", x_TH)
    gelu = _gelu_flag(activation)
    T, H = x_TH.shape
    E, two_I, _ = gate_up_E2IH.shape
    I = two_I // 2
    _check("x_TH", x_TH, (T, H), x_TH.dtype)
    _check("gate_up_E2IH", gate_up_E2IH, (E, two_I, H), x_TH.dtype)
    _check_expert_size("gate_up_E2IH", gate_up_E2IH)
    P = meta.sorted_slot_P.numel()
    h_PI = x_TH.new_empty(P, I)
    pre_P2I = x_TH.new_empty(P, two_I)
    if P == 0:
        return h_PI, pre_P2I

    def launch(c: Config):
        _gather_glu_kernel[_row_grid(c, P, I)](
            x_TH, gate_up_E2IH, meta.block_expert_B, meta.sorted_slot_P, h_PI, pre_P2I,
            P, H, I, top_k, meta.pad_m, gelu,
            GROUP_M=GROUP_M, INTERPRETED=interpreting(), **c.constexprs(), **c.launch_options(),
        )
        return h_PI, pre_P2I

    return _tuned("gather_glu", meta, x_TH.dtype, x_TH.device, (H, I, E), launch)


def rows_matmul(a_PK: torch.Tensor, w_E: torch.Tensor, meta: RoutingMetadata, *, w_layout: str,
                scale_N: torch.Tensor | None = None) -> torch.Tensor:
    """Per padded row p of expert e: ``w[e] @ a[p]`` for ``w_layout="nk"`` (w_E is [E, n_out, k])
    or ``a[p] @ w[e]`` for ``"kn"`` (w_E is [E, k, n_out]); times ``scale_N[slot(p)]`` if given."""
    _check_float("a_PK", a_PK)
    if w_layout not in ("nk", "kn"):
        raise ValueError(f"w_layout must be 'nk' or 'kn', got {w_layout!r}")
    P, k_red = a_PK.shape
    E = w_E.shape[0]
    n_out = w_E.shape[1] if w_layout == "nk" else w_E.shape[2]
    _check("a_PK", a_PK, (meta.sorted_slot_P.numel(), k_red), a_PK.dtype)
    _check("w_E", w_E, (E, n_out, k_red) if w_layout == "nk" else (E, k_red, n_out), a_PK.dtype)
    _check_expert_size("w_E", w_E)
    if scale_N is not None:
        _check("scale_N", scale_N, (meta.slot_pos_N.numel(),), torch.float32)
    out_PN = a_PK.new_empty(P, n_out)
    if P == 0:
        return out_PN
    # The pointer is never read without SCALE; any float32 tensor keeps the signature fixed.
    scale = scale_N if scale_N is not None else a_PK.new_empty(0, dtype=torch.float32)

    def launch(c: Config):
        _rows_matmul_kernel[_row_grid(c, P, n_out)](
            a_PK, w_E, meta.block_expert_B, meta.sorted_slot_P, scale, out_PN,
            P, n_out, k_red, meta.pad_m,
            W_NK=w_layout == "nk", SCALE=scale_N is not None,
            GROUP_M=GROUP_M, INTERPRETED=interpreting(), **c.constexprs(), **c.launch_options(),
        )
        return out_PN

    shapes = (n_out, k_red, E, w_layout, scale_N is not None)
    return _tuned("rows_matmul", meta, a_PK.dtype, a_PK.device, shapes, launch)


def glu_backward(dy_TH: torch.Tensor, down_EHI: torch.Tensor, pre_P2I: torch.Tensor, w_N: torch.Tensor,
                 meta: RoutingMetadata, top_k: int, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(d pre_P2I, d w_N): gradients of the GEMM-1 output and of each slot's routing weight."""
    _check_float("dy_TH", dy_TH)
    gelu = _gelu_flag(activation)
    T, H = dy_TH.shape
    E, _, I = down_EHI.shape
    P = meta.sorted_slot_P.numel()
    N = meta.slot_pos_N.numel()
    _check("dy_TH", dy_TH, (T, H), dy_TH.dtype)
    _check("down_EHI", down_EHI, (E, H, I), dy_TH.dtype)
    _check_expert_size("down_EHI", down_EHI)
    _check("pre_P2I", pre_P2I, (P, 2 * I), dy_TH.dtype)
    _check("w_N", w_N, (N,), torch.float32)
    dpre_P2I = torch.empty_like(pre_P2I)
    if P == 0:
        return dpre_P2I, w_N.new_zeros(N)

    def launch(c: Config):
        # Each column tile writes its own partial sum of d w; summed below in a fixed order.
        dw_part = w_N.new_empty(P, triton.cdiv(I, c.BLOCK_N))
        _glu_backward_kernel[_row_grid(c, P, I)](
            dy_TH, down_EHI, pre_P2I, w_N, meta.block_expert_B, meta.sorted_slot_P, dpre_P2I, dw_part,
            P, H, I, top_k, meta.pad_m, gelu,
            GROUP_M=GROUP_M, INTERPRETED=interpreting(), **c.constexprs(), **c.launch_options(),
        )
        return dpre_P2I, dw_part

    dpre_P2I, dw_part = _tuned("glu_backward", meta, dy_TH.dtype, dy_TH.device, (H, I, E), launch)
    # Padding rows of dw_part are never written; only the slots' own rows are read.
    dw_N = dw_part.index_select(0, meta.slot_pos_N).sum(1)
    return dpre_P2I, dw_N


def _weight_grad(a, b, scale_N, meta: RoutingMetadata, out_EMN, top_k: int, gelu: int, *,
                 a_gather: bool, a_scale: bool, b_gather: bool, b_glu: bool):
    E, M, N = out_EMN.shape
    if meta.sorted_slot_P.numel() == 0:
        return out_EMN.zero_()

    def launch(c: Config):
        grid = (E * triton.cdiv(M, c.BLOCK_M) * triton.cdiv(N, c.BLOCK_N),)
        _weight_grad_kernel[grid](
            a, b, scale_N, meta.padded_offsets_E1, meta.sorted_slot_P, out_EMN,
            M, N, top_k, gelu,
            A_GATHER=a_gather, A_SCALE=a_scale, B_GATHER=b_gather, B_GLU=b_glu,
            INTERPRETED=interpreting(), **c.constexprs(), **c.launch_options(),
        )
        return out_EMN

    shapes = (M, N, E, a_gather, a_scale, b_gather, b_glu)
    return _tuned("weight_grad", meta, out_EMN.dtype, out_EMN.device, shapes, launch)


def down_weight_grad(dy_TH: torch.Tensor, w_N: torch.Tensor, pre_P2I: torch.Tensor, meta: RoutingMetadata,
                     top_k: int, activation: str) -> torch.Tensor:
    """d down[e] = sum over e's slots of (w * dy[token])^T h, with h recomputed from pre: [E, H, I]."""
    _check_float("dy_TH", dy_TH)
    gelu = _gelu_flag(activation)
    T, H = dy_TH.shape
    P, two_I = pre_P2I.shape
    E = meta.counts_E.numel()
    _check("dy_TH", dy_TH, (T, H), dy_TH.dtype)
    _check("pre_P2I", pre_P2I, (meta.sorted_slot_P.numel(), two_I), dy_TH.dtype)
    _check("w_N", w_N, (meta.slot_pos_N.numel(),), torch.float32)
    out = dy_TH.new_empty(E, H, two_I // 2)
    return _weight_grad(dy_TH, pre_P2I, w_N, meta, out, top_k, gelu,
                        a_gather=True, a_scale=True, b_gather=False, b_glu=True)


def gate_up_weight_grad(dpre_P2I: torch.Tensor, x_TH: torch.Tensor, meta: RoutingMetadata,
                        top_k: int) -> torch.Tensor:
    """d gate_up[e] = sum over e's slots of d pre^T x[token]: [E, 2I, H]."""
    _check_float("x_TH", x_TH)
    T, H = x_TH.shape
    P, two_I = dpre_P2I.shape
    E = meta.counts_E.numel()
    _check("x_TH", x_TH, (T, H), x_TH.dtype)
    _check("dpre_P2I", dpre_P2I, (meta.sorted_slot_P.numel(), two_I), x_TH.dtype)
    out = x_TH.new_empty(E, two_I, H)
    # scale is unused without A_SCALE: pass any float32 tensor to keep the signature fixed.
    no_scale = x_TH.new_empty(0, dtype=torch.float32)
    return _weight_grad(dpre_P2I, x_TH, no_scale, meta, out, top_k, 0,
                        a_gather=False, a_scale=False, b_gather=True, b_glu=False)


def combine(rows_PH: torch.Tensor, meta: RoutingMetadata, num_tokens: int, top_k: int) -> torch.Tensor:
    """y[t] = sum_k rows[padded row of slot t * K + k], summed in float32 in slot order."""
    _check_float("rows_PH", rows_PH)
    P, H = rows_PH.shape
    _check("rows_PH", rows_PH, (meta.sorted_slot_P.numel(), H), rows_PH.dtype)
    if meta.slot_pos_N.numel() != num_tokens * top_k:
        raise ValueError(
            f"metadata holds {meta.slot_pos_N.numel()} slots, expected num_tokens * top_k = {num_tokens * top_k}"
        )
    y_TH = rows_PH.new_empty(num_tokens, H)
    if num_tokens == 0:
        return y_TH
    grid = (triton.cdiv(num_tokens, COMBINE_BLOCK_T), triton.cdiv(H, COMBINE_BLOCK_H))
    with on_device(rows_PH.device):
        _combine_kernel[grid](
            rows_PH, meta.slot_pos_N, y_TH, num_tokens, H, top_k,
            BLOCK_T=COMBINE_BLOCK_T, BLOCK_H=COMBINE_BLOCK_H, INTERPRETED=interpreting(), num_warps=COMBINE_WARPS,
        )
    return y_TH


# ----------------------------------------------------------------------------------------------
# Ahead-of-time compile list


def _spec(name, fn, pointers: dict, ints: tuple, constexprs: dict, config: Config | None, uses_dot: bool):
    signature = {**pointers, **{n: "i32" for n in ints}, **{n: "constexpr" for n in constexprs}}
    options = config.launch_options() if config is not None else {"num_warps": COMBINE_WARPS, "num_stages": 3}
    return KernelSpec(name=name, fn=fn, signature=signature, constexprs=constexprs, uses_dot=uses_dot,
                      unaligned=("top_k",), **options)


def aot_specs() -> list[KernelSpec]:
    """Every (kernel, dtype, configuration) the launchers above may launch on a GPU."""
    specs = []
    for dtype, ty in TRITON_TYPES.items():
        # IEEE float32 dot products run on FMAs: only the half types must reach tensor cores.
        on_tensor_cores = dtype in _HALF
        common = {"GROUP_M": GROUP_M, "INTERPRETED": False}
        for c in configs_for("gather_glu", dtype):
            specs.append(_spec(
                f"gather_glu_{ty}_{c}", _gather_glu_kernel,
                {"x_ptr": f"*{ty}", "w_ptr": f"*{ty}", "block_expert_ptr": "*i32", "sorted_slot_ptr": "*i32",
                 "h_ptr": f"*{ty}", "pre_ptr": f"*{ty}"},
                ("num_rows", "H", "I", "top_k", "pad_m", "gelu"),
                {**c.constexprs(), **common}, c, on_tensor_cores,
            ))
        for c in configs_for("rows_matmul", dtype):
            for w_nk, scale in ((True, True), (False, False)):
                specs.append(_spec(
                    f"rows_matmul_{'nk_scaled' if w_nk else 'kn'}_{ty}_{c}", _rows_matmul_kernel,
                    {"a_ptr": f"*{ty}", "w_ptr": f"*{ty}", "block_expert_ptr": "*i32", "sorted_slot_ptr": "*i32",
                     "scale_ptr": "*fp32", "out_ptr": f"*{ty}"},
                    ("num_rows", "n_out", "k_red", "pad_m"),
                    {"W_NK": w_nk, "SCALE": scale, **c.constexprs(), **common}, c, on_tensor_cores,
                ))
        for c in configs_for("glu_backward", dtype):
            specs.append(_spec(
                f"glu_backward_{ty}_{c}", _glu_backward_kernel,
                {"dy_ptr": f"*{ty}", "w_ptr": f"*{ty}", "pre_ptr": f"*{ty}", "scale_ptr": "*fp32",
                 "block_expert_ptr": "*i32", "sorted_slot_ptr": "*i32", "dpre_ptr": f"*{ty}", "dw_part_ptr": "*fp32"},
                ("num_rows", "H", "I", "top_k", "pad_m", "gelu"),
                {**c.constexprs(), **common}, c, on_tensor_cores,
            ))
        for c in configs_for("weight_grad", dtype):
            for name, flags in (
                ("down", dict(A_GATHER=True, A_SCALE=True, B_GATHER=False, B_GLU=True)),
                ("gate_up", dict(A_GATHER=False, A_SCALE=False, B_GATHER=True, B_GLU=False)),
            ):
                specs.append(_spec(
                    f"weight_grad_{name}_{ty}_{c}", _weight_grad_kernel,
                    {"a_ptr": f"*{ty}", "b_ptr": f"*{ty}", "scale_ptr": "*fp32", "padded_offsets_ptr": "*i32",
                     "sorted_slot_ptr": "*i32", "out_ptr": f"*{ty}"},
                    ("M", "N", "top_k", "gelu"),
                    {**flags, **c.constexprs(), "INTERPRETED": False}, c, on_tensor_cores,
                ))
        specs.append(_spec(
            f"combine_{ty}", _combine_kernel,
            {"rows_ptr": f"*{ty}", "slot_pos_ptr": "*i32", "out_ptr": f"*{ty}"},
            ("T", "H", "top_k"),
            {"BLOCK_T": COMBINE_BLOCK_T, "BLOCK_H": COMBINE_BLOCK_H, "INTERPRETED": False}, None, False,
        ))
    return specs
