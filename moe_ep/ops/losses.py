"""Load-balancing terms of MoE training: the auxiliary loss (Switch Transformer, with
transformers' normalisation; a sigmoid router's scores normalised over the experts, as
DeepSeek-V3's balance loss and Megatron-Core take them), optionally computed from counts gathered over every rank that holds
different tokens (Megatron-Core's global aux loss) or for each sequence on its own (DeepSeek-V3's
sequence-wise balance loss); the router z-loss (ST-MoE); and the
aux-loss-free expert bias of DeepSeek-V3, updated identically on every rank.

Gradient convention: each rank backpropagates its own loss and data parallelism averages the
gradients over the ``dp`` ranks (FSDP2 as ``moe_ep.parallel.parallelize`` sets it up). The
global aux loss is therefore returned with its true, global VALUE on every rank and a gradient
scaled by the group size, so that the averaged gradient is exactly the gradient of the global
loss. Nothing here reads a tensor back to the host."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from .routing import SCORES
from .validate import (
    check_count,
    check_index,
    check_indices_in_range,
    check_number,
    check_on_device,
    check_tensor,
    has_values,
)


def _as_layers(name: str, value) -> list[torch.Tensor]:
    if not isinstance(value, (torch.Tensor, Iterable)) or isinstance(value, (str, bytes)):
        raise TypeError(f"{name} must be a tensor or a sequence of tensors (one per layer), got {type(value).__name__}")
    layers = [value] if isinstance(value, torch.Tensor) else list(value)
    if not layers:
        raise ValueError(f"{name} must be a tensor or a non-empty sequence of tensors, got an empty sequence")
    for i, t in enumerate(layers):
        check_tensor(f"{name}[{i}]", t, ndim=2)
    return layers


def _check_token_mask(token_mask, tokens: int) -> None:
    if token_mask is None:
        return
    check_tensor("token_mask", token_mask)
    if token_mask.numel() != tokens:
        raise ValueError(f"token_mask must hold one value per token (T={tokens}), got shape {tuple(token_mask.shape)}")
    if token_mask.numel() and has_values(token_mask):
        # A weight outside {0, 1} (-1, NaN) would scale the loss silently; on the device where it is.
        check_on_device(((token_mask == 0) | (token_mask == 1)).all(),
                        "token_mask must hold 0 (padding) or 1 (a token that counts) for every token")


def expert_counts(top_k_index: torch.Tensor, num_experts: int, token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Routed (token, slot) pairs per expert, ``[E]`` float32 (masked tokens count 0). On the
    device: a scatter-add, no host sync (``bincount`` would read the maximum back)."""
    check_tensor("top_k_index", top_k_index, ndim=2)
    check_index("top_k_index", top_k_index)
    check_count("num_experts", num_experts, at_least=1)
    check_indices_in_range("top_k_index", top_k_index, num_experts)
    _check_token_mask(token_mask, top_k_index.shape[0])
    return _counts(top_k_index, num_experts, token_mask)[0]


def _counts(top_k_index: torch.Tensor, num_experts: int, token_mask: torch.Tensor | None, sequences: int = 1
            ) -> torch.Tensor:
    """``expert_counts`` of ids and a mask already checked; with ``sequences`` B > 1, ``[B, E]``:
    the counts of each sequence of ``T / B`` consecutive tokens."""
    T, K = top_k_index.shape
    device = top_k_index.device
    ones = torch.ones(T, K, dtype=torch.float32, device=device)
    if token_mask is not None:
        ones = ones * token_mask.reshape(T, 1).to(torch.float32)
    sequence_T1 = torch.arange(T, device=device)[:, None] // max(T // sequences, 1)
    counts = torch.zeros(sequences * num_experts, dtype=torch.float32, device=device)
    counts.scatter_add_(0, (sequence_T1 * num_experts + top_k_index.long()).reshape(-1), ones.reshape(-1))
    return counts.view(sequences, num_experts)


