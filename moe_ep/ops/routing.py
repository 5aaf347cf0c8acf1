"""Router math: logits, scores, top-k selection and renormalisation, with the semantics of the
Hugging Face MoE families (Mixtral's softmax top-k; DeepSeek-V3's sigmoid scores with a
correction bias that only steers the choice, group-limited top-k and a scaling factor)."""

from __future__ import annotations

import contextlib

import torch

from .validate import check_finite, check_float, check_number, check_same_device, check_tensor
from .backend import resolve_backend

SCORES = ("softmax", "sigmoid")


def check_route_args(hidden_states, router_weight, top_k, score, normalize, correction_bias, n_group, topk_group,
                     scale) -> None:
    check_tensor("hidden_states", hidden_states, ndim=2)
    check_tensor("router_weight", router_weight, ndim=2)
    check_float("hidden_states", hidden_states)
    check_float("router_weight", router_weight)
    check_same_device(hidden_states=hidden_states, router_weight=router_weight)
    E, H = router_weight.shape
    if hidden_states.shape[1] != H:
        raise ValueError(
            f"router_weight must have shape [E, H={hidden_states.shape[1]}] to match hidden_states "
            f"{tuple(hidden_states.shape)}, got {tuple(router_weight.shape)}"
        )
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise ValueError(f"top_k must be an int in [1, E={E}], got {top_k!r}")
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    if not isinstance(normalize, bool):
        raise TypeError(f"normalize must be a bool, got {type(normalize).__name__}")
    check_number("scale", scale, above=0)
    if correction_bias is not None:
        check_tensor("correction_bias", correction_bias, ndim=1)
        if correction_bias.shape[0] != E:
            raise ValueError(f"correction_bias must have shape [E={E}], got {tuple(correction_bias.shape)}")
        if not correction_bias.is_floating_point():
            raise TypeError(f"correction_bias must be a float tensor, got {correction_bias.dtype}")
        check_same_device(hidden_states=hidden_states, correction_bias=correction_bias)
        # A NaN bias makes every score NaN and top-k then picks the same experts for every token
        # with finite weights: silently wrong, so refused (queued on the device: no host sync).
        check_finite("correction_bias", correction_bias)
    check_expert_groups(E, top_k, n_group, topk_group)


