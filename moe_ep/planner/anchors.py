"""The planner against published runs: MoE training runs whose layout and speed were published,
costed by the planner with their own layouts, and the planned figures beside the published ones.

Each anchor fixes what the run published (the mesh, micro-batching, pipeline schedule and virtual
stages, checkpointing where stated, the global batch and sequence length) on the ``dgx-h100``
preset; only what the source leaves open is chosen, by the headroom rule of ``plan()``. Routing
is balanced (``imbalance=1, startup_imbalance=1``) where the benchmark forces it. The layout is
costed with :func:`moe_ep.planner.search.evaluate`, so a run that does not fit the planner's
memory model still gets its figures and the row says "does not fit" rather than failing.

moe_ep has no tensor parallelism: where a run used it, its TP x DP ranks become FSDP ranks here
(dp_shard), which the row's note says. Every figure on the moe_ep side is planned (estimated), not
measured on a GPU."""

from __future__ import annotations

import itertools
import textwrap
from dataclasses import dataclass, replace
from pathlib import Path

from .cluster import Cluster
from .layout import Layout
from .partition import InfeasiblePartition, format_bytes
from .report import _efficiency_lines, _why_not_fitting
from .schedules import DUALPIPEV, INTERLEAVED, INTERLEAVED_OVERLAP, INTERLEAVED_SCHEDULES, NO_PIPELINE, SCHEDULES
from .search import (
    DEFAULT_MIN_HEADROOM, DEFAULT_SPEED_MARGIN, Assumptions, Candidate, _resolve_cluster, _units, _virtual_stages,
    choose, evaluate,
)
from .presets import cluster_preset
from .recompute import COMPILED_BLOCKS_POLICIES, RECOMPUTE_POLICIES, SPLIT_BACKWARD_POLICIES
from .spec import MODEL_NAMES, ModelSpec

TOKENS_PER_GPU = "tokens/s/GPU"
STEP_SECONDS = "s/step"
_UNITS = (TOKENS_PER_GPU, STEP_SECONDS)
_AUTOMODEL_SUMMARY = (
    "https://docs.nvidia.com/nemo/automodel/performance/performance-summary.md, table 'Pre-Training "
    "Performance, System: DGX-H100, Precision: BF16'"
)
_AUTOMODEL_BALANCED = ("routing balanced: NeMo AutoModel's benchmark configs set fake_balanced_gate: true "
                       "(NVIDIA-NeMo/Automodel, examples/llm_benchmark)")


