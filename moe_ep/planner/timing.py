"""Step-time model: the slowest rank's seconds per optimizer step.

- Compute (``moe_ep.planner.compute``): GEMMs, attention and memory-bound kernels at the cluster's
  stated efficiencies, the routed experts at the busiest rank's load; the optimizer step and
  FSDP2's copies in and out of its collectives' buffers as memory-bound work.
- Expert all-to-all (``moe_ep.planner.comm``): on the critical path, at the busiest rank's load;
  with ``overlap_chunks`` > 1 (``parallelize(overlap_chunks=...)``) only what the chunks' experts
  do not hide (``exposed_exchange_seconds``).
- FSDP/HSDP without pipeline stages, every micro-batch: a unit's all-gather overlaps the previous
  unit's forward, and in the backward the previous unit's all-gather and this unit's
  reduce-scatter (and HSDP all-reduce) overlap its backward; the first all-gathers (the root's
  and the first layer's) and the last reductions (the first layer's and the root's) have nothing
  to hide behind. A collective sharing its links with the expert all-to-all (both inside a node,
  or both across nodes) can hide only behind compute, otherwise also behind the all-to-all.
- FSDP/HSDP with pipeline stages, once per step: the all-gathers overlap the first micro-batch's
  forward (the first one exposed), the reductions run after the stage's last backward, exposed.
- Pipeline: sends to stages on other ranks charged in full; bubble from the schedule
  (``moe_ep.planner.schedules``) in units of the slowest rank's micro-batch time. Under DualPipeV
  and interleaved 1F1B with overlap the forwards that run beside another micro-batch's backward
  (``overlapped_share``) expose only the exchanges that outlast the rank's compute.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from .partition import Partition
from .cluster import Cluster
from .comm import Collective, fsdp_units, p2p_collective
from .compute import FSDP_GATHER_COPY, FSDP_REDUCE_COPY, Seconds
from .layout import Layout
from .memory import Unit, stage_units
from .recompute import RERUN_DISPATCH
from .spec import BF16, FP32, ModelSpec


def exposed_exchange_seconds(exchange: float, experts: float, chunks: int) -> float:
    """The seconds one pass of a MoE layer's exchanges adds to its ``experts`` seconds when the
    layer runs in ``chunks`` pipelined chunks (``moe_ep.dispatch.overlap``): the dispatch and the
    combine are each half of ``exchange``, a chunk a ``1 / chunks`` share of each and of the
    experts; the links and the GPU each run one thing at a time, in the layer's order (every
    chunk's dispatch, then per chunk its experts and its combine). One chunk: all of
    ``exchange``; two, behind experts slower than the exchanges: only the first chunk's dispatch
    and the last chunk's combine, a quarter of ``exchange`` each. The count exchange is counted in
    ``exchange`` as if it could be hidden too (it cannot, but it is a few bytes per peer). The
    node-aware layer's two links: ``exposed_node_exchange_seconds``."""
    dispatch = combine = exchange / 2 / chunks
    link = gpu = 0.0  # when each is next free
    dispatched = []
    for _ in range(chunks):
        link += dispatch
        dispatched.append(link)
    for arrived in dispatched:
        gpu = max(gpu, arrived) + experts / chunks
        link = max(link, gpu) + combine
    return max(link, gpu) - experts


