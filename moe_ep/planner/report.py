"""What a plan prints: the cluster and where its figures come from, the layout, the per-GPU
memory table, the step-time estimate with the MFU that follows from the stated efficiencies, the
assumptions behind them and why the closest alternatives lost."""

from __future__ import annotations

from .activations import MicroBatch
from .memory import layer_ids, max_load, routed_counts
from .partition import format_bytes
from .presets import CLUSTERS, DEFAULT_CLUSTER, Efficiencies
from .recompute import DESCRIPTIONS as RECOMPUTE_DESCRIPTIONS
from .spec import format_count

ASSUMPTIONS = (
    "mixed precision as FSDP2 does it: fp32 master weights, bf16 compute, fp32 gradient reduction",
    "dense weights sharded over dp_shard, experts over ep then edp = dp_shard/ep, replicated over dp_replicate",
    "activations: what autograd saves with transformers' modeling code and moe_ep's Triton router and experts "
    "(checked against saved_tensors_hooks); full checkpointing keeps each layer's input, selective its input "
    "and its GEMM, attention-kernel and moe_ep-op outputs, attention recompute the attention block's input",
    "without pipeline: FSDP gathers each layer in forward and again in backward and reduce-scatters every "
    "micro-batch; the first all-gather and the last reduce-scatter are exposed, the rest overlaps compute "
    "(and the all-to-all when they use different links)",
    "with pipeline: weights stay gathered and gradients sync once per step; the reduction after the last "
    "backward is exposed",
    "routing uniform over experts; the busiest expert rank computes `imbalance` x the mean pairs",
    "a token is dispatched once per remote rank holding one of its experts; all-to-all on the critical path",
    "collectives inside a node run at the NVLink figure; across nodes at the network share of the group's GPUs "
    "per node (a group spanning whole nodes gets the node's network)",
    "backward scratch, memory-bound bytes and the efficiencies are estimates; everything on a GPU is estimated",
)


def _cluster_lines(plan) -> list[str]:
    c = plan.cluster
    preset = CLUSTERS[c.preset or DEFAULT_CLUSTER]
    name = (f"{c.preset} ({preset.description})" if c.preset
            else f"no preset named: the figures of {DEFAULT_CLUSTER} where not given")
    # The preset's description of its network holds only for its own figures.
    network_given = {"inter_node_gbps", "gpus_per_node"} & set(plan.overrides)
    lines = [
        f"cluster: {name}",
        f"  GPU {c.gpu}: {c.peak_tflops:g} TFLOP/s dense bf16, {c.gpu_memory_gib:g} GiB at {c.hbm_gbps:g} GB/s",
        f"  NVLink {c.intra_node_gbps:g} GB/s per GPU (NCCL bus bandwidth); network {c.node_network_gbps:g} GB/s "
        f"per node = {c.inter_node_gbps:g} GB/s per GPU" + (f" ({preset.network})" if c.preset and not network_given
                                                           else ""),
    ]
    if c.preset:
        lines.append(f"  sources: {preset.gpu.source}; {preset.source}")
    if plan.overrides:
        lines.append(f"  given: {', '.join(plan.overrides)}")
    return lines


def _efficiency_lines(c) -> list[str]:
    eff: Efficiencies = c.efficiencies
    names = {"grouped_gemm": "grouped GEMMs (experts)", "dense_gemm": "dense GEMMs",
             "attention": "attention (flash)", "memory": "memory-bound kernels"}
    lines = []
    for kind in Efficiencies.KINDS:
        value = getattr(eff, kind)
        figure = (f"{value * c.hbm_gbps:,.0f} GB/s" if kind == "memory" else f"{value * c.peak_tflops:,.0f} TFLOP/s")
        lines.append(f"    {names[kind]:<24} {value:5.0%} = {figure:>13}  {eff.source(kind)}")
    return lines


def _stages_line(cand) -> str:
    part, lay = cand.partition, cand.layout
    counts = [len(layer_ids(part.stage_names(s))) for s in range(part.num_stages)]
    extras = ["embedding on stage 0", f"head on stage {part.num_stages - 1}"]
    ranks = ", ".join(f"{s}->r{part.rank_of_stage(s)}" for s in range(part.num_stages)) if lay.stages_per_rank > 1 else ""
    return f"decoder layers per stage {counts} ({'; '.join(extras)}{'; ' + ranks if ranks else ''})"


