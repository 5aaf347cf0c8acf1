"""Search over layouts: every (pp, dp_replicate, dp_shard, ep) that divides the world, every
micro-batch size that divides a replica's batch, with and without activation checkpointing,
every pipeline schedule that applies; each is partitioned (moe_ep.partition), costed
(memory, timing) and the fastest one that fits wins."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..partition import Partition, fits, partition
from .cluster import Cluster
from .layout import Layout
from .memory import DEFAULT_IMBALANCE, MemoryTable, Unit, build_units, layer_ids, p2p_bytes, rank_memory, unit_costs
from .schedules import NO_PIPELINE, SCHEDULES
from .spec import ModelSpec
from .timing import StepTime, lower_bound, step_time

DEFAULT_GLOBAL_BATCH_TOKENS = 4 * 2**20
# Searching bigger clusters for "what would be needed" stops at this many times the request.
_MAX_GROWTH = 64


class PlanError(ValueError):
    """The request cannot be met; the message says what would be needed."""


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    partition: Partition
    memory_per_rank: tuple[MemoryTable, ...]  # one table per pipeline rank
    time: StepTime

    @property
    def memory(self) -> MemoryTable:
        """The fullest pipeline rank's table."""
        return max(self.memory_per_rank, key=lambda t: t.total)

    @property
    def split_points(self) -> list[int]:
        """The first decoder layer of stages 1..S-1: ``split_points`` of
        ``moe_ep.parallel.pipeline.build_pipeline`` for exactly this cut."""
        return [layer_ids(self.partition.stage_names(s))[0] for s in range(1, self.partition.num_stages)]

    @property
    def fits(self) -> bool:
        return self.memory.fits

    @property
    def key(self) -> tuple:
        """Layouts that differ only in micro-batch size are one alternative."""
        lay = self.layout
        return (lay.pp, lay.dp_replicate, lay.dp_shard, lay.ep, lay.schedule, lay.checkpointing)


@dataclass(frozen=True)
class Plan:
    spec: ModelSpec
    cluster: Cluster
    seq_len: int
    global_batch_tokens: int
    imbalance: float
    best: Candidate
    alternatives: list[tuple[Candidate, str]] = field(default_factory=list)
    considered: int = 0  # layouts enumerated
    costed: int = 0  # layouts whose lower bound was close enough to cost in full

    @property
    def layout(self) -> Layout:
        return self.best.layout

    def report(self) -> str:
        from .report import format_plan

        return format_plan(self)

    def to_dict(self) -> dict:
        from .report import plan_to_dict

        return plan_to_dict(self)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_positive_int(name, value, allow_none=True):
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int{' or None' if allow_none else ''}, got {value!r}")


def _check_fixed_degrees(spec: ModelSpec, cluster: Cluster, fixed: dict) -> None:
    world = cluster.world_size
    where = f"the world of {cluster.nodes} nodes x {cluster.gpus_per_node} GPUs = {world}"
    for name in ("pp", "dp_replicate", "dp_shard", "ep"):
        _check_positive_int(name, fixed[name])
    ep = fixed["ep"]
    if ep is not None and ep > 1:
        if not spec.num_experts:
            raise PlanError(f"ep={ep} needs an MoE model; {spec.name} has no experts")
        if spec.num_experts % ep:
            raise PlanError(
                f"ep={ep} does not divide the {spec.num_experts} experts of {spec.name}; "
                f"choose ep from {divisors(spec.num_experts)}"
            )
    for name in ("pp", "dp_replicate", "dp_shard", "ep"):
        value = fixed[name]
        if value is not None and world % value:
            raise PlanError(
                f"{name}={value} does not divide {where}; choose {name} from {divisors(world)} "
                f"or a world size that is a multiple of {value}"
            )
    if fixed["pp"] is not None and fixed["pp"] > spec.num_layers:
        raise PlanError(f"pp={fixed['pp']} exceeds the {spec.num_layers} decoder layers of {spec.name}")
    if fixed["dp_shard"] is not None and ep is not None and fixed["dp_shard"] % ep:
        raise PlanError(f"ep={ep} must divide dp_shard={fixed['dp_shard']}: experts are sharded inside dp_shard")
    if all(fixed[k] is not None for k in ("pp", "dp_replicate", "dp_shard")):
        product = fixed["pp"] * fixed["dp_replicate"] * fixed["dp_shard"]
        if product != world:
            raise PlanError(
                f"pp x dp_replicate x dp_shard = {fixed['pp']} x {fixed['dp_replicate']} x {fixed['dp_shard']} = "
                f"{product}, but {where}"
            )
    schedule = fixed["schedule"]
    if schedule is not None and schedule != NO_PIPELINE and schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {(NO_PIPELINE, *SCHEDULES)} or None, got {schedule!r}")
    if schedule == NO_PIPELINE and fixed["pp"] not in (None, 1):
        raise PlanError(f"schedule={NO_PIPELINE!r} means no pipeline, but pp={fixed['pp']}")


