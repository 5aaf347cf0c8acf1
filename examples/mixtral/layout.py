"""The parallel layout: degrees from the flags or from moe_ep.plan, checked against the number of
processes, then applied to the model with moe_ep.parallelize.

Rank order follows ARCHITECTURE.md's dense mesh ``(pp, dp_replicate, dp_shard)``, row-major; experts use
``(pp, dp_replicate, edp, ep)`` with ``edp = dp_shard / ep``, so expert parallelism borrows ranks
from sharded data parallelism and every rank of a pipeline stage trains on its own data."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from moe_ep import DEFAULT_SCHEDULE, NO_PIPELINE, Layout, ParallelConfig
from moe_ep.runs import UsageError

from models import num_experts_in


@dataclass(frozen=True)
class RunLayout(Layout):
    """moe_ep's planner Layout (degrees, ``microbatch_size`` x ``microbatches`` sequences per
    step on each data-parallel rank: pipeline micro-batches with ``pp > 1``, gradient-accumulation
    steps without; schedule; activation checkpointing) and where the pipeline is cut."""

    # The first decoder layer of stages 1..S-1 (the planner's cut); None: moe_ep's automatic cut.
    split_points: tuple[int, ...] | None = None

    def dp_rank(self, rank: int) -> int:
        """Ranks of a pipeline stage are consecutive (mesh ``(pp, dp_replicate, dp_shard)``), so
        the data-parallel rank is the position within the stage."""
        return rank % self.dp

    @property
    def global_batch(self) -> int:
        """Sequences of one optimizer step over all data-parallel ranks."""
        return self.microbatch_size * self.microbatches * self.dp

    def describe(self) -> str:
        return self.short()


def layout_from_flags(args, world_size: int, config) -> RunLayout:
    """Degrees from the flags; ``--dp-shard`` defaults to the ranks the other degrees leave."""
    if args.pp == 1:
        given = [flag for flag, value in (("--schedule", args.schedule), ("--microbatches", args.microbatches))
                 if value is not None]
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            raise UsageError(f"{' and '.join(given)} {verb} to pipeline stages only (--pp > 1); gradient "
                             "accumulation without a pipeline is --grad-accum")
    elif args.grad_accum != 1:
        raise UsageError(f"--grad-accum {args.grad_accum} does not apply with pipeline stages (--pp {args.pp}): the "
                         "pipeline's --microbatches are the step's accumulation; raise those instead")
    rest = args.pp * args.dp_replicate
    if args.dp_shard is None:
        if world_size % rest:
            raise UsageError(
                f"--pp {args.pp} x --dp-replicate {args.dp_replicate} = {rest} does not divide the "
                f"{world_size} processes launched"
            )
        dp_shard = world_size // rest
    else:
        dp_shard = args.dp_shard
    degrees = {"pp": args.pp, "dp_replicate": args.dp_replicate, "dp_shard": dp_shard, "ep": args.ep}
    schedule = (args.schedule or DEFAULT_SCHEDULE) if args.pp > 1 else NO_PIPELINE
    microbatches = (args.microbatches or 2 * args.pp) if args.pp > 1 else args.grad_accum
    check_layout(degrees, schedule, microbatches, world_size, config)
    return RunLayout(**degrees, microbatch_size=args.micro_batch_size, microbatches=microbatches,
                     schedule=schedule, checkpointing=args.activation_checkpointing)


def check_layout(degrees: dict[str, int], schedule: str, microbatches: int, world_size: int, config) -> None:
    """What moe_ep (and the planner's Layout) would refuse after start-up, said before it in
    terms of the flags."""
    pp, dp_replicate, dp_shard, ep = (degrees[k] for k in ("pp", "dp_replicate", "dp_shard", "ep"))
    if pp * dp_replicate * dp_shard != world_size:
        raise UsageError(
            f"layout pp={pp} dp_replicate={dp_replicate} dp_shard={dp_shard} ep={ep} needs pp*dp_replicate*dp_shard "
            f"= {pp * dp_replicate * dp_shard} processes, but {world_size} were launched (accelerate launch "
            "--num_processes / torchrun --nproc-per-node)"
        )
    if dp_shard % ep:
        raise UsageError(
            f"--ep {ep} must divide --dp-shard {dp_shard}: expert parallelism borrows its ranks "
            "from sharded data parallelism"
        )
    num_experts = num_experts_in(config)
    if num_experts % ep:
        raise UsageError(f"--ep {ep} must divide the model's {num_experts} experts")
    if pp > 1:
        check_pipeline(pp, schedule, microbatches, config.num_hidden_layers)


def check_pipeline(pp: int, schedule: str, microbatches: int, num_layers: int) -> None:
    from moe_ep import schedule_info

    try:
        info = schedule_info(schedule)
    except ValueError as err:
        raise UsageError(f"--schedule: {err}") from None
    problem = info.check_microbatches(pp, microbatches)
    if problem:
        raise UsageError(f"--microbatches {microbatches}: {problem}")
    stages = pp * info.stages_per_rank
    if stages > num_layers:
        per_rank = f" ({info.stages_per_rank} per rank for {schedule})" if info.stages_per_rank > 1 else ""
        raise UsageError(f"--pp {pp} needs {stages} pipeline stages{per_rank}, one decoder layer at least "
                         f"each, but the model has {num_layers} layers")


def layout_from_plan(args, config, world_size: int, gpus_per_node: int):
    """The planner's layout for this model on the launched processes, its micro-batching
    included (it replaces --micro-batch-size and --grad-accum). Returns (layout, plan)."""
    from moe_ep import plan

    if world_size % gpus_per_node:
        raise UsageError(f"--plan: {world_size} processes are not a whole number of nodes of {gpus_per_node}")
    memory = args.gpu_memory_gib
    if memory is None:
        if not torch.cuda.is_available():
            raise UsageError("--plan on a machine without CUDA needs --gpu-memory-gib (the memory of the GPUs to plan for)")
        memory = torch.cuda.get_device_properties(0).total_memory / 2**30
    options = {"seq_len": args.seq_len, "overlap_chunks": args.overlap_chunks, "chunked_loss": args.chunked_loss,
               "bf16_moments": args.bf16_moments}
    if args.global_batch_tokens is not None:
        options["global_batch_tokens"] = args.global_batch_tokens
    if args.peak_tflops is not None:
        options["peak_tflops"] = args.peak_tflops
    try:
        chosen = plan(config, nodes=world_size // gpus_per_node, gpus_per_node=gpus_per_node, gpu_memory_gib=memory,
                      **options)
    except ValueError as err:  # the planner's PlanError says what would be needed
        raise UsageError(f"--plan: {err}") from None
    p = chosen.layout
    check_layout({"pp": p.pp, "dp_replicate": p.dp_replicate, "dp_shard": p.dp_shard, "ep": p.ep}, p.schedule,
                 p.microbatches, world_size, config)
    split_points = tuple(chosen.best.split_points) if p.pp > 1 else None
    return RunLayout(**asdict(p), split_points=split_points), chosen


def check_compile_blocks(layout: RunLayout) -> None:
    """--compile-blocks against the layout's recompute policy, as parallelize will check it, before
    any work."""
    try:
        ParallelConfig(activation_checkpointing=layout.checkpointing, compile_blocks=True)
    except ValueError as err:
        raise UsageError(f"--compile-blocks: {err}") from err


# parallelize's dispatcher arguments: (flag, default).
DISPATCHER_FLAGS = {"overlap_chunks": ("--overlap-chunks", 1), "dispatch_mode": ("--dispatch-mode", "auto"),
                    "node_size": ("--node-size", None)}


def dispatcher_options(args, layout: RunLayout) -> dict:
    """--overlap-chunks, --dispatch-mode and --node-size as parallelize takes them, checked against
    the layout as parallelize will check them (the node size: the launcher's where not given), so
    that a refusal names the flags and comes before any work."""
    options = {name: getattr(args, name) for name in DISPATCHER_FLAGS}
    given = [flag for name, (flag, default) in DISPATCHER_FLAGS.items() if options[name] != default]
    try:
        ParallelConfig(ep=layout.ep, **options).ep_node_size  # raises where dispatch_mode="node" cannot apply
    except ValueError as err:
        raise UsageError(f"{' and '.join(given) or '--dispatch-mode'}: {err}") from None
    return options


def describe_dispatcher(options: dict, ep: int) -> str:
    """The dispatch parallelize binds for ``dispatcher_options`` at ``ep``, in words."""
    size = ParallelConfig(ep=ep, **options).ep_node_size
    text = f"node-aware over {ep // size} nodes x {size}" if size else "single-stage"
    return text + (f", exchanges overlapped over {options['overlap_chunks']} chunks"
                   if options["overlap_chunks"] > 1 else "")


def apply_layout(model: torch.nn.Module, layout: RunLayout, *, mixed_precision: torch.dtype | None,
                 compile_blocks: bool = False, dispatcher: dict | None = None):
    """Shard the model in place with moe_ep.parallelize (collective), recomputation, compiled
    dense blocks and the dispatcher (``dispatcher_options``) as asked. Returns the model, or with
    ``pp > 1`` this rank's moe_ep.parallel.PipelineStages. One process without a process group
    keeps the model as it is, so it refuses what only parallelize would apply."""
    if layout.world_size == 1 and not torch.distributed.is_initialized():
        asked = [flag for flag, on in (("--activation-checkpointing", layout.checkpointing != "none"),
                                       ("--compile-blocks", compile_blocks)) if on]
        if asked:
            raise UsageError(f"{' and '.join(asked)} apply through moe_ep.parallelize, which one process without "
                             "a launcher does not call: launch it with torchrun --nproc-per-node 1 (or accelerate "
                             "launch)")
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from moe_ep import parallelize

    # Compute in the low precision, reduce gradients and keep master weights in float32.
    policy = MixedPrecisionPolicy(param_dtype=mixed_precision, reduce_dtype=torch.float32) if mixed_precision else None
    pipeline = {}
    if layout.pp > 1:
        pipeline = {"schedule": layout.schedule, "microbatches": layout.microbatches,
                    "split_points": None if layout.split_points is None else list(layout.split_points)}
    return parallelize(
        model, ep=layout.ep, dp_replicate=layout.dp_replicate, dp_shard=layout.dp_shard, pp=layout.pp,
        mixed_precision=policy, activation_checkpointing=layout.checkpointing, compile_blocks=compile_blocks,
        **pipeline, **(dispatcher or {}),
    )


def rank_view(model: nn.Module, modules: list[nn.Module]) -> nn.Module:
    """This rank's pipeline stage modules as one module whose names are the full model's
    (``model.layers.5...``, ``lm_head...``): what checkpoints, initialisation and the expert-load
    hooks see, so a pipeline checkpoint holds the model's own names and loads under any layout.
    Holds the stages' own submodules (nothing is copied) and ``model.config``; the layers of the
    other stages are not in it."""
    view = _merge([dict(m.named_children()) for m in modules])
    view.config = model.config
    return view


def _merge(children: list[dict[str, nn.Module]]) -> nn.Module:
    """A plain module with the union of ``children``; a name found in several is either the same
    module (shared, e.g. the rotary table) or a plain container whose children are merged
    (the base model, its ``layers``)."""
    merged = nn.Module()
    names = list(dict.fromkeys(name for c in children for name in c))
    for name in names:
        found = list({id(c[name]): c[name] for c in children if name in c}.values())
        if len(found) == 1:
            merged.add_module(name, found[0])
        elif all(type(m) in (nn.Module, nn.ModuleDict) for m in found):
            merged.add_module(name, _merge([dict(m.named_children()) for m in found]))
        else:
            raise ValueError(f"pipeline stages hold different modules named {name!r}")
    return merged
