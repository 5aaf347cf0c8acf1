"""Fused-router forwards, one per family semantics, each returning exactly what the family's own
router forward returns: ``(router_logits, top_k_weights, top_k_index)`` with the same dtypes.

The router module is kept (its class, parameters, buffers and hooks); only its computation is
replaced by ``moe_ep.route_topk``. transformers records ``router_logits`` with a forward
hook on the router class (``OutputRecorder(<Router>, index=0)``), so the auxiliary loss of
``output_router_logits=True`` is computed from our logits exactly as from its own.

Semantics read from transformers 5.17-5.23 (``SEMANTICS_READ_FROM``):
- Mixtral: logits in the activation dtype; softmax in float32 over all experts; top-k;
  always renormalised; weights stay float32.
- Qwen2-MoE, Qwen3-MoE, OLMoE: the same softmax top-k, renormalised only when
  ``norm_topk_prob``; weights cast back to the logits' dtype.
- DeepSeek-V3: float32 logits from float32 copies of the activations and the weight; sigmoid
  scores; ``e_score_correction_bias`` steers the choice only; group-limited top-k (``n_group``
  groups ranked by the sum of their two best biased scores, ``topk_group`` kept); weights from the
  unbiased scores, renormalised (+1e-20) when ``norm_topk_prob``, times ``routed_scaling_factor``.
  transformers takes the top-k unsorted; we return the same experts sorted by score.

One deliberate difference: the fused router always computes the logits in float32 (``route_topk``
upcasts, as Megatron-Core's router dtype fp32 does), where Mixtral, Qwen2/3-MoE and OLMoE compute
them with a matmul in the activation dtype and only then upcast for the softmax. bf16 logits of
nearly tied experts can round to a tie or swap order, so in bf16 (or under autocast) the fused
router can pick another expert than the model's own router for such a token; its choice is the one
a float32/float64 model makes. The logits are returned in the activation dtype, as the family's
router returns them. ``patch(model, fused_router=False)`` keeps the model's own router computation,
bf16 logits included.

Classes are matched by qualified name, and a matched router is verified once per class, class
forward and configuration (``verify_fused_router``) on a probe input before its forward is
replaced: a transformers release whose router returns something else is refused, not patched with
the semantics above.
"""

from __future__ import annotations

import inspect

import torch

from ..ops.routing import SCORES, route_topk
from .autocast import autocast_dtype
from .binding import binding_of

SEMANTICS_READ_FROM = "5.17-5.23"


def _linear_out_dtype(x: torch.Tensor) -> torch.dtype:
    """dtype of ``F.linear(x, w)`` in the caller's context: autocast changes it."""
    return autocast_dtype(x.device) or x.dtype


def _node_limit(router) -> dict:
    """``route_topk``'s node-limited routing arguments bound to ``router`` (none by default)."""
    limit = binding_of(router).node_limit
    return {} if limit is None else dict(nodes=limit[0], max_nodes=limit[1])


def _softmax_topk(router, hidden_states, backend, *, normalize: bool, weights_in_logits_dtype: bool):
    x_TH = hidden_states.reshape(-1, router.hidden_dim)
    logits_dtype = _linear_out_dtype(x_TH)
    logits_TE, w_TK, idx_TK = route_topk(
        x_TH, router.weight, router.top_k, score="softmax", normalize=normalize, backend=backend,
        **_node_limit(router),
    )
    if weights_in_logits_dtype:
        w_TK = w_TK.to(logits_dtype)
    return logits_TE.to(logits_dtype), w_TK, idx_TK


def mixtral_route(router, hidden_states, backend):
    return _softmax_topk(router, hidden_states, backend, normalize=True, weights_in_logits_dtype=False)


def qwen_route(router, hidden_states, backend):
    """Qwen2-MoE, Qwen3-MoE and OLMoE share this router."""
    return _softmax_topk(
        router, hidden_states, backend, normalize=bool(router.norm_topk_prob), weights_in_logits_dtype=True
    )


