"""Slow, obviously correct implementations in float64, used by tests and benchmarks as the ground
truth. Nothing here is fast and nothing fast is imported here."""

from __future__ import annotations

import torch


def _in_float64(x_TH, w_TK, gate_up_E2IH, down_EHI, activation: str):
    """(x, w, gate_up, down) in float64 and the activation function."""
    act = torch.nn.functional.silu if activation == "silu" else torch.nn.functional.gelu
    return x_TH.double(), w_TK.double(), gate_up_E2IH.double(), down_EHI.double(), act


def moe_experts_ref(x_TH, idx_TK, w_TK, gate_up_E2IH, down_EHI, activation: str = "silu") -> torch.Tensor:
    """Per-token, per-slot loop in float64; differentiable through autograd."""
    x, w, gate_up, down, act = _in_float64(x_TH, w_TK, gate_up_E2IH, down_EHI, activation)
    I = down.shape[2]
    rows = []
    for t in range(x.shape[0]):
        acc = x.new_zeros(x.shape[1])
        for k in range(idx_TK.shape[1]):
            e = int(idx_TK[t, k])
            gu = gate_up[e] @ x[t]
            acc = acc + w[t, k] * (down[e] @ (act(gu[:I]) * gu[I:]))
        rows.append(acc)
    if not rows:
        return x.new_zeros(x.shape) + 0 * (gate_up.sum() + down.sum() + w.sum())
    return torch.stack(rows)


def moe_experts_ref_by_expert(x_TH, idx_TK, w_TK, gate_up_E2IH, down_EHI, activation: str = "silu"):
    """The same sum in float64, one expert at a time (gather its rows, two matmuls, a weighted
    scatter-add): fast enough on a GPU at Mixtral shapes, where the per-token loop is not."""
    x, w, gate_up, down, act = _in_float64(x_TH, w_TK, gate_up_E2IH, down_EHI, activation)
    I = down.shape[2]
    y = 0 * (x + gate_up.sum() + down.sum() + w.sum())
    for e in range(gate_up.shape[0]):
        token, slot = (idx_TK == e).nonzero(as_tuple=True)
        gu = x[token] @ gate_up[e].t()
        y = y.index_add(0, token, w[token, slot, None] * ((act(gu[:, :I]) * gu[:, I:]) @ down[e].t()))
    return y


def route_topk_ref(x_TH, router_weight_EH, top_k: int, *, score: str = "softmax", normalize: bool = True,
                   correction_bias=None, n_group: int = 1, topk_group: int = 1, scale: float = 1.0):
    """Router in float64: (logits_TE, weights_TK, indices_TK)."""
    logits = x_TH.double() @ router_weight_EH.double().t()
    probs = logits.softmax(-1) if score == "softmax" else logits.sigmoid()
    choice = probs if correction_bias is None else probs + correction_bias.double()
    T, E = choice.shape
    if n_group > 1:
        grouped = choice.view(T, n_group, E // n_group)
        # A group's score is the sum of its two best experts (its only one in groups of one).
        group_score = grouped.topk(min(2, E // n_group), dim=-1).values.sum(-1)
        keep = group_score.topk(topk_group, dim=-1).indices
        mask = torch.zeros(T, n_group, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~mask.repeat_interleave(E // n_group, dim=1), float("-inf"))
    indices = choice.topk(top_k, dim=-1).indices
    weights = probs.gather(1, indices)
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return logits, weights * scale, indices