def exposed_node_exchange_seconds(network: float, node: float, experts: float, chunks: int) -> float:
    """``exposed_exchange_seconds`` for the node-aware layer, whose exchanges run on two links:
    ``network`` seconds over the inter-node group (stage 1 and its return), ``node`` inside the
    node (stage 2 and its return), each half dispatch and half combine, in the order
    ``moe_ep.dispatch.overlap`` issues them: every chunk's stage 1 at once; a chunk's stage 2
    once its stage 1 arrived and the previous chunk's experts ended; its experts once its stage 2
    arrived and the previous chunk's in-node return did (whose network return is issued then);
    its in-node return when they end; the last chunk's network return after its in-node one."""
    s1 = c1 = network / 2 / chunks
    s2 = c2 = node / 2 / chunks
    net = link = gpu = 0.0  # when the network, the in-node link and the GPU are next free
    arrived = []
    for _ in range(chunks):
        net += s1
        arrived.append(net)
    in_node_done = None  # the previous chunk's in-node return
    for i in range(chunks):
        link = max(link, arrived[i], gpu if i else 0.0) + s2
        start = link
        if in_node_done is not None:
            start = max(start, in_node_done)
            net = max(net, in_node_done) + c1
        gpu = max(gpu, start) + experts / chunks
        link = max(link, gpu) + c2
        in_node_done = link
    net = max(net, in_node_done) + c1
    return max(net, link, gpu) - experts


def exchange_seconds(unit: Unit, cluster: Cluster, layout: Layout, overlap_chunks: int = 1) -> float:
    """A unit's all-to-all seconds over a micro-batch that its experts do not hide: its forward,
    its backward (twice the experts' FLOPs) and, where the recompute policy runs the dispatcher
    again, the forward again (with the experts' GEMMs under "full", without under "selective",
    which keeps their outputs), each pass an equal share of the bytes."""
    exchange = sum(c.seconds(cluster) for c in unit.a2a)
    if overlap_chunks == 1 or not exchange:
        return exchange
    experts = unit.work.seconds(cluster).grouped
    shares = {"full": (1, 1, 2), "selective": (1, 0, 2)}.get(layout.checkpointing, (1, 2))
    network = sum(c.seconds(cluster) for c in unit.a2a if c.group == "ep-inter")
    if network:  # node-aware
        node = exchange - network
        return sum(exposed_node_exchange_seconds(network / len(shares), node / len(shares),
                                                 experts * share / sum(shares), overlap_chunks) for share in shares)
    return sum(exposed_exchange_seconds(exchange / len(shares), experts * share / sum(shares), overlap_chunks)
               for share in shares)


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step on the slowest rank; the rows add up to ``total``."""

    compute: Seconds  # GEMMs, attention, memory-bound kernels (incl. recompute, optimizer, FSDP copies)
    all_to_all: float
    fsdp_exposed: float
    p2p: float
    bubble: float
    fsdp_traffic: float  # all FSDP/HSDP time, hidden or not
    model_flops: float  # useful FLOPs of the whole step over all ranks, without recompute
    ideal: float  # the slowest rank's model FLOPs at the stated efficiencies
    losses: dict = field(default_factory=dict)  # compute seconds beyond ``ideal``, by cause

    @property
    def total(self) -> float:
        return self.compute.total + self.all_to_all + self.fsdp_exposed + self.p2p + self.bubble

    def rows(self) -> list[tuple[str, float]]:
        return [
            ("dense GEMMs", self.compute.dense),
            ("grouped GEMMs (experts, busiest rank)", self.compute.grouped),
            ("attention", self.compute.attention),
            ("memory-bound kernels (incl. optimizer)", self.compute.memory),
            ("expert all-to-all", self.all_to_all),
            ("FSDP/HSDP traffic not hidden", self.fsdp_exposed),
            ("pipeline send/recv", self.p2p),
            ("pipeline bubble", self.bubble),
            ("total", self.total),
        ]

    def mfu(self, cluster: Cluster) -> float:
        return self.model_flops / (self.total * cluster.world_size * cluster.peak_flops)

    def mfu_ceiling(self, cluster: Cluster) -> float:
        """MFU if the slowest rank only ran its model FLOPs at the stated efficiencies."""
        return self.mfu(cluster) * self.total / self.ideal


@functools.lru_cache(maxsize=65536)
def _fsdp_seconds(params: float, size: int, stride: int, dp_replicate: int, dp_shard: int,
                  cluster: Cluster) -> tuple[float, float]:
    """(all-gather, reduce-scatter + HSDP all-reduce) seconds of an FSDP unit of ``params``
    gathered parameters sharded over ``size`` ranks ``stride`` apart."""
    gather = Collective("all-gather", "", size, stride, 1, BF16 * params).seconds(cluster)
    reduce = Collective("reduce-scatter", "", size, stride, 1, FP32 * params).seconds(cluster)
    if dp_replicate > 1:
        reduce += Collective("all-reduce", "", dp_replicate, dp_shard, 1, FP32 * params / size).seconds(cluster)
    return gather, reduce


def _unit_collectives(spec: ModelSpec, layout: Layout, unit: Unit, cluster: Cluster) -> tuple[float, float]:
    """(all-gather, reduction) seconds of the FSDP units of one planner unit."""
    gather = reduce = 0.0
    for f in fsdp_units(spec, layout, [unit.name]):
        size, stride = (layout.edp, layout.ep) if f.experts else (layout.dp_shard, 1)
        g, r = _fsdp_seconds(f.params, size, stride, layout.dp_replicate, layout.dp_shard, cluster)
        gather, reduce = gather + g, reduce + r
    return gather, reduce


def _contends(layout: Layout, cluster: Cluster) -> bool:
    """Whether FSDP's traffic shares links with the expert all-to-all."""
    if layout.ep == 1:
        return False
    a2a_local = cluster.intra_node(layout.ep, 1)
    return any(cluster.intra_node(size, stride) == a2a_local
               for size, stride in ((layout.dp_shard, 1), (layout.edp, layout.ep)) if size > 1)


