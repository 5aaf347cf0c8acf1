"""Pipeline stages of a Hugging Face decoder-only causal LM with torch.distributed.pipelining.

``build_pipeline`` cuts the model at decoder-layer boundaries, automatically (moe_ep.partition
over the planner's per-unit costs) or at explicit split points, and returns this rank's stages.
Stage modules do not copy anything: they hold the model's own submodules under the model's own
names (``model.embed_tokens``, ``model.layers.<i>``, ``model.norm``, ``lm_head``), so state dicts
of the stages are slices of the model's. ``stage_transform`` runs on each stage module before it
is wrapped, which is where expert parallelism and FSDP2 are applied per stage
(``parallelize_pipeline``, which ``moe_ep.parallelize`` calls for ``pp > 1``).

Inputs: stage 0 takes ``input_ids [B, S]``; positions are ``0..S-1`` and attention is causal with
no padding mask (right-pad and set the padded labels to -100). The last stage returns logits.
The schedule comes from :meth:`PipelineStages.schedule`, given the loss function (see
moe_ep.training.TrainStep, which drives it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..partition import Partition, UnitCost, partition
from ..planner.layout import Layout
from ..planner.memory import DEFAULT_IMBALANCE, build_units, layer_ids, unit_costs
from ..planner.schedules import schedule_info
from ..planner.spec import ModelSpec
from .expert_sharding import experts_modules, shard_experts
from .fsdp import apply_fsdp
from .mesh import check_degree
from .parallelize import PIPELINE_MESHES_ATTRIBUTE, prepare

DEFAULT_COST_SEQ_LEN = 4096


def _parts_of(model: nn.Module):
    """(base model, lm_head) of a transformers causal LM, checked for what a stage needs."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    missing = [a for a in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(base, a)]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if base is None or missing or head is None or not hasattr(model, "config"):
        raise TypeError(
            f"model must be a transformers decoder-only *ForCausalLM (base model with embed_tokens, layers, norm, "
            f"rotary_emb and an LM head), got {type(model).__name__}"
            + (f" whose base model lacks {missing}" if base is not None and missing else "")
        )
    return base, head


