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


def glu_fwd(gate_up_N2I: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up, computed in float32, returned in float32."""
    gate, up = gate_up_N2I.float().chunk(2, dim=-1)
    return act_fwd(gate, activation).mul_(up)


def glu_bwd(gate_up_N2I: torch.Tensor, dh_NI: torch.Tensor, w_N: torch.Tensor, activation: str):
    """Backward of ``w * (act(gate) * up)`` from ``dh_NI``, the gradient of the unweighted
    product, recomputing the activation instead of storing it. ``dh_NI`` is consumed (scaled in
    place when it is float32). Returns ``(dw_N, wh_NI, d gate_up_N2I)``: the routing weights'
    gradient, ``w * act(gate) * up`` (what the down projection's weight gradient needs against the
    unweighted output gradient), both float32, and the input gradient in the dtype of
    ``gate_up_N2I``. Temporaries are reused so that a large backward allocates little."""
    gate, up = gate_up_N2I.float().chunk(2, dim=-1)
    dh = dh_NI.float()
    act = act_fwd(gate, activation)
    wh = act * up
    dw_N = (wh * dh).sum(-1)
    w = w_N[:, None]
    dh.mul_(w)
    wh.mul_(w)
    d_gate_up_N2I = torch.empty(gate_up_N2I.shape, dtype=torch.float32, device=gate_up_N2I.device)
    d_gate, d_up = d_gate_up_N2I.chunk(2, dim=-1)
    torch.mul(dh, act, out=d_up)
    act_bwd(torch.mul(dh, up, out=act), gate, activation, out=d_gate)
    return dw_N, wh, d_gate_up_N2I.to(gate_up_N2I.dtype)