def _fsdp_without_pipeline(spec, layout, units, cluster) -> tuple[float, float]:
    """(exposed, total) FSDP seconds of one micro-batch without pipeline stages."""
    contends = _contends(layout, cluster)
    passes = 1 + (layout.recomputes if layout.checkpointing in RERUN_DISPATCH else 0)
    root_gather = root_reduce = head_backward = 0.0
    layers = []  # (all-gather, reductions, forward window, backward window) per decoder layer
    for u in units:
        gather, reduce = _unit_collectives(spec, layout, u, cluster)
        fwd = u.work.forward_seconds(cluster).total
        bwd = u.work.seconds(cluster).total - fwd
        if u.name in ("embed", "head"):
            root_gather, root_reduce = root_gather + gather, root_reduce + reduce
            head_backward += bwd if u.name == "head" else 0.0
            continue
        a2a = sum(c.seconds(cluster) for c in u.a2a)
        # The all-to-all's share per pass: forward, backward, and each recompute's forward.
        a2a_pass = 0.0 if contends else a2a / (passes + 1)
        layers.append((gather, reduce, fwd + a2a_pass, bwd + passes * a2a_pass))
    total = root_gather + root_reduce + sum(2 * g + r for g, r, _, _ in layers)
    if not layers:
        return total, total
    # Forward: the root's and the first layer's all-gathers have nothing before them; each other
    # layer's hides behind the previous layer's forward.
    exposed = root_gather + layers[0][0]
    for (gather, _, _, _), (_, _, fwd_window, _) in zip(layers[1:], layers[:-1]):
        exposed += max(0.0, gather - fwd_window)
    # Backward: the last layer's all-gather behind the head's backward; during layer i's backward
    # layer i-1's all-gather and layer i+1's reductions; the first layer's and the root's
    # reductions after everything.
    exposed += max(0.0, layers[-1][0] - head_backward)
    for i, (_, _, _, bwd_window) in enumerate(layers):
        previous = layers[i - 1][0] if i > 0 else 0.0
        following = layers[i + 1][1] if i + 1 < len(layers) else 0.0
        exposed += max(0.0, previous + following - bwd_window)
    return exposed + layers[0][1] + root_reduce, total


def _fsdp_with_pipeline(spec, layout, mine, cluster) -> tuple[float, float]:
    """(exposed, total) FSDP seconds of one step of a pipeline rank holding ``mine``."""
    collectives = [_unit_collectives(spec, layout, u, cluster) for u in mine]
    gathers = [g for g, _ in collectives]
    reductions = sum(r for _, r in collectives)
    forward = sum(u.work.forward_seconds(cluster).total for u in mine)
    exposed = gathers[0] + max(0.0, sum(gathers[1:]) - forward) + reductions
    return exposed, sum(gathers) + reductions


