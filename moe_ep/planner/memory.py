"""Memory model: what one rank holds, unit by unit (embedding, decoder layers, head), for a layout.

Rows of the table (printed with every plan):
- parameters, gradients, optimizer state: mixed precision as FSDP2 does it, float32 master weights
  sharded over ``dp_shard`` (dense) or ``ep x edp`` (experts; the same count per rank), float32
  gradient shards, AdamW's two float32 moments: 16 bytes per sharded parameter (12 with the
  moments in bf16: ``moe_ep.training.AdamW``, the planner's ``bf16_moments``). With pipeline
  stages the gradient shards are not live at the peak: the step clears them (``set_to_none``),
  FSDP2 accumulates each stage's gradients unsharded over its micro-batches (in its working set,
  below) and makes the shards only when the schedule reduces the stage, after its last backward,
  each stage's accumulation then giving way to its smaller shards
  (``tests/test_pipeline.py`` checks this on the schedules it runs);
- activations kept for the backward: ``moe_ep.planner.activations`` (checked against autograd's
  saved tensors); under pipeline stages the most the rank's stages keep at one moment of their
  schedule, each stage its own micro-batches in flight then (``ScheduleInfo.peak_activations``,
  the order of torch's schedule: the last stage of interleaved 1F1B keeps one where the first
  keep a round);
- backward scratch: the running unit's transient memory, what its recompute makes again, its
  backward's intermediates and, for the head, the logits and their float32 gradient;
- FSDP2 working set: without pipeline stages, the root's gathered embedding and head (kept from the
  forward to the end of the backward) and the head's bf16 gradient, then per running layer its bf16
  weights and the prefetched next layer's, its bf16 gradient, the float32 reduce-scatter input and
  the previous layer's reduce-scatter still in flight (14 bytes per gathered parameter); with
  pipeline stages the stage's bf16 weights and float32 accumulated gradients for the whole step,
  and the running layer's bf16 gradient until it joins the accumulation (the stage's reduction,
  after its last backward, needs no more: see ``PP_TRANSIENT_BYTES``);
- expert all-to-all buffers: the send and receive rows of one exchange;
- pipeline send/recv buffers: an activation and a gradient per stage;
- reserved: the CUDA context, NCCL and allocator fragmentation.

Everything on the expert side (activations, scratch, buffers) is sized for the start-up
imbalance: the busiest rank's routed load over the mean early in dropless training, before the
router has learnt to balance (in capacity mode the padded blocks, whatever the routing).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..dispatch.capacity import expert_capacity
from .activations import (
    MicroBatch, Routed, checkpoint_shared, checkpointed_layer_saved, chunked_head_saved, chunked_head_scratch,
    embed_saved, expected_routed, head_saved, head_scratch, layer_saved, layer_scratch, policy_layer_saved,
)
from .cluster import Cluster
from .comm import Collective, all_to_all_collective, node_all_to_all_collectives, node_shares
from .compute import (
    BF16_MOMENTS_OPTIMIZER_BYTES, OPTIMIZER_BYTES_PER_PARAM, Work, chunked_head_traffic, embed_traffic,
    head_traffic, layer_traffic, recomputed,
)
from .partition import Partition, UnitCost
from .layout import Layout
from .spec import BF16, FP32, ModelSpec

# The busiest expert rank's routed load over the mean: in steady training (step time), and early
# in dropless training (memory; the planner's stated design margin, overridable).
DEFAULT_IMBALANCE = 1.2
DEFAULT_STARTUP_IMBALANCE = 2.0
STATE_BYTES_PER_PARAM = {"params": FP32, "grads": FP32, "optim": 2 * FP32}
BF16_MOMENTS_BYTES = 2 * BF16  # AdamW's two moments in bf16 (moe_ep.training.AdamW)
# Per gathered parameter of the running layer (no pipeline): its bf16 weights and the prefetched
# next layer's, its bf16 gradient, its float32 reduce-scatter input, the previous one in flight.
FSDP_LAYER_BYTES = 2 * BF16 + BF16 + FP32 + FP32
# Held through the step under pipeline stages: bf16 weights and float32 gradient accumulation.
# Transient: a backward's bf16 gradient until FSDP2 adds it to the accumulation. The stage's
# reduction (torch's REDUCE_GRAD action, FSDPParamGroup.post_backward per layer) frees the bf16
# weights before it allocates the float32 reduce-scatter input beside the accumulation it copies
# and then frees, and the output after that (the whole size where a group is not sharded): 2 bytes
# above what the layer held at most, the earlier layers' inputs in flight taking less than the
# 6 they freed. tests/test_fsdp_pipeline_memory.py measures the held bytes and the reduction's
# on the CPU.
PP_HELD_BYTES = BF16 + FP32
PP_TRANSIENT_BYTES = BF16


def max_load(spec: ModelSpec, ep: int) -> float:
    """The most a rank's experts can get, over the mean (dropless): every token of the group
    sending it as many pairs as fit, ``min(K, L)``, against ``K / ep`` on average."""
    return ep * min(spec.top_k, spec.num_experts // ep) / spec.top_k


def routed_counts(spec: ModelSpec, layout: Layout, tokens: int, load: float, capacity_factor: float | None) -> Routed:
    """The dispatcher's counts on the busiest rank: ``load`` x the mean (dropless, at most what the
    routing allows), or capacity mode's fixed padded blocks."""
    ep = layout.ep
    if capacity_factor is None:
        return expected_routed(spec, ep, tokens, min(load, max_load(spec, ep)))
    L, k_max = spec.num_experts // ep, min(spec.top_k, spec.num_experts // ep)
    capacity = expert_capacity(tokens, spec.top_k, spec.num_experts, capacity_factor)
    rows = ep * min(tokens, L * capacity)
    return Routed(rows, rows, min(rows * k_max, ep * L * capacity))