@dataclass(frozen=True)
class Anchor:
    """One published run: its model (a name in MODEL_NAMES), cluster and layout as published, the
    published figure in ``unit`` and where it comes from. ``checkpointing`` None, and
    ``virtual_stages`` None under interleaved 1F1B: the source does not say, the planner chooses. ``global_batch`` counts sequences of ``seq_len`` tokens.
    ``bf16_moments``: the run keeps AdamW's moments in bf16, so moe_ep's plan does too
    (``moe_ep.training.AdamW``)."""

    name: str
    model: str
    nodes: int
    pp: int
    dp_replicate: int
    dp_shard: int
    ep: int
    microbatch_size: int
    global_batch: int
    seq_len: int
    schedule: str
    virtual_stages: int | None
    checkpointing: str | None  # a recompute policy of RECOMPUTE_POLICIES
    balanced_routing: bool
    published: float
    unit: str
    source: str
    note: str
    cluster: str = "dgx-h100"
    bf16_moments: bool = False

    def __post_init__(self):
        if self.model not in MODEL_NAMES:
            raise ValueError(f"anchor {self.name!r}: model must be one of {MODEL_NAMES}, got {self.model!r}")
        if self.unit not in _UNITS:
            raise ValueError(f"anchor {self.name!r}: unit must be one of {_UNITS}, got {self.unit!r}")
        if not self.source:
            raise ValueError(f"anchor {self.name!r}: source must say where the published figure comes from")
        if self.pp * self.dp_replicate * self.dp_shard != self.world_size:
            raise ValueError(f"anchor {self.name!r}: pp x dp_replicate x dp_shard must be the world of "
                             f"{self.world_size} GPUs ({self.nodes} nodes of {self.cluster})")
        replicas = self.dp_replicate * self.dp_shard
        if self.global_batch % (replicas * self.microbatch_size):
            raise ValueError(
                f"anchor {self.name!r}: global_batch={self.global_batch} is not a whole number of micro-batches of "
                f"{self.microbatch_size} on each of the {replicas} data-parallel replicas"
            )

    @property
    def world_size(self) -> int:
        return self.nodes * cluster_preset(self.cluster).gpus_per_node

    @property
    def microbatches(self) -> int:
        return self.global_batch // (self.dp_replicate * self.dp_shard * self.microbatch_size)

    @property
    def global_batch_tokens(self) -> int:
        return self.global_batch * self.seq_len

    def layouts(self) -> list[Layout]:
        """The published layout, once per recompute policy its schedule runs (SPLIT_BACKWARD_POLICIES
        under a split backward) and, under interleaved 1F1B, once per number of virtual stages (those
        that split the layers evenly) where the source leaves it open, and in both of moe_ep's forms of its order (with and without forwards overlapped
        with backwards: the same actions, run on one thread or two)."""
        choices = RECOMPUTE_POLICIES if self.checkpointing is None else (self.checkpointing,)
        spec = ModelSpec.resolve(self.model)
        stages = _virtual_stages(spec, self.pp, self.schedule, {"virtual_stages": self.virtual_stages})
        schedules = (self.schedule,)
        if self.schedule in INTERLEAVED_SCHEDULES:
            # The schedule's own default stands for None: the row names its stages.
            stages = [SCHEDULES[self.schedule].stages_per_rank if v is None else v for v in stages]
            schedules = INTERLEAVED_SCHEDULES
        return [Layout(self.pp, self.dp_replicate, self.dp_shard, self.ep, self.microbatch_size, self.microbatches,
                       schedule, ckpt, v) for schedule in schedules for ckpt in choices for v in stages
                if ckpt in SPLIT_BACKWARD_POLICIES or not SCHEDULES[schedule].splits_backward]


