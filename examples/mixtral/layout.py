"""The parallel layout: degrees from the flags or from moe_ep.plan, checked against the number of
processes, then applied to the model with moe_ep.parallelize.

Rank order follows DESIGN.md's dense mesh ``(pp, dp_replicate, dp_shard)``, row-major; experts use
``(pp, dp_replicate, edp, ep)`` with ``edp = dp_shard / ep``, so expert parallelism borrows ranks
from sharded data parallelism and every rank of a pipeline stage trains on its own data."""

from __future__ import annotations

import importlib
from dataclasses import asdict, dataclass

import torch
from torch import nn

from errors import UsageError

DEFAULT_SCHEDULE = "1f1b"
NO_PIPELINE = "none"


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    ep: int = 1
    microbatches: int = 1
    schedule: str = NO_PIPELINE
    activation_checkpointing: bool = False
    # The first decoder layer of stages 1..S-1 (the planner's cut); None: moe_ep's automatic cut.
    split_points: tuple[int, ...] | None = None

    @property
    def dp_size(self) -> int:
        """Ranks that see different data (expert parallel included)."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_size

    def dp_rank(self, rank: int) -> int:
        return rank % self.dp_size

    def sequences_per_rank(self, micro_batch_size: int, grad_accum: int) -> int:
        """One optimizer step's sequences on one data-parallel rank: the pipeline's micro-batches
        take the place of gradient accumulation."""
        return micro_batch_size * (self.microbatches if self.pp > 1 else grad_accum)

    def describe(self) -> str:
        text = f"pp={self.pp} dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} ep={self.ep}"
        if self.pp > 1:
            text += f" microbatches={self.microbatches} schedule={self.schedule}"
        return text + (" activation_checkpointing" if self.activation_checkpointing else "")

    def as_dict(self) -> dict:
        return asdict(self)


def layout_from_flags(args, world_size: int, config) -> Layout:
    """Degrees from the flags; ``--dp-shard`` defaults to the ranks the other degrees leave."""
    if args.pp == 1:
        given = [flag for flag, value in (("--schedule", args.schedule), ("--microbatches", args.microbatches))
                 if value is not None]
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            raise UsageError(f"{' and '.join(given)} {verb} to pipeline stages only (--pp > 1); gradient "
                             "accumulation without a pipeline is --grad-accum")
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
    layout = Layout(
        pp=args.pp, dp_replicate=args.dp_replicate, dp_shard=dp_shard, ep=args.ep,
        microbatches=args.microbatches or (2 * args.pp if args.pp > 1 else 1),
        schedule=(args.schedule or DEFAULT_SCHEDULE) if args.pp > 1 else NO_PIPELINE,
        activation_checkpointing=args.activation_checkpointing,
    )
    check_layout(layout, world_size, config)
    return layout


def num_experts_of(config) -> int:
    return getattr(config, "num_local_experts", None) or config.num_experts


def check_layout(layout: Layout, world_size: int, config) -> None:
    if layout.world_size != world_size:
        raise UsageError(
            f"layout {layout.describe()} needs pp*dp_replicate*dp_shard = {layout.world_size} processes, "
            f"but {world_size} were launched (accelerate launch --num_processes / torchrun --nproc_per_node)"
        )
    if layout.dp_shard % layout.ep:
        raise UsageError(
            f"--ep {layout.ep} must divide --dp-shard {layout.dp_shard}: expert parallelism borrows its ranks "
            "from sharded data parallelism"
        )
    num_experts = num_experts_of(config)
    if num_experts % layout.ep:
        raise UsageError(f"--ep {layout.ep} must divide the model's {num_experts} experts")
    if layout.pp > 1:
        check_pipeline(layout, config.num_hidden_layers)


def check_pipeline(layout: Layout, num_layers: int) -> None:
    """What moe_ep's pipeline would refuse after start-up, said before it."""
    from moe_ep.planner import schedule_info

    try:
        info = schedule_info(layout.schedule)
    except ValueError as err:
        raise UsageError(f"--schedule: {err}") from None
    problem = info.check_microbatches(layout.pp, layout.microbatches)
    if problem:
        raise UsageError(f"--microbatches {layout.microbatches}: {problem}")
    stages = layout.pp * info.stages_per_rank
    if stages > num_layers:
        per_rank = f" ({info.stages_per_rank} per rank for {layout.schedule})" if info.stages_per_rank > 1 else ""
        raise UsageError(f"--pp {layout.pp} needs {stages} pipeline stages{per_rank}, one decoder layer at least "
                         f"each, but the model has {num_layers} layers")