def deepseek_v3_route(router, hidden_states, backend):
    x_TH = hidden_states.reshape(-1, router.hidden_dim).float()
    logits_dtype = _linear_out_dtype(x_TH)
    logits_TE, w_TK, idx_TK = route_topk(
        x_TH,
        router.weight.float(),
        router.top_k,
        score="sigmoid",
        normalize=bool(router.norm_topk_prob),
        correction_bias=router.e_score_correction_bias,
        n_group=router.num_group,
        topk_group=router.topk_group,
        scale=float(router.routed_scaling_factor),
        backend=backend,
        **_node_limit(router),
    )
    # float32 as the family's, but under autocast its matmul's dtype runs through to its weights.
    return logits_TE.to(logits_dtype), w_TK.to(logits_dtype), idx_TK


# The instance-level forwards patch() installs: the family's route with the backend patch() bound.
def mixtral_router_forward(self, hidden_states):
    return mixtral_route(self, hidden_states, binding_of(self).backend)


def qwen_router_forward(self, hidden_states):
    return qwen_route(self, hidden_states, binding_of(self).backend)


def deepseek_v3_router_forward(self, hidden_states):
    return deepseek_v3_route(self, hidden_states, binding_of(self).backend)


_ROUTE_OF = {
    mixtral_router_forward: mixtral_route,
    qwen_router_forward: qwen_route,
    deepseek_v3_router_forward: deepseek_v3_route,
}

# Router classes by "module.qualname" (matched exactly: a subclass may compute something else),
# so that no modeling module is imported just to look it up.
FUSED_ROUTER_FORWARDS = {
    "transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter": mixtral_router_forward,
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter": qwen_router_forward,
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter": qwen_router_forward,
    "transformers.models.olmoe.modeling_olmoe.OlmoeTopKRouter": qwen_router_forward,
    "transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter": deepseek_v3_router_forward,
}


def router_score(router: torch.nn.Module) -> str | None:
    """How ``router`` scores the experts, as ``route_topk``'s ``score`` names it: ``"softmax"`` or
    ``"sigmoid"``, read from its class's forward, the one of the two it computes (every router of
    transformers 5.24 that computes only one, DeepSeek-V3's and the many copied from it among the
    sigmoid ones). A forward that names neither delegates (to its parent's, most often): the next
    forward up the class's bases is read. None where a forward names both (the choice is the
    config's, as Cohere2-MoE's ``expert_selection_fn``) or none up the bases names one."""
    for cls in type(router).__mro__:
        forward = cls.__dict__.get("forward")
        if forward is None:
            continue
        try:
            source = inspect.getsource(forward)
        except (OSError, TypeError):  # a class defined where its source cannot be read
            return None
        named = [score for score in SCORES if score in source]
        if named:
            return named[0] if len(named) == 1 else None
    return None


def router_key(router: torch.nn.Module) -> str:
    cls = type(router)
    return f"{cls.__module__}.{cls.__qualname__}"


def fused_router_forward(router: torch.nn.Module):
    """The fused forward for ``router``'s class, or None when moe_ep has no semantics for it."""
    return FUSED_ROUTER_FORWARDS.get(router_key(router))


# --- verification against the installed transformers ---------------------------------------------

_PROBE_TOKENS = 16
_VERIFIED: set = set()


class _Call(torch.nn.Module):
    """Holds ``router`` as a submodule, so that ``functional_call`` swaps in the probe tensors, and
    calls ``fn(router, x)`` directly: no hook and no instance-level forward runs."""

    def __init__(self, router: torch.nn.Module, fn):
        super().__init__()
        self.router = router
        self.fn = fn

    def forward(self, x):
        return self.fn(self.router, x)


def _configuration(router: torch.nn.Module) -> tuple:
    """The router's plain attributes (top_k, norm_topk_prob, n_group, scaling factor, ...): a
    router configured otherwise may take another branch of its forward, so it is probed again."""
    return tuple(
        sorted(
            (name, value)
            for name, value in vars(router).items()
            if not name.startswith("_")
            and name != "training"
            and isinstance(value, (bool, int, float, str, type(None)))
        )
    )