ANCHORS = (
    Anchor(
        "Megatron-Core Mixtral-8x7B", "mixtral-8x7b", nodes=8, pp=4, dp_replicate=1, dp_shard=16, ep=8,
        microbatch_size=1, global_batch=256, seq_len=4096, schedule=INTERLEAVED, virtual_stages=None,
        checkpointing=None, balanced_routing=False, published=5640, unit=TOKENS_PER_GPU,
        source="468 TFLOP/s per GPU for Mixtral 8x7B bf16 training with MCore v0.9: "
               "https://docs.nvidia.com/megatron-core/developer-guide/latest/api-guide/moe.html (opening paragraph); "
               "the layout (64 H100, EP8 PP4, seq 4096) and the 5,640 tokens/s per GPU derived from it as reported "
               "in moe_ep issue #22/#23, source not confirmed here",
        note="TP1 there: its 16 data-parallel ranks (distributed optimizer) are dp_shard 16 here; global batch "
             "256 x 4096 and aux-loss routing (steady imbalance 1.2) assumed, and the virtual stages per rank "
             "(2, 4 or 8, the ones that split 8 layers per rank evenly) and recomputation left to the planner: "
             "the source gives none of them",
    ),
    Anchor(
        "AutoModel Qwen3-30B-A3B", "qwen3-30b-a3b", nodes=1, pp=1, dp_replicate=1, dp_shard=8, ep=8,
        microbatch_size=4, global_batch=512, seq_len=4096, schedule=NO_PIPELINE, virtual_stages=None,
        checkpointing="full", balanced_routing=True, published=12040, unit=TOKENS_PER_GPU,
        source=f"{_AUTOMODEL_SUMMARY}, row 'Qwen3 MoE 30B' (8 GPUs, GBS 512, MBS 4, GA 16, seq 4096, EP 8, "
               f"FSDP 8, TE + DeepEP, 21.773 s per step, 277 TFLOP/s, 12,040 tokens/s per GPU)",
        note=f"full recomputation as moe_ep issue #22 states (the table has no recompute column); "
             f"{_AUTOMODEL_BALANCED}; the full logits of 4 x 4096 tokens over a 151,936-token vocabulary and "
             f"their fp32 gradient do not fit beside the rest: the layout fits with moe_ep's chunked loss only",
    ),
    Anchor(
        "AutoModel DeepSeek-V3", "deepseek-v3", nodes=32, pp=4, dp_replicate=1, dp_shard=64, ep=64,
        microbatch_size=1, global_batch=512, seq_len=4096, schedule=INTERLEAVED, virtual_stages=8,
        checkpointing=None, balanced_routing=True, published=1002, unit=TOKENS_PER_GPU,
        source=f"{_AUTOMODEL_SUMMARY}, row 'DeepSeek V3 671B' with 256 GPUs (GBS 512, MBS 1, LBS 8, seq 4096, "
               f"PP 4, EP 64, VP 8, FSDP 64, TE + DeepEP, 8.18 s per step, 250 TFLOP/s, 1,002 tokens/s per GPU)",
        note=f"recomputation not published: the planner chooses; the multi-token-prediction layer is not modelled; "
             f"{_AUTOMODEL_BALANCED}; its parameters stay in the checkpoint's bf16 and torch.optim.Adam keeps its "
             f"moments in their dtype (examples/benchmark/configs/deepseek_v3_te_deepep.yaml and the model's "
             f"code: 8 bytes per parameter), so moe_ep's plan keeps float32 master weights and bf16 moments "
             f"(12 bytes)",
        bf16_moments=True,
    ),
    Anchor(
        "Megatron Qwen3-235B-A22B", "qwen3-235b-a22b", nodes=32, pp=8, dp_replicate=1, dp_shard=32, ep=32,
        microbatch_size=1, global_batch=2048, seq_len=4096, schedule=INTERLEAVED, virtual_stages=4,
        checkpointing=None, balanced_routing=True, published=17.6, unit=STEP_SECONDS,
        source="layout: Megatron-Bridge's recipe qwen3_235b_a22b_pretrain_256gpu_h100_bf16_config, "
               "https://docs.nvidia.com/nemo/megatron-bridge/nightly/apidocs/bridge/"
               "bridge.perf_recipes.qwen.h100.qwen3_moe.html (256 H100, BF16, TP 2 PP 8 VP 4 EP 32; its source: "
               "MBS 1, seq 4096, no recompute, moe_router_force_load_balancing, all-to-all overlap); the 17.6 s "
               "per step as reported in moe_ep issue #22/#23, source not confirmed here",
        note="TP2 x DP16 become dp_shard 32, so each GPU keeps the activations that TP2 with sequence "
             "parallelism splits over two: the recipe recomputes nothing, the planner chooses here (kept "
             "whole, the activations alone would not fit in 80 GB); global batch 2048 x 4096 assumed: the "
             "recipe's GBS 8192 in 17.6 s "
             "would be 7,450 tokens/s per GPU, beyond an H100's dense peak for 22 B active parameters; the "
             "recipe's all-to-all overlap (a steady-state forward beside another micro-batch's backward) is "
             "moe_ep's schedule 'interleaved-1f1b-overlap', which runs apart the pairs whose two passes are of "
             "one stage (from none to about half of a rank's here)",
    ),
)


