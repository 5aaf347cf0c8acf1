"""Compute time of one unit for one micro-batch on one rank, by kind of kernel.

- GEMMs: FLOPs at the dense or grouped GEMM efficiency of the bf16 peak; backward = 2 x forward;
  recompute runs again what its policy recomputes (:func:`recomputed`): a whole layer's forward
  (``"full"``), its memory-bound kernels (``"selective"``) or its attention block
  (``"attention"``). The routed experts' FLOPs are the busiest rank's: its
  experts get ``load`` x the mean rows (``imbalance`` under expert parallelism; padded rows count
  in capacity mode).
- attention: flash attention's FLOPs at the attention efficiency; its backward recomputes the
  scores, 2.5 x the forward (the convention of the FlashAttention papers, whose figures the
  default efficiency comes from).
- memory-bound work: the bytes the non-GEMM kernels read and write, at the memory efficiency of
  the HBM bandwidth (:func:`layer_traffic`); their backward is taken as twice the forward, except
  in compiled dense blocks, whose regions move what Inductor counts for them.

Model FLOPs (for MFU) are the useful ones: 3 x the forward's GEMMs and attention at the mean
load, no recompute."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..ops.linear_cross_entropy import default_chunk_tokens
from .activations import MicroBatch, Routed
from .cluster import Cluster
from .spec import BF16, FP32, ModelSpec

GEMM_PASSES = 3.0  # forward, and a backward of twice its FLOPs (input and weight gradients)
ATTENTION_PASSES = 3.5  # flash attention's backward: 2.5 x its forward
MEMORY_BACKWARD = 2.0  # backward bytes of an elementwise op over its forward's


@dataclass(frozen=True)
class Recomputed:
    """What a unit's backward runs again of its forward: FLOPs by kind (the experts' at the mean
    load) and memory-bound bytes."""

    dense_flops: float = 0.0
    expert_flops: float = 0.0
    attention_flops: float = 0.0
    memory: float = 0.0


NOTHING = Recomputed()


@dataclass(frozen=True)
class Work:
    """One unit's work for one micro-batch on one rank: forward FLOPs by kind (the experts' at the
    mean load, run at ``expert_load`` times it), forward and backward memory-bound bytes, and
    what its backward recomputes."""

    dense_flops: float = 0.0
    expert_flops: float = 0.0
    attention_flops: float = 0.0
    memory_fwd: float = 0.0
    memory_bwd: float = 0.0
    recompute: Recomputed = NOTHING
    expert_load: float = 1.0

    @property
    def useful_expert_load(self) -> float:
        """The share of the mean load's expert pairs that are computed at all: 1, except in capacity
        mode with padded blocks smaller than the mean load (a capacity factor below 1), which drops
        the rest; dropped pairs are no model FLOPs."""
        return min(1.0, self.expert_load)

    @property
    def model_flops(self) -> float:
        """Useful FLOPs of forward and backward at the mean load (no recompute), less dropped pairs."""
        return GEMM_PASSES * (self.dense_flops + self.useful_expert_load * self.expert_flops + self.attention_flops)

    def ideal_seconds(self, cluster: Cluster) -> float:
        """The model FLOPs at the stated efficiencies: what MFU's ceiling is made of."""
        eff = cluster.efficiencies
        return GEMM_PASSES * (self.dense_flops / eff.dense_gemm
                              + self.useful_expert_load * self.expert_flops / eff.grouped_gemm
                              + self.attention_flops / eff.attention) / cluster.peak_flops

    def losses(self, cluster: Cluster) -> dict[str, float]:
        """Seconds beyond :meth:`ideal_seconds`, by cause; with them it adds up to :meth:`seconds`."""
        eff, peak = cluster.efficiencies, cluster.peak_flops
        expert, attention = self.expert_flops / eff.grouped_gemm, self.attention_flops / eff.attention
        again = self.recompute
        return {
            "memory-bound kernels":
                self._seconds(cluster, 0, 0, self.memory_fwd + again.memory + self.memory_bwd).total,
            "recompute (checkpointing)": (again.dense_flops / eff.dense_gemm
                                          + self.expert_load * again.expert_flops / eff.grouped_gemm
                                          + again.attention_flops / eff.attention) / peak,
            "busiest rank's extra expert load": (GEMM_PASSES * (self.expert_load - self.useful_expert_load) * expert
                                                 / peak),
            "flash attention's backward recompute": (ATTENTION_PASSES - GEMM_PASSES) * attention / peak,
        }

    def seconds(self, cluster: Cluster) -> "Seconds":
        """Forward, backward and recompute."""
        return _work_seconds(self, cluster)

    def forward_seconds(self, cluster: Cluster) -> "Seconds":
        return self._seconds(cluster, 1.0, 1.0, self.memory_fwd)

    def _seconds(self, cluster: Cluster, gemm_passes: float, attention_passes: float, memory: float) -> "Seconds":
        eff, peak = cluster.efficiencies, cluster.peak_flops
        return Seconds(
            dense=gemm_passes * self.dense_flops / (peak * eff.dense_gemm),
            grouped=gemm_passes * self.expert_load * self.expert_flops / (peak * eff.grouped_gemm),
            attention=attention_passes * self.attention_flops / (peak * eff.attention),
            memory=memory / (cluster.hbm_bytes_per_s * eff.memory),
        )