@dataclass(frozen=True)
class Unit:
    """One unit of the chain for one micro-batch, as the busiest rank sees it."""

    name: str
    moe: bool  # a MoE layer: has an all-to-all when ep > 1
    work: Work  # compute of one micro-batch
    params: float  # bytes on one rank
    grads: float  # the float32 gradient shards once the step's backward is done
    peak_grads: float  # of them, live at the peak (none with pipeline stages: see the module docstring)
    optim: float
    optim_traffic: float  # DRAM bytes of the optimizer step (and clipping) over its shards
    act: float  # kept for the backward, per micro-batch in flight
    scratch: float  # transient while its backward runs (recompute set included)
    gathered: float  # parameters this rank gathers for it (the experts' E / ep share)
    held: float  # FSDP2 bytes held through the step for it (pipeline stages: gathered weights, grads)
    fsdp_work: float  # FSDP2 transient bytes while it runs
    a2a_buffers: float  # send and receive rows of one all-to-all
    a2a: tuple[Collective, ...]  # its all-to-alls over one micro-batch (busiest rank); () = none
    shared: frozenset = frozenset()


def build_units(
    spec: ModelSpec, layout: Layout, seq_len: int, imbalance: float = DEFAULT_IMBALANCE, *,
    startup_imbalance: float = DEFAULT_STARTUP_IMBALANCE, capacity_factor: float | None = None,
    backend: str = "triton", node_size: int | None = None, max_nodes: int | None = None,
    chunked_loss: bool = False, bf16_moments: bool = False, compiled_blocks: bool = False,
) -> list[Unit]:
    """The chain's units; ``node_size``: the node-aware dispatch's nodes (None: single-stage);
    ``max_nodes``: node-limited routing's bound on a token's destination nodes (None: none);
    ``chunked_loss``: the head's loss is moe_ep's chunked one (no full logits); ``bf16_moments``:
    AdamW keeps its moments in bf16; ``compiled_blocks``: the layers' dense blocks are compiled
    (their memory-bound bytes; their saved activations are planned as eager's)."""
    mb = MicroBatch(layout.microbatch_size, seq_len)
    T, H, ep, ds = mb.tokens, spec.hidden_size, layout.ep, layout.dp_shard
    policy = layout.checkpointing
    expert_parallel = ep > 1 and spec.num_experts > 0
    steady = routed_counts(spec, layout, T, imbalance, capacity_factor) if expert_parallel else None
    startup = routed_counts(spec, layout, T, startup_imbalance, capacity_factor) if expert_parallel else None
    # The busiest rank's expert FLOPs over the mean: its load, or capacity mode's padded pairs.
    expert_load = steady.pairs / (T * spec.top_k) if expert_parallel else 1.0

    pipelined = layout.pp > 1
    split_backward = pipelined and layout.info.splits_backward
    optim_bytes = BF16_MOMENTS_BYTES if bf16_moments else STATE_BYTES_PER_PARAM["optim"]
    optim_traffic = BF16_MOMENTS_OPTIMIZER_BYTES if bf16_moments else OPTIMIZER_BYTES_PER_PARAM

    def unit(name, dense, expert, work, act, scratch=0.0, moe=False, a2a=(), buffers=0.0, shared=()):
        sharded = (dense + expert) / ds
        gathered = dense + expert / ep
        return Unit(
            name=name, moe=moe, work=work,
            params=sharded * STATE_BYTES_PER_PARAM["params"], grads=sharded * STATE_BYTES_PER_PARAM["grads"],
            peak_grads=0.0 if pipelined else sharded * STATE_BYTES_PER_PARAM["grads"],
            optim=sharded * optim_bytes, optim_traffic=sharded * optim_traffic, act=act, scratch=scratch,
            gathered=gathered,
            held=PP_HELD_BYTES * gathered if pipelined else 0.0,
            fsdp_work=(PP_TRANSIENT_BYTES if pipelined else FSDP_LAYER_BYTES) * gathered,
            a2a_buffers=buffers, a2a=a2a, shared=frozenset(shared),
        )

    tied = ("model.embed_tokens.weight",) if spec.tie_word_embeddings else ()
    fwd, bwd = embed_traffic(spec, mb)
    units = [unit("embed", spec.embed_params, 0, Work(memory_fwd=fwd, memory_bwd=bwd),
                  embed_saved(spec, mb) + (checkpoint_shared(spec, mb) if policy != "none" else 0.0), shared=tied)]
    for i in range(spec.num_layers):
        moe = spec.is_moe_layer(i)
        dense, expert, attention = T * spec.layer_dense_flops(i), T * spec.layer_expert_flops(i), T * spec.attention_flops(seq_len)
        forward, backward = layer_traffic(spec, i, mb, ep, steady, compiled=compiled_blocks)
        work = Work(dense, expert, attention, forward, backward, recomputed(spec, i, mb, policy, forward, layout.recomputes),
                    expert_load)
        full = layer_saved(spec, i, mb, backend, ep, startup)
        saved = policy_layer_saved(spec, i, mb, backend, policy, ep, startup)
        # The recompute makes again what the layer did not keep (its input it kept).
        again = max(0.0, full - saved + checkpointed_layer_saved(spec, mb)) if policy != "none" else 0.0
        scratch = layer_scratch(spec, i, mb, backend, ep, startup, repeatable=split_backward) + again
        a2a, buffers = (), 0.0
        if expert_parallel and moe:
            buffers = BF16 * H * (startup.sent + startup.received)
            if node_size is None:
                a2a = (all_to_all_collective(spec, layout, seq_len, 1, imbalance, capacity_factor),)
            else:
                a2a = tuple(node_all_to_all_collectives(spec, layout, seq_len, 1, node_size, imbalance, max_nodes))
                # Stage 1's rows too: one per (token, node), sent and received.
                node_rows = node_shares(spec, ep, node_size, max_nodes)[0] * T
                buffers += BF16 * H * node_rows * (1 + startup_imbalance)
        units.append(unit(f"layers.{i}", spec.layer_dense_params(i), spec.layer_expert_params(i), work,
                          saved, scratch, moe, a2a, buffers))
    fwd, bwd = (chunked_head_traffic if chunked_loss else head_traffic)(spec, mb)
    head = T * spec.head_flops
    saved, scratch = ((chunked_head_saved, chunked_head_scratch) if chunked_loss else (head_saved, head_scratch))
    units.append(unit("head", spec.head_params, 0, Work(dense_flops=head, memory_fwd=fwd, memory_bwd=bwd),
                      saved(spec, mb), scratch(spec, mb), shared=tied))
    return units


