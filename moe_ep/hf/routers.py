"""Fused-router forwards, one per family semantics, each returning exactly what the family's own
router forward returns: ``(router_logits, top_k_weights, top_k_index)`` with the same dtypes.

The router module is kept (its class, parameters, buffers and hooks); only its computation is
replaced by ``moe_ep.routing.route_topk``. transformers records ``router_logits`` with a forward
hook on the router class (``OutputRecorder(<Router>, index=0)``), so the auxiliary loss of
``output_router_logits=True`` is computed from our logits exactly as from its own.

Semantics read from transformers 5.17-5.23:
- Mixtral: logits in the activation dtype; softmax in float32 over all experts; top-k;
  always renormalised; weights stay float32.
- Qwen2-MoE, Qwen3-MoE, OLMoE: the same softmax top-k, renormalised only when
  ``norm_topk_prob``; weights cast back to the logits' dtype.
- DeepSeek-V3: float32 logits from float32 copies of the activations and the weight; sigmoid
  scores; ``e_score_correction_bias`` steers the choice only; group-limited top-k (``n_group``
  groups ranked by the sum of their two best biased scores, ``topk_group`` kept); weights from the
  unbiased scores, renormalised (+1e-20) when ``norm_topk_prob``, times ``routed_scaling_factor``.
  transformers takes the top-k unsorted; we return the same experts sorted by score.
"""

from __future__ import annotations

import torch

from ..routing import route_topk
from .autocast import autocast_dtype


def _linear_out_dtype(x: torch.Tensor) -> torch.dtype:
    """dtype of ``F.linear(x, w)`` in the caller's context: autocast changes it."""
    return autocast_dtype(x.device) or x.dtype


def _softmax_topk(router, hidden_states, *, normalize: bool, weights_in_logits_dtype: bool):
    x_TH = hidden_states.reshape(-1, router.hidden_dim)
    logits_dtype = _linear_out_dtype(x_TH)
    logits_TE, w_TK, idx_TK = route_topk(
        x_TH, router.weight, router.top_k, score="softmax", normalize=normalize, backend=router.moe_ep_backend
    )
    if weights_in_logits_dtype:
        w_TK = w_TK.to(logits_dtype)
    return logits_TE.to(logits_dtype), w_TK, idx_TK


def mixtral_router_forward(self, hidden_states):
    return _softmax_topk(self, hidden_states, normalize=True, weights_in_logits_dtype=False)


def qwen_router_forward(self, hidden_states):
    """Qwen2-MoE, Qwen3-MoE and OLMoE share this router."""
    return _softmax_topk(self, hidden_states, normalize=self.norm_topk_prob, weights_in_logits_dtype=True)


def deepseek_v3_router_forward(self, hidden_states):
    x_TH = hidden_states.reshape(-1, self.hidden_dim).float()
    logits_dtype = _linear_out_dtype(x_TH)
    logits_TE, w_TK, idx_TK = route_topk(
        x_TH,
        self.weight.float(),
        self.top_k,
        score="sigmoid",
        normalize=bool(self.norm_topk_prob),
        correction_bias=self.e_score_correction_bias,
        n_group=self.num_group,
        topk_group=self.topk_group,
        scale=float(self.routed_scaling_factor),
        backend=self.moe_ep_backend,
    )
    return logits_TE.to(logits_dtype), w_TK, idx_TK


# Router classes by "module.qualname" (matched exactly: a subclass may compute something else),
# so that no modeling module is imported just to look it up.
FUSED_ROUTER_FORWARDS = {
    "transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter": mixtral_router_forward,
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter": qwen_router_forward,
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter": qwen_router_forward,
    "transformers.models.olmoe.modeling_olmoe.OlmoeTopKRouter": qwen_router_forward,
    "transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter": deepseek_v3_router_forward,
}


def router_key(router: torch.nn.Module) -> str:
    cls = type(router)
    return f"{cls.__module__}.{cls.__qualname__}"


def fused_router_forward(router: torch.nn.Module):
    """The fused forward for ``router``'s class, or None when moe_ep has no semantics for it."""
    return FUSED_ROUTER_FORWARDS.get(router_key(router))
