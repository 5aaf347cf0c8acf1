"""Pipeline stages of a Hugging Face decoder-only causal LM with torch.distributed.pipelining.

``build_pipeline`` cuts the model at decoder-layer boundaries, automatically (moe_ep.partition
over the planner's per-unit costs) or at explicit split points (no cost model needed), and
returns this rank's stages. Stage modules do not copy anything: they hold the model's own
submodules under the model's own names (``model.embed_tokens``, ``model.layers.<i>``,
``model.norm``, ``lm_head``), so state dicts of the stages are slices of the model's.
``stage_transform`` runs on this rank's stage modules before they are wrapped, which is where
expert parallelism and FSDP2 are applied per stage (``parallelize_pipeline``, which
``moe_ep.parallelize`` calls for ``pp > 1``).

Tied parameters (an LM head tied to the embedding) stay on one rank: the automatic cut keeps the
stages that share them there (ZB-V puts the first and the last stage on rank 0), and FSDP2 shards
such a parameter once, with the stage that holds it first (see ``_shard_tied_stages``).

Inputs: stage 0 takes ``input_ids [B, S]``; positions are ``0..S-1`` and attention is causal with
no padding mask (right-pad and set the padded labels to -100). The last stage returns logits.
The schedule comes from :meth:`PipelineStages.schedule`, given the loss function (see
moe_ep.training.TrainStep, which drives it)."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..planner.partition import Partition, UnitCost, partition
from ..planner.layout import Layout
from ..planner.memory import DEFAULT_IMBALANCE, build_units, layer_chain, layer_ids, unit_costs
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
        # The (absent) cache goes positionally: transformers 5.17 names it past_key_values, later
        # releases cache and warn about the old name.
        mask = create_causal_mask(self.config, hidden, None, None, position_ids=position_ids)
        for layer in trunk.layers.values():
            hidden = layer(hidden, attention_mask=mask, position_ids=position_ids,
                           position_embeddings=position_embeddings)
            # Families written before transformers 5 return (hidden_states, ...).
            if isinstance(hidden, tuple):
                hidden = hidden[0]
        if self.last:
            hidden = self.lm_head(trunk.norm(hidden))
        return hidden


class _LatestLoss:
    """The loss function the schedule calls: the one ``PipelineStages.schedule`` got last. A
    separate object, so that the schedule holds no reference back to the stages."""

    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.fn(logits, labels)


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
    # (stage that shards a tied parameter, later stage of this rank that uses it), by stage id.
    tied_stages: tuple[tuple[int, int], ...] = ()
    _schedule: object = field(default=None, repr=False)
    _loss: _LatestLoss = field(default_factory=_LatestLoss, repr=False)

    @property
    def num_stages(self) -> int:
        return self.partition.num_stages

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
        """The torch schedule over these stages, computing the loss with ``loss_fn(logits, labels)``
        until the next call gives another (so every TrainStep on these stages calls this before
        each of its steps). The schedule is built once: it holds the stages' communication set-up
        and shape inference, which a second schedule would redo on the same stages; it calls the
        loss through ``_LatestLoss``. Gradients are not divided by the number of micro-batches:
        ``loss_fn`` normalises by the tokens of the whole step (moe_ep.training.CausalLMLoss)."""
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(logits, labels), got {type(loss_fn).__name__}")
        self._loss.fn = loss_fn
        if self._schedule is None:
            from torch.distributed.pipelining import schedules

            info = schedule_info(self.schedule_name)
            cls = getattr(schedules, info.torch_class)
            stages = self.stages[0] if info.stages_per_rank == 1 else self.stages
            schedule = cls(stages, n_microbatches=self.microbatches, loss_fn=self._loss, scale_grads=False)
            _check_tied_order(schedule, self.pp_rank, self.tied_stages)
            self._schedule = schedule
        return self._schedule


def _check_tied_order(schedule, rank: int, tied_stages) -> None:
    """A tied parameter is gathered, reduced and resharded with the stage that shards it
    (``_shard_tied_stages``), so that stage's gradient reduction and reshard must come after
    every computation of the later stage that uses it too, or the later stage's last gradient
    contributions would miss the reduction. torch's ZB-V ends each rank's step with stage 0; this
    checks the schedule actually built rather than assuming it."""
    if not tied_stages:
        return
    order = getattr(schedule, "pipeline_order_with_comms", None)
    if order is None:
        raise RuntimeError(
            f"{type(schedule).__name__} exposes no per-rank action list to check that stages {list(tied_stages)} "
            "sharing a parameter reduce it after both have run"
        )
    actions = [a for a in order[rank] if a is not None]
    compute = {"FORWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT", "FULL_BACKWARD", "OVERLAP_F_B"}
    for owner, user in tied_stages:
        last_use = max(i for i, a in enumerate(actions) if a.stage_index == user and a.computation_type.name in compute)
        early = [str(a) for i, a in enumerate(actions)
                 if a.stage_index == owner and a.computation_type.name in ("REDUCE_GRAD", "RESHARD") and i < last_use]
        if early:
            raise RuntimeError(
                f"schedule {type(schedule).__name__} runs {early} of stage {owner}, which shards the parameter it "
                f"shares with stage {user}, before stage {user}'s last computation: the shared gradient would be "
                "reduced incomplete"
            )


def pipeline_unit_costs(
    model: nn.Module, pp: int, *, schedule: str, microbatches: int, seq_len: int | None = None,
    microbatch_size: int = 1, dp_shard: int = 1, ep: int = 1, checkpointing: bool = False,
) -> list[UnitCost]:
    """Per-unit costs of ``model`` for one micro-batch, one unit per decoder layer (embedding
    and head ride with the first and last), from the planner's cost model, so that the automatic
    cut and the planner agree. ``seq_len`` defaults to the model's context, at most
    ``DEFAULT_COST_SEQ_LEN``."""
    spec = ModelSpec.from_config(model.config)
    seq = seq_len or min(DEFAULT_COST_SEQ_LEN, getattr(model.config, "max_position_embeddings", DEFAULT_COST_SEQ_LEN))
    layout = Layout(pp, 1, dp_shard, ep, microbatch_size, microbatches, schedule, checkpointing)
    return _with_tie(model, unit_costs(build_units(spec, layout, seq, DEFAULT_IMBALANCE)))


def _layer_units(model: nn.Module, num_layers: int) -> list[UnitCost]:
    """The chain of ``pipeline_unit_costs`` with names and ties only: what explicit split points
    need, so cutting a model by hand never depends on the planner modelling its family."""
    names = ["embed", *(f"layers.{i}" for i in range(num_layers)), "head"]
    return _with_tie(model, layer_chain([UnitCost(name, 0.0) for name in names]))


def _with_tie(model: nn.Module, costs: list[UnitCost]) -> list[UnitCost]:
    """Each unit marked with the parameters it shares with another unit, under the first name the
    model gives them, so that the cut keeps the units between them on one stage (an LM head tied
    to the embedding ties the two end units, which only the V placement puts on one rank). The
    planner reads a tie from the config; the modules are what count."""
    base, head = _parts_of(model)
    last = len(base.layers) - 1
    if len(costs) != len(base.layers):
        raise ValueError(f"costs must hold one unit per decoder layer ({len(base.layers)}), got {len(costs)}")
    parts = [("embed_tokens", base.embed_tokens, 0), *((f"layers.{i}", layer, i) for i, layer in enumerate(base.layers)),
             ("norm", base.norm, last), ("lm_head", head, last)]
    units_of: dict[int, set[int]] = {}
    name_of: dict[int, str] = {}
    for prefix, module, unit in parts:
        for name, param in module.named_parameters(remove_duplicate=False):
            units_of.setdefault(id(param), set()).add(unit)
            name_of.setdefault(id(param), f"{prefix}.{name}")
    shared: list[set[str]] = [set() for _ in costs]
    for key, units in units_of.items():
        if len(units) > 1:
            for unit in units:
                shared[unit].add(name_of[key])
    return [UnitCost(**{**cost.__dict__, "shared": frozenset(keys)}) for cost, keys in zip(costs, shared)]


def _check_cut_options(memory_cap, seq_len, microbatch_size) -> None:
    if memory_cap is not None and (
        isinstance(memory_cap, bool) or not isinstance(memory_cap, (int, float)) or not 0 < memory_cap < math.inf
    ):
        raise ValueError(f"memory_cap must be a positive finite number of bytes or None, got {memory_cap!r}")
    for name, value in (("seq_len", seq_len), ("microbatch_size", microbatch_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int or None, got {value!r}")


def _check_pipeline(model: nn.Module, pp: int, schedule: str, microbatches, memory_cap, seq_len, microbatch_size):
    """Everything about a pipeline that can be checked before anything changes. Returns the
    schedule's ScheduleInfo and the model's number of decoder layers."""
    info = schedule_info(schedule)
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be a positive int, got {microbatches!r}")
    problem = info.check_microbatches(pp, microbatches)
    if problem:
        raise ValueError(f"microbatches={microbatches}: {problem}")
    _check_cut_options(memory_cap, seq_len, microbatch_size)
    base, _ = _parts_of(model)
    num_layers = len(base.layers)
    if pp * info.stages_per_rank > num_layers:
        raise ValueError(
            f"{pp * info.stages_per_rank} stages ({pp} ranks x {info.stages_per_rank} for {schedule!r}) need at "
            f"least as many decoder layers, the model has {num_layers}"
        )
    return info, num_layers


def build_pipeline(
    model: nn.Module,
    pp_mesh,
    *,
    schedule: str = "1f1b",
    microbatches: int,
    split_points: Sequence[int] | None = None,
    memory_cap: float | None = None,
    seq_len: int | None = None,
    microbatch_size: int | None = None,
    dp_shard: int = 1,
    ep: int = 1,
    checkpointing: bool = False,
    stage_transform: Callable[[list[nn.Module]], None] | None = None,
    device: torch.device | str | None = None,
) -> PipelineStages:
    """Cut ``model`` into pipeline stages and return this rank's.

    Args:
        model: a transformers decoder-only ``*ForCausalLM`` (any device, meta included).
        pp_mesh: the 1-D pipeline DeviceMesh (e.g. ``meshes.world["pp"]``) or a ProcessGroup.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"`` (2 stages per rank) or ``"zbv"``
            (zero-bubble V, 2 stages per rank, first and last stage on pipeline rank 0).
        microbatches: micro-batches per step (at least the pipeline size).
        split_points: decoder-layer indices that start stages 1..S-1; overrides the automatic cut
            and, without ``memory_cap``, needs no cost model (any decoder-only family).
        memory_cap: bytes one rank may hold, checked with the planner's memory model.
        seq_len, microbatch_size: the shape of one micro-batch the cost model assumes: tokens per
            sequence (default: the model's context, at most 4096) and sequences (default 1).
        dp_shard, ep: the sharding the cost model assumes.
        checkpointing: whether layers will be recomputed (costs and memory only; enabling it is
            the caller's, e.g. ``enable_activation_checkpointing``).
        stage_transform: called once with this rank's stage modules (in stage order) before they
            are wrapped (expert sharding, FSDP).
        device: where the stages compute; defaults to the model's parameters' device (cpu for meta).
    """
    if isinstance(pp_mesh, dist.ProcessGroup):
        group = pp_mesh
    elif hasattr(pp_mesh, "get_group") and getattr(pp_mesh, "ndim", 1) == 1:
        group = pp_mesh.get_group()
    else:
        raise TypeError(f"pp_mesh must be a 1-D DeviceMesh or a ProcessGroup, got {type(pp_mesh).__name__}")
    pp = group.size()
    info, num_layers = _check_pipeline(model, pp, schedule, microbatches, memory_cap, seq_len, microbatch_size)
    num_stages = pp * info.stages_per_rank
    if split_points is not None and memory_cap is None:
        costs = _layer_units(model, num_layers)
    else:
        costs = pipeline_unit_costs(
            model, pp, schedule=schedule, microbatches=microbatches, seq_len=seq_len,
            microbatch_size=microbatch_size or 1, dp_shard=dp_shard, ep=ep, checkpointing=checkpointing,
        )
    # Unit i is decoder layer i, so split points index units and decoder layers alike.
    part = partition(
        costs, num_stages, memory_cap=memory_cap, split_points=split_points, placement=info.placement,
        stages_per_rank=info.stages_per_rank, inflight=info.inflight(pp, microbatches),
    )
    if device is None:
        device = next(model.parameters()).device
        device = torch.device("cpu") if device.type == "meta" else device
    from torch.distributed.pipelining import PipelineStage

    rank = group.rank()
    stage_ids = [s for s in range(num_stages) if part.rank_of_stage(s) == rank]
    modules = [
        CausalLMStage(model, layer_ids(part.stage_names(s)), first=s == 0, last=s == num_stages - 1) for s in stage_ids
    ]
    if stage_transform is not None:
        stage_transform(modules)
    stages = [PipelineStage(m, s, num_stages, torch.device(device), group=group) for m, s in zip(modules, stage_ids)]
    return PipelineStages(modules, stages, stage_ids, part, schedule, microbatches, group)


@dataclass(frozen=True)
class _Borrowed:
    """A submodule of stage ``user`` (``parent.<name>``) whose parameters stage ``owner`` (an
    earlier stage of the same rank) holds too: an LM head tied to the embedding under ZB-V."""

    owner: int
    user: int
    parent: nn.Module
    name: str
    module: nn.Module


def _borrowed_modules(stages: list[nn.Module]) -> list[_Borrowed]:
    """The submodules of this rank's stages that hold parameters of an earlier stage, by index
    into ``stages``."""
    owner_of: dict[int, int] = {}
    found = []
    for s, stage in enumerate(stages):
        for parent in stage.modules():
            for name, child in parent.named_children():
                owners = {owner_of.get(id(p)) for p in child.parameters(recurse=False)}
                if owners in (set(), {None}):
                    continue
                if len(owners) != 1 or None in owners:
                    raise ValueError(
                        f"{type(child).__name__} {name!r} of pipeline stage {s} mixes parameters of other stages of "
                        f"this rank ({sorted(o for o in owners if o is not None)}) with its own; FSDP2 can keep a "
                        "parameter tied across stages only when the module using it holds nothing else"
                    )
                found.append(_Borrowed(owners.pop(), s, parent, name, child))
        for p in stage.parameters():
            owner_of.setdefault(id(p), s)
    return found


@contextlib.contextmanager
def _swapped(parent: nn.Module, name: str, module: nn.Module):
    """``parent.<name>`` replaced by ``module`` (or attached, if absent) for the block, then restored."""
    had, old = name in parent._modules, parent._modules.get(name)
    parent._modules[name] = module
    try:
        yield
    finally:
        if had:
            parent._modules[name] = old
        else:
            del parent._modules[name]


def _shard_tied_stages(stages: list[nn.Module], shard: Callable[[nn.Module], None]) -> list[tuple[int, int]]:
    """Run ``shard`` (FSDP2) on each stage so that parameters shared between stages of this rank
    stay one parameter. FSDP2 ties only what one ``fully_shard`` call sees, and each stage is its
    own FSDP root (a root must be one module, and the pipeline drives each stage's gradient
    reduction itself). So the stage that holds a shared parameter first is sharded with the
    modules of the later stages that use it attached for the call: FSDP records them as sharing
    the parameter and sets its sharded and gathered tensors on them too. The later stage is
    sharded with those modules set aside, so it leaves the parameter alone. Returns the
    (owner, user) pairs, by index into ``stages``."""
    borrowed = _borrowed_modules(stages)
    for s, stage in enumerate(stages):
        with contextlib.ExitStack() as stack:
            for i, b in enumerate(x for x in borrowed if x.owner == s):
                stack.enter_context(_swapped(stage, f"_moe_ep_tied_{i}", b.module))
            for b in (x for x in borrowed if x.user == s):
                stack.enter_context(_swapped(b.parent, b.name, nn.Identity()))
            shard(stage)
    return sorted({(b.owner, b.user) for b in borrowed})


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
    microbatch_size: int | None = None,
    mixed_precision=None,
    activation_checkpointing: bool = False,
    capacity_factor: float | None = None,
    reshard_after_forward: bool = False,
    experts_backend: str | None = None,
) -> PipelineStages:
    """Pipeline stages composed with expert parallelism and FSDP2/HSDP: what
    ``moe_ep.parallelize`` does for ``pp > 1`` (the arguments are its, see there). Builds the
    meshes of DESIGN.md with a real ``pp`` dimension, cuts the model (``build_pipeline``), and on
    each of this rank's stages shards the experts over ``ep`` and applies FSDP2 exactly as
    ``parallelize`` does for a whole model; a parameter tied between two stages of one rank (ZB-V
    with a tied LM head) stays one FSDP parameter. A model without experts modules is accepted
    (dense stages). Returns the stages with the meshes on ``stages.meshes``.

    ``reshard_after_forward`` defaults to False: the schedule keeps a stage's gradients unsharded
    until its last micro-batch anyway, and regathering weights for every micro-batch would
    multiply the all-gather traffic by the micro-batch count."""
    check_degree("pp", pp)
    _check_pipeline(model, pp, schedule, microbatches, memory_cap, seq_len, microbatch_size)
    _, meshes = prepare(
        model, "parallelize_pipeline", pp=pp, ep=ep, dp_replicate=dp_replicate, dp_shard=dp_shard,
        mixed_precision=mixed_precision, activation_checkpointing=activation_checkpointing,
        capacity_factor=capacity_factor, reshard_after_forward=reshard_after_forward, require_experts=False,
    )
    dims = meshes.dims
    tied = []

    def shard_stages(stages: list[nn.Module]) -> None:
        stage_experts = [experts_modules(stage) for stage in stages]
        if dims.ep > 1:
            for stage in stages:
                shard_experts(stage, meshes.ep, capacity_factor=capacity_factor, backend=experts_backend)
        experts_of = {id(stage): [m for _, m in found] for stage, found in zip(stages, stage_experts)}
        tied.extend(_shard_tied_stages(stages, lambda stage: apply_fsdp(
            stage, meshes, experts_of[id(stage)], mixed_precision=mixed_precision,
            reshard_after_forward=reshard_after_forward,
        )))

    stages = build_pipeline(
        model, meshes.world["pp"], schedule=schedule, microbatches=microbatches, split_points=split_points,
        memory_cap=memory_cap, seq_len=seq_len, microbatch_size=microbatch_size, dp_shard=dims.dp_shard, ep=dims.ep,
        checkpointing=activation_checkpointing, stage_transform=shard_stages,
    )
    stages.meshes = meshes
    stages.tied_stages = tuple((stages.stage_ids[o], stages.stage_ids[u]) for o, u in tied)
    setattr(model, PIPELINE_MESHES_ATTRIBUTE, meshes)
    return stages