def unit_seconds(unit: Unit, cluster: Cluster) -> float:
    """Compute and all-to-all seconds of one micro-batch through ``unit`` on the busiest rank."""
    return unit.work.seconds(cluster).total + sum(c.seconds(cluster) for c in unit.a2a)


def transient(unit: Unit) -> float:
    """What the memory table charges while ``unit`` runs: its backward scratch, FSDP2's working
    set and the all-to-all buffers."""
    return unit.scratch + unit.fsdp_work + unit.a2a_buffers


def unit_costs(units: list[Unit], cluster: Cluster | None = None) -> list[UnitCost]:
    """The partition's view of ``units``, one unit per decoder layer (see :func:`layer_chain`): the
    cost is the unit's seconds on ``cluster`` (default: a DGX A100 node's figures), its static
    bytes include what a pipeline stage holds gathered through the step, and its transient term is
    what the memory table charges while it runs (``rank_memory``)."""
    cluster = cluster or Cluster(1, 8, 80)
    return layer_chain([
        UnitCost(
            name=u.name, flops=unit_seconds(u, cluster), param_bytes=u.params, grad_bytes=u.peak_grads,
            optim_bytes=u.optim + u.held, act_bytes=u.act, work_bytes=transient(u), shared=u.shared,
        )
        for u in units
    ])