def _imbalance_line(plan) -> str:
    a, spec, lay = plan.assumptions, plan.spec, plan.layout
    if lay.ep == 1 or not spec.num_experts:
        return "  expert side local (ep=1): no dispatcher, no imbalance between ranks"
    if a.capacity_factor is not None:
        tokens = MicroBatch(lay.microbatch_size, plan.seq_len).tokens
        padded = routed_counts(spec, lay, tokens, a.imbalance, a.capacity_factor).pairs / (tokens * spec.top_k)
        drops = (f"; a factor below 1 drops at least {1 - padded:.1%} of the routed pairs even under balanced routing "
                 f"(dropped pairs are not counted as model FLOPs)" if padded < 1 else "")
        return (f"  expert side in capacity mode (factor {a.capacity_factor:g}): fixed padded blocks, whatever the "
                f"routing; step time at the busiest rank's padded blocks, {padded:.3g}x the mean load{drops}")
    top = max_load(spec, lay.ep)
    startup = min(a.startup_imbalance, top)
    overlap = (f"; all-to-alls overlapped with the experts in {a.overlap_chunks} chunks (only what they do not "
               f"hide is counted)" if a.overlap_chunks > 1 else "")
    return (f"  expert side sized for a start-up imbalance of {startup:g}x the mean load (dropless routing allows "
            f"at most {top:g}x at ep={lay.ep}; a capacity factor bounds it); step time at {a.imbalance:g}x{overlap}")


def _rule_line(plan) -> str:
    rule, best = plan.rule, plan.best
    line = (f"  headroom rule: of the layouts within {rule.speed_margin:.0%} of the fastest step time, the fastest "
            f"keeping {rule.min_headroom:.0%} of GPU memory ({format_bytes(rule.min_headroom * best.memory.capacity)}) "
            f"free wins")
    if best.memory.headroom < rule.min_headroom * best.memory.capacity:
        line += (f"; none of them keeps that much, so the one with the most headroom wins "
                 f"({format_bytes(best.memory.headroom)} free)")
    if rule.fastest is not None:
        f = rule.fastest
        line += (f"; it passed over {f.layout.short()}, {1 - f.time.total / best.time.total:.1%} faster "
                 f"({f.time.total:.2f} s) but leaving {format_bytes(f.memory.headroom)} free")
    return line


def _mfu_lines(plan) -> list[str]:
    t, c = plan.best.time, plan.cluster
    mfu, ceiling = t.mfu(c), t.mfu_ceiling(c)
    listed = dict(t.losses)
    listed.update({"expert all-to-all": t.all_to_all, "FSDP/HSDP not hidden": t.fsdp_exposed,
                   "pipeline send/recv": t.p2p, "pipeline bubble": t.bubble})
    other = t.total - t.ideal - sum(listed.values())
    if abs(other) > 1e-9 * t.total:
        listed["other ranks' uneven work"] = other
    parts = ", ".join(f"{name} {_seconds(seconds)}" for name, seconds in listed.items() if seconds > 0.005 * t.total)
    return [
        "MFU, as a consequence of the stated efficiencies",
        *_efficiency_lines(c),
        f"  the slowest rank's model FLOPs take {_seconds(t.ideal)} at these efficiencies: MFU at most {ceiling:.1%}",
        f"  the step adds: {parts}",
        f"  MFU = {ceiling:.1%} x {_seconds(t.ideal)} / {_seconds(t.total)} = {mfu:.1%}",
    ]


def _seconds(x: float) -> str:
    """Seconds to two decimals, or three significant digits below one: a small model's step of
    0.03 s still shows the figures its MFU line is computed from."""
    return f"{x:.2f} s" if x >= 0.995 else f"{x:.3g} s"


