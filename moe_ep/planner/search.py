"""Search over layouts: every (pp, dp_replicate, dp_shard, ep) that divides the world, every
micro-batch size that divides a replica's batch, every recompute policy
(``moe_ep.planner.recompute``: none, full, selective, attention), every pipeline schedule that
applies; each is partitioned (moe_ep.planner.partition) and costed
(memory, timing). Of the layouts that fit, the fastest wins unless it leaves less than
``min_headroom`` of GPU memory free while another within ``speed_margin`` of its step time keeps
that much (see :func:`choose`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from ..dispatch.nodes import node_size_for
from ..ops.routing import node_limited_groups
from .calibration import read_calibration
from .partition import InfeasiblePartition, Partition, fits, partition
from .cluster import Cluster
from .inputs import BOUNDS, MAX_WORLD, check, check_world
from .layout import Layout
from .memory import (
    DEFAULT_IMBALANCE, DEFAULT_STARTUP_IMBALANCE, MemoryTable, Unit, build_units, layer_ids, p2p_bytes, rank_memory,
    unit_costs,
)
from .recompute import (COMPILED_BLOCKS_POLICIES, RECOMPUTE_POLICIES, SPLIT_BACKWARD_POLICIES,
                        check_split_backward_recompute, recompute_policy)
from .presets import DEFAULT_CLUSTER, CLUSTERS, Efficiencies, cluster_preset
from .schedules import INTERLEAVED, INTERLEAVED_SCHEDULES, NO_PIPELINE, SCHEDULES, schedule_info
from .spec import ModelSpec, format_count
from .timing import StepTime, exchange_seconds, step_time

DEFAULT_GLOBAL_BATCH_TOKENS = 4 * 2**20
# The headroom rule: a layout within SPEED_MARGIN of the fastest one's step time that keeps
# MIN_HEADROOM of GPU memory free beats a faster one that does not.
DEFAULT_MIN_HEADROOM = 0.10
DEFAULT_SPEED_MARGIN = 0.05
# Searching bigger clusters for "what would be needed" stops at this many times the request.
_MAX_GROWTH = 64
BACKEND = "triton"  # the experts' and router's kernels on a GPU, whose saved tensors the memory model counts


class PlanError(ValueError):
    """The request cannot be met; the message says what would be needed."""


@dataclass(frozen=True)
class Assumptions:
    """What the cost model assumes of the training run, beyond the layout: the busiest expert
    rank's load over the mean in steady training (step time) and at start-up (memory), and the
    capacity factor of the dispatcher (None: dropless), and node-limited routing's bound on the
    nodes a token reaches (None: no bound), and the chunks whose exchanges overlap the experts
    (``parallelize(overlap_chunks=...)``; 1: none), and whether the loss is moe_ep's chunked one
    (no full logits), and whether AdamW keeps its moments in bf16 (``moe_ep.training.AdamW``), and
    whether the layers' dense blocks are compiled (``parallelize(compile_blocks=...)``)."""

    imbalance: float = DEFAULT_IMBALANCE
    startup_imbalance: float = DEFAULT_STARTUP_IMBALANCE
    capacity_factor: float | None = None
    max_nodes: int | None = None
    overlap_chunks: int = 1
    chunked_loss: bool = False
    bf16_moments: bool = False
    compiled_blocks: bool = False


def _shape(lay: Layout) -> tuple:
    """Layouts that differ only in micro-batch size are one alternative."""
    return (lay.pp, lay.dp_replicate, lay.dp_shard, lay.ep, lay.schedule, lay.virtual_stages, lay.checkpointing)


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
        return _shape(self.layout)


@dataclass(frozen=True)
class Rule:
    """The headroom rule the plan was chosen by, and what it did."""

    min_headroom: float  # fraction of GPU memory
    speed_margin: float  # fraction of the fastest fitting layout's step time
    fastest: Candidate | None  # the fastest fitting layout, when the rule passed it over


@dataclass(frozen=True)
class Plan:
    spec: ModelSpec
    cluster: Cluster
    seq_len: int
    global_batch_tokens: int
    assumptions: Assumptions
    best: Candidate
    rule: Rule
    alternatives: list[tuple[Candidate, str]] = field(default_factory=list)
    considered: int = 0  # layouts enumerated
    costed: int = 0  # layouts whose lower bound was close enough to cost in full
    overrides: tuple[str, ...] = ()  # cluster figures given instead of the preset's

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
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _check_fixed_degrees(spec: ModelSpec, cluster: Cluster, fixed: dict) -> None:
    world = cluster.world_size
    where = f"the world of {cluster.nodes} nodes x {cluster.gpus_per_node} GPUs = {world}"
    for name in ("pp", "dp_replicate", "dp_shard", "ep"):
        check(name, fixed[name], optional=True)
    ep = fixed["ep"]
    if ep is not None and ep > 1:
        if not spec.num_experts:
            raise PlanError(f"ep={ep} needs an MoE model; {spec.name} has no experts")
        if not spec.num_moe_layers:
            raise PlanError(f"ep={ep} shards the experts of MoE layers; every layer of {spec.name} is dense "
                            "(first_k_dense_replace, mlp_only_layers or decoder_sparse_step cover them all)")
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


class _Mesh(NamedTuple):
    pp: int
    dp_replicate: int
    dp_shard: int
    ep: int

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard


def _dispatch_problem(spec: ModelSpec, ep: int, cluster: Cluster, assumptions: Assumptions) -> str | None:
    """Why the dispatcher options of ``assumptions`` cannot run over ``ep`` ranks of ``cluster``
    (what parallelize would refuse), or None: capacity mode, overlapped exchanges and node-limited
    routing need expert parallelism, and node-limited routing the node-aware dispatch over whole
    nodes, groups of experts it can bound, and room for the top-k on its nodes."""
    asked = [f"{name}={value}" for name, value, on in (
        ("capacity_factor", assumptions.capacity_factor, assumptions.capacity_factor is not None),
        ("overlap_chunks", assumptions.overlap_chunks, assumptions.overlap_chunks > 1),
        ("max_nodes", assumptions.max_nodes, assumptions.max_nodes is not None)) if on]
    if not asked:
        return None
    if ep == 1:
        verb = "applies" if len(asked) == 1 else "apply"
        return f"{', '.join(asked)} {verb} to the expert-parallel dispatcher; ep=1 has none"
    max_nodes = assumptions.max_nodes
    if max_nodes is None:
        return None
    node_size = node_size_for("auto", ep, cluster.gpus_per_node, assumptions.capacity_factor)
    if node_size is None:
        return (f"max_nodes={max_nodes} bounds the nodes a token reaches, which needs the node-aware dispatch: ep={ep} "
                f"must be a multiple of the node's {cluster.gpus_per_node} GPUs larger than it")
    nodes = ep // node_size
    try:
        node_limited_groups(spec.num_experts, spec.expert_groups, 1, nodes, max_nodes, spec.top_k)
    except ValueError as err:
        return f"max_nodes={max_nodes} over ep={ep} ({nodes} nodes): {err}"
    return None


def _meshes(spec: ModelSpec, world: int, fixed: dict, runs=lambda ep: True) -> list[_Mesh]:
    """The degrees that multiply to the world and honour the fixed ones: at most one pipeline
    rank per decoder layer, ep dividing both dp_shard and the experts, and ``runs(ep)``."""
    meshes = []
    for pp in divisors(world):
        if pp > spec.num_layers or fixed["pp"] not in (None, pp):
            continue
        dp = world // pp
        for dp_shard in divisors(dp):
            dp_replicate = dp // dp_shard
            if fixed["dp_shard"] not in (None, dp_shard) or fixed["dp_replicate"] not in (None, dp_replicate):
                continue
            for ep in divisors(math.gcd(dp_shard, spec.num_experts if spec.num_moe_layers else 1)):
                if fixed["ep"] in (None, ep) and runs(ep):
                    meshes.append(_Mesh(pp, dp_replicate, dp_shard, ep))
    return meshes


def _schedules(spec: ModelSpec, pp: int, fixed: dict) -> list[str]:
    """The schedules that can run pp pipeline ranks: each stage needs a decoder layer of its own
    (the embedding and the head ride with the first and the last), so pp x stages per rank must
    not exceed the layers."""
    names = [NO_PIPELINE] if pp == 1 else [
        name for name in SCHEDULES if pp * _info(name, fixed).stages_per_rank <= spec.num_layers
    ]
    return [name for name in names if fixed["schedule"] in (None, name)
            and (fixed["virtual_stages"] is None or name in INTERLEAVED_SCHEDULES)]


def _info(schedule: str, fixed: dict):
    """``schedule`` with the fixed virtual stages where they apply."""
    return schedule_info(schedule, fixed["virtual_stages"] if schedule in INTERLEAVED_SCHEDULES else None)