@functools.lru_cache(maxsize=4096)
def _work_seconds(work: Work, cluster: Cluster) -> "Seconds":
    # The search asks for the same units' seconds for every layout that shares them.
    again = work.recompute
    recompute = Work(again.dense_flops, again.expert_flops, again.attention_flops, expert_load=work.expert_load)
    return (work._seconds(cluster, GEMM_PASSES, ATTENTION_PASSES, work.memory_fwd + work.memory_bwd)
            + recompute._seconds(cluster, 1.0, 1.0, again.memory))


@dataclass(frozen=True)
class Seconds:
    dense: float = 0.0
    grouped: float = 0.0
    attention: float = 0.0
    memory: float = 0.0

    @property
    def total(self) -> float:
        return self.dense + self.grouped + self.attention + self.memory

    def __add__(self, other: "Seconds") -> "Seconds":
        return Seconds(self.dense + other.dense, self.grouped + other.grouped, self.attention + other.attention,
                       self.memory + other.memory)

    def __mul__(self, k: float) -> "Seconds":
        return Seconds(self.dense * k, self.grouped * k, self.attention * k, self.memory * k)


# Bytes read and written per element by transformers' eager non-GEMM ops in bf16 (an estimate):
# RMSNorm: upcast (2 + 4), square (4 + 4), mean (4), scale (4 + 4), downcast (4 + 2), weight (2 + 2).
NORM = 36
ROTARY = 20  # x cos (2 + 2), rotate_half (2 + 4), x sin (2 + 2), add (4 + 2)
RESIDUAL = 6  # a + b
SWIGLU = 10  # act (2 + 2), product (4 + 2)


# Bytes per element moved by the regions ``parallelize(compile_blocks=...)`` compiles (a layer's
# norms, attention, dense MLP or shared expert: everything around the experts but the residual
# adds and the MoE block's glue), as Inductor counts them (``GraphLowering.count_bytes``, its fused
# kernels, the GEMMs and the attention kernel left out) for transformers' modules compiled on its
# CPU backend at three shapes each; tests/test_planner_compiled.py counts them again. Forward,
# backward. A GPU's Triton fusion may differ: estimated there.
COMPILED_NORM = (4.0, 10.0)  # per element of H: x read and the output written; backward 2.5x that
# Per element of q + kv (the rotary embedding, the q/k norms where the model has them, the copies
# into and out of the attention kernel's layout), by whether the model has q/k norms.
COMPILED_ATTENTION = {True: (12.5, 16.5), False: (10.5, 6.5)}
COMPILED_SWIGLU = (6.0, 10.0)  # per element of the intermediate width: gate and up read, product written
# Backward, per element of H: a region's input gradient summed over its projections (q, k, v; gate, up).
COMPILED_INPUT_GRADIENT = 6.0