@dataclass(frozen=True)
class AnchorRow:
    """An anchor and its planned candidate, or why it could not be planned."""

    anchor: Anchor
    candidate: Candidate | None
    why: str | None = None  # why there is no candidate
    chunked_loss: bool = False  # the candidate is planned with moe_ep's chunked loss
    overlap_chunks: int = 1  # its MoE layers' exchanges overlap the experts of this many chunks
    compiled_blocks: bool = False  # the candidate's dense blocks are compiled
    # The same anchor under moe_ep's DualPipeV (one micro-batch's exchanges behind another's
    # compute), for a pipelined anchor on another schedule; None otherwise.
    dualpipev: AnchorRow | None = None
    # The experts' grouped-GEMM efficiency the row is planned at (a calibration file's problem
    # nearest its model's experts), and the one at which the candidate's layout plans the
    # published figure, every other rate as it is (None: not even the whole peak gets there).
    experts_efficiency: float | None = None
    experts_efficiency_to_match: float | None = None
    # The attention efficiency the row is planned at (a calibration file's model nearest its own).
    attention_efficiency: float | None = None

    @property
    def step_s(self) -> float:
        return self.candidate.time.total

    @property
    def tokens_per_gpu(self) -> float:
        return self.anchor.global_batch_tokens / self.step_s / self.candidate.layout.world_size

    @property
    def planned(self) -> float:
        """The planned figure in the published figure's unit."""
        return self.tokens_per_gpu if self.anchor.unit == TOKENS_PER_GPU else self.step_s

    @property
    def ratio(self) -> float:
        """Planned over published throughput: above 1, moe_ep plans the run faster than published."""
        published = self.anchor.published
        return self.planned / published if self.anchor.unit == TOKENS_PER_GPU else published / self.planned

    @property
    def all_to_all_share(self) -> float:
        return self.candidate.time.all_to_all / self.step_s

    def status(self) -> str:
        if self.candidate is None:
            return f"not planned: {self.why}"
        memory = self.candidate.memory
        options = "; with the chunked loss" if self.chunked_loss else ""
        if self.anchor.bf16_moments:
            options += "; AdamW's moments in bf16"
        if self.overlap_chunks > 1:
            options += f"; the all-to-alls overlapped with the experts of {self.overlap_chunks} chunks"
        if self.compiled_blocks:
            options += "; dense blocks compiled"
        if self.candidate.layout.schedule == INTERLEAVED_OVERLAP:
            options += "; each steady-state forward beside another stage's backward (interleaved-1f1b-overlap)"
        if memory.fits:
            return f"fits: {format_bytes(memory.total)} per GPU, {format_bytes(memory.headroom)} free{options}"
        return _why_not_fitting(self.candidate) + options


@dataclass(frozen=True)
class AnchorReport:
    rows: tuple[AnchorRow, ...]
    cluster: Cluster  # the first anchor's, resolved: the efficiencies all rows share
    calibration: str | None

    def format(self) -> str:
        return format_anchors(self)

    def to_dict(self) -> dict:
        return anchors_to_dict(self)


