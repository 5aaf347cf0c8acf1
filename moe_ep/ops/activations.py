"""Gated activations of the expert MLP, in float32, with hand-written derivatives so the backward
pass recomputes them from the stored GEMM-1 output instead of keeping the activation."""

from __future__ import annotations

import torch

ACTIVATIONS = ("silu", "gelu")


def check_activation(activation) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def act_fwd(gate: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return torch.nn.functional.silu(gate)
    return torch.nn.functional.gelu(gate)


def act_bwd(grad: torch.Tensor, gate: torch.Tensor, activation: str, *, out: torch.Tensor) -> torch.Tensor:
    """``out = grad * d act(gate) / d gate`` in one fused ATen op."""
    if activation == "silu":
        return torch.ops.aten.silu_backward.grad_input(grad, gate, grad_input=out)
    return torch.ops.aten.gelu_backward.grad_input(grad, gate, grad_input=out)


# The float32 temporaries are built a block of rows at a time, so they stay near a gigabyte
# whatever the token count: at Mixtral-8x7B shapes (T=16384, top-2) one [N, 2I] float32 tensor is
# 3.8 GB, and the backward held four of them at once (a 17.7 GB peak against transformers'
# grouped_mm experts' 6.7 GB on an H100). A block is large enough that its launches stay few.
CHUNK_ELEMENTS = 1 << 26


def row_blocks(num_rows: int, row_elements: int) -> list[slice]:
    """Slices of rows holding about ``CHUNK_ELEMENTS`` elements each (at least one row)."""
    step = max(1, CHUNK_ELEMENTS // max(1, row_elements))
    return [slice(start, min(start + step, num_rows)) for start in range(0, num_rows, step)]


def glu_fwd(gate_up_N2I: torch.Tensor, activation: str, dtype: torch.dtype) -> torch.Tensor:
    """act(gate) * up, computed in float32, returned in ``dtype``."""
    N, two_I = gate_up_N2I.shape
    h_NI = gate_up_N2I.new_empty((N, two_I // 2), dtype=dtype)
    for rows in row_blocks(N, two_I):
        gate, up = gate_up_N2I[rows].float().chunk(2, dim=-1)
        h_NI[rows] = act_fwd(gate, activation).mul_(up)
        del gate, up  # before the next block's are made
    return h_NI


def glu_bwd(gate_up_N2I: torch.Tensor, dh_NI: torch.Tensor, w_N: torch.Tensor, activation: str, *,
            overwrite: bool = False):
    """Backward of ``w * (act(gate) * up)`` from ``dh_NI``, the gradient of the unweighted
    product, recomputing the activation instead of storing it. ``dh_NI`` is consumed (scaled in
    place when it is float32). Returns ``(dw_N, wh_NI, d gate_up_N2I)``: the routing weights'
    gradient in float32, ``w * act(gate) * up`` (what the down projection's weight gradient needs
    against the unweighted output gradient) and the input gradient, both in the dtype of
    ``gate_up_N2I``. Computed in float32 a block of rows at a time; ``overwrite``: the input
    gradient is written over ``gate_up_N2I``, each block after its rows were read."""
    N, two_I = gate_up_N2I.shape
    dw_N = torch.empty(N, dtype=torch.float32, device=gate_up_N2I.device)
    wh_NI = gate_up_N2I.new_empty((N, two_I // 2))
    d_gate_up_N2I = gate_up_N2I if overwrite else torch.empty_like(gate_up_N2I)
    for rows in row_blocks(N, two_I):
        # A copy also in float32 when the gradient goes over the rows: up is read after d up is written.
        gate, up = gate_up_N2I[rows].to(torch.float32, copy=overwrite).chunk(2, dim=-1)
        dh = dh_NI[rows].float()
        act = act_fwd(gate, activation)
        wh = act * up
        dw_N[rows] = (wh * dh).sum(-1)
        w = w_N[rows, None]
        dh.mul_(w)
        wh_NI[rows] = wh.mul_(w)
        d_gate, d_up = d_gate_up_N2I[rows].chunk(2, dim=-1)
        d_up.copy_(wh.copy_(dh).mul_(act))
        d_gate.copy_(act_bwd(dh.mul_(up), gate, activation, out=act))
        del gate, up, dh, act, wh  # before the next block's are made
    return dw_N, wh_NI, d_gate_up_N2I