def _layouts(spec: ModelSpec, cluster: Cluster, seq_len: int, global_batch_tokens: int, fixed: dict):
    world = cluster.world_size
    sequences = global_batch_tokens // seq_len
    for pp in divisors(world):
        if pp > spec.num_layers or fixed["pp"] not in (None, pp):
            continue
        dp = world // pp
        if sequences % dp:
            continue
        per_replica = sequences // dp
        for dp_shard in divisors(dp):
            dp_replicate = dp // dp_shard
            if fixed["dp_shard"] not in (None, dp_shard) or fixed["dp_replicate"] not in (None, dp_replicate):
                continue
            for ep in divisors(math.gcd(dp_shard, spec.num_experts or 1)):
                if fixed["ep"] not in (None, ep):
                    continue
                schedules = [NO_PIPELINE] if pp == 1 else list(SCHEDULES)
                for schedule in schedules:
                    if fixed["schedule"] not in (None, schedule):
                        continue
                    info = SCHEDULES.get(schedule)
                    if info is not None and pp * info.stages_per_rank > spec.num_layers + 2:
                        continue
                    for mbs in divisors(per_replica):
                        m = per_replica // mbs
                        if fixed["microbatch_size"] not in (None, mbs):
                            continue
                        if info is not None and info.check_microbatches(pp, m):
                            continue
                        for ckpt in (False, True):
                            if fixed["checkpointing"] not in (None, ckpt):
                                continue
                            yield Layout(pp, dp_replicate, dp_shard, ep, mbs, m, schedule, ckpt)


def evaluate(
    spec: ModelSpec, cluster: Cluster, layout: Layout, seq_len: int, imbalance: float = DEFAULT_IMBALANCE
) -> Candidate | None:
    """Cost one layout. None when it cannot be partitioned at all (tied parameters that a loop
    placement would separate)."""
    units: list[Unit] = build_units(spec, layout, seq_len, imbalance)
    costs = unit_costs(units)
    p2p = p2p_bytes(layout, spec, seq_len)
    capacity = cluster.memory_bytes
    kwargs = dict(placement=layout.placement, stages_per_rank=layout.stages_per_rank, inflight=layout.inflight())

    def tables(part):
        return tuple(rank_memory(units, part, r, p2p, cluster.reserved_bytes, capacity) for r in range(layout.pp))

    def all_fit(per_rank):
        return all(t.fits for t in per_rank)

    try:
        part = partition(costs, layout.num_stages, **kwargs)
    except ValueError:
        return None
    per_rank = tables(part)
    if not all_fit(per_rank) and layout.pp > 1:
        # The time-balanced cut does not fit: trade balance for memory.
        budget = capacity - cluster.reserved_bytes - p2p
        if budget > 0 and fits(costs, layout.num_stages, budget, **kwargs):
            capped = partition(costs, layout.num_stages, memory_cap=budget, **kwargs)
            if all_fit(tables(capped)):
                part, per_rank = capped, tables(capped)
    return Candidate(layout, part, per_rank, step_time(spec, cluster, layout, units, part, seq_len, imbalance))


# The search costs in full every layout whose lower bound is within this factor of the best
# fitting step time (more while fewer than the requested alternatives are known), so the
# alternatives it explains are the real runners-up.
_EXPLAIN_WINDOW = 1.25
_GIVE_UP_WINDOW = 2.0


def _search(spec, cluster, seq_len, global_batch_tokens, imbalance, fixed, num_alternatives=0):
    """(costed candidates, number of layouts enumerated)."""
    layouts = list(_layouts(spec, cluster, seq_len, global_batch_tokens, fixed))
    bounded = sorted(((lower_bound(spec, cluster, lay, seq_len, imbalance), i) for i, lay in enumerate(layouts)))
    candidates, best, shapes = [], None, set()
    for bound, i in bounded:
        if best is not None:
            window = _EXPLAIN_WINDOW if len(shapes - {best.key}) >= num_alternatives else _GIVE_UP_WINDOW
            if bound > best.time.total * window:
                break
        cand = evaluate(spec, cluster, layouts[i], seq_len, imbalance)
        if cand is None:
            continue
        candidates.append(cand)
        if cand.fits:
            shapes.add(cand.key)
            if best is None or _rank(cand) < _rank(best):
                best = cand
    return candidates, len(layouts)