def layer_traffic(spec: ModelSpec, layer: int, mb: MicroBatch, ep: int, routed: Routed | None,
                  compiled: bool = False) -> tuple[float, float]:
    """(forward, backward) bytes of decoder layer ``layer``'s memory-bound kernels: two norms, the
    rotary embedding, q/k norms, two residual adds, the router's softmax / top-k, the dense MLP's
    or shared expert's SwiGLU, the experts' combine (moe_ep's Triton kernels fuse gather, SwiGLU
    and the routing weight into the GEMMs) and under expert parallelism the packing and the sums
    of the returned rows. Eager, each kernel's backward is taken as twice its forward; with
    ``compiled`` dense blocks, the compiled regions move what Inductor counts for them."""
    T, H = mb.tokens, spec.hidden_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    if compiled:
        (norm_f, norm_b), (attn_f, attn_b) = COMPILED_NORM, COMPILED_ATTENTION[bool(spec.qk_norm)]
        regions = (2 * norm_f * H + attn_f * (q + kv), 2 * norm_b * H + attn_b * (q + kv) + COMPILED_INPUT_GRADIENT * H)
    else:
        forward = 2 * NORM * H + ROTARY * (q + kv) + (NORM * (q + kv) if spec.qk_norm else 0)
        regions = (forward, MEMORY_BACKWARD * forward)

    def swiglu(width: int) -> tuple[float, float]:
        if compiled:
            return COMPILED_SWIGLU[0] * width, COMPILED_SWIGLU[1] * width + COMPILED_INPUT_GRADIENT * H
        return SWIGLU * width, MEMORY_BACKWARD * SWIGLU * width

    if not spec.is_moe_layer(layer):
        mlp = swiglu(spec.dense_intermediate_size if spec.num_experts else spec.intermediate_size)
        eager = 2 * RESIDUAL * H
        return (T * (regions[0] + mlp[0] + eager), T * (regions[1] + mlp[1] + MEMORY_BACKWARD * eager))
    eager = 2 * RESIDUAL * H + 3 * 2 * FP32 * spec.num_experts + 2 * FP32 * spec.top_k  # softmax, top-k, renormalise
    shared = (0.0, 0.0)
    if spec.shared_intermediate_size:
        shared = swiglu(spec.shared_intermediate_size)
        eager += RESIDUAL * H
    traffic = T * eager
    if ep == 1:
        traffic += BF16 * H * (T * spec.top_k + T)  # combine: read every pair's row, write the token's
    else:
        # Packing reads and writes each sent row. The experts take the received rows as they came
        # and their combine sums each row's pairs: every pair's output read, each row written. The
        # source sums each token's returned rows in one gather-sum pass (kernels.grouped_gemm.sum_rows):
        # each row read, the token written.
        rows = routed.sent
        traffic += BF16 * H * (2 * rows + routed.pairs + routed.received + rows + T)
    return (T * (regions[0] + shared[0]) + traffic, T * (regions[1] + shared[1]) + MEMORY_BACKWARD * traffic)


def recomputed(spec: ModelSpec, layer: int, mb: MicroBatch, policy: str, traffic: float, passes: int = 1) -> Recomputed:
    """What the backward of decoder layer ``layer`` runs again under the recompute ``policy``
    (``traffic``: its memory-bound forward bytes, :func:`layer_traffic`'s first) in its ``passes``
    recomputes (``moe_ep.planner.recompute.recompute_passes``)."""
    once = _recomputed_once(spec, layer, mb, policy, traffic)
    return Recomputed(passes * once.dense_flops, passes * once.expert_flops, passes * once.attention_flops,
                      passes * once.memory)


