"""Fused MoE router: one program per block of tokens computes the fp32 logits ``x @ W^T`` with
tensor cores, then the softmax or sigmoid scores, the (optionally bias-steered, group-limited)
top-k choice and the renormalised, scaled weights, and writes logits, weights and indices: one
launch and one pass over ``x``. The backward kernel turns the gradients of the weights and of
the logits into the gradient of the logits; the two matmuls that follow (dX, dW) are plain
GEMMs left to the caller.

Feature switches (score, renormalisation, bias, groups) are runtime arguments excluded from
Triton's value specialisation, so one compiled kernel per dtype and tile serves every router
family; only tile sizes and dtypes are compile-time, which keeps the set the ahead-of-time check
compiles small and complete."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .aot_spec import TRITON_TYPES, KernelSpec, pointer
from .runtime import on_device

# tl.dot needs every dimension >= 16; the experts axis is padded to a power of two at least this.
MIN_BLOCK_E = 16
MAX_EXPERTS = 256


class FwdConfig(NamedTuple):
    block_t: int  # tokens per program (rows of the GEMM tile)
    block_h: int  # reduction step
    sub_t: int  # rows per step of the selection phase
    num_warps: int
    num_stages: int


class BwdConfig(NamedTuple):
    block_t: int
    num_warps: int


@triton.jit
def _scores(z, col_ok, sigmoid):
    """Softmax over the real experts, or elementwise sigmoid, of fp32 logits."""
    if sigmoid != 0:
        probs = tl.sigmoid(z)
    else:
        z = tl.where(col_ok[None, :], z, -float("inf"))
        e = tl.exp(z - tl.max(z, axis=1)[:, None])
        probs = e / tl.sum(e, axis=1)[:, None]
    return probs


@triton.jit
def _select_rows(
    logits_ptr, bias_ptr, weights_ptr, indices_ptr, row0,
    T, E, top_k, n_group, topk_group, scale, sigmoid, normalize, has_bias,
    SUB_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """Scores, top-k choice and weights of SUB_T rows whose logits are already in memory."""
    rows = row0 + tl.arange(0, SUB_T).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    col_ok = cols < E
    z = tl.load(logits_ptr + rows[:, None] * E + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    probs = _scores(z, col_ok, sigmoid)

    # The correction bias steers the choice only; the weights come from the unbiased scores.
    choice = probs
    if has_bias != 0:
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        choice = probs + bias[None, :]

    # Rows past T compute on zeros and are never stored.
    avail = col_ok[None, :] & (rows[:, None] >= 0)
    if n_group > 1:
        # DeepSeek-V3: rank groups by the sum of their two best experts, keep topk_group groups.
        group_size = E // n_group
        grp = tl.where(col_ok, cols // group_size, n_group)
        group_score = tl.full((SUB_T, BLOCK_E), -float("inf"), tl.float32)
        for g in range(n_group):
            in_g = avail & (grp == g)[None, :]
            best1 = tl.max(tl.where(in_g, choice, -float("inf")), axis=1)
            arg1 = tl.min(tl.where(in_g & (choice == best1[:, None]), cols[None, :], BLOCK_E), axis=1)
            best2 = tl.max(tl.where(in_g & (cols[None, :] != arg1[:, None]), choice, -float("inf")), axis=1)
            score_g = tl.where(group_size > 1, best1 + best2, best1)
            group_score = tl.where(in_g, score_g[:, None], group_score)
        keep = tl.zeros((SUB_T, BLOCK_E), dtype=tl.int1)
        for _ in range(topk_group):
            open_ = avail & ~keep
            best = tl.max(tl.where(open_, group_score, -float("inf")), axis=1)
            g_best = tl.min(tl.where(open_ & (group_score == best[:, None]), grp[None, :], n_group), axis=1)
            keep = keep | (grp[None, :] == g_best[:, None])
        avail = avail & keep

    # k rounds of argmax; ties go to the lowest expert id. rank[t, e] is e's slot, or -1.
    rank = tl.full((SUB_T, BLOCK_E), -1, tl.int32)
    for k in range(top_k):
        free = avail & (rank < 0)
        cand = tl.where(free, choice, -float("inf"))
        best = tl.max(cand, axis=1)
        pick = tl.min(tl.where(free & (cand == best[:, None]), cols[None, :], BLOCK_E), axis=1)
        # A NaN score matches nothing; still fill the slot with a valid id rather than leave
        # garbage that a later kernel would use as an address.
        first_free = tl.min(tl.where(free, cols[None, :], BLOCK_E), axis=1)
        pick = tl.where(pick < BLOCK_E, pick, first_free)
        rank = tl.where(cols[None, :] == pick[:, None], k, rank)

    chosen = rank >= 0
    weights = probs
    if normalize != 0:
        denom = tl.sum(tl.where(chosen, probs, 0.0), axis=1)
        if sigmoid != 0:
            # DeepSeek-V3 guards the sigmoid sum; a softmax top-k sum is never zero.
            denom = denom + 1e-20
        weights = probs / denom[:, None]
    weights = weights * scale
    out = rows[:, None] * top_k + rank
    store_ok = chosen & row_ok[:, None]
    tl.store(weights_ptr + out, weights, mask=store_ok)
    tl.store(indices_ptr + out, (tl.zeros_like(rank) + cols[None, :]).to(tl.int64), mask=store_ok)


@triton.jit(do_not_specialize=["T", "E", "top_k", "n_group", "topk_group", "sigmoid", "normalize", "has_bias"])
def router_fwd_kernel(
    x_ptr, w_ptr, bias_ptr, logits_ptr, weights_ptr, indices_ptr,
    T, H, E, top_k, n_group, topk_group, scale,
    stride_xt, stride_we,
    sigmoid, normalize, has_bias,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, SUB_T: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Phase 1: logits of BLOCK_T tokens with tl.dot, stored in fp32. Phase 2: the selection,
    SUB_T rows at a time from the logits just written (cache hits), so the register-hungry
    [rows, experts] score tiles stay small whatever the GEMM tile is."""
    row0 = tl.program_id(0).to(tl.int64) * BLOCK_T
    rows = row0 + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    offs_h = tl.arange(0, BLOCK_H)
    row_ok = rows < T
    col_ok = cols < E

    x_ptrs = x_ptr + rows[:, None] * stride_xt + offs_h[None, :]
    # W^T tile [BLOCK_H, BLOCK_E], read straight from the row-major [E, H] weight.
    w_ptrs = w_ptr + cols[None, :] * stride_we + offs_h[:, None]
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        h_ok = offs_h + h0 < H
        x = tl.load(x_ptrs, mask=row_ok[:, None] & h_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=h_ok[:, None] & col_ok[None, :], other=0.0)
        if DOT_FP32:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        if x.dtype == tl.float32:
            # Three tf32 passes give float32 accuracy on the tensor cores; plain tf32 would not.
            acc = tl.dot(x, w, acc, input_precision="tf32x3")
        else:
            acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_H
        w_ptrs += BLOCK_H
    tl.store(logits_ptr + rows[:, None] * E + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])
    # Make this block's logits visible to every thread of the block before they are re-read.
    tl.debug_barrier()

    for sub in range(0, BLOCK_T, SUB_T):
        _select_rows(
            logits_ptr, bias_ptr, weights_ptr, indices_ptr, row0 + sub,
            T, E, top_k, n_group, topk_group, scale, sigmoid, normalize, has_bias,
            SUB_T, BLOCK_E,
        )