def _rank(c: Candidate):
    return (c.time.total, c.memory.total)


def plan(
    model,
    *,
    nodes: int,
    gpus_per_node: int,
    gpu_memory_gib: float,
    seq_len: int = 4096,
    global_batch_tokens: int = DEFAULT_GLOBAL_BATCH_TOKENS,
    intra_node_gbps: float = 200.0,
    inter_node_gbps: float = 25.0,
    peak_tflops: float = 312.0,
    efficiency: float = 0.40,
    reserve_fraction: float = 0.10,
    imbalance: float = DEFAULT_IMBALANCE,
    pp: int | None = None,
    dp_replicate: int | None = None,
    dp_shard: int | None = None,
    ep: int | None = None,
    microbatch_size: int | None = None,
    schedule: str | None = None,
    checkpointing: bool | None = None,
    num_alternatives: int = 5,
) -> Plan:
    """Choose the fastest layout of ``model`` that fits the cluster.

    Args:
        model: a Hugging Face config, a ModelSpec, or a name in ``moe_ep.planner.MODEL_NAMES``.
        nodes, gpus_per_node, gpu_memory_gib: the cluster (GPU memory in GiB, 80 for A100-80GB).
        seq_len, global_batch_tokens: tokens per sequence and per optimizer step, all ranks.
        intra_node_gbps, inter_node_gbps: effective bus bandwidth per GPU, GB/s.
        peak_tflops, efficiency: the GEMM throughput the cost model assumes.
        reserve_fraction: memory kept back for the CUDA context, NCCL and fragmentation.
        imbalance: the busiest expert rank's load over the mean (sizes buffers and all-to-all).
        pp, dp_replicate, dp_shard, ep, microbatch_size, schedule, checkpointing: fix any of
            them; None lets the search choose.
        num_alternatives: how many rejected layouts the plan explains.

    Raises PlanError (a ValueError) when nothing fits, saying what would be needed.
    """
    spec = ModelSpec.resolve(model)
    cluster = Cluster(
        nodes, gpus_per_node, gpu_memory_gib, intra_node_gbps, inter_node_gbps, peak_tflops, efficiency,
        reserve_fraction,
    )
    _check_positive_int("seq_len", seq_len, allow_none=False)
    _check_positive_int("global_batch_tokens", global_batch_tokens, allow_none=False)
    _check_positive_int("microbatch_size", microbatch_size)
    if not isinstance(imbalance, (int, float)) or imbalance < 1:
        raise ValueError(f"imbalance must be a number >= 1, got {imbalance!r}")
    if checkpointing is not None and not isinstance(checkpointing, bool):
        raise TypeError(f"checkpointing must be a bool or None, got {type(checkpointing).__name__}")
    fixed = dict(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, ep=ep, microbatch_size=microbatch_size,
                 schedule=schedule, checkpointing=checkpointing)
    _check_fixed_degrees(spec, cluster, fixed)
    if global_batch_tokens % seq_len:
        raise PlanError(
            f"global_batch_tokens={global_batch_tokens} is not a whole number of sequences of seq_len={seq_len}; "
            f"use a multiple of {seq_len}, e.g. {max(1, round(global_batch_tokens / seq_len)) * seq_len}"
        )
    candidates, enumerated = _search(spec, cluster, seq_len, global_batch_tokens, imbalance, fixed, num_alternatives)
    if not candidates:
        raise PlanError(_nothing_to_search(spec, cluster, seq_len, global_batch_tokens, fixed))
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        raise PlanError(_nothing_fits(spec, cluster, seq_len, global_batch_tokens, imbalance, fixed, candidates))
    best = min(fitting, key=_rank)
    from .report import explain_alternatives

    return Plan(
        spec, cluster, seq_len, global_batch_tokens, imbalance, best,
        explain_alternatives(best, candidates, num_alternatives), enumerated, len(candidates),
    )