def _recomputed_once(spec: ModelSpec, layer: int, mb: MicroBatch, policy: str, traffic: float) -> Recomputed:
    """One recompute: ``"full"`` the whole forward; ``"selective"`` the memory-bound kernels (the
    dispatcher's row movements included); ``"attention"`` the attention block's projections,
    kernel, rotary embedding and q/k norms."""
    T = mb.tokens
    attention = T * spec.attention_flops(mb.seq_len)
    if policy == "full":
        return Recomputed(T * spec.layer_dense_flops(layer), T * spec.layer_expert_flops(layer), attention, traffic)
    if policy == "selective":
        return Recomputed(memory=traffic)
    if policy == "attention":
        width = spec.num_heads * spec.head_dim + spec.num_kv_heads * spec.head_dim
        memory = T * (ROTARY + (NORM if spec.qk_norm else 0)) * width
        return Recomputed(dense_flops=T * 2.0 * spec.attn_params, attention_flops=attention, memory=memory)
    return NOTHING


def head_traffic(spec: ModelSpec, mb: MicroBatch) -> tuple[float, float]:
    """(forward, backward) bytes of the final norm and the loss over the vocabulary: the shifted
    logits' copy (2 + 2), the float32 upcast (2 + 4), log-softmax (three reads and a write of 4);
    backward: the log-softmax gradient (4 + 4 + 4), the downcast (4 + 2), the shifted gradient
    written into a zeroed full-size one (2 + 2 + 2 per position of the unshifted logits)."""
    V, N = spec.vocab_size, mb.predicted
    norm = NORM * spec.hidden_size * mb.tokens
    return norm + 26 * V * N, MEMORY_BACKWARD * norm + 18 * V * N + 6 * V * mb.tokens


def chunked_head_traffic(spec: ModelSpec, mb: MicroBatch) -> tuple[float, float]:
    """(forward, backward) bytes of the final norm and moe_ep's chunked loss: per logit, the bf16
    product and its float32 copy (2 + 2 + 4), log-sum-exp (4), the softmax gradient made in place
    (4 + 4, then 4 + 4) and its bf16 copy for the GEMMs (4 + 2); per chunk, the weight gradient's
    bf16 product added into its float32 sum (2 + 2 + 4 + 4 per weight); backward: the gradients
    scaled by the incoming one (the hidden states' 2 + 2, the weight's 4 + 4 + 2 with its cast)."""
    V, H, T = spec.vocab_size, spec.hidden_size, mb.tokens
    chunks = -(-T // default_chunk_tokens(T, H, V))
    norm = NORM * H * T
    return norm + 34 * V * T + 12 * V * H * chunks, MEMORY_BACKWARD * norm + 4 * H * T + 10 * V * H


def embed_traffic(spec: ModelSpec, mb: MicroBatch) -> tuple[float, float]:
    """(forward, backward) bytes of the embedding: the gather, and in backward the zeroed bf16
    weight gradient and the scatter-add into it."""
    H = spec.hidden_size
    return 2 * BF16 * H * mb.tokens, BF16 * H * spec.vocab_size + 2 * BF16 * H * mb.tokens


# Per step: AdamW over each sharded float32 parameter (read weight, gradient and both moments,
# write weight and moments) and gradient clipping (read for the norm, read and write to scale).
OPTIMIZER_BYTES_PER_PARAM = 7 * FP32 + 3 * FP32
# The same with moe_ep.training.AdamW's bf16 moments, one unfused element-wise op at a time in its
# order: each moment widened (2 + 4) and updated (12; 8 + 12), both stored back (4 + 2 each), the
# root, the bias scale and eps (8 each), the decay (8) and the step (16); then the clipping.
BF16_MOMENTS_OPTIMIZER_BYTES = 6 + 12 + 6 + 8 + 12 + 2 * 6 + 3 * 8 + 8 + 16 + 3 * FP32
# Per gathered parameter and FSDP2 round: the all-gather's copy-out (2 + 2); per reduction: the
# gradient's copy into the float32 reduce-scatter input (2 + 4).
FSDP_GATHER_COPY = 2 * BF16
FSDP_REDUCE_COPY = BF16 + FP32