class CausalLMStage(nn.Module):
    """Decoder layers ``layer_ids`` of ``model``, with the embedding when ``first`` and the final
    norm and LM head when ``last``. Submodules are the model's own, under the model's names."""

    def __init__(self, model: nn.Module, layer_ids: Sequence[int], *, first: bool, last: bool):
        super().__init__()
        base, head = _parts_of(model)
        prefix = getattr(model, "base_model_prefix", "model")
        self.config = model.config
        self.first, self.last = first, last
        self.layer_ids = tuple(layer_ids)
        # FSDP wraps the blocks this names (moe_ep.parallel.fsdp.transformer_blocks).
        self._no_split_modules = getattr(model, "_no_split_modules", None)
        self.prefix = prefix
        trunk = nn.Module()
        if first:
            trunk.embed_tokens = base.embed_tokens
        trunk.layers = nn.ModuleDict({str(i): base.layers[i] for i in self.layer_ids})
        trunk.rotary_emb = base.rotary_emb  # buffers only
        if last:
            trunk.norm = base.norm
        self.add_module(prefix, trunk)
        if last:
            self.lm_head = head

    @property
    def trunk(self) -> nn.Module:
        return getattr(self, self.prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        trunk = self.trunk
        hidden = trunk.embed_tokens(x) if self.first else x
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        position_embeddings = trunk.rotary_emb(hidden, position_ids)
        mask = create_causal_mask(
            config=self.config, inputs_embeds=hidden, attention_mask=None, past_key_values=None,
            position_ids=position_ids,
        )
        for layer in trunk.layers.values():
            hidden = layer(hidden, attention_mask=mask, position_ids=position_ids,
                           position_embeddings=position_embeddings)
            # Families written before transformers 5 return (hidden_states, ...).
            if isinstance(hidden, tuple):
                hidden = hidden[0]
        if self.last:
            hidden = self.lm_head(trunk.norm(hidden))
        return hidden


@dataclass
class PipelineStages:
    """This rank's share of a pipeline: stage modules (in stage order), their torch
    ``PipelineStage`` wrappers, the partition and the schedule to run them with."""

    modules: list[nn.Module]
    stages: list
    stage_ids: list[int]
    partition: Partition
    schedule_name: str
    microbatches: int
    group: dist.ProcessGroup
    meshes: object = None  # MoEMeshes when built by parallelize_pipeline
    _schedule: object = field(default=None, repr=False)

    @property
    def num_stages(self) -> int:
        return self.partition.num_stages

    @property
    def pp_size(self) -> int:
        return self.group.size()

    @property
    def pp_rank(self) -> int:
        return self.group.rank()

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    @property
    def last_stage_global_rank(self) -> int:
        """Global rank of the member of this pipeline group that computes the loss."""
        return dist.get_global_rank(self.group, self.partition.rank_of_stage(self.num_stages - 1))

    def parameters(self):
        seen = set()
        for module in self.modules:
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def named_parameters(self):
        seen = set()
        for module in self.modules:
            for name, p in module.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield name, p

    def train(self, mode: bool = True) -> "PipelineStages":
        for module in self.modules:
            module.train(mode)
        return self

    def schedule(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        """The torch schedule over these stages with ``loss_fn(logits, labels)``; built once.
        Gradients are not divided by the number of micro-batches: ``loss_fn`` normalises by the
        tokens of the whole step (moe_ep.training.CausalLMLoss)."""
        if self._schedule is None:
            from torch.distributed.pipelining import schedules

            info = schedule_info(self.schedule_name)
            cls = getattr(schedules, info.torch_class)
            stages = self.stages[0] if info.stages_per_rank == 1 else self.stages
            self._schedule = cls(stages, n_microbatches=self.microbatches, loss_fn=loss_fn, scale_grads=False)
        return self._schedule


def pipeline_unit_costs(
    model: nn.Module, pp: int, *, schedule: str, microbatches: int, seq_len: int | None = None,
    microbatch_size: int = 1, dp_shard: int = 1, ep: int = 1, checkpointing: bool = False,
) -> list[UnitCost]:
    """Per-unit costs of ``model`` for one micro-batch, one unit per decoder layer (embedding
    and head ride with the first and last), from the planner's cost model, so that the automatic
    cut and the planner agree."""
    spec = ModelSpec.from_config(model.config)
    seq = seq_len or min(DEFAULT_COST_SEQ_LEN, getattr(model.config, "max_position_embeddings", DEFAULT_COST_SEQ_LEN))
    layout = Layout(pp, 1, dp_shard, ep, microbatch_size, microbatches, schedule, checkpointing)
    costs = unit_costs(build_units(spec, layout, seq, DEFAULT_IMBALANCE))
    base, head = _parts_of(model)
    if head.weight is base.embed_tokens.weight:
        # The planner marks a tie from the config; the module is what counts.
        key = frozenset({"embed_tokens.weight"})
        costs[0] = UnitCost(**{**costs[0].__dict__, "shared": key})
        costs[-1] = UnitCost(**{**costs[-1].__dict__, "shared": key})
    return costs


def _check_split_points(split_points, num_layers: int, num_stages: int) -> list[int]:
    points = list(split_points)
    if len(points) != num_stages - 1 or not all(isinstance(p, int) and 0 < p < num_layers for p in points):
        raise ValueError(
            f"split_points must hold {num_stages - 1} decoder-layer indices in [1, {num_layers - 1}] (the first "
            f"layer of stages 1..{num_stages - 1}), got {points}"
        )
    # Unit i is decoder layer i (the embedding rides with layer 0, the head with the last).
    return points


def build_pipeline(
    model: nn.Module,
    pp_mesh,
    *,
    schedule: str = "1f1b",
    microbatches: int,
    split_points: Sequence[int] | None = None,
    memory_cap: float | None = None,
    seq_len: int | None = None,
    microbatch_size: int = 1,
    dp_shard: int = 1,
    ep: int = 1,
    checkpointing: bool = False,
    stage_transform: Callable[[nn.Module], None] | None = None,
    device: torch.device | str | None = None,
) -> PipelineStages:
    """Cut ``model`` into pipeline stages and return this rank's.

    Args:
        model: a transformers decoder-only ``*ForCausalLM`` (any device, meta included).
        pp_mesh: the 1-D pipeline DeviceMesh (e.g. ``meshes.world["pp"]``) or a ProcessGroup.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"`` (2 stages per rank) or ``"zbv"``
            (zero-bubble V, 2 stages per rank, first and last stage on pipeline rank 0).
        microbatches: micro-batches per step (at least the pipeline size).
        split_points: decoder-layer indices that start stages 1..S-1; overrides the automatic cut.
        memory_cap: bytes one rank may hold, checked with the planner's memory model under the
            batch shape ``seq_len`` x ``microbatch_size`` and sharding ``dp_shard``, ``ep``.
        checkpointing: whether layers will be recomputed (costs and memory only; enabling it is
            the caller's, e.g. ``enable_activation_checkpointing``).
        stage_transform: called on each stage module before it is wrapped (expert sharding, FSDP).
        device: where the stages compute; defaults to the model's parameters' device (cpu for meta).
    """
    if isinstance(pp_mesh, dist.ProcessGroup):
        group = pp_mesh
    elif hasattr(pp_mesh, "get_group") and getattr(pp_mesh, "ndim", 1) == 1:
        group = pp_mesh.get_group()
    else:
        raise TypeError(f"pp_mesh must be a 1-D DeviceMesh or a ProcessGroup, got {type(pp_mesh).__name__}")
    info = schedule_info(schedule)
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be a positive int, got {microbatches!r}")
    pp = group.size()
    problem = info.check_microbatches(pp, microbatches)
    if problem:
        raise ValueError(f"microbatches={microbatches}: {problem}")
    base, _ = _parts_of(model)
    num_layers = len(base.layers)
    num_stages = pp * info.stages_per_rank
    if num_stages > num_layers:
        raise ValueError(
            f"{num_stages} stages ({pp} ranks x {info.stages_per_rank} for {schedule!r}) need at least as many "
            f"decoder layers, the model has {num_layers}"
        )
    costs = pipeline_unit_costs(
        model, pp, schedule=schedule, microbatches=microbatches, seq_len=seq_len, microbatch_size=microbatch_size,
        dp_shard=dp_shard, ep=ep, checkpointing=checkpointing,
    )
    part = partition(
        costs, num_stages, memory_cap=memory_cap,
        split_points=None if split_points is None else _check_split_points(split_points, num_layers, num_stages),
        placement=info.placement, stages_per_rank=info.stages_per_rank, inflight=info.inflight(pp, microbatches),
    )
    if device is None:
        device = next(model.parameters()).device
        device = torch.device("cpu") if device.type == "meta" else device
    from torch.distributed.pipelining import PipelineStage

    rank = group.rank()
    stage_ids = [s for s in range(num_stages) if part.rank_of_stage(s) == rank]
    modules, stages = [], []
    for s in stage_ids:
        module = CausalLMStage(model, layer_ids(part.stage_names(s)), first=s == 0, last=s == num_stages - 1)
        if stage_transform is not None:
            stage_transform(module)
        modules.append(module)
        stages.append(PipelineStage(module, s, num_stages, torch.device(device), group=group))
    return PipelineStages(modules, stages, stage_ids, part, schedule, microbatches, group)


def parallelize_pipeline(
    model: nn.Module,
    *,
    pp: int,
    ep: int = 1,
    dp_replicate: int = 1,
    dp_shard: int | None = None,
    schedule: str = "1f1b",
    microbatches: int,
    split_points: Sequence[int] | None = None,
    memory_cap: float | None = None,
    seq_len: int | None = None,
    microbatch_size: int = 1,
    mixed_precision=None,
    activation_checkpointing: bool = False,
    capacity_factor: float | None = None,
    reshard_after_forward: bool = False,
    experts_backend: str | None = None,
) -> PipelineStages:
    """Pipeline stages composed with expert parallelism and FSDP2/HSDP: what
    ``moe_ep.parallelize`` does for ``pp > 1``, plus the automatic cut's knobs of
    ``build_pipeline`` (``memory_cap``, ``seq_len``, ``microbatch_size``). Builds the meshes of
    DESIGN.md with a real ``pp`` dimension, cuts the model, and on each of this rank's stages
    shards the experts over ``ep`` and applies FSDP2 exactly as ``parallelize`` does for a whole
    model; the other arguments are checked as there (``capacity_factor`` needs ``ep > 1``). A
    model without experts modules is accepted (dense stages). Returns the stages with the meshes
    on ``stages.meshes``.

    ``reshard_after_forward`` defaults to False: the schedule keeps a stage's gradients unsharded
    until its last micro-batch anyway, and regathering weights for every micro-batch would
    multiply the all-gather traffic by the micro-batch count."""
    check_degree("pp", pp)
    _, meshes = prepare(
        model, "parallelize_pipeline", pp=pp, ep=ep, dp_replicate=dp_replicate, dp_shard=dp_shard,
        mixed_precision=mixed_precision, activation_checkpointing=activation_checkpointing,
        capacity_factor=capacity_factor, reshard_after_forward=reshard_after_forward, require_experts=False,
    )
    dims = meshes.dims

    def shard_stage(stage: nn.Module) -> None:
        stage_experts = experts_modules(stage)
        if dims.ep > 1:
            shard_experts(stage, meshes.ep, capacity_factor=capacity_factor, backend=experts_backend)
        apply_fsdp(
            stage, meshes, [m for _, m in stage_experts], mixed_precision=mixed_precision,
            reshard_after_forward=reshard_after_forward,
        )

    stages = build_pipeline(
        model, meshes.world["pp"], schedule=schedule, microbatches=microbatches, split_points=split_points,
        memory_cap=memory_cap, seq_len=seq_len, microbatch_size=microbatch_size, dp_shard=dims.dp_shard, ep=dims.ep,
        checkpointing=activation_checkpointing, stage_transform=shard_stage,
    )
    stages.meshes = meshes
    setattr(model, PIPELINE_MESHES_ATTRIBUTE, meshes)
    return stages