def check_layout_supported(layout: Layout, args) -> None:
    """Fail before any work when a flag asks for what the pipeline's training step does not do."""
    if layout.pp > 1 and args.grad_accum != 1:
        pipelined = f"with pipeline stages ({'--plan chose pp=' if args.plan else '--pp '}{layout.pp})"
        raise UsageError(f"--grad-accum {args.grad_accum} does not apply {pipelined}: the pipeline's "
                         "--microbatches are the step's accumulation; raise those instead")


def layout_from_plan(args, config, world_size: int, gpus_per_node: int):
    """The planner's layout for this model on the launched processes. Returns (layout, plan); sets
    ``args.micro_batch_size`` and ``args.grad_accum`` from the plan's micro-batching."""
    from moe_ep.planner import plan

    if world_size % gpus_per_node:
        raise UsageError(f"--plan: {world_size} processes are not a whole number of nodes of {gpus_per_node}")
    memory = args.gpu_memory_gib
    if memory is None:
        if not torch.cuda.is_available():
            raise UsageError("--plan on a machine without CUDA needs --gpu-memory-gib (the memory of the GPUs to plan for)")
        memory = torch.cuda.get_device_properties(0).total_memory / 2**30
    options = {"seq_len": args.seq_len}
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
    layout = Layout(pp=p.pp, dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, ep=p.ep,
                    microbatches=p.microbatches if p.pp > 1 else 1, schedule=p.schedule,
                    activation_checkpointing=p.checkpointing,
                    split_points=tuple(chosen.best.split_points) if p.pp > 1 else None)
    check_layout(layout, world_size, config)
    # Without pipeline stages the plan's micro-batches are gradient-accumulation steps.
    args.micro_batch_size = p.microbatch_size
    args.grad_accum = 1 if p.pp > 1 else p.microbatches
    return layout, chosen


def apply_layout(model: torch.nn.Module, layout: Layout, *, mixed_precision: torch.dtype | None):
    """Shard the model in place with moe_ep.parallelize (collective). Returns the model, or with
    ``pp > 1`` this rank's moe_ep.parallel.PipelineStages. One process without a process group
    keeps the model as it is."""
    if layout.world_size == 1 and not torch.distributed.is_initialized():
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from moe_ep.parallel import parallelize

    # Compute in the low precision, reduce gradients and keep master weights in float32.
    policy = MixedPrecisionPolicy(param_dtype=mixed_precision, reduce_dtype=torch.float32) if mixed_precision else None
    pipeline = {}
    if layout.pp > 1:
        pipeline = {"schedule": layout.schedule, "microbatches": layout.microbatches,
                    "split_points": None if layout.split_points is None else list(layout.split_points)}
    return parallelize(
        model, ep=layout.ep, dp_replicate=layout.dp_replicate, dp_shard=layout.dp_shard, pp=layout.pp,
        mixed_precision=policy, activation_checkpointing=layout.activation_checkpointing, **pipeline,
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


def meshes_of(model: torch.nn.Module):
    from moe_ep.parallel import meshes_of as meshes

    return meshes(model)


def is_parallelized(model: torch.nn.Module) -> bool:
    return hasattr(model, "moe_ep_meshes")


def clip_grad_norm_(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """The global gradient norm (clipped to ``max_norm``) across the dense and expert meshes."""
    if is_parallelized(model):
        from moe_ep.parallel import clip_grad_norm_ as clip_across_meshes

        return clip_across_meshes(model, max_norm)
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def gradient_sync(model: torch.nn.Module, enabled: bool) -> None:
    """Skip the gradient reduce-scatter on all micro-batches but the last of a step."""
    if is_parallelized(model):
        model.set_requires_gradient_sync(enabled)
