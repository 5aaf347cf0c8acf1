"""Every collective one rank issues in one optimizer step, with its bytes, and its time on the
cluster's links.

FSDP2 / HSDP (``moe_ep.parallel.fsdp``): each decoder layer is two FSDP units, its block's dense
parameters over ``dp_shard`` and its experts over ``edp`` (ranks ``ep`` apart); the root unit
holds the embedding, the final norm and the LM head. A unit's all-gather outputs its bf16
parameters (the experts' ``E / ep`` share of them), its reduce-scatter takes their float32
gradients, and with ``dp_replicate > 1`` an all-reduce sums the float32 gradient shard across the
replicas. Without pipeline stages every micro-batch gathers each block twice (forward, and again
for the backward after resharding) and the root once, and reduces each unit once; with pipeline
stages the weights stay gathered and the gradients are reduced once per step. (FSDP2 pads each
parameter's first dimension to a multiple of the group; the planner does not: Mixtral-8x7B's
8-row router over 128 ranks makes its dense all-gathers 1.1% larger than counted here.)

Expert all-to-all (``moe_ep.dispatch``): per MoE layer and micro-batch, forward: the count
exchange (``L`` int32 per peer, ``L + 2`` when rows can carry several experts), the rows (a token
goes once to each rank holding one of its experts), the multi rows' routing columns (float32
weight and int32 id per expert) and the combine's rows back; backward: the combine's and the
dispatch's rows again and the routing weights' float32 gradients; a layer recomputed by a policy
that runs the dispatcher again (``"full"``, ``"selective"``) repeats the forward. Bytes are those
sent to other ranks; the busiest rank receives ``load`` times the mean.
With the node-aware dispatch (``moe_ep.dispatch.nodes``: an ep group over several whole nodes,
dropless) the same exchanges run twice, over the inter-node group (``ep-inter``: one row per
token and destination node, each node standing for a rank holding ``node_size L`` experts) and
over the node (``ep-intra``: one row per token and destination rank, as the single-stage
dispatch, its routing columns ``min(K, L)``); the inter-node count exchange also carries each
node's ranks' stage-2 counts (``node_size`` times the intra-node columns per peer node).

Pipeline: each stage sends its output forward and its input's gradient back, per micro-batch, to
a stage on another rank (two stages of one rank pass them in memory)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..dispatch.capacity import expert_capacity
from ..dispatch.wire_bytes import count_columns
from .partition import Partition
from .activations import I32, rank_shares
from .cluster import Cluster
from .layout import Layout
from .recompute import RERUN_DISPATCH
from .spec import BF16, FP32, ModelSpec


@dataclass(frozen=True)
class Collective:
    """One kind of collective of one rank over one step. ``bytes``: summed over its calls, the
    gathered output of an all-gather, the input of a reduce-scatter, the tensor of an all-reduce,
    what an all-to-all or a send moves to other ranks."""

    kind: str  # all-gather, reduce-scatter, all-reduce, all-to-all, send
    group: str  # dp_shard, edp, dp_replicate, ep (ep-inter, ep-intra: node-aware), pp
    size: int
    stride: int
    calls: float
    bytes: float

    @property
    def wire_bytes(self) -> float:
        """What one rank puts on the wire (ring algorithms for the gather, scatter and reduce)."""
        n = self.size
        if self.kind in ("all-gather", "reduce-scatter"):
            return self.bytes * (n - 1) / n
        if self.kind == "all-reduce":
            return 2 * self.bytes * (n - 1) / n
        return self.bytes

    def seconds(self, cluster: Cluster) -> float:
        if self.size == 1 or not self.bytes:
            return 0.0
        if self.kind == "all-to-all":
            per_call = self.bytes / self.calls
            return self.calls * cluster.all_to_all_seconds(per_call, self.size, self.stride)
        if self.kind == "send":
            return self.bytes / cluster.p2p_bandwidth(self.size, self.stride)
        return self.wire_bytes / cluster.bandwidth(self.size, self.stride)


@dataclass(frozen=True)
class FsdpUnit:
    """An FSDP2 unit of one rank: its gathered parameter count and the mesh it is sharded on."""

    name: str
    params: float  # parameters it gathers on this rank (the experts' E / ep share)
    experts: bool
    root: bool  # resharded only at the end of the backward: gathered once per micro-batch


def fsdp_units(spec: ModelSpec, layout: Layout, unit_names: list[str]) -> list[FsdpUnit]:
    """The FSDP units of a pipeline rank holding the planner units ``unit_names``."""
    units, root = [], 0.0
    for name in unit_names:
        if name == "embed":
            root += spec.embed_params
        elif name == "head":
            root += spec.head_params
        else:
            i = int(name.split(".")[1])
            units.append(FsdpUnit(name, spec.layer_dense_params(i), False, False))
            if spec.layer_expert_params(i):
                units.append(FsdpUnit(name + ".experts", spec.layer_expert_params(i) / layout.ep, True, False))
    if root:
        units.append(FsdpUnit("root", root, False, True))
    return units


def fsdp_collectives(spec: ModelSpec, layout: Layout, unit_names: list[str]) -> list[Collective]:
    per_step = layout.microbatches if layout.pp == 1 else 1
    groups = {False: ("dp_shard", layout.dp_shard, 1), True: ("edp", layout.edp, layout.ep)}
    out = []
    for experts in (False, True):
        mine = [u for u in fsdp_units(spec, layout, unit_names) if u.experts == experts]
        if not mine:
            continue
        name, size, stride = groups[experts]
        gathers = [(1 if u.root or layout.pp > 1 else 2) * per_step for u in mine]
        out.append(Collective("all-gather", name, size, stride, sum(gathers),
                              sum(g * BF16 * u.params for g, u in zip(gathers, mine))))
        params = sum(u.params for u in mine)
        out.append(Collective("reduce-scatter", name, size, stride, per_step * len(mine), per_step * FP32 * params))
        if layout.dp_replicate > 1:
            out.append(Collective("all-reduce", "dp_replicate", layout.dp_replicate, layout.dp_shard,
                                  per_step * len(mine), per_step * FP32 * params / size))
    return out


def _exchange_collective(group: str, size: int, stride: int, experts_per_rank: int, top_k: int, hidden: int,
                         rows: float, multi: float, layer_passes: int, layout: Layout,
                         columns_extra: int = 0) -> Collective:
    """The exchanges of one dispatch stage over ``layer_passes`` layer runs: ``rows`` hidden rows and
    ``multi`` rows carrying several experts sent to other ranks per forward (their combine
    returns as many), ``experts_per_rank`` experts per destination, ``top_k`` columns per row."""
    k_max = min(top_k, experts_per_rank)
    columns = count_columns(experts_per_rank, top_k) + columns_extra
    forward_calls = 3 + (k_max > 1)
    forward = I32 * columns * (size - 1) + 2 * BF16 * hidden * rows + 2 * FP32 * k_max * multi
    backward = 2 * BF16 * hidden * rows + FP32 * k_max * multi
    # Each recompute runs the dispatcher again.
    passes = 1 + (layout.recomputes if layout.checkpointing in RERUN_DISPATCH else 0)
    per_layer = passes * forward + backward
    calls = passes * forward_calls + 2 + (k_max > 1)
    return Collective("all-to-all", group, size, stride, layer_passes * calls, layer_passes * per_layer)


def all_to_all_collective(spec: ModelSpec, layout: Layout, seq_len: int, layer_passes: int, load: float = 1.0,
                          capacity_factor: float | None = None) -> Collective | None:
    """The expert all-to-alls of ``layer_passes`` runs (forward and backward) of a MoE layer over a
    micro-batch, on a rank whose experts receive ``load`` times the mean rows (single-stage)."""
    ep = layout.ep
    if ep == 1 or not layer_passes:
        return None
    E, K = spec.num_experts, spec.top_k
    L = E // ep
    T = layout.microbatch_size * seq_len
    if capacity_factor is None:
        rows_per_token, multi_per_token = rank_shares(spec, ep)
        # Rows to the other ranks: each rank holds a given token's expert equally often.
        rows = load * T * rows_per_token * (ep - 1) / ep
        multi = load * T * multi_per_token * (ep - 1) / ep
    else:
        # Capacity mode exchanges fixed blocks: ceil(c T K / E) slots per expert, L experts per peer.
        capacity = expert_capacity(T, K, E, capacity_factor)
        rows = (ep - 1) * min(T, L * capacity)
        multi = (ep - 1) * min(T, L * capacity // 2) if min(K, L) > 1 else 0.0
    # Capacity mode: each rank's token count rides with the counts.
    return _exchange_collective("ep", ep, 1, L, K, spec.hidden_size, rows, multi, layer_passes, layout,
                                columns_extra=int(capacity_factor is not None))


def node_shares(spec: ModelSpec, ep: int, node_size: int, max_nodes: int | None = None) -> tuple[float, float]:
    """``rank_shares`` over the nodes of an ep group (a token's destination nodes, and those that
    hold two or more of its experts), under node-limited routing when ``max_nodes`` is given: the
    token's experts then lie, uniformly, among the experts of ``max_nodes`` nodes."""
    nodes = ep // node_size
    if max_nodes is None or max_nodes >= nodes:
        return rank_shares(spec, nodes)
    return rank_shares(replace(spec, num_experts=max_nodes * (spec.num_experts // nodes)), max_nodes)


def node_all_to_all_collectives(spec: ModelSpec, layout: Layout, seq_len: int, layer_passes: int, node_size: int,
                                load: float = 1.0, max_nodes: int | None = None) -> list[Collective]:
    """The node-aware dispatch's all-to-alls (inter-node, then intra-node) of ``layer_passes`` runs
    of a MoE layer over a micro-batch, its ep group split into nodes of ``node_size`` ranks; the
    forwarding rank of a node receives ``load`` times the mean rows. ``max_nodes``: node-limited
    routing (fewer destination nodes per token; the ranks inside them as before)."""
    ep = layout.ep
    if ep == 1 or not layer_passes:
        return []
    E, K, H = spec.num_experts, spec.top_k, spec.hidden_size
    nodes, T = ep // node_size, layout.microbatch_size * seq_len
    # Stage 1: the nodes are the "ranks" (node_size L experts each), one row per destination node.
    node_rows, node_multi = node_shares(spec, ep, node_size, max_nodes)
    share = (nodes - 1) / nodes
    # Stage 1's counts carry, per node, what its forwarding rank will send to each rank of it.
    rank_columns = count_columns(E // ep, K)
    inter = _exchange_collective("ep-inter", nodes, node_size, E // nodes, K, H, load * T * node_rows * share,
                                 load * T * node_multi * share, layer_passes, layout,
                                 columns_extra=node_size * rank_columns)
    # Stage 2: a forwarding rank holds one row per (token, node) and sends one per (token, rank):
    # over the node's ranks, as many as the single-stage dispatch, a share (G - 1) / G of them away.
    if max_nodes is None or max_nodes >= nodes:
        rank_rows, rank_multi = rank_shares(spec, ep)
    else:  # the token's experts among max_nodes nodes' ranks
        rank_rows, rank_multi = rank_shares(replace(spec, num_experts=max_nodes * (E // nodes)), max_nodes * node_size)
    share = (node_size - 1) / node_size
    intra = _exchange_collective("ep-intra", node_size, 1, E // ep, min(K, E // nodes), H,
                                 load * T * rank_rows * share, load * T * rank_multi * share, layer_passes,
                                 layout)
    return [inter, intra]


def p2p_collective(spec: ModelSpec, layout: Layout, part: Partition, rank: int, seq_len: int) -> Collective | None:
    """Activations forward and their gradients back, to stages on other ranks, over a step."""
    if layout.pp == 1:
        return None
    S = part.num_stages
    sends = 0
    for s in part.stages_of_rank(rank):
        sends += s + 1 < S and part.rank_of_stage(s + 1) != rank
        sends += s > 0 and part.rank_of_stage(s - 1) != rank
    tensor = BF16 * layout.microbatch_size * seq_len * spec.hidden_size
    calls = layout.microbatches * sends
    return Collective("send", "pp", layout.pp, layout.dp, calls, calls * tensor)


def step_collectives(spec: ModelSpec, layout: Layout, part: Partition, rank: int, unit_names: list[str],
                     seq_len: int, load: float = 1.0, capacity_factor: float | None = None) -> list[Collective]:
    """Every collective of pipeline rank ``rank`` (holding the planner units ``unit_names``) in one
    step, its experts receiving ``load`` times the mean rows."""
    moe_layers = sum(spec.is_moe_layer(int(n.split(".")[1])) for n in unit_names if n.startswith("layers."))
    out = fsdp_collectives(spec, layout, unit_names)
    extra = [all_to_all_collective(spec, layout, seq_len, layout.microbatches * moe_layers, load, capacity_factor),
             p2p_collective(spec, layout, part, rank, seq_len)]
    return out + [c for c in extra if c is not None]