@triton.jit(do_not_specialize=["T", "E", "top_k", "sigmoid", "normalize"])
def router_bwd_kernel(
    logits_ptr, indices_ptr, grad_weights_ptr, grad_logits_ptr, dlogits_ptr,
    T, E, top_k, scale,
    sigmoid, normalize,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    col_ok = cols < E
    tile_ok = row_ok[:, None] & col_ok[None, :]
    tile = rows[:, None] * E + cols[None, :]
    probs = _scores(tl.load(logits_ptr + tile, mask=tile_ok, other=0.0), col_ok, sigmoid)

    # Scatter the slot gradients onto the experts they came from (ids within a row are distinct).
    g = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    chosen = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int1)
    for k in range(top_k):
        # Rows past T read expert 0 so that their (never stored) sums stay finite.
        idx = tl.load(indices_ptr + rows * top_k + k, mask=row_ok, other=0)
        g_k = tl.load(grad_weights_ptr + rows * top_k + k, mask=row_ok, other=0.0)
        hit = cols[None, :] == idx[:, None]
        g = tl.where(hit, g_k[:, None], g)
        chosen = chosen | hit
    g = g * scale

    if normalize != 0:
        # w_k = p_k / S: dp_k = (g_k - sum_j g_j w_j) / S on the chosen experts.
        p_chosen = tl.where(chosen, probs, 0.0)
        denom = tl.sum(p_chosen, axis=1)
        if sigmoid != 0:
            denom = denom + 1e-20
        inner = tl.sum(g * p_chosen, axis=1) / denom
        dp = tl.where(chosen, (g - inner[:, None]) / denom[:, None], 0.0)
    else:
        dp = g

    if sigmoid != 0:
        dz = dp * probs * (1.0 - probs)
    else:
        dz = probs * (dp - tl.sum(dp * probs, axis=1)[:, None])
    dz += tl.load(grad_logits_ptr + tile, mask=tile_ok, other=0.0)
    tl.store(dlogits_ptr + tile, dz, mask=tile_ok)