def layer_chain(costs: list[UnitCost]) -> list[UnitCost]:
    """``[embed, layers.0, ..., layers.L-1, head]`` as one unit per decoder layer: the embedding
    rides with the first layer and the head with the last (``embed+layers.0``,
    ``layers.L-1+head``), so every stage passes hidden states of one shape."""
    if len(costs) < 3:
        raise ValueError(f"a chain needs an embedding, at least one decoder layer and a head, got {len(costs)} units")
    embed, layers, head = costs[0], list(costs[1:-1]), costs[-1]
    layers[0] = _merge(embed, layers[0])
    layers[-1] = _merge(layers[-1], head)
    return layers


def _merge(a: UnitCost, b: UnitCost) -> UnitCost:
    return UnitCost(
        name=f"{a.name}+{b.name}", flops=a.flops + b.flops, param_bytes=a.param_bytes + b.param_bytes,
        grad_bytes=a.grad_bytes + b.grad_bytes, optim_bytes=a.optim_bytes + b.optim_bytes,
        act_bytes=a.act_bytes + b.act_bytes, work_bytes=max(a.work_bytes, b.work_bytes), shared=a.shared | b.shared,
    )


def layer_ids(names: list[str]) -> list[int]:
    """Decoder-layer indices in a stage's unit names (``embed+layers.0``, ``layers.5``, ...)."""
    return [int(part.split(".")[1]) for name in names for part in name.split("+") if part.startswith("layers.")]


@dataclass(frozen=True)
class MemoryTable:
    """Bytes on one pipeline rank at its peak."""

    rank: int  # pipeline rank it describes
    params: float
    grads: float  # the gradient shards once the backward is done
    peak_grads: float  # of them, live at the peak
    optim: float
    activations: float
    scratch: float
    fsdp: float
    all_to_all: float
    p2p: float
    reserved: float
    capacity: float
    inflight: float  # micro-batches whose activations the fullest stage keeps at the rank's peak
    scratch_unit: str  # the unit whose backward peaks
    bf16_moments: bool = False  # AdamW's moments in bf16 (the optimizer state's row says which)

    @property
    def total(self) -> float:
        return (self.params + self.peak_grads + self.optim + self.activations + self.scratch + self.fsdp
                + self.all_to_all + self.p2p + self.reserved)

    @property
    def headroom(self) -> float:
        return self.capacity - self.total

    @property
    def fits(self) -> bool:
        return self.headroom >= 0

    # Names of ``rows``' entries, in their order, that do not change with the plan (the labels
    # carry the micro-batches in flight, the scratch's unit): the JSON's keys.
    KEYS = ("params", "grads", "optim", "activations", "scratch", "fsdp", "all_to_all", "p2p", "reserved", "total",
            "headroom")

    def rows(self) -> list[tuple[str, float]]:
        inflight = f"{self.inflight:g} micro-batch{'es' if self.inflight != 1 else ''} in flight"
        return [
            ("parameters (fp32 master shards)", self.params),
            ("gradients (fp32 shards)" if self.peak_grads == self.grads
             else "gradients (fp32 shards, made after the peak)", self.peak_grads),
            (f"optimizer state (AdamW, 2 x {'bf16' if self.bf16_moments else 'fp32'})", self.optim),
            (f"activations kept for backward ({inflight})", self.activations),
            (f"backward scratch ({self.scratch_unit})", self.scratch),
            ("FSDP2 working set (gathered weights, grads, RS in flight)", self.fsdp),
            ("expert all-to-all buffers", self.all_to_all),
            ("pipeline send/recv buffers", self.p2p),
            ("reserved (CUDA context, NCCL, fragmentation)", self.reserved),
            ("total", self.total),
            ("headroom", self.headroom),
        ]