def format_plan(plan) -> str:
    best, lay, spec, c = plan.best, plan.layout, plan.spec, plan.cluster
    tokens_per_step = plan.global_batch_tokens
    t = best.time
    lines = [
        f"moe-ep plan: {spec.name} ({format_count(spec.total_params)} parameters, "
        f"{format_count(spec.active_params)} active per token) on {c.nodes} nodes x {c.gpus_per_node} GPUs "
        f"({c.gpu_memory_gib:g} GiB each)",
        *_cluster_lines(plan),
        f"batch: {tokens_per_step} tokens per step = {tokens_per_step // plan.seq_len} sequences of {plan.seq_len}",
        "",
        "layout",
        f"  degrees            pp={lay.pp}  dp_replicate={lay.dp_replicate}  dp_shard={lay.dp_shard}  ep={lay.ep}"
        f"  (edp={lay.edp}, world {lay.world_size})",
        f"  micro-batches      {lay.microbatches} per step of {lay.microbatch_size} sequence(s) "
        f"({lay.microbatch_size * plan.seq_len} tokens) per data-parallel rank",
        f"  schedule           {lay.schedule}"
        + (f" ({lay.info.description}, bubble {lay.bubble():.2f} micro-batch times)" if lay.pp > 1 else ""),
        f"  checkpointing      {RECOMPUTE_DESCRIPTIONS[lay.checkpointing]}",
    ]
    if lay.pp > 1:
        lines.append(f"  stages             {_stages_line(best)}")
    lines += ["", f"memory per GPU (fullest rank{'' if lay.pp == 1 else f', pipeline rank {best.memory.rank}'})"]
    lines += [f"  {name:<62} {format_bytes(value):>12}" for name, value in best.memory.rows()]
    lines += [_imbalance_line(plan)]
    if plan.assumptions.bf16_moments:
        lines.append("  optimizer: AdamW with its two moments in bf16 (moe_ep.training.AdamW)")
    if plan.assumptions.chunked_loss:
        lines.append("  loss: moe_ep's chunked loss (no full logits; the head weight's float32 gradient kept from "
                     "forward to backward)")
    if plan.assumptions.compiled_blocks:
        lines.append("  dense blocks compiled (parallelize(compile_blocks=True)): their memory-bound bytes as Inductor "
                     "counts them; activations planned as eager's (an upper bound)")
    lines += [_rule_line(plan), "", "estimated step time (slowest rank)"]
    lines += [f"  {name:<62} {value:>10.2f} s" for name, value in t.rows()]
    lines += [
        f"  {'FSDP/HSDP traffic in all (hidden or not)':<62} {t.fsdp_traffic:>10.2f} s",
        f"  throughput {tokens_per_step / t.total:,.0f} tokens/s",
        "",
        *_mfu_lines(plan),
        "",
        "assumptions:",
    ]
    optimizer = ("AdamW with two bf16 moments (moe_ep.training.AdamW): 12 bytes per sharded parameter (weights 4, "
                 "gradients 4, moments 4)" if plan.assumptions.bf16_moments else
                 "AdamW with two fp32 moments: 16 bytes per sharded parameter (weights 4, gradients 4, moments 8)")
    lines += [f"  - {a}" for a in (ASSUMPTIONS[0], optimizer, *ASSUMPTIONS[1:])]
    lines += ["", f"alternatives ({plan.considered} layouts enumerated, {plan.costed} close enough to cost in full)"]
    if not plan.alternatives and plan.costed <= 1:
        lines.append("  none: the constraints leave a single layout")
    lines += [f"  - {cand.layout.short()}: {reason}" for cand, reason in plan.alternatives]
    return "\n".join(lines)


def _speed(cand, best) -> str:
    a, b = cand.time.total, best.time.total
    if abs(a - b) <= 0.005 * b:
        return f"as fast ({a:.2f} s vs {b:.2f} s per step)"
    word = "slower" if a > b else "faster"
    return f"{word}: {a:.2f} s vs {b:.2f} s per step ({a / b - 1:+.1%})"


def _memory(cand, best) -> str:
    a, b = cand.memory, best.memory
    word = "more" if a.total > b.total else "less"
    return (f"{word} memory: {format_bytes(a.total)} vs {format_bytes(b.total)} per GPU, "
            f"{format_bytes(a.headroom)} free")


def _biggest_time_delta(cand, best) -> str:
    mine, theirs = dict(cand.time.rows()), dict(best.time.rows())
    deltas = {name: mine[name] - theirs[name] for name in mine if name != "total"}
    name = max(deltas, key=deltas.get)
    return f"{name} {mine[name]:.2f} s vs {theirs[name]:.2f} s"


def _why_fitting_lost(cand, best, rule) -> str:
    if cand.time.total < best.time.total:
        return (f"{_speed(cand, best)}, within the {rule.speed_margin:.0%} margin, but leaves only "
                f"{format_bytes(cand.memory.headroom)} free, under the {rule.min_headroom:.0%} headroom rule; "
                f"{_memory(cand, best)}")
    speed = _speed(cand, best)
    if speed.startswith("slower"):
        speed += f"; {_biggest_time_delta(cand, best)}"
    return f"{speed}; {_memory(cand, best)}"