def plan_anchor(anchor: Anchor, calibration: str | Path | None = None) -> AnchorRow:
    """Cost ``anchor``'s published layout; where checkpointing is open, the headroom rule picks
    among the fitting choices (the smallest footprint when none fits)."""
    spec = ModelSpec.resolve(anchor.model)
    cluster, _ = _resolve_cluster(anchor.nodes, anchor.cluster, calibration, {}, {}, spec)
    info = SCHEDULES.get(anchor.schedule)
    problem = info.check_microbatches(anchor.pp, anchor.microbatches) if info is not None else None
    if problem is not None:
        return AnchorRow(anchor, None, f"{anchor.schedule}: {problem}")
    imbalance = dict(imbalance=1.0, startup_imbalance=1.0) if anchor.balanced_routing else {}
    candidates, reasons, options = [], [], {}
    # moe_ep's stack with or without its chunked loss (no full logits, but the head weight's
    # float32 gradient reread once per chunk), the exchanges of two chunks overlapped with the
    # experts (expert parallelism only) and compiled dense blocks (recompute "none" or "full"), as
    # the headroom rule picks.
    for chunked_loss, overlap_chunks, compiled_blocks in itertools.product(
            (False, True), (1, 2) if anchor.ep > 1 else (1,), (False, True)):
        assumptions = Assumptions(**imbalance, chunked_loss=chunked_loss, overlap_chunks=overlap_chunks,
                                  bf16_moments=anchor.bf16_moments, compiled_blocks=compiled_blocks)
        for layout in anchor.layouts():
            if compiled_blocks and layout.checkpointing not in COMPILED_BLOCKS_POLICIES:
                continue
            try:
                candidates.append(evaluate(spec, cluster, layout, anchor.seq_len, assumptions))
            except InfeasiblePartition as err:
                reasons.append(f"{layout.short()}: {err}")
                continue
            options[id(candidates[-1])] = assumptions
    if not candidates:
        return AnchorRow(anchor, None, "; ".join(dict.fromkeys(reasons)))
    fitting = [c for c in candidates if c.fits]
    best = (choose(fitting, DEFAULT_MIN_HEADROOM, DEFAULT_SPEED_MARGIN)[0] if fitting
            else min(candidates, key=lambda c: (c.memory.total, c.time.total)))
    dualpipev = None
    if anchor.pp > 1 and anchor.schedule != DUALPIPEV:
        dualpipev = plan_anchor(replace(anchor, schedule=DUALPIPEV, virtual_stages=None), calibration)
    assumptions = options[id(best)]
    return AnchorRow(anchor, best, chunked_loss=assumptions.chunked_loss, overlap_chunks=assumptions.overlap_chunks,
                     compiled_blocks=assumptions.compiled_blocks, dualpipev=dualpipev,
                     experts_efficiency=cluster.efficiencies.grouped_gemm,
                     experts_efficiency_to_match=experts_efficiency_to_match(anchor, spec, cluster, best.layout,
                                                                             assumptions),
                     attention_efficiency=cluster.efficiencies.attention)


def experts_efficiency_to_match(anchor: Anchor, spec: ModelSpec, cluster: Cluster, layout: Layout,
                                assumptions: Assumptions, tolerance: float = 1e-3) -> float | None:
    """The grouped-GEMM efficiency (a fraction of the peak) at which ``layout`` plans ``anchor``'s
    published figure on ``cluster``, the other efficiencies as they are: what the experts' kernels
    would have to reach for the rest of the stack, as planned, to match the published run. None
    when the whole peak does not get there: the difference lies elsewhere too. Found by bisection
    (to ``tolerance``) on the planned ratio, which grows with the experts' rate."""
    units = _units(spec, layout, anchor.seq_len, assumptions, cluster)

    def ratio(efficiency: float) -> float:
        rates = replace(cluster.efficiencies, grouped_gemm=efficiency)
        candidate = evaluate(spec, replace(cluster, efficiencies=rates), layout, anchor.seq_len, assumptions, units)
        return AnchorRow(anchor, candidate).ratio

    if ratio(1.0) < 1:
        return None
    low, high = 0.0, 1.0
    while high - low > tolerance:
        middle = (low + high) / 2
        low, high = (low, middle) if ratio(middle) >= 1 else (middle, high)
    return high


def anchor_report(calibration: str | Path | None = None, anchors: tuple[Anchor, ...] = ANCHORS) -> AnchorReport:
    """Plan every anchor on its published layout. ``calibration``: a result file of the kernels
    bench (or of scripts/gpu_check.sh) from an H100, whose measured efficiencies replace the
    defaults, as ``plan(calibration=)`` takes it."""
    if not anchors:
        raise ValueError("anchors must name at least one published run")
    if len({a.cluster for a in anchors}) > 1:
        # The report states one set of efficiencies for all rows.
        raise ValueError(f"anchors must share one cluster preset, got {sorted({a.cluster for a in anchors})}")
    cluster, _ = _resolve_cluster(anchors[0].nodes, anchors[0].cluster, calibration, {}, {})
    rows = tuple(plan_anchor(a, calibration) for a in anchors)
    return AnchorReport(rows, cluster, None if calibration is None else str(calibration))


_WIDTH = 120
_COLUMNS = ("#", "anchor", "GPUs", "layout", "ckpt", "tok/s/GPU", "step s", "GiB/GPU", "fits", "a2a", "published",
            "ratio")