def _nothing_to_search(spec, cluster, seq_len, global_batch_tokens, fixed) -> str:
    sequences = global_batch_tokens // seq_len
    world = cluster.world_size
    pps = [p for p in divisors(world) if fixed["pp"] in (None, p) and p <= spec.num_layers]
    smallest_dp = world // max(pps) if pps else world
    return (
        f"no layout of {world} GPUs divides the global batch of {sequences} sequences of {seq_len} tokens "
        f"among its data-parallel replicas under the fixed choices "
        f"{ {k: v for k, v in fixed.items() if v is not None} }: every replica needs whole micro-batches, "
        f"so the batch must hold a multiple of dp = world / pp sequences (at least {smallest_dp}, i.e. "
        f"global_batch_tokens a multiple of {smallest_dp * seq_len})"
    )


def _nothing_fits(spec, cluster, seq_len, global_batch_tokens, imbalance, fixed, candidates) -> str:
    from ..partition import format_bytes

    smallest = min(candidates, key=lambda c: c.memory.total)
    state = 16 * spec.total_params
    usable = cluster.memory_bytes - cluster.reserved_bytes
    message = (
        f"{spec.name} ({spec.total_params / 1e9:.1f} B parameters) does not fit {cluster.nodes} node(s) x "
        f"{cluster.gpus_per_node} GPUs of {cluster.gpu_memory_gib:g} GiB at seq_len={seq_len}: the smallest "
        f"footprint found is {format_bytes(smallest.memory.total)} per GPU ({smallest.layout.short()}), "
        f"{format_bytes(-smallest.memory.headroom)} over the {format_bytes(cluster.memory_bytes)} per GPU. "
        f"Parameters, gradients and AdamW state alone take 16 B x {spec.total_params / 1e9:.1f} B = "
        f"{format_bytes(state)}, at least {math.ceil(state / usable)} GPUs' worth of usable memory."
    )
    requested = _fit_on_more_nodes(spec, cluster, seq_len, lambda growth: global_batch_tokens, imbalance, fixed)
    if requested is not None:
        growth, best = requested
        nodes = cluster.nodes * growth
        return message + (
            f" It would fit on {nodes} nodes ({nodes * cluster.gpus_per_node} GPUs) at the same global batch of "
            f"{global_batch_tokens} tokens, as {best.layout.short()} using {format_bytes(best.memory.total)} per GPU."
        )
    # More GPUs need more sequences: at least one per GPU, split evenly over the data-parallel
    # replicas. Only when the requested batch is too small for any cluster that would hold the
    # model is it worth proposing a bigger batch, and then the message must say so.
    scaled = _fit_on_more_nodes(spec, cluster, seq_len, lambda growth: global_batch_tokens * growth, imbalance, fixed)
    most = cluster.nodes * _MAX_GROWTH
    if scaled is not None:
        growth, best = scaled
        nodes, tokens = cluster.nodes * growth, global_batch_tokens * growth
        return message + (
            f" No cluster of up to {most} nodes fits it at the requested global batch of {global_batch_tokens} tokens "
            f"({global_batch_tokens // seq_len} sequences): every layout needs at least one sequence per GPU, split "
            f"evenly over the data-parallel replicas. With the batch grown along with the nodes, it would fit on "
            f"{nodes} nodes ({nodes * cluster.gpus_per_node} GPUs) at a global batch of {tokens} tokens "
            f"({tokens // seq_len} sequences), as {best.layout.short()} using {format_bytes(best.memory.total)} "
            f"per GPU."
        )
    return message + f" Nothing fits even on {most} nodes; use GPUs with more memory."


def _fit_on_more_nodes(spec, cluster, seq_len, tokens_for, imbalance, fixed):
    """(growth, fastest fitting candidate) for the smallest growth of the node count, doubling up
    to _MAX_GROWTH, with ``tokens_for(growth)`` tokens per step and the mesh degrees left free;
    or None."""
    fixed_free = dict(fixed, pp=None, dp_replicate=None, dp_shard=None)
    for growth in (2**i for i in range(1, _MAX_GROWTH.bit_length())):
        nodes = cluster.nodes * growth
        bigger = Cluster(
            nodes, cluster.gpus_per_node, cluster.gpu_memory_gib, cluster.intra_node_gbps, cluster.inter_node_gbps,
            cluster.peak_tflops, cluster.efficiency, cluster.reserve_fraction,
        )
        found = [c for c in _search(spec, bigger, seq_len, tokens_for(growth), imbalance, fixed_free)[0] if c.fits]
        if found:
            return growth, min(found, key=_rank)
    return None