def _why_not_fitting(cand) -> str:
    m = cand.memory
    terms = {
        "parameters, gradients and optimizer state": m.params + m.peak_grads + m.optim,
        "activations": m.activations,
        "backward scratch": m.scratch,
        "FSDP2 working set": m.fsdp,
        "all-to-all buffers": m.all_to_all,
    }
    name = max(terms, key=terms.get)
    return (
        f"does not fit: needs {format_bytes(m.total)} per GPU, {format_bytes(-m.headroom)} over "
        f"{format_bytes(m.capacity)} (largest: {name} {format_bytes(terms[name])}); "
        f"it would take {cand.time.total:.2f} s per step"
    )


def _fastest_per_shape(candidates):
    per_key = {}
    for cand in sorted(candidates, key=lambda c: (c.time.total, c.memory.total)):
        per_key.setdefault(cand.key, cand)
    return list(per_key.values())


def explain_alternatives(best, candidates, count: int, rule) -> list[tuple[object, str]]:
    """The layouts that lost, one per shape (micro-batch size folded in), fastest first: up to
    half of them faster ones that do not fit (the winner's shape with bigger micro-batches
    included), the rest the next fastest that fit, the one the headroom rule passed over first."""
    faster = _fastest_per_shape([c for c in candidates if not c.fits and c.time.total < best.time.total])
    fitting = [c for c in candidates if c.fits and c is not best]
    if rule.fastest is not None:
        fitting = [rule.fastest] + [c for c in fitting if c.key != rule.fastest.key]
    slower = [c for c in _fastest_per_shape(fitting) if c.key != best.key or c is rule.fastest]
    if rule.fastest is not None and rule.fastest not in slower:
        slower.insert(0, rule.fastest)
    faster = faster[: count // 2]
    slower = slower[: count - len(faster)]
    return [(c, _why_not_fitting(c)) for c in faster] + [(c, _why_fitting_lost(c, best, rule)) for c in slower]


def plan_to_dict(plan) -> dict:
    lay, best, c, t = plan.layout, plan.best, plan.cluster, plan.best.time
    return {
        "model": plan.spec.name,
        "world_size": c.world_size,
        "cluster": {
            "preset": c.preset, "nodes": c.nodes, "gpus_per_node": c.gpus_per_node, "gpu": c.gpu,
            "gpu_memory_gib": c.gpu_memory_gib, "peak_tflops": c.peak_tflops, "hbm_gbps": c.hbm_gbps,
            "intra_node_gbps": c.intra_node_gbps, "inter_node_gbps": c.inter_node_gbps,
            "node_network_gbps": c.node_network_gbps, "overrides": list(plan.overrides),
        },
        "efficiencies": {k: {"value": getattr(c.efficiencies, k), "source": c.efficiencies.source(k)}
                         for k in Efficiencies.KINDS},
        "assumptions": {"imbalance": plan.assumptions.imbalance, "startup_imbalance": plan.assumptions.startup_imbalance,
                        "capacity_factor": plan.assumptions.capacity_factor,
                        "max_nodes": plan.assumptions.max_nodes,
                        "overlap_chunks": plan.assumptions.overlap_chunks,
                        "chunked_loss": plan.assumptions.chunked_loss,
                        "bf16_moments": plan.assumptions.bf16_moments,
                        "compiled_blocks": plan.assumptions.compiled_blocks},
        "degrees": {"pp": lay.pp, "dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard, "ep": lay.ep},
        "microbatch_size": lay.microbatch_size,
        "microbatches": lay.microbatches,
        "schedule": lay.schedule,
        "stages_per_rank": best.partition.num_stages // lay.pp,
        "checkpointing": lay.checkpointing,
        "stage_starts": list(best.partition.starts),
        "seq_len": plan.seq_len,
        "global_batch_tokens": plan.global_batch_tokens,
        "memory_bytes": dict(best.memory.rows()),
        "memory": {key: value for key, (_, value) in zip(best.memory.KEYS, best.memory.rows(), strict=True)},
        "step_time_s": dict(t.rows()),
        "fsdp_traffic_s": t.fsdp_traffic,
        "tokens_per_s": plan.global_batch_tokens / t.total,
        "tokens_per_s_per_gpu": plan.global_batch_tokens / t.total / c.world_size,
        "mfu": t.mfu(c),
        "mfu_ceiling": t.mfu_ceiling(c),
        "headroom_rule": {"min_headroom": plan.rule.min_headroom, "speed_margin": plan.rule.speed_margin,
                          "passed_over": plan.rule.fastest.layout.short() if plan.rule.fastest else None},
        "alternatives": [{"layout": cand.layout.short(), "reason": r} for cand, r in plan.alternatives],
        "layouts_enumerated": plan.considered,
        "layouts_costed": plan.costed,
        "estimated": True,
    }