def _per_step_memory_seconds(layout: Layout, mine: list[Unit], cluster: Cluster) -> float:
    """The optimizer over the rank's shards, and FSDP2's copies into and out of its buffers."""
    rounds = layout.microbatches if layout.pp == 1 else 1
    gathers = 2 if layout.pp == 1 else 1
    gathered = sum(u.gathered for u in mine)
    copies = rounds * gathered * (gathers * FSDP_GATHER_COPY + FSDP_REDUCE_COPY)
    optimizer = sum(u.optim_traffic for u in mine)
    return (optimizer + copies) / (cluster.hbm_bytes_per_s * cluster.efficiencies.memory)


def _losses(mine: list[Unit], cluster: Cluster, scale: float) -> dict[str, float]:
    out: dict[str, float] = {}
    for u in mine:
        for name, seconds in u.work.losses(cluster).items():
            out[name] = out.get(name, 0.0) + scale * seconds
    return out


def step_time(
    spec: ModelSpec, cluster: Cluster, layout: Layout, units: list[Unit], part: Partition, seq_len: int,
    overlap_chunks: int = 1,
) -> StepTime:
    m = layout.microbatches
    model_flops = sum(u.work.model_flops for u in units) * m * layout.dp

    def rank_units(rank):
        return [u for s in part.stages_of_rank(rank) for u in stage_units(units, part, s)]

    def per_microbatch(mine):
        compute = Seconds()
        for u in mine:
            compute = compute + u.work.seconds(cluster)
        a2a = sum(exchange_seconds(u, cluster, layout, overlap_chunks) for u in mine)
        return compute, a2a

    if layout.pp == 1:
        compute, a2a = per_microbatch(units)
        exposed, traffic = _fsdp_without_pipeline(spec, layout, units, cluster)
        extra = _per_step_memory_seconds(layout, units, cluster)
        losses = _losses(units, cluster, m)
        losses["memory-bound kernels"] += extra
        return StepTime(
            compute=compute * m + Seconds(memory=extra), all_to_all=m * a2a, fsdp_exposed=m * exposed, p2p=0.0,
            bubble=0.0, fsdp_traffic=m * traffic, model_flops=model_flops,
            ideal=m * sum(u.work.ideal_seconds(cluster) for u in units), losses=losses,
        )

    ranks = []
    for r in range(layout.pp):
        mine = rank_units(r)
        compute, a2a = per_microbatch(mine)
        overlapped = layout.info.overlapped_share(layout.pp, m, r)
        if overlapped:
            # Beside another micro-batch's backward an exchange hides behind that compute; what
            # the link carries beyond it stays exposed.
            whole = sum(exchange_seconds(u, cluster, layout) for u in mine)
            a2a = (1 - overlapped) * a2a + overlapped * max(0.0, whole - compute.total)
        p2p = p2p_collective(spec, layout, part, r, seq_len)
        p2p_seconds = p2p.seconds(cluster) / m if p2p is not None else 0.0
        ranks.append((mine, compute, a2a, p2p_seconds))
    slowest = max(ranks, key=lambda r: r[1].total + r[2] + r[3])
    mine, compute, a2a, p2p = slowest
    exposed, traffic = max(_fsdp_with_pipeline(spec, layout, rank[0], cluster) for rank in ranks)
    extra = _per_step_memory_seconds(layout, mine, cluster)
    losses = _losses(mine, cluster, m)
    losses["memory-bound kernels"] += extra
    return StepTime(
        compute=compute * m + Seconds(memory=extra), all_to_all=m * a2a, fsdp_exposed=exposed, p2p=m * p2p,
        bubble=layout.bubble() * (compute.total + a2a + p2p), fsdp_traffic=traffic, model_flops=model_flops,
        ideal=m * sum(u.work.ideal_seconds(cluster) for u in mine), losses=losses,
    )