def check_expert_groups(num_experts: int, top_k: int, n_group, topk_group, *, experts: str = "E",
                        top_k_name: str = "top_k") -> None:
    """DeepSeek-V3's group-limited routing: ``n_group`` groups of whole experts, ``topk_group`` of
    them kept, enough experts in those for ``top_k``. ``experts``, ``top_k_name``: what the
    caller calls the expert count and top-k (the planner: a config's fields)."""
    E = num_experts
    if isinstance(n_group, bool) or not isinstance(n_group, int) or n_group < 1 or E % n_group:
        raise ValueError(f"n_group must be a positive divisor of {experts}={E}, got {n_group!r}")
    if isinstance(topk_group, bool) or not isinstance(topk_group, int) or not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group must be an int in [1, n_group={n_group}], got {topk_group!r}")
    if n_group > 1 and top_k > topk_group * (E // n_group):
        raise ValueError(
            f"{top_k_name}={top_k} exceeds the {topk_group * (E // n_group)} experts left by topk_group={topk_group} "
            f"of n_group={n_group}"
        )


def node_limited_groups(num_experts: int, n_group: int, topk_group: int, nodes: int,
                        max_nodes: int | None, top_k: int) -> tuple[int, int]:
    """``(n_group, topk_group)`` that route every token to experts on at most ``max_nodes`` of
    ``nodes`` (DeepSeek-V3's node-limited routing): expert parallelism puts ``E / nodes``
    consecutive experts on each node, so the nodes are expert groups, ranked as DeepSeek-V3 ranks
    its groups (the sum of their two best scores). A model without groups gets the nodes as its
    groups; a model whose groups are the nodes keeps them, with ``topk_group`` at most
    ``max_nodes``; other groupings cannot be limited by one group rule and are refused, as is a
    ``top_k`` that the experts of ``max_nodes`` nodes cannot hold."""
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1 or num_experts % nodes:
        raise ValueError(f"nodes must be a positive divisor of E={num_experts}, got {nodes!r}")
    if max_nodes is None:
        return n_group, topk_group
    if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or not 1 <= max_nodes <= nodes:
        raise ValueError(f"max_nodes must be an int in [1, nodes={nodes}] or None, got {max_nodes!r}")
    if top_k > max_nodes * (num_experts // nodes):
        raise ValueError(f"top_k={top_k} experts do not fit on max_nodes={max_nodes} nodes of "
                         f"{num_experts // nodes} experts each (nodes={nodes})")
    if n_group == 1:
        return nodes, max_nodes
    if n_group == nodes:
        return nodes, min(topk_group, max_nodes)
    raise ValueError(
        f"max_nodes needs the router's expert groups to be the nodes: n_group={n_group} groups over nodes={nodes} "
        f"(each node holds {num_experts // nodes} experts); use n_group=1 or n_group=nodes"
    )


def _top_indices(scores, k):
    """Indices of the ``k`` largest ``scores`` along the last dim, best first, ties to the lowest
    index as the Triton router breaks them (``torch.topk`` leaves the order of equal values
    unspecified, and ties are real: padding rows, a zero router, duplicated router rows)."""
    # A copy of the k columns: the weights' gather saves the indices, and a view would keep all E
    # (contiguous() would return the view itself for one token, whose [1, k] slice is contiguous).
    return scores.sort(dim=-1, descending=True, stable=True).indices[..., :k].clone()


def select_experts(probs_TE, top_k, correction_bias=None, n_group=1, topk_group=1):
    """Indices of the chosen experts. The correction bias and the group limit steer only the
    choice; the weights are always taken from the unbiased scores."""
    choice_TE = probs_TE if correction_bias is None else probs_TE + correction_bias.float()
    if n_group > 1:
        T, E = choice_TE.shape
        grouped = choice_TE.view(T, n_group, E // n_group)
        # DeepSeek-V3 ranks groups by the sum of their two best experts.
        group_score = grouped.topk(min(2, E // n_group), dim=-1).values.sum(-1)
        keep = _top_indices(group_score, topk_group)
        group_mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
        expert_mask = group_mask.repeat_interleave(E // n_group, dim=1)
        choice_TE = choice_TE.masked_fill(~expert_mask, float("-inf"))
    return _top_indices(choice_TE, top_k)


def route_topk_torch(hidden_states, router_weight, top_k, score, normalize, correction_bias, n_group, topk_group, scale):
    # float32 logits from half inputs, as the Triton kernel's float32 accumulator gives them: the
    # choice of experts must not depend on the backend, and a half-rounded logit can flip it (an
    # enclosing autocast would make the product half again).
    device_type = hidden_states.device.type
    with torch.autocast(device_type, enabled=False) if device_type != "meta" else contextlib.nullcontext():
        logits_TE = torch.nn.functional.linear(hidden_states.float(), router_weight.float())
    probs_TE = logits_TE.softmax(-1) if score == "softmax" else logits_TE.sigmoid()
    with torch.no_grad():
        indices_TK = select_experts(probs_TE, top_k, correction_bias, n_group, topk_group)
    weights_TK = probs_TE.gather(1, indices_TK)
    if normalize:
        # DeepSeek-V3 adds 1e-20 for sigmoid scores; softmax top-k sums are never zero.
        denom = weights_TK.sum(-1, keepdim=True)
        weights_TK = weights_TK / (denom + 1e-20 if score == "sigmoid" else denom)
    return logits_TE, weights_TK * scale, indices_TK


def route_topk(
    hidden_states: torch.Tensor,
    router_weight: torch.Tensor,
    top_k: int,
    *,
    score: str = "softmax",
    normalize: bool = True,
    correction_bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    scale: float = 1.0,
    nodes: int = 1,
    max_nodes: int | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Route ``[T, H]`` tokens to ``top_k`` of the ``E`` experts of ``router_weight [E, H]``.

    Returns ``(logits [T, E] float32, weights [T, K] float32, indices [T, K] int64)``, with
    Mixtral's semantics by default: softmax over all experts, top-k, weights renormalised to sum
    to one. ``score="sigmoid"``, ``correction_bias``, ``n_group``/``topk_group`` and ``scale``
    give DeepSeek-V3's router. ``max_nodes`` limits every token to experts on at most that many of
    ``nodes`` nodes, over which expert parallelism lays the experts out in equal consecutive blocks
    (DeepSeek-V3's node-limited routing, which bounds the network copies of a token;
    ``node_limited_groups`` says how it combines with ``n_group``). Differentiable in ``hidden_states`` and ``router_weight`` through
    the logits and the weights; the indices carry no gradient.

    ``hidden_states`` is ``[T, H]`` (flatten batch and sequence first). ``router_weight`` may have
    another float dtype than ``hidden_states`` (a float32 router over bfloat16 activations): both
    are then promoted to the wider dtype, on either backend, and each gradient comes back in its
    input's dtype.

    ``backend`` as for ``moe_experts``: "auto" (the default on CUDA) runs the fused Triton router
    for up to 256 experts and the torch path beyond. Both choose the same experts, ties going to
    the lowest expert id.
    """
    if max_nodes is not None or nodes != 1:
        check_tensor("router_weight", router_weight, ndim=2)
        n_group, topk_group = node_limited_groups(router_weight.shape[0], n_group, topk_group, nodes, max_nodes, top_k)
    check_route_args(hidden_states, router_weight, top_k, score, normalize, correction_bias, n_group, topk_group, scale)
    if router_weight.dtype != hidden_states.dtype:
        dtype = torch.promote_types(hidden_states.dtype, router_weight.dtype)
        hidden_states, router_weight = hidden_states.to(dtype), router_weight.to(dtype)
    backend = resolve_backend(backend, hidden_states.device)
    args = (hidden_states, router_weight, top_k, score, normalize, correction_bias, n_group, topk_group, scale)
    if backend == "auto":
        from ..kernels.router import MAX_EXPERTS

        if router_weight.shape[0] > MAX_EXPERTS:
            backend = "torch"  # more experts than the Triton router's one block of scores holds
    if backend in ("triton", "auto"):
        from .routing_triton import route_topk_triton

        return route_topk_triton(*args)
    return route_topk_torch(*args)