def _probe_tensors(router: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random tensors named and shaped as the router's parameters and buffers, on the CPU whatever
    the default device: matrices giving logits of a few units (decisive choices, no ties), vectors
    ~0.3 (a live correction bias). Never the router's own values, which may sit on the meta device,
    be sharded DTensors, or be all zeros (ties everywhere) before a checkpoint is loaded."""
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name, t in [*router.named_parameters(), *router.named_buffers()]:
        if not t.is_floating_point():
            tensors[name] = torch.zeros(t.shape, dtype=t.dtype, device="cpu")
            continue
        scale = 4 * t.shape[-1] ** -0.5 if t.dim() > 1 else 0.3
        tensors[name] = (torch.randn(t.shape, generator=g, device="cpu") * scale).to(dtype)
    return tensors


def _run_probe(router, own_forward, route, dtype):
    tensors = {f"router.{name}": t for name, t in _probe_tensors(router, dtype).items()}
    g = torch.Generator().manual_seed(1)
    x_TH = torch.randn(_PROBE_TOKENS, router.hidden_dim, generator=g, device="cpu").to(dtype)
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        try:
            want = torch.func.functional_call(_Call(router, own_forward), tensors, (x_TH,))
        except Exception as err:  # a configuration the family's own router cannot route
            raise ValueError(f"fused_router=True: {type(router).__name__}.forward itself fails on a probe input of "
                             f"the router's shapes ({type(err).__name__}: {err}); check the model's routing "
                             "configuration") from None
        try:
            got = torch.func.functional_call(_Call(router, lambda r, x: route(r, x, "torch")), tensors, (x_TH,))
        except ValueError as err:  # route_topk's checks of the configuration
            raise ValueError(f"fused_router=True: moe_ep's fused router for {router_key(router)} refuses the "
                             f"model's routing configuration: {err}") from None
    return got, want


def _structure(outputs) -> list:
    if not isinstance(outputs, tuple):
        return [type(outputs).__name__]
    return [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__ for t in outputs]


def _disagreement(got, want, *, values: bool) -> str | None:
    """What differs between the fused and the own router's outputs, None when nothing does."""
    if _structure(got) != _structure(want):
        return f"it returns {_structure(want)} (shape, dtype), the fused router {_structure(got)}"
    if not values:
        return None
    (logits, w_TK, idx_TK), (w_logits, w_w_TK, w_idx_TK) = got, want
    # The experts of a token compare as a set (DeepSeek-V3 takes its top-k unsorted).
    order, w_order = idx_TK.sort(-1).indices, w_idx_TK.sort(-1).indices
    if not torch.equal(idx_TK.gather(1, order), w_idx_TK.gather(1, w_order)):
        return "it chooses other experts"
    if not torch.allclose(logits, w_logits, rtol=1e-5, atol=1e-6):
        return f"its router logits differ by up to {(logits - w_logits).abs().max().item():.3g}"
    w, w_w = w_TK.gather(1, order), w_w_TK.gather(1, w_order)
    if not torch.allclose(w, w_w, rtol=1e-5, atol=1e-6):
        return f"its routing weights differ by up to {(w - w_w).abs().max().item():.3g}"
    return None


def verify_fused_router(router: torch.nn.Module) -> None:
    """Raise ValueError unless moe_ep's fused router for ``router``'s class (one that
    ``fused_router_forward`` knows) returns what the class's own forward returns, run on a probe of 16 tokens with random weights of the router's
    shapes: the same experts, logits and routing weights in float32 (1e-5), the same shapes and
    dtypes in bfloat16 (where float32 and bf16 logits may legitimately pick other experts). Cached
    per class, class forward and configuration, so a model's routers cost one probe per family."""
    forward = fused_router_forward(router)
    cls = type(router)
    key = (cls, cls.forward, _configuration(router))
    if key in _VERIFIED:
        return
    route = _ROUTE_OF[forward]
    for dtype, values in ((torch.float32, True), (torch.bfloat16, False)):
        why = _disagreement(*_run_probe(router, cls.forward, route, dtype), values=values)
        if why is not None:
            import transformers

            raise ValueError(
                f"fused_router=True: moe_ep's fused router for {router_key(router)} (semantics read from "
                f"transformers {SEMANTICS_READ_FROM}) does not return what {cls.__name__}.forward returns under "
                f"the installed transformers=={transformers.__version__} on a {dtype} probe input: {why}. The "
                "router's semantics changed, or its forward was replaced, so moe_ep refuses to patch it; pass "
                "fused_router=False to keep the model's own router"
            )
    _VERIFIED.add(key)
