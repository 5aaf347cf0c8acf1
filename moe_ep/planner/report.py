"""What a plan prints: the layout, the per-GPU memory table, the step-time estimate, the
assumptions behind them and why the closest alternatives lost."""

from __future__ import annotations

from .partition import format_bytes
from .memory import layer_ids
from .schedules import SCHEDULES

ASSUMPTIONS = (
    "mixed precision as FSDP2 does it: fp32 master weights, bf16 compute, fp32 gradient reduction",
    "AdamW with two fp32 moments: 16 bytes per sharded parameter (weights 4, gradients 4, moments 8)",
    "dense weights sharded over dp_shard, experts over ep then edp = dp_shard/ep, replicated over dp_replicate",
    "without pipeline: FSDP gathers one layer ahead and reduce-scatters every micro-batch, hidden behind compute",
    "with pipeline: gradients sync once per step, a stage holds its unsharded bf16 weights and fp32 gradients",
    "activations bf16, norms and loss fp32, flash/SDPA attention; full checkpointing keeps each layer's input",
    "routing uniform over experts; the busiest expert rank carries `imbalance` x the mean load",
    "a token is dispatched once per remote rank holding one of its experts; all-to-all on the critical path",
    "collectives run at the intra-node bandwidth when the group fits in a node, else at the inter-node one",
)


def _cost_model_line(plan) -> str:
    c = plan.cluster
    return (
        f"compute at {c.efficiency:.0%} of {c.peak_tflops:g} TFLOP/s bf16; links {c.intra_node_gbps:g} GB/s "
        f"intra-node, {c.inter_node_gbps:g} GB/s inter-node per GPU, {c.latency_us:g} us per all-to-all; "
        f"{c.reserve_fraction:.0%} of GPU memory reserved"
    )


def _stages_line(cand) -> str:
    part, lay = cand.partition, cand.layout
    counts = [len(layer_ids(part.stage_names(s))) for s in range(part.num_stages)]
    extras = ["embedding on stage 0", f"head on stage {part.num_stages - 1}"]
    ranks = ", ".join(f"{s}->r{part.rank_of_stage(s)}" for s in range(part.num_stages)) if lay.stages_per_rank > 1 else ""
    return f"decoder layers per stage {counts} ({'; '.join(extras)}{'; ' + ranks if ranks else ''})"


def format_plan(plan) -> str:
    best, lay, spec, c = plan.best, plan.layout, plan.spec, plan.cluster
    tokens_per_step = plan.global_batch_tokens
    t = best.time
    mfu = t.model_flops / (t.total * c.world_size * c.peak_tflops * 1e12)
    lines = [
        f"moe-ep plan: {spec.name} ({spec.total_params / 1e9:.1f} B parameters, {spec.active_params / 1e9:.1f} B active "
        f"per token) on {c.nodes} nodes x {c.gpus_per_node} GPUs ({c.gpu_memory_gib:g} GiB each)",
        f"batch: {tokens_per_step} tokens per step = {tokens_per_step // plan.seq_len} sequences of {plan.seq_len}",
        "",
        "layout",
        f"  degrees            pp={lay.pp}  dp_replicate={lay.dp_replicate}  dp_shard={lay.dp_shard}  ep={lay.ep}"
        f"  (edp={lay.edp}, world {lay.world_size})",
        f"  micro-batches      {lay.microbatches} per step of {lay.microbatch_size} sequence(s) "
        f"({lay.microbatch_size * plan.seq_len} tokens) per data-parallel rank",
        f"  schedule           {lay.schedule}"
        + (f" ({SCHEDULES[lay.schedule].description}, bubble {lay.bubble():.2f} micro-batch times)" if lay.pp > 1 else ""),
        f"  checkpointing      {'full (every decoder layer)' if lay.checkpointing else 'none'}",
    ]
    if lay.pp > 1:
        lines.append(f"  stages             {_stages_line(best)}")
    lines += ["", f"memory per GPU (fullest rank{'' if lay.pp == 1 else f', pipeline rank {best.memory.rank}'})"]
    lines += [f"  {name:<46} {format_bytes(value):>12}" for name, value in best.memory.rows()]
    lines += ["", "estimated step time"]
    lines += [f"  {name:<46} {value:>10.2f} s" for name, value in t.rows()]
    lines += [
        f"  {'FSDP/HSDP traffic in all (mostly overlapped)':<46} {t.fsdp_traffic:>10.2f} s",
        f"  throughput {tokens_per_step / t.total:,.0f} tokens/s, model FLOPs utilisation {mfu:.1%}",
        "",
        f"cost model: {_cost_model_line(plan)}",
        "assumptions:",
    ]
    lines += [f"  - {a}" for a in ASSUMPTIONS]
    lines += ["", f"alternatives ({plan.considered} layouts enumerated, {plan.costed} close enough to cost in full)"]
    if not plan.alternatives:
        lines.append("  none: the constraints leave a single layout")
    lines += [f"  - {cand.layout.short()}: {reason}" for cand, reason in plan.alternatives]
    return "\n".join(lines)