def load_balancing_loss(
    router_logits: torch.Tensor | Sequence[torch.Tensor],
    top_k: int,
    *,
    top_k_index: torch.Tensor | Sequence[torch.Tensor] | None = None,
    token_mask: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
    score: str = "softmax",
    sequence_length: int | None = None,
) -> torch.Tensor:
    """``E * sum_e f_e * P_e`` summed over the batch of every layer: ``f_e`` routed pairs of expert
    ``e`` per token, ``P_e`` its mean softmax probability. Equals transformers'
    ``load_balancing_loss_func`` on the same logits.

    Args:
        router_logits: ``[T, E]`` per MoE layer (one tensor or a sequence; every layer counts).
        top_k: experts per token; the choice is the top-k of the softmax unless ``top_k_index``
            gives the router's actual choice (e.g. with a correction bias), one ``[T, K]`` per layer.
        token_mask: ``[T]``, 1 for tokens that count (padding 0), shared by every layer.
        group: None = this rank's tokens only. A process group = every rank that holds different
            tokens (``moe_ep.parallel_context(model).meshes.dp_group``): counts, probability sums and
            token counts are summed over it (one all-reduce), the value is the loss of the whole
            global batch on every rank, and the gradient is scaled by the group size for the
            gradient averaging of data parallelism. Collective then: call it on every rank.
        score: how the router scores the experts: ``"softmax"``, or ``"sigmoid"`` (DeepSeek-V3 and
            the routers copied from it), whose ``P_e`` is the mean of ``sigmoid(logit_e)`` over the
            sum of the token's sigmoid scores (DeepSeek-V3's balance loss, Megatron-Core's aux loss of
            a sigmoid router).
        sequence_length: None pools the batch. ``S``: the loss of each sequence of ``S``
            consecutive tokens on its own (``f_e`` and ``P_e`` over that sequence's tokens, every
            layer pooled), averaged over the sequences that have a token that counts: the
            sequence-wise balance loss of DeepSeek-V3 (times ``top_k``, with ``score="sigmoid"``)
            and Megatron-Core's ``seq_aux_loss``, for transformers' ``[batch, seq]`` flattened to
            ``T = batch x S`` rows. Not with ``group``: a sequence's statistics are its own.
    """
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    logits = _as_layers("router_logits", router_logits)
    E = logits[0].shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise ValueError(f"top_k must be an int in [1, E={E}], got {top_k!r}")
    choices = None if top_k_index is None else _as_layers("top_k_index", top_k_index)
    if choices is not None and len(choices) != len(logits):
        raise ValueError(f"top_k_index must give one tensor per layer ({len(logits)}), got {len(choices)}")
    _check_token_mask(token_mask, logits[0].shape[0])
    sequences = _sequences(logits[0].shape[0], sequence_length, group)
    rows = logits[0].shape[0] // sequences  # per sequence
    device = logits[0].device
    # float32 at least (bf16 logits), float64 kept for float64 references.
    dtype = torch.promote_types(logits[0].dtype, torch.float32)
    # [B, E] per sequence (B = 1: the batch pooled).
    counts_BE = torch.zeros(sequences, E, dtype=dtype, device=device)
    prob_sum_BE = torch.zeros(sequences, E, dtype=dtype, device=device)
    for i, layer_logits in enumerate(logits):
        if layer_logits.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            raise TypeError(f"router_logits[{i}] must be a float tensor, got {layer_logits.dtype}")
        if tuple(layer_logits.shape) != tuple(logits[0].shape):
            raise ValueError(
                f"router_logits[{i}] must have the shape of router_logits[0] {tuple(logits[0].shape)}, "
                f"got {tuple(layer_logits.shape)}"
            )
        probs_TE = router_probabilities(layer_logits.to(dtype), score)
        if choices is None:
            chosen = probs_TE.detach().topk(top_k, dim=-1).indices
        else:
            chosen = choices[i]
            if tuple(chosen.shape) != (layer_logits.shape[0], top_k):
                raise ValueError(f"top_k_index[{i}] must have shape [T, top_k] = [{layer_logits.shape[0]}, {top_k}] "
                                 f"to match router_logits[{i}], got {tuple(chosen.shape)}")
            check_index("top_k_index", chosen)
            check_indices_in_range("top_k_index", chosen, E)
        # The mask was checked once, above, not once per layer.
        counts_BE = counts_BE + _counts(chosen, E, token_mask, sequences).to(dtype)
        if token_mask is not None:
            probs_TE = probs_TE * token_mask.reshape(-1, 1).to(dtype)
        prob_sum_BE = prob_sum_BE + probs_TE.view(sequences, rows, E).sum(1)
    # Rows over all layers, as transformers normalises: (tokens per layer) * (layers).
    per_layer_B = torch.full((sequences,), float(rows), dtype=dtype, device=device) if token_mask is None else (
        token_mask.to(dtype).reshape(sequences, rows).sum(1))
    tokens_B = per_layer_B * len(logits)
    if group is not None:
        # One all-reduce of the non-differentiable statistics; the local probability sum keeps its
        # gradient, scaled by the group size (see the module docstring).
        stats = torch.cat([counts_BE[0], prob_sum_BE[0].detach(), tokens_B])
        dist.all_reduce(stats, group=group)
        ranks = dist.get_world_size(group)
        counts_BE = stats[None, :E]
        prob_sum_BE = stats[None, E:2 * E] + ranks * (prob_sum_BE - prob_sum_BE.detach())
        tokens_B = stats[2 * E:]
    per_sequence_B = E * torch.sum(counts_BE * prob_sum_BE, dim=1) / _at_least_one(tokens_B) ** 2
    # A sequence without a token that counts (all padding) has no balance to measure: left out of
    # the mean, as an empty batch gives 0.
    return per_sequence_B.sum() / _at_least_one((tokens_B > 0).sum().to(dtype))


