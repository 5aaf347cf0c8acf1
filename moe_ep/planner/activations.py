"""Activation memory of one micro-batch, unit by unit (embedding, decoder layer, head): the bytes
autograd keeps for the backward when transformers' modeling code runs with moe_ep's router and
experts in bf16 (what ``torch.autograd.graph.saved_tensors_hooks`` sees, parameters excluded, each
storage once), and the transient scratch of a unit's backward.

What is saved, read from the code and checked against measurements (``tests/test_plan_activations.py``
counts the saved tensors of real models, on the CPU and at full Mixtral-8x7B shapes under
``FakeTensorMode``):

- RMSNorm (transformers' eager one): its float32 input, the float32 reciprocal RMS of each row and
  the normalised bf16 rows before the weight: ``rows x (4 width + 4 + 2 width)``.
- attention: the projections' input (the norm's output); q/k norms (Qwen3 per head, OLMoE over the
  projection); q and k after the rotary embedding, v; the flash kernel's float32 log-sum-exp per
  head and its output (o_proj's input). The rotary tables once per micro-batch, shared by the layers.
- router (``route_topk``): torch backend: float32 copies of the input and the weight, the float32
  probabilities, the int64 top-k indices and, when it renormalises, the top-k sums and weights;
  Triton backend: the float32 logits and int64 indices (and the float32 copies DeepSeek-V3 hands it).
- experts (``moe_experts``): the input rows, the routing weights, the sort (torch: int64 order and
  int32 offsets; Triton: int32 metadata over rows padded per expert to its tile) and the GEMM-1
  output ``[rows, 2I]`` from which the backward recomputes SwiGLU.
- expert parallel (``moe_ep.dispatch``): on the source rank the rows coming back (for the gradient
  of the routing weights) and the int64 maps of the exchange; on the expert rank the received rows,
  which the experts take as they came (one column per local expert a row can carry), with their
  routing columns; see :func:`dispatch_saved`.
- dense MLP and shared expert: the input, the gate and up outputs, the activation and the product.
- head: the final norm, lm_head's input and the loss of ``moe_ep.training.CausalLMLoss``: the float32
  log-softmax of the ``B (S - 1)`` predicted positions and their int64 targets.
- recompute (``moe_ep.planner.recompute``): under ``"full"`` a decoder layer keeps only its input
  (non-reentrant checkpointing); under ``"selective"`` its input and the outputs of the ops
  PyTorch's selective checkpoint keeps: the projections' GEMMs, the attention kernel's output and
  log-sum-exp, the router's logits (torch backend: its float32 GEMM; Triton: the op's three
  outputs), the dense MLP's or shared expert's three GEMMs (and the shared expert's gate) and the
  expert op's output with what it saves; under ``"attention"`` the attention block keeps only its
  input (the first norm's output), the rest of the layer what it saves. Whatever is recomputed
  exists again while the layer's backward runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..ops.activations import CHUNK_ELEMENTS
from ..ops.linear_cross_entropy import default_chunk_tokens
from .recompute import recompute_policy
from .spec import BF16, FP32, ModelSpec

I32 = 4
I64 = 8
BACKENDS = ("triton", "torch")


@dataclass(frozen=True)
class MicroBatch:
    sequences: int
    seq_len: int

    @property
    def tokens(self) -> int:
        return self.sequences * self.seq_len

    @property
    def predicted(self) -> int:
        """Positions with a next token to predict."""
        return self.sequences * (self.seq_len - 1)


@dataclass(frozen=True)
class Routed:
    """What one rank's expert-parallel dispatcher moves for one micro-batch, counting the rank
    itself as a destination: ``sent`` rows (one per (token, destination rank)), ``received`` rows,
    and ``pairs``: the (row, local expert) pairs its experts compute."""

    sent: float
    received: float
    pairs: float


def rank_shares(spec: ModelSpec, ep: int) -> tuple[float, float]:
    """(rows, multi rows) a token sends, expected over uniform top-k routing: the ranks holding at
    least one, and at least two, of its experts (``L = E / ep`` consecutive experts per rank)."""
    E, K = spec.num_experts, spec.top_k
    L = E // ep
    total = math.comb(E, K)
    none = math.comb(E - L, K) / total
    one = L * math.comb(E - L, K - 1) / total
    return ep * (1.0 - none), ep * (1.0 - none - one)


def expected_routed(spec: ModelSpec, ep: int, tokens: int, load: float = 1.0) -> Routed:
    """The dispatcher's counts for ``tokens`` tokens per rank under uniform routing, on a rank
    whose experts get ``load`` times the mean (every rank sends alike; the busiest receives more)."""
    rows, _ = rank_shares(spec, ep)
    return Routed(rows * tokens, load * rows * tokens, load * spec.top_k * tokens)


def norm_saved(rows: float, width: int) -> float:
    return rows * ((FP32 + BF16) * width + FP32)


def _rotary_dim(spec: ModelSpec) -> int:
    return spec.qk_rope_head_dim if spec.kv_lora_rank else spec.head_dim


def embed_saved(spec: ModelSpec, mb: MicroBatch) -> float:
    """The token ids, and the rotary tables (cos and sin, one row per position) the layers share."""
    return I64 * mb.tokens + 2 * BF16 * mb.seq_len * _rotary_dim(spec)


def _sliding_masked(spec: ModelSpec, mb: MicroBatch) -> bool:
    """Whether the sliding-window layers get a mask: transformers passes none (the kernel's causal
    flag instead) where the window covers the whole sequence, as on full-attention layers."""
    return bool(spec.sliding_layers) and mb.seq_len >= spec.sliding_window


def sliding_mask_saved(spec: ModelSpec, layer: int, mb: MicroBatch) -> float:
    """A sliding-window layer's attention kernel keeps its own half-precision copy of the boolean
    ``[batch, 1, seq, seq]`` mask."""
    if layer not in spec.sliding_layers or not _sliding_masked(spec, mb):
        return 0.0
    return BF16 * mb.sequences * mb.seq_len ** 2


def attention_saved(spec: ModelSpec, mb: MicroBatch, layer: int) -> float:
    T, H, nh = mb.tokens, spec.hidden_size, spec.num_heads
    qk, v = spec.head_dim, spec.value_head_dim
    flash = T * (FP32 * nh + BF16 * nh * v)  # log-sum-exp per head, output (o_proj's input)
    mask = sliding_mask_saved(spec, layer, mb)
    if spec.kv_lora_rank:
        # Multi-head latent attention: the latents' norms and the up-projections' inputs, then q
        # and k (the rotary part broadcast to every head) as the attention kernel reads them, and
        # v as a view of kv_b_proj's whole output (the keys' non-rotary part beside it). q,
        # concatenated, lays the kernel's output out by head: o_proj reads a copy of it (of
        # sequences longer than one token).
        latents = norm_saved(T, spec.kv_lora_rank) + T * BF16 * spec.kv_lora_rank
        if spec.q_lora_rank:
            latents += norm_saved(T, spec.q_lora_rank) + T * BF16 * spec.q_lora_rank
        kv_b_out = nh * (qk - spec.qk_rope_head_dim + v)
        copy = T * BF16 * nh * v if mb.seq_len > 1 else 0.0  # one position: the transpose is the layout
        return T * BF16 * H + latents + T * BF16 * (2 * nh * qk + kv_b_out) + flash + copy + mask
    q, kv, vv = nh * qk, spec.num_kv_heads * qk, spec.num_kv_heads * v
    norms = {
        None: 0.0,
        "head": norm_saved(T * nh, qk) + norm_saved(T * spec.num_kv_heads, qk),
        "full": norm_saved(T, q) + norm_saved(T, kv),
    }[spec.qk_norm]
    # OLMoE's clip_qkv clamps the projections in place: each clamp keeps its input.
    clipped = T * BF16 * (q + kv + vv) if spec.clip_qkv else 0.0
    return T * BF16 * H + norms + clipped + T * BF16 * (q + kv + vv) + flash + mask


def router_saved(spec: ModelSpec, tokens: int, backend: str) -> float:
    E, K, H, T = spec.num_experts, spec.top_k, spec.hidden_size, tokens
    # float32 copies of the weight (one per micro-batch) and of the input: route_topk's torch
    # backend makes them; DeepSeek-V3's router makes them before either backend.
    copies = FP32 * (E * H + T * H) if backend == "torch" or spec.sigmoid_router else 0.0
    saved = copies + FP32 * T * E + I64 * T * K
    if backend == "torch" and spec.normalize_topk:
        saved += FP32 * T * (1 + K)
    return saved


def _routing_weight_bytes(spec: ModelSpec) -> int:
    return FP32 if spec.fp32_routing_weights else BF16


def padded_rows(pairs: float, experts: int) -> float:
    """Rows of the Triton experts' padded layout (``kernels.routing_metadata.padded_rows`` with the
    tile ``kernels.grouped_gemm.routing_block`` picks): each expert's rows padded to the tile,
    allocated at the static bound."""
    if pairs <= 0:
        return 0.0
    tile = 128 if pairs >= 256 * experts else 64
    return (math.ceil(pairs / tile) + experts) * tile


def experts_op_saved(spec: ModelSpec, pairs: float, experts: int, backend: str, slots: float | None = None
                     ) -> float:
    """What ``moe_experts`` keeps beyond its input rows and weights, for ``pairs`` (row, expert)
    pairs over ``experts`` experts in ``slots`` routing slots (default ``pairs``; the dispatcher's
    received rows have more, some without an expert): the sort and the GEMM-1 output."""
    two_i = 2 * spec.intermediate_size
    slots = pairs if slots is None else slots
    if backend == "torch":
        return I64 * slots + I32 * experts + BF16 * two_i * pairs
    rows = padded_rows(pairs, experts)
    tile = 128 if pairs >= 256 * experts else 64
    metadata = I32 * (experts + (experts + 1) + rows + slots + rows / tile)
    return metadata + BF16 * two_i * rows


def dispatch_saved(spec: ModelSpec, ep: int, tokens: int, routed: Routed, backend: str) -> float:
    """The expert-parallel path of one MoE layer (dropless): the dispatcher's saved maps and rows
    on both sides, and what the experts keep of the pairs they compute.

    Source side: the scatter indices of the routing weights' return factors ([T, K] and [T, ep]
    int64, a [T, ep] bool), the gather map of the rows it packs, the rows that come back (their
    dot with the output gradient is the routing weights' gradient), the return weights and map.
    With rows that can carry several experts (``min(K, L) > 1``) also the weights' scatter index,
    and on the expert side the routing columns' selection. The experts keep the received rows
    and their ``[S, min(K, L)]`` weights, and sort their slots."""
    T, K, H = tokens, spec.top_k, spec.hidden_size
    L = spec.num_experts // ep
    r_max, k_max = min(K, ep), min(K, L)
    S, P = routed.received, routed.pairs
    source = (I64 * T * K + T * ep + I64 * T * ep  # return factors: two scatter indices, a where's condition
              + (T * K * K if K > 1 else 0)  # repeated experts' merge: its where's [T, K, K] condition
              + I64 * (T * r_max + 1) + I64 * routed.sent  # packing gather: copy map, row targets
              + BF16 * H * routed.sent  # the rows that come back
              + FP32 * (T * r_max + 1) + I64 * (routed.sent + 1))  # return weights and map
    slots = S * k_max
    expert = BF16 * H * S + FP32 * slots + experts_op_saved(spec, P, L, backend, slots)
    if k_max > 1:
        source += I64 * T * K  # the routing weights' scatter into the multi rows' columns
        expert += S + I64 * S  # routing columns: condition, selection
    return source + expert


def mlp_saved(spec: ModelSpec, layer: int, tokens: int, backend: str, ep: int, routed: Routed | None) -> float:
    """The MLP of decoder layer ``layer`` after its norm: dense, or router + shared expert +
    routed experts (locally, or through the dispatcher when ``ep > 1``)."""
    H, T = spec.hidden_size, tokens
    x = BF16 * T * H  # the norm's output: the first consumer saves it, the others share it
    if not spec.is_moe_layer(layer):
        width = spec.dense_intermediate_size if spec.num_experts else spec.intermediate_size
        return x + BF16 * 4 * width * T
    saved = router_saved(spec, T, backend)
    if spec.shared_intermediate_size:
        saved += BF16 * 4 * spec.shared_intermediate_size * T
        if spec.shared_expert_gate:
            saved += BF16 * T * (1 + H)  # the gate's sigmoid and the shared output it scales
    if ep == 1:
        N = T * spec.top_k
        return saved + x + _routing_weight_bytes(spec) * N + experts_op_saved(spec, N, spec.num_experts, backend)
    # The routing weights reach the experts through the dispatcher; the norm's output is saved by
    # the router (Triton) or not at all (torch saves its float32 copy), and by the shared expert.
    shares_x = (backend == "triton" and not spec.sigmoid_router) or spec.shared_intermediate_size
    return saved + (x if shares_x else 0.0) + dispatch_saved(spec, ep, T, routed, backend)


def layer_saved(spec: ModelSpec, layer: int, mb: MicroBatch, backend: str, ep: int = 1,
                routed: Routed | None = None) -> float:
    T, H = mb.tokens, spec.hidden_size
    return 2 * norm_saved(T, H) + attention_saved(spec, mb, layer) + mlp_saved(spec, layer, T, backend, ep, routed)


def checkpointed_layer_saved(spec: ModelSpec, mb: MicroBatch) -> float:
    """A checkpointed layer keeps its input for the recompute."""
    return BF16 * mb.tokens * spec.hidden_size


def _attention_gemm_outputs(spec: ModelSpec, mb: MicroBatch) -> float:
    """The outputs of the attention block's GEMMs and attention kernel: the projections (latent
    attention: down- and up-projections), the kernel's float32 log-sum-exp and output, o_proj's."""
    T, H, nh = mb.tokens, spec.hidden_size, spec.num_heads
    qk, v = spec.head_dim, spec.value_head_dim
    if spec.kv_lora_rank:
        queries = spec.q_lora_rank + nh * qk if spec.q_lora_rank else nh * qk
        latents = spec.kv_lora_rank + spec.qk_rope_head_dim + nh * (qk - spec.qk_rope_head_dim + v)
        projections = queries + latents
    else:
        projections = nh * qk + spec.num_kv_heads * (qk + v)
    return T * (BF16 * projections + FP32 * nh + BF16 * nh * v + BF16 * H)


def _mlp_kept_outputs(spec: ModelSpec, layer: int, tokens: int, backend: str, ep: int, routed: Routed | None) -> float:
    """What ``"selective"`` keeps of the MLP: its GEMMs' outputs and moe_ep's ops' outputs (the
    expert op's output rows and what it saves)."""
    H, T = spec.hidden_size, tokens
    if not spec.is_moe_layer(layer):
        width = spec.dense_intermediate_size if spec.num_experts else spec.intermediate_size
        return BF16 * T * (2 * width + H)
    E, K = spec.num_experts, spec.top_k
    kept = FP32 * T * E + ((FP32 + I64) * T * K if backend == "triton" else 0.0)
    if spec.shared_intermediate_size:
        kept += BF16 * T * (2 * spec.shared_intermediate_size + H) + (BF16 * T if spec.shared_expert_gate else 0.0)
    if ep == 1:
        return kept + BF16 * H * T + experts_op_saved(spec, T * K, E, backend)
    # Through the dispatcher the op's output is one row per received row.
    slots = routed.received * min(K, E // ep)
    return kept + BF16 * H * routed.received + experts_op_saved(spec, routed.pairs, E // ep, backend, slots)


def selective_layer_saved(spec: ModelSpec, layer: int, mb: MicroBatch, backend: str, ep: int = 1,
                          routed: Routed | None = None) -> float:
    """Under ``"selective"``: the layer's input and the outputs the policy keeps."""
    return (checkpointed_layer_saved(spec, mb) + _attention_gemm_outputs(spec, mb)
            + _mlp_kept_outputs(spec, layer, mb.tokens, backend, ep, routed))


def attention_recomputed_layer_saved(spec: ModelSpec, layer: int, mb: MicroBatch, backend: str, ep: int = 1,
                                     routed: Routed | None = None) -> float:
    """Under ``"attention"``: the layer's saved tensors, of the attention block only its input."""
    return (layer_saved(spec, layer, mb, backend, ep, routed) - attention_saved(spec, mb, layer)
            + BF16 * mb.tokens * spec.hidden_size)


def policy_layer_saved(spec: ModelSpec, layer: int, mb: MicroBatch, backend: str, policy: str, ep: int = 1,
                       routed: Routed | None = None) -> float:
    """Saved bytes of decoder layer ``layer`` under the recompute ``policy``."""
    if policy == "full":
        return checkpointed_layer_saved(spec, mb)
    if policy == "selective":
        return selective_layer_saved(spec, layer, mb, backend, ep, routed)
    if policy == "attention":
        return attention_recomputed_layer_saved(spec, layer, mb, backend, ep, routed)
    return layer_saved(spec, layer, mb, backend, ep, routed)


def checkpoint_shared(spec: ModelSpec, mb: MicroBatch) -> float:
    """What every checkpointed layer's (or attention block's) call also holds, once per
    micro-batch: the int64 position ids (one row), beside the rotary tables the embedding's figure
    already counts, and where sliding-window layers get a mask, that boolean ``[seq, seq]`` mask
    (expanded over the batch)."""
    return I64 * mb.seq_len + (mb.seq_len ** 2 if _sliding_masked(spec, mb) else 0)


def head_saved(spec: ModelSpec, mb: MicroBatch) -> float:
    """Final norm, lm_head's input, the loss's float32 log-softmax and int64 targets (of one
    sequence, or of sequences of at most two tokens, a view of its labels, else a copy of the
    shifted ones), and the division by the normaliser (one float32)."""
    T, H = mb.tokens, spec.hidden_size
    targets = I64 * (T if mb.sequences == 1 or mb.seq_len <= 2 else mb.predicted)
    return norm_saved(T, H) + BF16 * T * H + FP32 * spec.vocab_size * mb.predicted + targets + FP32


def chunked_loss_saved(tokens: int, hidden: int, vocab: int) -> float:
    """What moe_ep's chunked loss (``ops.linear_cross_entropy``) keeps from forward to backward
    for bf16 hidden states: their gradient, computed in forward, and the head weight's float32
    gradient [V, H], whatever the token count."""
    return BF16 * tokens * hidden + FP32 * vocab * hidden


def chunked_head_saved(spec: ModelSpec, mb: MicroBatch) -> float:
    """The head under ``chunked_loss``: the final norm's saved tensors, what the loss keeps
    (``chunked_loss_saved``), the int64 shifted targets and the loss's two float32 scalars; no
    logits and no log-softmax."""
    T, H = mb.tokens, spec.hidden_size
    return norm_saved(T, H) + chunked_loss_saved(T, H, spec.vocab_size) + I64 * T + 2 * FP32


def chunked_head_scratch(spec: ModelSpec, mb: MicroBatch) -> float:
    """The head's transient memory under ``chunked_loss`` (estimated from the code): the larger
    of the forward's chunk (its float32 logits and their bf16 copy, and the chunk's bf16 product
    for the weight gradient) and the backward's scaled float32 weight gradient with its bf16 copy."""
    V, H = spec.vocab_size, spec.hidden_size
    chunk = default_chunk_tokens(mb.tokens, H, V)
    return max((FP32 + BF16) * chunk * V + BF16 * V * H, (FP32 + BF16) * V * H)


def experts_scratch(pairs: float, hidden: int, intermediate: int, experts: int, backend: str,
                    repeatable: bool = False, slots: float | None = None, columns: int = 1) -> float:
    """What ``moe_experts``' backward (bf16, ``pairs`` routed rows over ``experts``, in ``slots``
    routing slots of ``columns`` per input row: ``pairs`` by default, more for the dispatcher's
    received rows, ``min(K, L)`` columns each) holds at once
    beyond its saved tensors and the gradients it returns, counted from its code and checked
    against the bytes its CPU run allocates (``tests/test_plan_scratch.py``). Torch: at its peak,
    in the gated activation's backward, the output gradient's rows, their product with the down
    projection and the weighted activation, the float32 temporaries of a block of rows
    (``ops.activations.CHUNK_ELEMENTS``: 12 bytes per element of its ``[rows, 2I]`` block) and the
    per-row indices and weights; later the input gradient's rows and their copy in token order.
    Triton: the output gradient's padded rows with the weighted activation, and the partial
    routing-weight gradients (one float32 per row and column block; the blocks of aligned rows,
    which real models have, are at least 64 columns wide). GEMM 1's output
    gradient goes over its saved output, except under ``repeatable``
    (``moe_ep.ops.repeatable_backward``, which ZB-V and DualPipeV set), where it is one more
    ``[rows, 2I]`` buffer. Slots without an expert add their share of the per-slot vectors and,
    torch, the combine's per-slot map with a block of gathered rows and its float32 sums per input
    row instead of a slot-order copy of all rows."""
    H, I = hidden, intermediate
    gemm1_grad = BF16 * 2 * I if repeatable else 0
    slots = pairs if slots is None else slots
    if backend == "torch":
        # Per row: its token (int64), routing weight and weight gradient; per slot dw's copy.
        vectors = 16 * pairs + FP32 * slots
        activation = (pairs * (BF16 * (H + 2 * I) + gemm1_grad) + vectors
                      + 3 * FP32 * min(CHUNK_ELEMENTS, pairs * 2 * I))
        if slots == pairs:
            combine = pairs * (BF16 * 2 * H + gemm1_grad) + vectors + FP32 * min(CHUNK_ELEMENTS, pairs * H)
        else:
            combine = (pairs * (BF16 * H + gemm1_grad) + vectors + I64 * slots
                       + (BF16 + FP32 / columns) * min(CHUNK_ELEMENTS, slots * H))
        return max(activation, combine)
    weight_grad_parts = FP32 * math.ceil(I / 64)
    return (padded_rows(pairs, experts) * (BF16 * (H + I) + gemm1_grad + weight_grad_parts)
            + slots * (8 + weight_grad_parts))


def layer_scratch(spec: ModelSpec, layer: int, mb: MicroBatch, backend: str, ep: int = 1,
                  routed: Routed | None = None, repeatable: bool = False) -> float:
    """Transient memory of a decoder layer's backward beyond its saved tensors: the gradients of
    the residual stream and of the branch (estimated from the backward's formulas), and the
    largest kernel's intermediates, the experts' (:func:`experts_scratch`, ``repeatable`` as
    there) or attention's (q, k, v gradients and flash attention's float32 accumulator for dq;
    estimated)."""
    T, H, I = mb.tokens, spec.hidden_size, spec.intermediate_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    stream = 2 * BF16 * T * H
    attention = BF16 * T * (q + 2 * kv) + FP32 * T * q
    if not spec.is_moe_layer(layer):
        width = spec.dense_intermediate_size if spec.num_experts else I
        return stream + max(attention, BF16 * T * 3 * width)
    if ep > 1:
        columns = min(spec.top_k, spec.num_experts // ep)
        expert = experts_scratch(routed.pairs, H, I, spec.num_experts // ep, backend, repeatable,
                                 routed.received * columns, columns)
    else:
        expert = experts_scratch(T * spec.top_k, H, I, spec.num_experts, backend, repeatable)
    return stream + max(attention, expert)


def head_scratch(spec: ModelSpec, mb: MicroBatch) -> float:
    """The logits around the loss (estimated): the bf16 logits the caller holds until the loss
    returns, and in the backward the float32 gradient of the log-softmax with its bf16 copy."""
    return BF16 * spec.vocab_size * mb.tokens + (FP32 + BF16) * spec.vocab_size * mb.predicted


def chain_saved(spec: ModelSpec, mb: MicroBatch, *, backend: str, checkpointing: str | bool, ep: int = 1,
                routed: list[Routed | None] | None = None) -> dict[str, float]:
    """Saved bytes of one micro-batch per unit of the planner's chain (``embed+layers.0``, ...,
    ``layers.L-1+head``) under the recompute policy ``checkpointing`` (a bool: ``"full"`` or
    ``"none"``); ``routed[i]``: the dispatcher's counts in layer ``i`` when ``ep > 1``."""
    policy = recompute_policy("checkpointing", checkpointing)
    L = spec.num_layers
    out = {}
    for i in range(L):
        saved = policy_layer_saved(spec, i, mb, backend, policy, ep, routed[i] if routed else None)
        name = f"layers.{i}"
        if i == 0:
            saved += embed_saved(spec, mb) + (checkpoint_shared(spec, mb) if policy != "none" else 0.0)
            name = "embed+" + name
        if i == L - 1:
            saved, name = saved + head_saved(spec, mb), name + "+head"
        out[name] = saved
    return out