def _why_slower(cand, best) -> str:
    if cand.time.total <= best.time.total * 1.005:
        return (
            f"as fast ({cand.time.total:.2f} s vs {best.time.total:.2f} s per step) but needs more memory: "
            f"{format_bytes(cand.memory.total)} vs {format_bytes(best.memory.total)} per GPU"
        )
    mine, theirs = dict(cand.time.rows()), dict(best.time.rows())
    deltas = {name: mine[name] - theirs[name] for name in mine if name != "total"}
    name = max(deltas, key=deltas.get)
    return (
        f"slower: {cand.time.total:.2f} s vs {best.time.total:.2f} s per step "
        f"(+{cand.time.total / best.time.total - 1:.0%}); {name} {mine[name]:.2f} s vs {theirs[name]:.2f} s"
    )


def _why_not_fitting(cand) -> str:
    rows = dict(cand.memory.rows())
    biggest = max(
        ("parameters, gradients and optimizer state", cand.memory.params + cand.memory.grads + cand.memory.optim),
        ("activations", rows["activations"]),
        ("communication buffers", rows["communication buffers"]),
        key=lambda kv: kv[1],
    )
    return (
        f"does not fit: needs {format_bytes(cand.memory.total)} per GPU, {format_bytes(-cand.memory.headroom)} over "
        f"{format_bytes(cand.memory.capacity)} (largest: {biggest[0]} {format_bytes(biggest[1])}); "
        f"it would take {cand.time.total:.2f} s per step"
    )


def _fastest_per_shape(candidates):
    per_key = {}
    for cand in sorted(candidates, key=lambda c: (c.time.total, c.memory.total)):
        per_key.setdefault(cand.key, cand)
    return list(per_key.values())


def explain_alternatives(best, candidates, count: int) -> list[tuple[object, str]]:
    """The layouts that lost, one per shape (micro-batch size folded in), fastest first: up to
    half of them faster ones that do not fit (the winner's shape with bigger micro-batches
    included), the rest the next fastest that fit."""
    faster = _fastest_per_shape([c for c in candidates if not c.fits and c.time.total < best.time.total])
    slower = _fastest_per_shape([c for c in candidates if c.fits and c.key != best.key])
    faster = faster[: count // 2]
    slower = slower[: count - len(faster)]
    return [(c, _why_not_fitting(c)) for c in faster] + [(c, _why_slower(c, best)) for c in slower]


def plan_to_dict(plan) -> dict:
    lay, best = plan.layout, plan.best
    return {
        "model": plan.spec.name,
        "world_size": plan.cluster.world_size,
        "degrees": {"pp": lay.pp, "dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard, "ep": lay.ep},
        "microbatch_size": lay.microbatch_size,
        "microbatches": lay.microbatches,
        "schedule": lay.schedule,
        "checkpointing": lay.checkpointing,
        "stage_starts": list(best.partition.starts),
        "memory_bytes": dict(best.memory.rows()),
        "step_time_s": dict(best.time.rows()),
        "alternatives": [{"layout": c.layout.short(), "reason": r} for c, r in plan.alternatives],
    }