_FORMAT = "{:<2} {:<26} {:>4} {:<26} {:<4} {:>9} {:>6} {:>7} {:<4} {:>4} {:>12} {:>5}"
# The recompute policy in 4 columns: the table fits 120.
_CHECKPOINTING = {"none": "-", "full": "full", "selective": "sel", "attention": "attn"}


def _layout_text(layout: Layout) -> str:
    parts = [f"pp{layout.pp}"] if layout.pp > 1 else []
    parts.append(f"ep{layout.ep}")
    parts.append(f"fsdp{layout.dp_shard}" + (f"x{layout.dp_replicate}" if layout.dp_replicate > 1 else ""))
    if layout.virtual_stages is not None:
        parts.append(f"v{layout.virtual_stages}")
    parts.append(f"mb{layout.microbatch_size}x{layout.microbatches}")
    return " ".join(parts)


def _published_text(anchor: Anchor) -> str:
    value = f"{anchor.published:,.0f}" if anchor.unit == TOKENS_PER_GPU else f"{anchor.published:g}"
    return f"{value} {'tok/s' if anchor.unit == TOKENS_PER_GPU else 's/step'}"


def _row_line(i: int, row: AnchorRow) -> str:
    a = row.anchor
    if row.candidate is None:
        return _FORMAT.format(i, a.name, a.world_size, *("-",) * 7, _published_text(a), "-")
    c = row.candidate
    return _FORMAT.format(
        i, a.name, c.layout.world_size, _layout_text(c.layout), _CHECKPOINTING[c.layout.checkpointing],
        f"{row.tokens_per_gpu:,.0f}", f"{row.step_s:.2f}",
        f"{c.memory.total / 2**30:.1f}", "yes" if c.fits else "NO", f"{row.all_to_all_share:.0%}",
        _published_text(a), f"{row.ratio:.2f}",
    )


def _wrap(text: str, indent: str = "    ") -> list[str]:
    # URLs stay whole: no breaks at their hyphens.
    return textwrap.wrap(text, _WIDTH, initial_indent=indent, subsequent_indent=indent + "  ",
                         break_on_hyphens=False, break_long_words=False)


def format_anchors(report: AnchorReport) -> str:
    c = report.cluster
    how = (f"measured efficiencies from {report.calibration}" if report.calibration
           else "the default H100 efficiencies")
    lines = [
        f"moe-ep plan --anchors: published MoE training runs planned with their published layouts on {c.preset}",
        f"({c.gpu}, {c.gpu_memory_gib:g} GiB), planned (estimated, not measured) with",
        *_wrap(f"{how}:", indent=""),
    ]
    for line in _efficiency_lines(c):
        lines += _wrap(line.strip())
    planned = [row for row in report.rows if row.candidate is not None]
    if {row.experts_efficiency for row in planned} - {c.efficiencies.grouped_gemm}:
        lines += _wrap("the experts of each row at the measured problem nearest its model's (the rate its notes say "
                       "it is planned at); the line above is the first row's")
    if {row.attention_efficiency for row in planned} - {c.efficiencies.attention}:
        lines += _wrap("the attention of each row at the measured model nearest its own ("
                       + ", ".join(f"{row.anchor.model} {row.attention_efficiency * c.peak_tflops:,.0f} TFLOP/s"
                                   for row in planned) + "); the line above is the first row's")
    lines += [
        "tok/s/GPU and step s: planned; GiB/GPU: planned memory of the fullest rank (fits: within the GPU's memory",
        "less the 10% reserve); a2a: the expert all-to-all's share of the planned step; ratio: planned over published",
        "throughput (for a published step time, published over planned seconds): above 1, moe_ep plans it faster.",
        "",
        _FORMAT.format(*_COLUMNS),
        "-" * len(_FORMAT.format(*_COLUMNS)),
    ]
    lines += [_row_line(i, row) for i, row in enumerate(report.rows, 1)]
    lines += ["", "notes and sources"]
    for i, row in enumerate(report.rows, 1):
        a = row.anchor
        lines += _wrap(f"[{i}] {a.name}: {row.status()}.", indent="  ")
        if row.candidate is not None:
            lines += _wrap(f"{_to_match_text(row, c)}.")
        if row.dualpipev is not None:
            lines += _wrap(f"under DualPipeV instead: {_dualpipev_text(row.dualpipev)}; "
                           f"{_to_match_text(row.dualpipev, c)}.")
        lines += _wrap(f"note: {a.note}.")
        lines += _wrap(f"source: {a.source}.")
    return "\n".join(lines)


