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


def act_grad(gate: torch.Tensor, activation: str) -> torch.Tensor:
    """d act(gate) / d gate, elementwise."""
    if activation == "silu":
        sig = torch.sigmoid(gate)
        return sig * (1 + gate * (1 - sig))
    return torch.ops.aten.gelu_backward(torch.ones_like(gate), gate)


def glu_fwd(gate_up_N2I: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up, computed in float32, returned in float32."""
    gate, up = gate_up_N2I.float().chunk(2, dim=-1)
    return act_fwd(gate, activation) * up


def glu_bwd(gate_up_N2I: torch.Tensor, dh_NI: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Recompute the gated activation and return (h_NI, d gate_up_N2I), both float32."""
    gate, up = gate_up_N2I.float().chunk(2, dim=-1)
    act = act_fwd(gate, activation)
    dh = dh_NI.float()
    d_gate = dh * up * act_grad(gate, activation)
    d_up = dh * act
    return act * up, torch.cat([d_gate, d_up], dim=-1)