def _sequences(tokens: int, sequence_length, group) -> int:
    """How many sequences the loss averages over (1: the batch pooled), checked."""
    if sequence_length is None:
        return 1
    if isinstance(sequence_length, bool) or not isinstance(sequence_length, int) or sequence_length < 1:
        raise ValueError(f"sequence_length must be a positive int or None, got {sequence_length!r}")
    if tokens % sequence_length:
        raise ValueError(f"sequence_length={sequence_length} must divide the T={tokens} rows of router_logits "
                         "(sequences of consecutive tokens, transformers' [batch, seq] flattened)")
    if group is not None:
        raise ValueError("sequence_length and group exclude each other: a sequence's statistics are its own, "
                         "not summed over ranks")
    return max(tokens // sequence_length, 1)


def router_probabilities(logits_TE: torch.Tensor, score: str) -> torch.Tensor:
    """``[T, E]`` scores that sum to one per token: the softmax, or the sigmoid scores over their sum
    (+1e-20, DeepSeek-V3's guard against a sum of 0)."""
    if score == "softmax":
        return logits_TE.softmax(-1)
    scores_TE = logits_TE.sigmoid()
    return scores_TE / (scores_TE.sum(-1, keepdim=True) + 1e-20)


def _at_least_one(tokens: torch.Tensor) -> torch.Tensor:
    # No token counted (an empty batch, every token masked) leaves every count at 0: the loss is
    # 0 with a zero gradient, not 0/0. A where on the device, not a host check.
    return torch.where(tokens > 0, tokens, torch.ones_like(tokens))


def router_z_loss(router_logits: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """ST-MoE's z-loss: the mean over tokens of ``logsumexp(logits)^2``, summed over layers. It
    keeps router logits small, so softmax stays accurate in low precision."""
    layers = _as_layers("router_logits", router_logits)
    for i, t in enumerate(layers):
        if not t.is_floating_point():
            raise TypeError(f"router_logits[{i}] must be a float tensor, got {t.dtype}")
    dtype = torch.promote_types(layers[0].dtype, torch.float32)
    # The sum over max(T, 1) rows: an empty batch gives 0, not the NaN of an empty mean.
    return sum(torch.logsumexp(t.to(dtype), dim=-1).square().sum() / max(t.shape[0], 1) for t in layers)


@torch.no_grad()
def update_expert_bias_(
    bias: torch.Tensor | Sequence[torch.Tensor],
    counts: torch.Tensor | Sequence[torch.Tensor],
    *,
    rate: float,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor | list[torch.Tensor]:
    """Aux-loss-free balancing (DeepSeek-V3): ``bias += rate * sign(mean(load) - load)``, in place.

    ``bias [E]`` and ``counts [E]``: one tensor each, or one per MoE layer (sequences of equal
    length; each layer is balanced on its own). ``counts`` are this rank's routed pairs per expert
    since the last update (e.g. summed ``expert_counts`` over micro-batches). With ``group`` they
    are summed over it first, in float64 (exact for integer counts; one all-reduce for every
    layer), so every rank applies the same update to the same bias: the biases stay identical
    without being broadcast. Returns ``bias``."""
    single = isinstance(bias, torch.Tensor)
    biases = [bias] if single else list(bias)
    loads = [counts] if isinstance(counts, torch.Tensor) else list(counts)
    if not biases:
        raise ValueError("bias must be a tensor or a non-empty sequence of tensors, got an empty sequence")
    if len(loads) != len(biases):
        raise ValueError(f"counts must give one tensor per bias ({len(biases)}), got {len(loads)}")
    for i, (b, c) in enumerate(zip(biases, loads)):
        at = "" if single else f"[{i}]"
        check_tensor(f"bias{at}", b, ndim=1)
        if not b.is_floating_point():
            raise TypeError(f"bias{at} must be a floating-point tensor, got {b.dtype}")
        check_tensor(f"counts{at}", c, ndim=1)
        if c.shape != b.shape:
            raise ValueError(f"counts{at} must have the shape of bias{at} {tuple(b.shape)}, got {tuple(c.shape)}")
    check_number("rate", rate, at_least=0)
    load = torch.cat([c.to(torch.float64) for c in loads])  # a new tensor: the callers' counts stay as they are
    if group is not None:
        dist.all_reduce(load, group=group)
    for b, layer_load in zip(biases, load.split([b.numel() for b in biases])):
        b.add_(torch.sign(layer_load.mean() - layer_load).to(b.dtype), alpha=rate)
    return bias if single else biases