def _to_match_text(row: AnchorRow, cluster: Cluster) -> str:
    """What the experts' kernels would have to reach for the row to plan the published figure."""
    if row.candidate is None:
        return "nothing to match: not planned"
    now = row.experts_efficiency
    needed = row.experts_efficiency_to_match
    if needed is None:
        return (f"to match the published figure: not by the experts alone; even at the whole peak of "
                f"{cluster.peak_tflops:,.0f} TFLOP/s (planned here at {now * cluster.peak_tflops:,.0f}) the rest of "
                f"the planned step is longer than the published one")
    return (f"to match the published figure: the experts' grouped GEMMs at {needed * cluster.peak_tflops:,.0f} "
            f"TFLOP/s ({needed:.0%} of the peak; planned here at {now * cluster.peak_tflops:,.0f}), the rest as "
            f"planned")


def _dualpipev_text(row: AnchorRow) -> str:
    """The anchor under DualPipeV, in a note line."""
    if row.candidate is None:
        return f"not planned: {row.why}"
    c = row.candidate
    return (f"{row.tokens_per_gpu:,.0f} tok/s/GPU, {row.step_s:.2f} s per step (ratio {row.ratio:.2f}), a2a "
            f"{row.all_to_all_share:.0%}, {_CHECKPOINTING[c.layout.checkpointing]} recompute; {row.status()}")


def anchors_to_dict(report: AnchorReport) -> dict:
    from .presets import Efficiencies

    c = report.cluster
    rows = [_row_dict(row) for row in report.rows]
    return {
        "estimated": True,
        "calibration": report.calibration,
        "efficiencies": {k: {"value": getattr(c.efficiencies, k), "source": c.efficiencies.source(k)}
                         for k in Efficiencies.KINDS},
        "anchors": rows,
    }


def _row_dict(row: AnchorRow) -> dict:
    """One row of ``anchors_to_dict``."""
    a, cand = row.anchor, row.candidate
    entry = {
        "name": a.name, "model": a.model, "cluster": a.cluster, "nodes": a.nodes, "world_size": a.world_size,
        "seq_len": a.seq_len, "global_batch_sequences": a.global_batch,
        "balanced_routing": a.balanced_routing, "bf16_moments": a.bf16_moments,
        "published": {"value": a.published, "unit": a.unit, "source": a.source},
        "note": a.note, "status": row.status(),
    }
    if cand is None:
        entry["planned"] = None
    else:
        entry["layout"] = cand.layout.short()
        entry["chunked_loss"] = row.chunked_loss
        entry["compiled_blocks"] = row.compiled_blocks
        entry["overlap_chunks"] = row.overlap_chunks
        entry["experts_efficiency"] = row.experts_efficiency
        entry["experts_efficiency_to_match"] = row.experts_efficiency_to_match
        entry["attention_efficiency"] = row.attention_efficiency
        entry["planned"] = {
            "tokens_per_s_per_gpu": row.tokens_per_gpu, "step_time_s": row.step_s,
            "memory_bytes_per_gpu": cand.memory.total, "fits": cand.fits,
            "all_to_all_share": row.all_to_all_share, "in_published_unit": row.planned,
            "ratio_planned_over_published_throughput": row.ratio,
            "step_time_rows_s": dict(cand.time.rows()),
        }
    if row.dualpipev is not None:
        entry["dualpipev"] = _row_dict(row.dualpipev)
    return entry