def _virtual_stages(spec: ModelSpec, pp: int, schedule: str, fixed: dict) -> list[int | None]:
    """Interleaved 1F1B's stages per rank worth costing (either form): its default 2 (None) and
    every larger V whose pp x V stages split the decoder layers evenly (as Megatron-Core requires
    of its virtual pipeline), or the fixed one; [None] for the other schedules."""
    if schedule not in INTERLEAVED_SCHEDULES:
        return [None]
    if fixed["virtual_stages"] is not None:
        return [fixed["virtual_stages"]] if pp * fixed["virtual_stages"] <= spec.num_layers else []
    return [None] + [v for v in range(3, spec.num_layers // pp + 1) if spec.num_layers % (pp * v) == 0]


def _microbatchings(pp: int, per_replica: int, schedule: str, fixed: dict) -> list[tuple[int, int]]:
    """(micro-batch size, micro-batches) that split a replica's sequences as the schedule needs."""
    info = SCHEDULES.get(schedule)
    return [
        (mbs, per_replica // mbs) for mbs in divisors(per_replica)
        if fixed["microbatch_size"] in (None, mbs)
        and (info is None or info.check_microbatches(pp, per_replica // mbs) is None)
    ]


def _layouts(spec: ModelSpec, cluster: Cluster, seq_len: int, global_batch_tokens: int, fixed: dict,
             assumptions: Assumptions, policies: tuple[str, ...] = RECOMPUTE_POLICIES):
    sequences = global_batch_tokens // seq_len
    for mesh in _meshes(spec, cluster.world_size, fixed, _runs(spec, cluster, assumptions)):
        if sequences % mesh.dp:
            continue
        per_replica = sequences // mesh.dp
        for schedule in _schedules(spec, mesh.pp, fixed):
            splits = schedule != NO_PIPELINE and _info(schedule, fixed).splits_backward
            runnable = SPLIT_BACKWARD_POLICIES if splits else policies
            for mbs, m in _microbatchings(mesh.pp, per_replica, schedule, fixed):
                for policy in policies:
                    if fixed["checkpointing"] in (None, policy) and policy in runnable:
                        for v in _virtual_stages(spec, mesh.pp, schedule, fixed):
                            yield Layout(*mesh, mbs, m, schedule, policy, v)


def _runs(spec: ModelSpec, cluster: Cluster, assumptions: Assumptions):
    """Whether an ep runs the dispatcher options asked for (``_dispatch_problem``)."""
    return lambda ep: _dispatch_problem(spec, ep, cluster, assumptions) is None


def _units(spec: ModelSpec, layout: Layout, seq_len: int, assumptions: Assumptions, cluster: Cluster) -> list[Unit]:
    # The dispatch parallelize's "auto" picks on this cluster: node-aware over whole nodes.
    node_size = node_size_for("auto", layout.ep, cluster.gpus_per_node, assumptions.capacity_factor)
    return build_units(spec, layout, seq_len, assumptions.imbalance, startup_imbalance=assumptions.startup_imbalance,
                       capacity_factor=assumptions.capacity_factor, backend=BACKEND, node_size=node_size,
                       max_nodes=assumptions.max_nodes, chunked_loss=assumptions.chunked_loss,
                       bf16_moments=assumptions.bf16_moments, compiled_blocks=assumptions.compiled_blocks)


def evaluate(
    spec: ModelSpec, cluster: Cluster, layout: Layout, seq_len: int, assumptions: Assumptions = Assumptions(),
    units: list[Unit] | None = None, costs: list | None = None,
) -> Candidate:
    """Cost one layout (``units`` and their ``unit_costs``, when given, must be this layout's).
    Raises InfeasiblePartition (a ValueError) when it cannot be cut into its pipeline stages at
    all (tied parameters that a loop placement would separate)."""
    units = units if units is not None else _units(spec, layout, seq_len, assumptions, cluster)
    costs = costs if costs is not None else unit_costs(units, cluster)
    p2p = p2p_bytes(layout, spec, seq_len)
    capacity = cluster.memory_bytes
    kwargs = dict(placement=layout.placement, stages_per_rank=layout.stages_per_rank, inflight=layout.inflight())

    def tables(part):
        return tuple(rank_memory(units, part, r, layout, p2p, cluster.reserved_bytes, capacity,
                                 assumptions.bf16_moments) for r in range(layout.pp))

    def all_fit(per_rank):
        return all(t.fits for t in per_rank)

    part = partition(costs, layout.num_stages, **kwargs)
    per_rank = tables(part)
    if not all_fit(per_rank) and layout.pp > 1:
        # The time-balanced cut does not fit: trade balance for memory.
        budget = capacity - cluster.reserved_bytes - p2p
        if budget > 0 and fits(costs, layout.num_stages, budget, **kwargs):
            capped = partition(costs, layout.num_stages, memory_cap=budget, **kwargs)
            if all_fit(tables(capped)):
                part, per_rank = capped, tables(capped)
    return Candidate(layout, part, per_rank,
                     step_time(spec, cluster, layout, units, part, seq_len, assumptions.overlap_chunks))


# The search costs in full every layout whose lower bound is within this factor of the best
# fitting step time (more while fewer than the requested alternatives are known), so the
# alternatives it explains are the real runners-up.
_EXPLAIN_WINDOW = 1.25
_GIVE_UP_WINDOW = 2.0


class _UnitCache:
    """Units depend on the micro-batch size, ep, checkpointing, dp_shard and whether there are
    pipeline stages; their compute on the first three only. Built once per key, with their costs
    and the sums the memory floor needs."""

    def __init__(self, spec, seq_len, assumptions, cluster):
        self.spec, self.seq_len, self.assumptions, self.cluster = spec, seq_len, assumptions, cluster
        self.units, self.costs, self.sums, self.seconds = {}, {}, {}, {}

    @staticmethod
    def _key(layout: Layout) -> tuple:
        return (layout.microbatch_size, layout.ep, layout.checkpointing, layout.dp_shard, layout.pp > 1)

    def get(self, layout: Layout) -> list[Unit]:
        key = self._key(layout)
        if key not in self.units:
            units = _units(self.spec, layout, self.seq_len, self.assumptions, self.cluster)
            self.units[key] = units
            self.costs[key] = unit_costs(units, self.cluster)
            self.sums[key] = (sum(u.params + u.peak_grads + u.optim + u.held for u in units), sum(u.act for u in units))
        return self.units[key]

    def unit_costs(self, layout: Layout) -> list:
        self.get(layout)
        return self.costs[self._key(layout)]

    def memory_floor(self, layout: Layout) -> float:
        """Bytes the fullest rank holds at least: all static bytes and activations (of the
        micro-batches every stage keeps at one moment of its rank's schedule) spread evenly over
        the pipeline ranks, the pipeline buffers and the reserve."""
        self.get(layout)
        static, act = self.sums[self._key(layout)]
        inflight = layout.info.common_inflight(layout.microbatches) if layout.pp > 1 else 1.0
        return ((static + inflight * act) / layout.pp + p2p_bytes(layout, self.spec, self.seq_len)
                + self.cluster.reserved_bytes)

    def lower_bound(self, layout: Layout) -> float:
        """A step time no layout of these degrees can beat: the whole model's compute and
        all-to-all (what the experts do not hide, with ``overlap_chunks``) split evenly over the
        pipeline ranks, everything else hidden. Lets the search
        skip layouts that cannot win."""
        key = (layout.microbatch_size, layout.ep, layout.checkpointing)
        if key not in self.seconds:
            self.seconds[key] = sum(u.work.seconds(self.cluster).total
                                    + exchange_seconds(u, self.cluster, layout, self.assumptions.overlap_chunks)
                                    for u in self.get(layout))
        return (layout.microbatches + layout.bubble()) * self.seconds[key] / layout.pp


def _search(spec, cluster, seq_len, global_batch_tokens, assumptions, fixed, num_alternatives=0, speed_margin=0.0):
    """(costed candidates, number of layouts enumerated, the first layout that could not be cut
    into stages with the reason, or None). Every layout within ``speed_margin`` of the fastest
    fitting one is costed, so the headroom rule (:func:`choose`) sees all it may choose from."""
    policies = COMPILED_BLOCKS_POLICIES if assumptions.compiled_blocks else RECOMPUTE_POLICIES
    layouts = list(_layouts(spec, cluster, seq_len, global_batch_tokens, fixed, assumptions, policies))
    cache = _UnitCache(spec, seq_len, assumptions, cluster)
    bounded = sorted((cache.lower_bound(lay), i) for i, lay in enumerate(layouts))
    candidates, best, shapes, uncut, oversized = [], None, set(), None, []

    def cost(i):
        nonlocal uncut
        try:
            candidates.append(evaluate(spec, cluster, layouts[i], seq_len, assumptions, cache.get(layouts[i]),
                                       cache.unit_costs(layouts[i])))
        except InfeasiblePartition as err:
            uncut = uncut or (layouts[i], str(err))
            return None
        return candidates[-1]

    for bound, i in bounded:
        if best is not None:
            window = _EXPLAIN_WINDOW if len(shapes - {best.key}) >= num_alternatives else _GIVE_UP_WINDOW
            window = max(window, 1 + speed_margin)
            if bound > best.time.total * window:
                break
        if cache.memory_floor(layouts[i]) > cluster.memory_bytes:
            oversized.append((bound, i))  # cannot fit: costed below only to be explained
            continue
        cand = cost(i)
        if cand is not None and cand.fits:
            shapes.add(cand.key)
            if best is None or _rank(cand) < _rank(best):
                best = cand
    # The faster layouts that cannot fit worth explaining are those closest to fitting, one per
    # shape; with nothing fitting, the smallest ones say how close the request came.
    faster = [i for bound, i in oversized if best is None or bound < best.time.total]
    limit, explained = (num_alternatives // 2 if best is not None else 8), set()
    for i in sorted(faster, key=lambda i: cache.memory_floor(layouts[i])):
        if len(explained) >= limit:
            break
        key = _shape(layouts[i])
        if key not in explained:
            explained.add(key)
            cost(i)
    return candidates, len(layouts), uncut


def _rank(c: Candidate):
    return (c.time.total, c.memory.total)


def choose(fitting: list[Candidate], min_headroom: float, speed_margin: float) -> tuple[Candidate, Candidate | None]:
    """The headroom rule: of the layouts within ``speed_margin`` of the fastest one's step time,
    the fastest that keeps ``min_headroom`` of GPU memory free; if none does, the one with the most
    headroom among them. Returns (chosen, the fastest when the rule passed it over, else None)."""
    fastest = min(fitting, key=_rank)
    near = [c for c in fitting if c.time.total <= fastest.time.total * (1 + speed_margin)]
    safe = [c for c in near if c.memory.headroom >= min_headroom * c.memory.capacity]
    chosen = min(safe, key=_rank) if safe else max(near, key=lambda c: (c.memory.headroom, -c.time.total))
    return chosen, (fastest if chosen is not fastest else None)


def expert_sizes(spec: ModelSpec) -> tuple[int, int] | None:
    """(H, I) of the model's routed experts, whose measured rate a calibration file gives; None
    for a dense model."""
    return (spec.hidden_size, spec.intermediate_size) if spec.num_experts else None


def attention_dims(spec: ModelSpec) -> tuple[int, int, int]:
    """(heads, query/key head size, value head size) of the model's attention, whose measured rate
    a calibration file gives."""
    return spec.num_heads, spec.head_dim, spec.value_head_dim


def _resolve_cluster(nodes, cluster, calibration, figures: dict, efficiency: dict,
                     spec: ModelSpec | None = None) -> tuple[Cluster, tuple[str, ...]]:
    """The Cluster of a plan: the preset's figures (or the default preset's, with gpus_per_node
    and gpu_memory_gib required), the given figures over them, the calibration file's efficiencies
    (its grouped-GEMM and attention rates for ``spec``'s shapes, :func:`expert_sizes` and
    :func:`attention_dims`) over the defaults and the given efficiencies over everything. Returns
    it with the names of the figures given instead of a named preset's."""
    preset = cluster_preset(cluster if cluster is not None else DEFAULT_CLUSTER)
    if cluster is None:
        for name in ("gpus_per_node", "gpu_memory_gib"):
            if figures.get(name) is None:
                raise ValueError(
                    f"{name} is required unless a cluster preset is named (cluster= one of {tuple(CLUSTERS)})"
                )
    given = {k: v for k, v in figures.items() if v is not None}
    result = Cluster.from_preset(preset, nodes, **given)
    if cluster is None:
        result = result.replace(preset=None)
    eff = result.efficiencies
    if calibration is not None:
        eff = read_calibration(calibration, gpu_family=preset.gpu.family, peak_tflops=result.peak_tflops,
                               hbm_gbps=result.hbm_gbps, defaults=eff,
                               expert_sizes=None if spec is None else expert_sizes(spec),
                               attention_dims=None if spec is None else attention_dims(spec))
    chosen = {k: v for k, v in efficiency.items() if v is not None}
    if chosen:
        sources = dict(eff.sources)
        sources.update({k: "given" for k in chosen})
        eff = Efficiencies(**{**{k: getattr(eff, k) for k in Efficiencies.KINDS}, **chosen},
                           sources=tuple(sources.items()))
    return result.replace(efficiencies=eff), tuple(given) + tuple(f"{k}_efficiency" for k in chosen)


def plan(
    model,
    *,
    nodes: int,
    cluster: str | None = None,
    gpus_per_node: int | None = None,
    gpu_memory_gib: float | None = None,
    seq_len: int = 4096,
    global_batch_tokens: int = DEFAULT_GLOBAL_BATCH_TOKENS,
    intra_node_gbps: float | None = None,
    inter_node_gbps: float | None = None,
    peak_tflops: float | None = None,
    hbm_gbps: float | None = None,
    calibration: str | Path | None = None,
    grouped_gemm_efficiency: float | None = None,
    dense_gemm_efficiency: float | None = None,
    attention_efficiency: float | None = None,
    memory_efficiency: float | None = None,
    reserve_fraction: float = 0.10,
    imbalance: float = DEFAULT_IMBALANCE,
    startup_imbalance: float = DEFAULT_STARTUP_IMBALANCE,
    capacity_factor: float | None = None,
    min_headroom: float = DEFAULT_MIN_HEADROOM,
    speed_margin: float = DEFAULT_SPEED_MARGIN,
    pp: int | None = None,
    dp_replicate: int | None = None,
    dp_shard: int | None = None,
    ep: int | None = None,
    microbatch_size: int | None = None,
    schedule: str | None = None,
    checkpointing: str | bool | None = None,
    virtual_stages: int | None = None,
    max_nodes: int | None = None,
    overlap_chunks: int = 1,
    chunked_loss: bool = False,
    bf16_moments: bool = False,
    compiled_blocks: bool = False,
    num_alternatives: int = 5,
) -> Plan:
    """Choose the fastest layout of ``model`` that fits the cluster, by the headroom rule.

    Args:
        model: a Hugging Face config, a ModelSpec, a name in ``moe_ep.planner.MODEL_NAMES``, or
            the path of a local ``config.json`` or model folder (a file that fails to load is named).
        nodes: how many nodes.
        cluster: a preset of ``moe_ep.planner.CLUSTERS`` (``"dgx-a100-80gb"``, ``"p4d"``, ...) whose
            figures the others default to; None takes the DGX A100 80 GB figures and then needs
            ``gpus_per_node`` and ``gpu_memory_gib``.
        gpus_per_node, gpu_memory_gib: per node, and per GPU in GiB.
        seq_len, global_batch_tokens: tokens per sequence and per optimizer step, all ranks.
        intra_node_gbps, inter_node_gbps: NCCL bus bandwidth per GPU over NVLink, and one GPU's
            share of its node's network, GB/s.
        peak_tflops, hbm_gbps: dense bf16 peak and memory bandwidth of one GPU.
        calibration: a result file of ``python -m moe_ep.bench kernels`` from the cluster's GPU;
            its measured efficiencies replace the defaults.
        grouped_gemm_efficiency, dense_gemm_efficiency, attention_efficiency, memory_efficiency:
            fractions of the peaks, over the preset's and the calibration's.
        reserve_fraction: memory kept back for the CUDA context, NCCL and fragmentation.
        imbalance: the busiest expert rank's routed load over the mean in steady training (time).
        startup_imbalance: the same early in dropless training (memory: expert activations and
            buffers), at most what the routing allows.
        capacity_factor: the dispatcher's capacity mode (padded fixed buffers); None: dropless.
        max_nodes: node-limited routing (``parallelize(max_nodes=...)``): each token's experts on at
            most this many nodes of its ep group, which bounds the node-aware dispatch's copies.
        overlap_chunks: plan for ``parallelize(overlap_chunks=...)``: each MoE layer in this many
            chunks whose all-to-alls overlap the other chunks' experts, so only what the experts
            do not hide counts (``moe_ep.planner.timing.exposed_exchange_seconds``); dropless,
            single-stage or node-aware; 1: no overlap.
        chunked_loss: the loss is moe_ep's chunked one (``TrainStep(chunked_loss=True)``,
            ``moe_ep.chunked_causal_lm_loss``): the head keeps no logits but the head weight's
            float32 gradient, and rereads that gradient once per chunk.
        bf16_moments: AdamW keeps its two moments in bf16 (``moe_ep.training.AdamW``): 12 bytes
            per sharded parameter instead of 16.
        compiled_blocks: the layers' dense blocks are compiled (``parallelize(compile_blocks=...)``):
            their memory-bound bytes are what Inductor's fused kernels move
            (``moe_ep.planner.compute.layer_traffic``), and the recompute policy is ``"none"`` or
            ``"full"``, the ones compiled blocks run with.
        min_headroom, speed_margin: the headroom rule (fractions of GPU memory and of step time).
        pp, dp_replicate, dp_shard, ep, microbatch_size, schedule, checkpointing: fix any of
            them; None lets the search choose. ``checkpointing`` is a recompute policy of
            ``moe_ep.planner.recompute.RECOMPUTE_POLICIES`` (True: ``"full"``, False: ``"none"``),
            what ``moe_ep.parallelize(activation_checkpointing=...)`` takes.
        virtual_stages: interleaved 1F1B's stages per rank (implies that schedule, with or without
            overlap); None lets the search try 2 and every V whose pp x V stages split the layers
            evenly.
        num_alternatives: how many rejected layouts the plan explains.

    Raises ValueError naming the argument for inputs out of range, and PlanError (a ValueError)
    when nothing fits, saying what would be needed.
    """
    spec = ModelSpec.resolve(model)
    check("nodes", nodes)
    figures = dict(gpus_per_node=gpus_per_node, gpu_memory_gib=gpu_memory_gib, intra_node_gbps=intra_node_gbps,
                   inter_node_gbps=inter_node_gbps, peak_tflops=peak_tflops, hbm_gbps=hbm_gbps)
    for name, value in figures.items():
        check(name, value, optional=True)
    efficiency = dict(grouped_gemm=grouped_gemm_efficiency, dense_gemm=dense_gemm_efficiency,
                      attention=attention_efficiency, memory=memory_efficiency)
    for name, value in efficiency.items():
        check(f"{name}_efficiency", value, optional=True)
    check("reserve_fraction", reserve_fraction)
    check_world(nodes, gpus_per_node or cluster_preset(cluster or DEFAULT_CLUSTER).gpus_per_node)
    for name, value in (("seq_len", seq_len), ("global_batch_tokens", global_batch_tokens),
                        ("imbalance", imbalance), ("startup_imbalance", startup_imbalance),
                        ("min_headroom", min_headroom), ("speed_margin", speed_margin),
                        ("num_alternatives", num_alternatives)):
        check(name, value)
    check("microbatch_size", microbatch_size, optional=True)
    check("capacity_factor", capacity_factor, optional=True)
    if capacity_factor is not None and ep == 1:
        raise ValueError(f"capacity_factor={capacity_factor} applies to the expert-parallel dispatcher; ep=1 has none")
    if checkpointing is not None:
        checkpointing = recompute_policy("checkpointing", checkpointing)
    resolved, overrides = _resolve_cluster(nodes, cluster, calibration, figures, efficiency, spec)
    resolved = resolved.replace(reserve_fraction=reserve_fraction)
    check("max_nodes", max_nodes, optional=True)
    check("overlap_chunks", overlap_chunks)
    if overlap_chunks > 1 and (capacity_factor is not None or ep == 1):
        raise ValueError(
            f"overlap_chunks={overlap_chunks} overlaps the dropless expert-parallel dispatcher's exchanges; "
            + ("ep=1 has none" if ep == 1 else f"capacity_factor={capacity_factor} is capacity mode")
        )
    for name, value in (("chunked_loss", chunked_loss), ("bf16_moments", bf16_moments),
                        ("compiled_blocks", compiled_blocks)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    if compiled_blocks and checkpointing not in (None, *COMPILED_BLOCKS_POLICIES):
        raise ValueError(f"checkpointing={checkpointing!r} does not run with compiled_blocks=True; compiled dense "
                         f"blocks run with {' or '.join(map(repr, COMPILED_BLOCKS_POLICIES))}")
    if max_nodes is not None and capacity_factor is not None:
        raise ValueError(f"max_nodes={max_nodes} bounds the nodes of the node-aware dispatch, which is dropless: not with "
                         f"capacity_factor={capacity_factor}")
    assumptions = Assumptions(imbalance, startup_imbalance, capacity_factor, max_nodes, overlap_chunks, chunked_loss,
                              bf16_moments, compiled_blocks)
    if virtual_stages is not None:
        if schedule == NO_PIPELINE:
            raise ValueError(f"virtual_stages={virtual_stages!r} sets the stages per rank of an interleaved pipeline "
                             f"schedule; schedule={NO_PIPELINE!r} has no pipeline")
        schedule_info(schedule or INTERLEAVED, virtual_stages)  # names the argument when wrong
    if schedule not in (None, NO_PIPELINE) and checkpointing is not None:
        check_split_backward_recompute("checkpointing", checkpointing, schedule, schedule_info(schedule).splits_backward)
    fixed = dict(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, ep=ep, microbatch_size=microbatch_size,
                 schedule=schedule, checkpointing=checkpointing, virtual_stages=virtual_stages)
    _check_fixed_degrees(spec, resolved, fixed)
    if ep is not None and (problem := _dispatch_problem(spec, ep, resolved, assumptions)) is not None:
        raise ValueError(problem)
    if global_batch_tokens % seq_len:
        raise PlanError(
            f"global_batch_tokens={global_batch_tokens} is not a whole number of sequences of seq_len={seq_len}; "
            f"use a multiple of {seq_len}, e.g. {max(1, round(global_batch_tokens / seq_len)) * seq_len}"
        )
    candidates, enumerated, uncut = _search(
        spec, resolved, seq_len, global_batch_tokens, assumptions, fixed, num_alternatives, speed_margin
    )
    if not candidates:
        raise PlanError(_nothing_to_search(spec, resolved, seq_len, global_batch_tokens, fixed, uncut, assumptions))
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        raise PlanError(_nothing_fits(spec, resolved, seq_len, global_batch_tokens, assumptions, fixed, candidates))
    best, passed_over = choose(fitting, min_headroom, speed_margin)
    from .report import explain_alternatives

    rule = Rule(min_headroom, speed_margin, passed_over)
    return Plan(
        spec, resolved, seq_len, global_batch_tokens, assumptions, best, rule,
        explain_alternatives(best, candidates, num_alternatives, rule), enumerated, len(candidates), overrides,
    )


def _nothing_to_search(spec, cluster, seq_len, global_batch_tokens, fixed, uncut, assumptions) -> str:
    """Why no layout was costed: the constraints of the enumeration (``_layouts``) applied one
    after another, mesh degrees first, naming the first that leaves nothing and what would lift
    it; if every layout was enumerated but none could be cut into stages, the partition's reason."""
    world = cluster.world_size
    sequences = global_batch_tokens // seq_len
    chosen = {k: v for k, v in fixed.items() if v is not None}
    under = f" under the fixed choices {chosen}" if chosen else ""
    every_ep = _meshes(spec, world, fixed)
    if not every_ep:
        return _no_mesh(spec, world, fixed)
    meshes = _meshes(spec, world, fixed, _runs(spec, cluster, assumptions))
    if not meshes:
        largest = max(mesh.ep for mesh in every_ep)
        return (f"no expert-parallel degree{under} runs what was asked (the largest: "
                f"{_dispatch_problem(spec, largest, cluster, assumptions)})")
    pipelines = [(mesh, schedule) for mesh in meshes for schedule in _schedules(spec, mesh.pp, fixed)]
    if not pipelines:
        return _no_schedule(spec, meshes, fixed, under)
    batched = [(mesh, schedule) for mesh, schedule in pipelines if sequences % mesh.dp == 0]
    if not batched:
        smallest_dp = min(mesh.dp for mesh, _ in pipelines)
        return (
            f"no layout of {world} GPUs divides the global batch of {sequences} sequences of {seq_len} tokens "
            f"among its data-parallel replicas{under}: every replica needs whole micro-batches, so the batch must "
            f"hold a multiple of dp = world / pp sequences (at least {smallest_dp}, i.e. global_batch_tokens a "
            f"multiple of {smallest_dp * seq_len})"
        )
    if not any(_microbatchings(mesh.pp, sequences // mesh.dp, schedule, fixed) for mesh, schedule in batched):
        return _no_microbatching(world, sequences, seq_len, batched, fixed, under)
    layout, reason = uncut
    return f"no layout{under} can be cut into pipeline stages; e.g. {layout.short()}: {reason}"


def _no_mesh(spec, world, fixed) -> str:
    names = [name for name in ("pp", "dp_replicate", "dp_shard") if fixed[name] is not None]
    triples = [(pp, dp // ds, ds) for pp in divisors(world) if pp <= spec.num_layers and fixed["pp"] in (None, pp)
               for dp in [world // pp] for ds in divisors(dp)
               if fixed["dp_shard"] in (None, ds) and fixed["dp_replicate"] in (None, dp // ds)]
    if not triples:
        # One of pp, dp_replicate, dp_shard fixed always completes to the world (each divides
        # it, and pp=1 or any fixed pp <= the layers is a stage count); all three fixed are
        # checked up front. So two are fixed: their product misses the world, or the third, pp,
        # would need more stages than there are decoder layers.
        product = math.prod(fixed[name] for name in names)
        spelled = " x ".join(names) + " = " + " x ".join(str(fixed[name]) for name in names) + f" = {product}"
        if world % product:
            return f"{spelled} does not divide the world of {world} GPUs; choose a product in {divisors(world)}"
        enough = min(d for d in divisors(world) if world // d <= spec.num_layers)
        return (
            f"{spelled} leaves pp = {world} / {product} = {world // product} pipeline ranks, more than the "
            f"{spec.num_layers} decoder layers of {spec.name} (a stage needs at least one); choose dp_replicate x "
            f"dp_shard from {[d for d in divisors(world) if d >= enough]}"
        )
    # The triples exist, so the fixed ep is what no dp_shard among them admits.
    ep = fixed["ep"]
    largest = max(ds for _, _, ds in triples)
    others = ", ".join(f"{name}={fixed[name]}" for name in names)
    return (
        f"ep={ep} must divide dp_shard (experts are sharded inside dp_shard), but with {others} dp_shard = "
        f"{world} / (pp x dp_replicate) is at most {largest}; choose pp x dp_replicate dividing {world // ep} "
        f"(= {world} / ep), or ep from {[e for e in divisors(spec.num_experts) if largest % e == 0]}"
    )


def _no_schedule(spec, meshes, fixed, under) -> str:
    # Left free, the schedule always has an option: 'none' for pp = 1, GPipe for any pp up to
    # the layers. So a fixed one binds.
    pps = sorted({mesh.pp for mesh in meshes})
    schedule = fixed["schedule"]
    if schedule is None:  # left free, only fixed virtual stages bind: they need an interleaved pipeline
        v = fixed["virtual_stages"]
        return (f"virtual_stages={v} runs {v} stages on each rank of an interleaved pipeline: it needs pp > 1 and pp x "
                f"{v} at most the {spec.num_layers} decoder layers of {spec.name}, but the mesh degrees{under} leave "
                f"pp in {pps}")
    if schedule == NO_PIPELINE:
        return (
            f"schedule={NO_PIPELINE!r} means no pipeline (pp=1), but the mesh degrees{under} leave pp in {pps}; "
            f"fix dp_replicate x dp_shard to the world size or leave the schedule free"
        )
    info = _info(schedule, fixed)
    if pps == [1]:
        return f"schedule={schedule!r} is a pipeline schedule and needs pp > 1, but the mesh degrees{under} leave pp=1"
    pp = min(p for p in pps if p > 1)
    one_per_rank = [name for name, other in SCHEDULES.items() if other.stages_per_rank == 1]
    return (
        f"schedule={schedule!r} runs {info.stages_per_rank} stages on each pipeline rank, so pp={pp} needs "
        f"{pp * info.stages_per_rank} stages of at least one decoder layer each, but {spec.name} has "
        f"{spec.num_layers}; use pp at most {spec.num_layers // info.stages_per_rank} with {schedule!r}, or a "
        f"schedule with one stage per rank ({', '.join(one_per_rank)})"
    )


def _no_microbatching(world, sequences, seq_len, batched, fixed, under) -> str:
    mbs = fixed["microbatch_size"]
    per_replica = sorted({sequences // mesh.dp for mesh, _ in batched})
    if mbs is not None and all(n % mbs for n in per_replica):
        return (
            f"microbatch_size={mbs} divides no data-parallel replica's batch{under}: the {sequences} sequences "
            f"split over dp = world / pp replicas give {per_replica} sequences per replica; choose a "
            f"microbatch_size dividing one of them" + _or_a_batch_of(world * mbs, seq_len)
        )
    # Every split into whole micro-batches leaves a pipeline with too few of them (or, for
    # interleaved 1F1B, not a multiple of pp); pp = 1 takes any split, so every split here is
    # pipelined. Name the one with the most micro-batches.
    splits = [(n // size, mesh, schedule, size) for mesh, schedule in batched for n in [sequences // mesh.dp]
              for size in divisors(n) if mbs in (None, size)]
    m, mesh, schedule, size = max(splits, key=lambda split: split[0])
    size_fixed = mbs or 1
    advice = (f"; a global batch of world x microbatch_size = {world * size_fixed} sequences "
              f"({world * size_fixed * seq_len} tokens) gives every replica pp micro-batches of {size_fixed}"
              if world * size_fixed * seq_len <= BOUNDS["global_batch_tokens"].hi else "")
    return (
        f"no split into micro-batches suits the pipeline schedule{under}: e.g. pp={mesh.pp} with dp={mesh.dp} "
        f"leaves {sequences // mesh.dp} sequences per replica, {m} micro-batches of {size}, and "
        f"{SCHEDULES[schedule].check_microbatches(mesh.pp, m)}" + advice
        + (", or use a smaller microbatch_size" if mbs is not None else "")
    )


def _or_a_batch_of(sequences: int, seq_len: int) -> str:
    """The advice of a global batch of ``sequences``, where the planner takes one that large."""
    tokens = sequences * seq_len
    if tokens > BOUNDS["global_batch_tokens"].hi:
        return ""
    return f", or a global batch of {sequences} sequences ({tokens} tokens)"


def _nothing_fits(spec, cluster, seq_len, global_batch_tokens, assumptions, fixed, candidates) -> str:
    from .partition import format_bytes

    smallest = min(candidates, key=lambda c: c.memory.total)
    state = 16 * spec.total_params
    usable = cluster.memory_bytes - cluster.reserved_bytes
    message = (
        f"{spec.name} ({format_count(spec.total_params)} parameters) does not fit {cluster.nodes} node(s) x "
        f"{cluster.gpus_per_node} GPUs of {cluster.gpu_memory_gib:g} GiB at seq_len={seq_len}: the smallest "
        f"footprint found is {format_bytes(smallest.memory.total)} per GPU ({smallest.layout.short()}), "
        f"{format_bytes(-smallest.memory.headroom)} over the {format_bytes(cluster.memory_bytes)} per GPU. "
        f"Parameters, gradients and AdamW state alone take 16 B x {format_count(spec.total_params)} = "
        f"{format_bytes(state)}, at least {math.ceil(state / usable)} GPUs' worth of usable memory."
    )
    # The mesh degrees grow with the nodes: the ones the request fixed are said to be left free.
    given = [f"{name}={fixed[name]}" for name in ("pp", "dp_replicate", "dp_shard") if fixed.get(name) is not None]
    freed = f" ({', '.join(given)} of the request left free)" if given else ""
    requested = _fit_on_more_nodes(spec, cluster, seq_len, lambda growth: global_batch_tokens, assumptions, fixed)
    if requested is not None:
        growth, best = requested
        nodes = cluster.nodes * growth
        return message + (
            f" It would fit on {nodes} nodes ({nodes * cluster.gpus_per_node} GPUs) at the same global batch of "
            f"{global_batch_tokens} tokens, as {best.layout.short()}{freed} using {format_bytes(best.memory.total)} "
            "per GPU."
        )
    # More GPUs need more sequences: at least one per GPU, split evenly over the data-parallel
    # replicas. Only when the requested batch is too small for any cluster that would hold the
    # model is it worth proposing a bigger batch, and then the message must say so.
    scaled = _fit_on_more_nodes(spec, cluster, seq_len, lambda growth: global_batch_tokens * growth, assumptions, fixed)
    growths = _growths(cluster)
    most = cluster.nodes * (growths[-1] if growths else 1)
    if scaled is not None:
        growth, best = scaled
        nodes, tokens = cluster.nodes * growth, global_batch_tokens * growth
        return message + (
            f" No cluster of up to {most} nodes fits it at the requested global batch of {global_batch_tokens} tokens "
            f"({global_batch_tokens // seq_len} sequences): every layout needs at least one sequence per GPU, split "
            f"evenly over the data-parallel replicas. With the batch grown along with the nodes, it would fit on "
            f"{nodes} nodes ({nodes * cluster.gpus_per_node} GPUs) at a global batch of {tokens} tokens "
            f"({tokens // seq_len} sequences), as {best.layout.short()}{freed} using "
            f"{format_bytes(best.memory.total)} per GPU."
        )
    return message + (f" Nothing fits even on {most} nodes (the planner's limit is {_most_nodes(cluster)} nodes of "
                      f"{cluster.gpus_per_node} GPUs); use GPUs with more memory.")


def _most_nodes(cluster) -> int:
    """The most nodes of ``cluster``'s size the planner takes (its bounds on nodes and GPUs)."""
    return min(int(BOUNDS["nodes"].hi), MAX_WORLD // cluster.gpus_per_node)


def _growths(cluster) -> list[int]:
    """The node counts' growths ``_fit_on_more_nodes`` tries: doubling, up to _MAX_GROWTH and
    within the planner's bounds (a cluster it suggests must be one it would plan)."""
    return [2**i for i in range(1, _MAX_GROWTH.bit_length()) if cluster.nodes * 2**i <= _most_nodes(cluster)]


def _fit_on_more_nodes(spec, cluster, seq_len, tokens_for, assumptions, fixed):
    """(growth, fastest fitting candidate) for the smallest growth of ``_growths``, with
    ``tokens_for(growth)`` tokens per step (within the planner's bound) and the mesh degrees left
    free; or None."""
    fixed_free = dict(fixed, pp=None, dp_replicate=None, dp_shard=None)
    for growth in _growths(cluster):
        if tokens_for(growth) > BOUNDS["global_batch_tokens"].hi:
            break
        nodes = cluster.nodes * growth
        bigger = cluster.replace(nodes=nodes)
        found = [c for c in _search(spec, bigger, seq_len, tokens_for(growth), assumptions, fixed_free)[0] if c.fits]
        if found:
            return growth, min(found, key=_rank)
    return None
