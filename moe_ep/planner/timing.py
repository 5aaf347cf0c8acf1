"""Step-time model.

- Compute: FLOPs at ``Cluster.efficiency`` of the bf16 peak; backward = 2 x forward, a
  checkpointed layer runs its forward twice.
- Expert all-to-all: per MoE layer and micro-batch a dispatch and a combine forward, the same
  backward, again under recompute; a token travels once to each remote rank that holds one of
  its experts (uniform routing), the busiest rank carries ``imbalance`` times the mean; on the
  critical path.
- FSDP/HSDP: ring all-gather of bf16 weights, reduce-scatter of fp32 gradients, all-reduce of
  the fp32 gradient shards over ``dp_replicate``; each group at the bandwidth of the links it
  spans. Without pipeline stages this happens every micro-batch (forward gather, backward
  gather, reduce) and overlaps compute: a micro-batch costs max(compute, FSDP) + all-to-all.
  With pipeline stages gradients sync once per step: the gather overlaps the first micro-batch
  forward, the reduction at the end of the step is exposed.
- Pipeline: point-to-point activations and gradients charged in full; bubble from the schedule
  (moe_ep.planner.schedules).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .partition import Partition
from .cluster import Cluster
from .layout import Layout
from .memory import Unit, stage_units
from .spec import BF16, FP32, ModelSpec


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step on the slowest rank; the parts add up to ``total``."""

    compute: float
    all_to_all: float
    fsdp_exposed: float
    p2p: float
    bubble: float
    fsdp_traffic: float  # all FSDP/HSDP time, hidden or not
    model_flops: float  # 6 N T-style useful FLOPs of the whole step, without recompute

    @property
    def total(self) -> float:
        return self.compute + self.all_to_all + self.fsdp_exposed + self.p2p + self.bubble

    def rows(self) -> list[tuple[str, float]]:
        return [
            ("compute (incl. recompute)", self.compute),
            ("expert all-to-all", self.all_to_all),
            ("FSDP/HSDP traffic not hidden", self.fsdp_exposed),
            ("pipeline send/recv", self.p2p),
            ("pipeline bubble", self.bubble),
            ("total", self.total),
        ]


def remote_ranks_per_token(spec: ModelSpec, ep: int) -> float:
    """Expected number of other ranks a token is sent to, with top-k over E experts uniform and
    E / ep experts per rank."""
    if ep == 1 or not spec.num_experts:
        return 0.0
    per_rank = spec.num_experts // ep
    missed = math.comb(spec.num_experts - per_rank, spec.top_k) / math.comb(spec.num_experts, spec.top_k)
    return (ep - 1) * (1.0 - missed)


def _all_to_all_seconds(spec: ModelSpec, cluster: Cluster, layout: Layout, tokens: int, imbalance: float) -> float:
    """All-to-all time of one MoE layer for one micro-batch, forward, backward and recompute."""
    per_call = imbalance * tokens * remote_ranks_per_token(spec, layout.ep) * spec.hidden_size * BF16
    if not per_call:
        return 0.0
    calls = 6 if layout.checkpointing else 4
    return calls * (per_call / cluster.bandwidth(layout.ep, 1) + cluster.latency_us * 1e-6)


def _p2p_seconds(spec: ModelSpec, cluster: Cluster, layout: Layout, tokens: int) -> float:
    """Pipeline sends of one rank for one micro-batch: an activation and a gradient per stage."""
    if layout.pp == 1:
        return 0.0
    one = tokens * spec.hidden_size * BF16 / cluster.bandwidth(layout.pp, layout.dp)
    return 2 * layout.stages_per_rank * one


def lower_bound(spec: ModelSpec, cluster: Cluster, layout: Layout, seq_len: int, imbalance: float) -> float:
    """A step time no layout of these degrees can beat: perfectly balanced stages, FSDP fully
    hidden. Lets the search skip layouts that cannot win."""
    tokens = layout.microbatch_size * seq_len
    layers = sum(spec.layer_flops(i, seq_len) for i in range(spec.num_layers)) * (4 if layout.checkpointing else 3)
    flops = tokens * (layers + 3 * spec.head_flops)
    a2a = spec.num_moe_layers * _all_to_all_seconds(spec, cluster, layout, tokens, imbalance)
    per_rank = (flops / cluster.flops_per_s + a2a) / layout.pp + _p2p_seconds(spec, cluster, layout, tokens)
    return (layout.microbatches + layout.bubble()) * per_rank


def _fsdp_times(units: list[Unit], layout: Layout, cluster: Cluster) -> tuple[float, float, float]:
    """(all-gather, reduce-scatter, replicate all-reduce) seconds for these units."""
    ds, ep, edp, r = layout.dp_shard, layout.ep, layout.edp, layout.dp_replicate
    dense = sum(u.dense_params for u in units)
    expert = sum(u.expert_params for u in units)

    def ring(n):
        return (n - 1) / n

    gather_elems_s = dense * ring(ds) / cluster.bandwidth(ds, 1) + expert / ep * ring(edp) / cluster.bandwidth(edp, ep)
    all_gather = BF16 * gather_elems_s
    reduce_scatter = FP32 * gather_elems_s
    shard = (dense + expert) / ds
    all_reduce = FP32 * shard * 2 * ring(r) / cluster.bandwidth(r, ds)
    return all_gather, reduce_scatter, all_reduce


def step_time(
    spec: ModelSpec, cluster: Cluster, layout: Layout, units: list[Unit], part: Partition, seq_len: int,
    imbalance: float,
) -> StepTime:
    tokens = layout.microbatch_size * seq_len
    m = layout.microbatches
    a2a_layer = _all_to_all_seconds(spec, cluster, layout, tokens, imbalance)
    model_flops = 3 * sum(u.fwd_flops for u in units) * m * layout.dp

    def per_rank(rank):
        mine = [u for s in range(part.num_stages) if part.rank_of_stage(s) == rank for u in stage_units(units, part, s)]
        compute = sum(u.train_flops for u in mine) / cluster.flops_per_s
        a2a = sum(u.moe for u in mine) * a2a_layer
        return mine, compute, a2a

    if layout.pp == 1:
        mine, compute, a2a = per_rank(0)
        gather, reduce, allreduce = _fsdp_times(mine, layout, cluster)
        fsdp = 2 * gather + reduce + allreduce
        return StepTime(
            compute=m * compute, all_to_all=m * a2a, fsdp_exposed=m * max(0.0, fsdp - compute), p2p=0.0,
            bubble=0.0, fsdp_traffic=m * fsdp, model_flops=model_flops,
        )

    p2p = _p2p_seconds(spec, cluster, layout, tokens)
    ranks = [per_rank(r) for r in range(layout.pp)]
    slowest = max(range(layout.pp), key=lambda r: ranks[r][1] + ranks[r][2])
    _, compute, a2a = ranks[slowest]
    exposed, traffic = 0.0, 0.0
    for mine, c, _ in ranks:
        gather, reduce, allreduce = _fsdp_times(mine, layout, cluster)
        # The gather hides behind the first micro-batch's forward (a third of its compute).
        exposed = max(exposed, max(0.0, gather - c / 3) + reduce + allreduce)
        traffic = max(traffic, gather + reduce + allreduce)
    return StepTime(
        compute=m * compute, all_to_all=m * a2a, fsdp_exposed=exposed, p2p=m * p2p,
        bubble=layout.bubble() * (compute + a2a + p2p), fsdp_traffic=traffic, model_flops=model_flops,
    )
