"""``parallelize``: expert parallelism, FSDP2/HSDP and pipeline stages on a transformers MoE
model, the one entry point for every layout. Its arguments become one ``ParallelConfig``; every
check runs before the first change, so a refused model is left as it was."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from ..hf.layout import expert_count, experts_modules, num_experts_of
from ..hf.patch import check_node_limit, fused_routers, is_patched, limit_routing_to_nodes, patch
from ..planner.partition import Partition
from .agreement import Description, parameter_fields, ranks_agree, shown
from .compile import check_compilable, compile_dense_blocks
from .config import ParallelConfig
from .context import ParallelContext, parallel_context, record_context
from .expert_sharding import shard_experts
from .fsdp import apply_fsdp
from .mesh import MoEMeshes, ParallelDims, build_meshes, resolve_dims
from .pipeline import PipelineStages, build_stages, plan_stages
from .pipeline.tied import shard_tied_stages
from .recompute import check_recompute_support, enable_activation_checkpointing

logger = logging.getLogger(__name__)


def parallelize(
    model: nn.Module,
    *,
    ep: int = 1,
    dp_replicate: int = 1,
    dp_shard: int | None = None,
    pp: int = 1,
    schedule: str | None = None,
    microbatches: int | None = None,
    split_points: Sequence[int] | None = None,
    memory_cap: float | None = None,
    seq_len: int | None = None,
    microbatch_size: int | None = None,
    virtual_stages: int | None = None,
    mixed_precision: MixedPrecisionPolicy | None = None,
    activation_checkpointing: str | bool = "none",
    capacity_factor: float | None = None,
    reshard_after_forward: bool | None = None,
    experts_backend: str | None = None,
    dispatch_mode: str = "auto",
    node_size: int | None = None,
    max_nodes: int | None = None,
    compile_blocks: bool | dict = False,
    overlap_chunks: int = 1,
) -> nn.Module | PipelineStages:
    """Spread ``model`` over the default process group; returns what ``moe_ep.TrainStep`` takes,
    so the training loop is the same for every layout::

        target = moe_ep.parallelize(model, ep=2, pp=pp, microbatches=4 if pp > 1 else None)
        step = moe_ep.TrainStep(target, torch.optim.AdamW(target.parameters()), microbatches=4)
        for batch in batches:
            loss = step(batch)

    - ``pp == 1``: ``model`` itself, sharded in place (an ``nn.Module``). Also usable without
      TrainStep, with any optimizer and loop, and with ``full_state_dict``.
    - ``pp > 1``: this rank's ``moe_ep.parallel.PipelineStages`` (``.parameters()`` for the
      optimizer). Stages run only under their schedule, which TrainStep drives; the model object
      is cut and must not be called or saved as a whole.

    Either way ``moe_ep.parallel.parallel_context(result)`` gives the configuration, the meshes
    and the stages.

    Degrees:

    - ``ep``: experts are split over ``ep`` ranks (DTensor ``Shard(0)``, global shapes and HF names
      kept) and tokens reach them through moe_ep's all-to-all dispatcher, which runs in moe_ep's
      experts implementation: a model whose experts run on another one is switched to it
      (``moe_ep.patch``, its routers left as they are), with a logged warning.
    - ``dp_replicate`` x ``dp_shard``: FSDP2 over ``dp_shard`` ranks, HSDP replicas over
      ``dp_replicate``; ``dp_shard=None`` uses the rest of the world. Experts are FSDP-sharded over
      ``edp = dp_shard / ep`` and replicated over ``dp_replicate``.
    - ``pp``: pipeline stages. ``schedule`` is ``"gpipe"``, ``"1f1b"`` (the default),
      ``"interleaved-1f1b"`` (``virtual_stages`` stages per rank, default 2; Megatron-Core's
      virtual pipeline size), ``"interleaved-1f1b-overlap"`` (the same order, each steady-state
      forward run beside the backward of another of the rank's stages, as Megatron-Core's
      all-to-all overlap pairs them), ``"zbv"`` or ``"dualpipev"`` (DualPipeV: at least
      ``2 * pp`` micro-batches). The two overlapping schedules run a backward on a second thread
      beside a forward, so each one's all-to-alls hide behind the other's compute; they need
      ``reshard_after_forward`` left None. ZB-V and DualPipeV run each
      backward as an input- and a weight-gradient pass over one graph, so they keep the experts'
      saved GEMM-1 output through the first (``moe_ep.ops.set_repeatable_backward(True)``, for
      the process): one ``[routed rows, 2I]`` buffer more at the experts' backward peak.
      ``microbatches`` (required, at least ``pp``) is the number of micro-batches per step;
      ``split_points`` the decoder-layer indices that start stages 1..S-1 (default: an automatic
      cut that balances the planner's per-layer costs). The automatic cut keeps every rank under
      ``memory_cap`` bytes (planner's memory model; None: no cap) for micro-batches of
      ``microbatch_size`` sequences (default 1) of ``seq_len`` tokens (default: the model's
      context, at most 4096). All seven are refused with ``pp=1``, where there is no pipeline (gradient accumulation without a pipeline: ``TrainStep(microbatches=...)``).

    Options:

    - ``mixed_precision``: an FSDP2 ``MixedPrecisionPolicy`` for every unit, or None (no casting).
    - ``activation_checkpointing``: what the backward recomputes of each decoder layer instead of
      keeping it, a policy of ``moe_ep.planner.recompute``: ``"none"`` (False), ``"full"`` (True:
      whole layers, transformers' non-reentrant checkpointing), ``"selective"`` (a
      selective checkpoint: GEMM, attention-kernel and moe_ep-op outputs kept, norms, rotary,
      gated activations and casts recomputed) or ``"attention"`` (the attention block only).
      Under ``"full"`` and ``"selective"`` the dispatcher's collectives run again in the same
      order on every rank.
    - ``capacity_factor``: None = dropless dispatch, else capacity mode (no host sync); needs
      ``ep > 1``.
    - ``reshard_after_forward``: FSDP2's; None means True without a pipeline and False with one
      (a pipeline would otherwise regather the weights for every micro-batch).
    - ``experts_backend``: the expert kernels' backend under expert parallelism (None: the default
      of ``moe_experts``).
    - ``dispatch_mode``: ``"auto"`` (default) dispatches node-aware (each token sent once per
      destination node over the network, forwarded inside it: ``moe_ep.dispatch.nodes``) when the
      ep group spans several whole nodes and the dispatch is dropless, else single-stage;
      ``"node"`` pins the node-aware dispatch (refused where it cannot apply), ``"flat"`` the
      single-stage one. ``node_size``: ranks per node (None: the launcher's ``LOCAL_WORLD_SIZE``;
      ranks are numbered node by node).
    - ``max_nodes``: node-limited routing (DeepSeek-V3's): every token goes to experts on at most
      this many of the ep group's nodes, so it crosses the network at most ``max_nodes`` times
      (``moe_ep.hf.limit_routing_to_nodes``). It changes the model's routing; it needs the
      node-aware dispatch and the fused routers of ``moe_ep.patch`` (checked before any change).
    - ``overlap_chunks``: 1 (default) dispatches, computes and combines each MoE layer's tokens in
      one go; ``n > 1`` cuts them into ``n`` chunks whose all-to-alls overlap the other chunks'
      experts, forward and backward (``moe_ep.dispatch.overlap``; the same results, the same one
      host sync per layer), single-stage or node-aware. Dropless only: refused with
      ``capacity_factor``.
    - ``compile_blocks``: ``torch.compile`` the dense parts of every decoder layer (of this rank's
      stages with ``pp > 1``), in place, so names and state-dict keys stay: False (default), True
      (torch.compile's defaults: inductor) or a dict of its keywords ``backend``, ``mode``,
      ``options``, ``dynamic``. Each submodule of a layer that holds no experts module (attention,
      norms, router, shared experts; torch's own modules are entered instead) is compiled with
      ``fullgraph=True``, so a graph break in the dense path is an error; the experts module, its
      FSDP2 hooks and the dispatcher's all-to-alls stay eager (``moe_ep.parallel.compile``). With
      ``activation_checkpointing`` ``"none"`` or ``"full"``.

    Every rank must call it (collective), with the same arguments and the same model (parameter
    names, shapes and dtypes, expert counts, routing): one all-gather of fingerprints confirms it
    before the first collective that depends on them, and ``moe_ep.RanksDisagree`` names the first
    difference on every rank otherwise (a rank that refuses its arguments stops the others too).
    Gradients are those of the mean of the data-parallel ranks' losses (TrainStep makes that the
    mean over all their tokens); clip them with ``moe_ep.parallel.clip_grad_norm_``. Model parameters may live on the meta device (shards are
    created there; materialise with ``to_empty`` and ``load_full_state_dict``)."""
    arguments = dict(
        ep=ep, dp_replicate=dp_replicate, dp_shard=dp_shard, pp=pp, schedule=schedule, microbatches=microbatches,
        split_points=split_points, memory_cap=memory_cap, seq_len=seq_len, microbatch_size=microbatch_size,
        virtual_stages=virtual_stages, mixed_precision=mixed_precision, activation_checkpointing=activation_checkpointing,
        capacity_factor=capacity_factor, reshard_after_forward=reshard_after_forward, experts_backend=experts_backend,
        dispatch_mode=dispatch_mode, node_size=node_size, max_nodes=max_nodes, compile_blocks=compile_blocks,
        overlap_chunks=overlap_chunks,
    )
    return _parallelize(model, arguments, lambda: ParallelConfig.from_arguments(**arguments))


def parallelize_with(model: nn.Module, config: ParallelConfig) -> nn.Module | PipelineStages:
    """``parallelize`` for a ``ParallelConfig`` built beforehand."""
    if not isinstance(config, ParallelConfig):
        raise TypeError(f"config must be a moe_ep.parallel.ParallelConfig, got {type(config).__name__}")
    return _parallelize(model, config.arguments(), lambda: config)


def _parallelize(model: nn.Module, arguments: dict, make_config: Callable[[], ParallelConfig]):
    """Check (the configuration, then what needs the model and the process group) and confirm that
    every rank was given the same, then change the model."""
    if not dist.is_initialized():
        raise RuntimeError("parallelize needs an initialised default process group (torch.distributed.init_process_group)")
    with ranks_agree("parallelize", _description(model, arguments)):
        config = make_config()
        dims, cut = _check(model, config)
    if dims.ep > 1 and not is_patched(model):
        _switch_to_moe_ep_experts(model, config)
    device = next(model.parameters()).device
    meshes = build_meshes(dims, _mesh_device(device))
    if config.pipeline is not None and config.pipeline.info.overlaps_forward_backward:
        # Imported here: torch's pipelining schedules import dynamo (0.7 s of a start-up).
        from .pipeline.overlap import create_backward_lanes

        create_backward_lanes(meshes)
    if config.max_nodes is not None:
        limit_routing_to_nodes(model, *_node_limit(dims, config))
    enable_activation_checkpointing(model, config.activation_checkpointing)
    if cut is None:
        _shard(model, meshes, config)
        record_context(model, ParallelContext(config, meshes))
        return model
    tied: list[tuple[int, int]] = []
    stages = build_stages(model, meshes.world["pp"].get_group(), cut, config.pipeline,
                          stage_transform=lambda modules: tied.extend(_shard_stages(modules, meshes, config)))
    stages.tied_stages = tuple((stages.stage_ids[owner], stages.stage_ids[user]) for owner, user in tied)
    record_context(model, ParallelContext(config, meshes, stages))
    return stages


def _mesh_device(device) -> str:
    return "cuda" if device.type == "cuda" else "cpu"


# The routing of a model's config that the parameter shapes do not show: ranks that route
# differently exchange different amounts (top-k) or train apart.
_ROUTING_FIELDS = ("num_experts_per_tok", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor")


def _description(model, arguments: dict) -> Description:
    """What every rank must agree on before the first collective: parallelize's arguments as
    given, the model's class, the device type its meshes will use, its expert counts and routing,
    and every parameter's name, shape and dtype."""
    shared = {name: shown(value) for name, value in arguments.items()}
    shared["model"] = type(model).__qualname__
    if isinstance(model, nn.Module):
        first = next(model.parameters(), None)
        shared["mesh device"] = "none" if first is None else _mesh_device(first.device)
        shared["experts per MoE layer"] = shown([expert_count(m) for _, m in experts_modules(model)])
        config = getattr(model, "config", None)
        for name in _ROUTING_FIELDS:
            if hasattr(config, name):
                shared[f"config.{name}"] = shown(getattr(config, name))
        shared.update(parameter_fields(model.named_parameters()))
    return Description(shared)


def _check(model: nn.Module, config: ParallelConfig) -> tuple[ParallelDims, Partition | None]:
    """What needs the model and the process group, checked before anything changes: the degrees
    against the world size and the expert count, and with ``pp > 1`` the pipeline's cut."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if parallel_context(model) is not None:
        raise ValueError("model was already parallelized (moe_ep.parallel.parallel_context(model) describes how)")
    experts = experts_modules(model)
    if config.ep > 1 and not experts:  # a dense model takes the rest: FSDP2/HSDP, pipeline stages
        raise ValueError(f"{type(model).__name__} has no transformers experts module to parallelize with "
                         f"ep={config.ep}")
    top_k = getattr(getattr(model, "config", None), "num_experts_per_tok", None)
    if experts and isinstance(top_k, int) and not 1 <= top_k <= num_experts_of(experts):
        raise ValueError(f"the model's config.num_experts_per_tok={top_k} must be in [1, E={num_experts_of(experts)}] "
                         "(the experts of each MoE layer)")
    dims = resolve_dims(
        dist.get_world_size(), ep=config.ep, dp_replicate=config.dp_replicate, dp_shard=config.dp_shard, pp=config.pp,
        num_experts=num_experts_of(experts) if experts else None,
        ep_node_size=config.ep_node_size,
    )
    check_recompute_support(model, config.activation_checkpointing)
    if config.compile_options is not None:
        check_compilable(model)
    if config.max_nodes is not None:
        check_node_limit(model, *_node_limit(dims, config))
    if config.pp == 1:
        return dims, None
    cut = plan_stages(model, dims.pp, config.pipeline, dp_shard=dims.dp_shard, ep=dims.ep,
                      checkpointing=config.activation_checkpointing)
    return dims, cut


def _node_limit(dims: ParallelDims, config: ParallelConfig) -> tuple[int, int]:
    """``(nodes, max_nodes)`` of node-limited routing: the nodes of the node-aware dispatch."""
    if dims.ep_node_size is None:
        raise ValueError(
            f"max_nodes={config.max_nodes} bounds the nodes a token reaches, which needs the node-aware dispatch: an "
            f"ep group over several whole nodes (ep={dims.ep} a multiple of the node size, larger than it; "
            f"dispatch_mode 'auto' or 'node', not {config.dispatch_mode!r} here or no such node size)"
        )
    return dims.ep // dims.ep_node_size, config.max_nodes


def _switch_to_moe_ep_experts(model: nn.Module, config: ParallelConfig) -> None:
    """Expert parallelism runs in moe_ep's experts implementation: switch a model whose experts
    run on another one, keeping its routers as they are (fused or its own)."""
    fused = bool(fused_routers(model))
    found = getattr(model.config, "_experts_implementation", None)
    patch(model, backend=config.experts_backend, fused_router=fused)
    logger.warning(
        "parallelize(ep=%d): %s ran its experts on %r; switched them to moe_ep's with moe_ep.patch(model, "
        "fused_router=%s), routers left as they were", config.ep, type(model).__name__, found, fused,
    )


def _shard(module: nn.Module, meshes: MoEMeshes, config: ParallelConfig) -> None:
    """The dense blocks compiled (after the recompute policy, before FSDP2, torchtitan's order),
    the experts over ``ep`` (with their dispatcher), then FSDP2 over the dense and expert meshes."""
    if config.compile_options is not None:
        compile_dense_blocks(module, config.compile_options,
                             split_backward=config.pipeline is not None and config.pipeline.info.splits_backward)
    experts = [m for _, m in experts_modules(module)]
    if meshes.dims.ep > 1 and experts:  # a pipeline stage of dense layers only has none to shard
        shard_experts(module, meshes.ep, capacity_factor=config.capacity_factor, backend=config.experts_backend,
                      node_groups=meshes.ep_nodes, overlap_chunks=config.overlap_chunks)
    apply_fsdp(module, meshes, experts, mixed_precision=config.mixed_precision,
               reshard_after_forward=config.fsdp_reshard_after_forward)


def _shard_stages(stages: list[nn.Module], meshes: MoEMeshes, config: ParallelConfig) -> list[tuple[int, int]]:
    """``_shard`` on each of this rank's stage modules, a parameter tied between two of them (ZB-V
    with a tied LM head) kept one FSDP parameter. Returns the tied (owner, user) stage indices."""
    return shard_tied_stages(stages, lambda stage: _shard(stage, meshes, config))