def block_e_for(num_experts: int) -> int:
    return max(MIN_BLOCK_E, triton.next_power_of_2(num_experts))


def fwd_config(block_e: int, operand_bytes: int) -> FwdConfig:
    """Tile of the forward kernel. BLOCK_T = 64 is the M of one Hopper warpgroup MMA (wgmma).
    Eight warps once the W^T tile is wide (the fp32 accumulator and, for float32's three tf32
    passes, the split operands must stay in registers); BLOCK_H keeps a pipeline stage of x and
    W at <= 40 KB of shared memory, so 3 stages fit A100 and H100; SUB_T gives the selection
    phase about 8 elements of each [rows, experts] tile per thread."""
    num_warps = 4 if block_e * operand_bytes <= 128 else 8
    block_h = 64 if operand_bytes == 2 else (16 if block_e >= 256 else 32)
    sub_t = min(64, 256 * num_warps // block_e)
    return FwdConfig(64, block_h, sub_t, num_warps, 3)


def bwd_config(block_e: int) -> BwdConfig:
    # Elementwise over [rows, experts]: about 8 elements of each tile per thread. At 128 experts
    # Triton 3.6 spills 8 bytes of the 4-warp build on sm_80; the 8-warp one does not.
    num_warps = 8 if block_e == 128 else 4
    return BwdConfig(max(1, 256 * num_warps // block_e), num_warps)


def router_forward(
    x_TH: torch.Tensor,
    w_EH: torch.Tensor,
    top_k: int,
    *,
    sigmoid: bool,
    normalize: bool,
    bias_E: torch.Tensor | None,
    n_group: int,
    topk_group: int,
    scale: float,
    interpreting: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the fused router. Arguments are assumed valid (checked by the caller); ``x_TH`` and
    ``w_EH`` share one dtype.

    Returns (logits_TE float32, weights_TK float32, indices_TK int64)."""
    T, H = x_TH.shape
    E = w_EH.shape[0]
    if E > MAX_EXPERTS:
        raise ValueError(f"router_weight must have at most {MAX_EXPERTS} experts for the Triton router, got {E}")
    x_TH = x_TH.contiguous()
    w_EH = w_EH.contiguous()
    logits_TE = torch.empty(T, E, device=x_TH.device, dtype=torch.float32)
    weights_TK = torch.empty(T, top_k, device=x_TH.device, dtype=torch.float32)
    indices_TK = torch.empty(T, top_k, device=x_TH.device, dtype=torch.int64)
    if T == 0:
        return logits_TE, weights_TK, indices_TK
    block_e = block_e_for(E)
    # The interpreter of triton 3.9 multiplies the raw bits of bfloat16 operands in tl.dot.
    dot_fp32 = interpreting and x_TH.dtype == torch.bfloat16
    cfg = fwd_config(block_e, x_TH.element_size())
    bias = bias_E.contiguous() if bias_E is not None else logits_TE  # never read without has_bias
    with on_device(x_TH.device):
        router_fwd_kernel[(triton.cdiv(T, cfg.block_t),)](
            x_TH, w_EH, bias, logits_TE, weights_TK, indices_TK,
            T, H, E, top_k, n_group, topk_group, float(scale),
            x_TH.stride(0), w_EH.stride(0),
            int(sigmoid), int(normalize), int(bias_E is not None),
            BLOCK_T=cfg.block_t, BLOCK_E=block_e, BLOCK_H=cfg.block_h, SUB_T=cfg.sub_t, DOT_FP32=dot_fp32,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return logits_TE, weights_TK, indices_TK


def router_backward(
    logits_TE: torch.Tensor,
    indices_TK: torch.Tensor,
    grad_weights_TK: torch.Tensor,
    grad_logits_TE: torch.Tensor,
    *,
    sigmoid: bool,
    normalize: bool,
    scale: float,
) -> torch.Tensor:
    """Gradient of the router's logits from the gradients of its weights and of its logits
    (zeros unless an auxiliary or z loss reads them). Returns dlogits_TE in float32."""
    T, E = logits_TE.shape
    K = indices_TK.shape[1]
    dlogits_TE = torch.empty_like(logits_TE)
    if T == 0:
        return dlogits_TE
    block_e = block_e_for(E)
    cfg = bwd_config(block_e)
    with on_device(logits_TE.device):
        router_bwd_kernel[(triton.cdiv(T, cfg.block_t),)](
            logits_TE.contiguous(), indices_TK.contiguous(), grad_weights_TK.contiguous(),
            grad_logits_TE.contiguous(), dlogits_TE,
            T, E, K, float(scale),
            int(sigmoid), int(normalize),
            BLOCK_T=cfg.block_t, BLOCK_E=block_e, num_warps=cfg.num_warps,
        )
    return dlogits_TE


# Routers the AOT check compiles, as (name, sigmoid, normalize, has bias, top_k, n_group,
# topk_group): Mixtral's softmax top-2, DeepSeek-V3's grouped sigmoid top-8 with a bias, and a
# top-1 softmax without renormalisation (Switch, some Qwen-MoE). Flags and counts equal to 1 are
# constants in the JIT's specialisation, so each is a launch of its own.
_ROUTERS = (("softmax_top2", 0, 1, 0, 2, 1, 1), ("sigmoid_grouped_top8", 1, 1, 1, 8, 8, 4),
            ("softmax_top1", 0, 0, 0, 1, 1, 1))


def aot_specs() -> list[KernelSpec]:
    """Every (kernel, dtype, tile) the launchers may choose, for each router above, at 16384
    tokens of hidden size 4096, for ``python -m moe_ep.kernels.aot``."""
    T, H = 16384, 4096
    specs = []
    block_es = sorted({block_e_for(e) for e in range(1, MAX_EXPERTS + 1)})
    f32, i64 = pointer(torch.float32), pointer(torch.int64)
    for name, sigmoid, normalize, has_bias, top_k, n_group, topk_group in _ROUTERS:
        for block_e in block_es:
            E = 8 if block_e == MIN_BLOCK_E else block_e
            # DOT_FP32 is the interpreter's bfloat16 workaround only: never compiled for a GPU.
            for dtype, ty in TRITON_TYPES.items():
                cfg = fwd_config(block_e, dtype.itemsize)
                x = pointer(dtype)
                specs.append(KernelSpec(
                    name=f"router_fwd {name} {ty} E<={block_e} t{cfg.block_t}h{cfg.block_h}sub{cfg.sub_t}"
                         f"w{cfg.num_warps}s{cfg.num_stages}",
                    fn=router_fwd_kernel,
                    args=(x, x, f32, f32, f32, i64, T, H, E, top_k, n_group, topk_group, 1.0, H, H,
                          sigmoid, normalize, has_bias),
                    constexprs={"BLOCK_T": cfg.block_t, "BLOCK_E": block_e, "BLOCK_H": cfg.block_h,
                                "SUB_T": cfg.sub_t, "DOT_FP32": False},
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages, uses_dot=True,
                ))
            cfg = bwd_config(block_e)
            specs.append(KernelSpec(
                name=f"router_bwd {name} E<={block_e} t{cfg.block_t}w{cfg.num_warps}", fn=router_bwd_kernel,
                args=(f32, i64, f32, f32, f32, T, E, top_k, 1.0, sigmoid, normalize),
                constexprs={"BLOCK_T": cfg.block_t, "BLOCK_E": block_e}, num_warps=cfg.num_warps,
            ))
    return specs