def p2p_bytes(layout: Layout, spec: ModelSpec, seq_len: int) -> float:
    """Pipeline send and receive buffers of one rank: an activation and its gradient per stage."""
    if layout.pp == 1:
        return 0.0
    return 2 * layout.stages_per_rank * layout.microbatch_size * seq_len * spec.hidden_size * BF16


def root_bytes(units: list[Unit], pipelined: bool) -> float:
    """Without pipeline stages FSDP2's root keeps the embedding and head gathered from the forward
    to the end of the backward (``reshard_after_forward=False``), and the head's bf16 gradient from
    its backward on; with stages every unit's weights stay gathered anyway (``Unit.held``)."""
    if pipelined:
        return 0.0
    return sum(BF16 * u.gathered * (2 if u.name == "head" else 1) for u in units if u.name in ("embed", "head"))


def rank_memory(units: list[Unit], part: Partition, rank: int, layout: Layout, p2p: float, reserved: float,
                capacity: float, bf16_moments: bool = False) -> MemoryTable:
    """The memory table of pipeline rank ``rank``; ``part`` cuts ``unit_costs(units)``. Its total
    is the partition's bytes of the rank's stages plus the pipeline buffers, the reserve and the
    root's gathered embedding and head (:func:`root_bytes`)."""
    stages = part.stages_of_rank(rank)
    mine = [(s, u) for s in stages for u in stage_units(units, part, s)]
    # One unit runs at a time: its transient terms make the peak.
    _, running = max(mine, key=lambda su: transient(su[1]))
    held = sum(u.held for _, u in mine) + root_bytes([u for _, u in mine], layout.pp > 1)
    act_by_stage = {s: sum(u.act for t, u in mine if t == s) for s in stages}
    if layout.pp > 1:
        # The most the rank's stages keep at one moment of its schedule, each stage its own
        # micro-batches in flight then (on interleaved 1F1B's last rank its last stage holds one).
        activations, inflight = layout.info.peak_activations(layout.pp, layout.microbatches, rank, act_by_stage)
    else:
        activations, inflight = sum(act_by_stage.values()), 1.0
    return MemoryTable(
        rank=rank,
        params=sum(u.params for _, u in mine),
        grads=sum(u.grads for _, u in mine),
        peak_grads=sum(u.peak_grads for _, u in mine),
        optim=sum(u.optim for _, u in mine),
        activations=activations,
        scratch=running.scratch,
        fsdp=held + running.fsdp_work,
        all_to_all=running.a2a_buffers,
        p2p=p2p,
        reserved=reserved,
        capacity=capacity,
        inflight=inflight,
        scratch_unit=running.name,
        bf16_moments=bf16_moments,
    )


def stage_units(units: list[Unit], part: Partition, stage: int) -> list[Unit]:
    """The planner units (embedding, layers, head) of one stage of a cut of ``unit_costs(units)``."""
    by_name = {u.name: u for u in units}
    return [by_name[piece] for name in part.stage_names(stage) for piece in name.split("+")]
