"""Triton backend of ``route_topk``: the fused router kernels of ``moe_ep.kernels.router`` behind
a ``torch.library`` custom op with a fake (meta) implementation and an autograd formula, so that
``torch.compile`` traces it as one node and FSDP2 sees ordinary tensors.

Forward: one kernel gives fp32 logits, weights and indices. Backward: one kernel gives the
gradient of the logits (through renormalisation, top-k and softmax or sigmoid, plus whatever
gradient arrived on the logits output, e.g. from an auxiliary or z loss), then two GEMMs give
dX and dW. Nothing reads a value back to the host."""

from __future__ import annotations

import torch

from ..kernels.runtime import interpreting
from ..kernels.router import router_backward, router_forward
from .validate import refuse_double_backward


@torch.library.custom_op("moe_ep::route_topk", mutates_args=())
def _route_topk(
    hidden_states: torch.Tensor,
    router_weight: torch.Tensor,
    top_k: int,
    score: str,
    normalize: bool,
    correction_bias: torch.Tensor | None,
    n_group: int,
    topk_group: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return router_forward(
        hidden_states, router_weight, top_k,
        sigmoid=score == "sigmoid", normalize=normalize, bias_E=correction_bias,
        n_group=n_group, topk_group=topk_group, scale=scale, interpreting=interpreting(),
    )


@_route_topk.register_fake
def _(hidden_states, router_weight, top_k, score, normalize, correction_bias, n_group, topk_group, scale):
    T, E = hidden_states.shape[0], router_weight.shape[0]
    return (
        hidden_states.new_empty(T, E, dtype=torch.float32),
        hidden_states.new_empty(T, top_k, dtype=torch.float32),
        hidden_states.new_empty(T, top_k, dtype=torch.int64),
    )


@torch.library.custom_op("moe_ep::route_topk_logits_grad", mutates_args=())
def _route_topk_logits_grad(
    logits: torch.Tensor,
    indices: torch.Tensor,
    grad_weights: torch.Tensor,
    grad_logits: torch.Tensor,
    score: str,
    normalize: bool,
    scale: float,
) -> torch.Tensor:
    return router_backward(
        logits, indices, grad_weights, grad_logits,
        sigmoid=score == "sigmoid", normalize=normalize, scale=scale,
    )


@_route_topk_logits_grad.register_fake
def _(logits, indices, grad_weights, grad_logits, score, normalize, scale):
    return torch.empty_like(logits)


def _setup_context(ctx, inputs, output):
    hidden_states, router_weight, _, score, normalize, _, _, _, scale = inputs
    logits, _, indices = output
    ctx.save_for_backward(hidden_states, router_weight, logits, indices)
    ctx.score, ctx.normalize, ctx.scale = score, normalize, scale


def _backward(ctx, grad_logits, grad_weights, _grad_indices):
    hidden_states, router_weight, logits, indices = ctx.saved_tensors
    dlogits_TE = _route_topk_logits_grad(
        logits, indices, grad_weights, grad_logits, ctx.score, ctx.normalize, ctx.scale
    )
    # logits = x @ W^T; the GEMMs run in the input dtype with fp32 accumulation, as autograd
    # of F.linear would.
    dlogits_TE = dlogits_TE.to(hidden_states.dtype)
    grad_x = dlogits_TE @ router_weight if ctx.needs_input_grad[0] else None
    grad_w = dlogits_TE.t() @ hidden_states if ctx.needs_input_grad[1] else None
    return grad_x, grad_w, None, None, None, None, None, None, None


_route_topk.register_autograd(_backward, setup_context=_setup_context)
refuse_double_backward(_route_topk_logits_grad, "route_topk's Triton backend", "; backend='torch' supports it")


def route_topk_triton(
    hidden_states, router_weight, top_k, score, normalize, correction_bias, n_group, topk_group, scale
):
    """Same contract as ``moe_ep.ops.routing.route_topk_torch``; arguments already validated by
    ``route_topk``, which gives both tensors one dtype. Returns (logits_TE float32, weights_TK
    float32, indices_TK int64)."""
    return _route_topk(
        hidden_states, router_weight, top_k, score, bool(normalize), correction_bias,
        n_group, topk_group, float(scale),
    )
