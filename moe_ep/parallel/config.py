"""The parallel configuration: ``parallelize``'s arguments as one frozen object, checked once
when it is built and passed down whole (the meshes, the expert sharding, FSDP and the pipeline
read it; nothing relays its fields one by one). What needs the model or the process group (the
world size, the expert count, the decoder layers) is checked by ``parallelize`` before it
changes anything."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from ..dispatch.capacity import check_capacity_factor
from ..dispatch.nodes import check_dispatch_mode, check_node_size, node_size_for
from ..dispatch.overlap import check_overlap_chunks
from ..ops.backend import BACKENDS
from ..planner.recompute import check_split_backward_recompute, recompute_policy
from ..planner.schedules import ScheduleInfo, schedule_info
from .compile import check_compilable_recompute, compile_options
from .mesh import check_degree

DEFAULT_SCHEDULE = "1f1b"
# parallelize's arguments that describe the pipeline, in the order its errors name them.
PIPELINE_ARGUMENTS = ("schedule", "microbatches", "split_points", "memory_cap", "seq_len", "microbatch_size",
                      "virtual_stages")


def _check_optional_positive_int(name: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")


@dataclass(frozen=True)
class PipelineConfig:
    """How a model is cut into pipeline stages and scheduled.

    ``schedule``: ``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"`` (``virtual_stages`` stages per
    rank, default 2), ``"interleaved-1f1b-overlap"`` (the same, each steady-state forward run
    beside the backward of another stage, ``moe_ep.parallel.pipeline.overlap``), ``"zbv"``
    (zero-bubble V, 2 stages per rank, first and last stage on pipeline rank 0) or
    ``"dualpipev"`` (DualPipeV: the same V, at least 2 pp micro-batches, one micro-batch's forward
    run beside another's backward). ``microbatches``:
    per step. ``split_points``: the decoder-layer indices that start stages 1..S-1 (None: the
    automatic cut, which balances the planner's per-layer costs and keeps every rank under
    ``memory_cap`` bytes, for micro-batches of ``microbatch_size`` sequences (default 1) of
    ``seq_len`` tokens (default: the model's context, at most 4096))."""

    microbatches: int
    schedule: str = DEFAULT_SCHEDULE
    split_points: tuple[int, ...] | None = None
    memory_cap: float | None = None
    seq_len: int | None = None
    microbatch_size: int | None = None
    virtual_stages: int | None = None

    def __post_init__(self):
        info = schedule_info(self.schedule, self.virtual_stages)
        from torch.distributed.pipelining import schedules

        needs = (info.torch_class, "OVERLAP_F_B") if info.overlaps_forward_backward else (info.torch_class,)
        missing = [name for name in needs if not hasattr(schedules, name)]
        if info.overlaps_forward_backward and not missing and not hasattr(getattr(schedules, info.torch_class),
                                                                          "_prepare_schedule_with_comms"):
            # The overlapped actions are lowered to sends and receives by torch's action runtime.
            missing = [f"{info.torch_class} on its action runtime (_PipelineScheduleRuntime)"]
        if missing:
            raise ValueError(f"schedule={self.schedule!r} needs torch's {' and '.join(missing)}, which this torch "
                             f"({torch.__version__}) does not have")
        if isinstance(self.microbatches, bool) or not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ValueError(f"microbatches must be a positive int, got {self.microbatches!r}")
        if self.split_points is not None:
            points = self.split_points
            if isinstance(points, (str, bytes)) or not hasattr(points, "__iter__"):
                raise ValueError(f"split_points must be a sequence of ints (the first decoder layer of each stage "
                                 f"after the first) or None, got {points!r}")
            object.__setattr__(self, "split_points", tuple(points))
        memory_cap = self.memory_cap
        if memory_cap is not None and (
            isinstance(memory_cap, bool) or not isinstance(memory_cap, (int, float)) or not 0 < memory_cap < math.inf
        ):
            raise ValueError(f"memory_cap must be a positive finite number of bytes or None, got {memory_cap!r}")
        _check_optional_positive_int("seq_len", self.seq_len)
        _check_optional_positive_int("microbatch_size", self.microbatch_size)

    @property
    def info(self) -> ScheduleInfo:
        return schedule_info(self.schedule, self.virtual_stages)

    def num_stages(self, pp: int) -> int:
        return pp * self.info.stages_per_rank

    def check(self, pp: int, num_layers: int) -> None:
        """What depends on the pipeline size and on the model's decoder layers."""
        problem = self.info.check_microbatches(pp, self.microbatches)
        if problem:
            raise ValueError(f"microbatches={self.microbatches}: {problem}")
        if self.num_stages(pp) > num_layers:
            raise ValueError(
                f"{self.num_stages(pp)} stages ({pp} ranks x {self.info.stages_per_rank} for {self.schedule!r}) need "
                f"at least as many decoder layers, the model has {num_layers}"
            )


@dataclass(frozen=True)
class ParallelConfig:
    """Everything ``moe_ep.parallelize`` is asked to do (its docstring says what each field means).

    ``pipeline`` is given exactly when ``pp > 1``. ``reshard_after_forward`` None means FSDP2's
    resharding after forward without a pipeline and none with one (``fsdp_reshard_after_forward``).
    ``activation_checkpointing`` is a policy name of ``moe_ep.planner.recompute.RECOMPUTE_POLICIES``
    once built (True and False are given as ``"full"`` and ``"none"``). ``compile_blocks`` is False,
    True or a dict of torch.compile keywords (``compile_options`` says which). Build it from
    ``parallelize``'s flat keywords with ``ParallelConfig.from_arguments``."""

    ep: int = 1
    dp_replicate: int = 1
    dp_shard: int | None = None
    pp: int = 1
    pipeline: PipelineConfig | None = None
    mixed_precision: MixedPrecisionPolicy | None = None
    activation_checkpointing: str | bool = "none"
    capacity_factor: float | None = None
    reshard_after_forward: bool | None = None
    experts_backend: str | None = None
    dispatch_mode: str = "auto"
    node_size: int | None = None
    max_nodes: int | None = None
    compile_blocks: bool | dict = False
    overlap_chunks: int = 1

    def __post_init__(self):
        for name in ("pp", "ep", "dp_replicate"):
            check_degree(name, getattr(self, name))
        if self.dp_shard is not None:
            check_degree("dp_shard", self.dp_shard)
        if self.pp > 1 and not isinstance(self.pipeline, PipelineConfig):
            raise ValueError(f"pp={self.pp} needs microbatches: the micro-batches of one step (at least pp)")
        if self.pp == 1 and self.pipeline is not None:
            raise ValueError("a PipelineConfig describes pipeline stages and needs pp > 1, got pp=1")
        if self.mixed_precision is not None and not isinstance(self.mixed_precision, MixedPrecisionPolicy):
            raise TypeError(
                f"mixed_precision must be a torch.distributed.fsdp.MixedPrecisionPolicy or None, got "
                f"{type(self.mixed_precision).__name__}"
            )
        # Kept as the policy's name: True and False are "full" and "none".
        object.__setattr__(self, "activation_checkpointing",
                           recompute_policy("activation_checkpointing", self.activation_checkpointing))
        if self.reshard_after_forward is not None and not isinstance(self.reshard_after_forward, bool):
            raise TypeError(
                f"reshard_after_forward must be a bool or None, got {type(self.reshard_after_forward).__name__}"
            )
        check_capacity_factor(self.capacity_factor)
        if self.capacity_factor is not None and self.ep == 1:
            raise ValueError(
                f"capacity_factor={self.capacity_factor} applies to the expert-parallel dispatcher; ep=1 has none"
            )
        if self.pipeline is not None and self.pipeline.info.overlaps_forward_backward and self.reshard_after_forward:
            raise ValueError(
                f"reshard_after_forward=True cannot run schedule={self.pipeline.schedule!r}: its overlapped forward "
                "and backward would each gather their stage's weights over the same FSDP group at once; leave it "
                "None (False with a pipeline)"
            )
        if self.pipeline is not None:
            check_split_backward_recompute("activation_checkpointing", self.activation_checkpointing,
                                           self.pipeline.schedule, self.pipeline.info.splits_backward)
        check_overlap_chunks(self.overlap_chunks, self.capacity_factor)
        if self.overlap_chunks > 1 and self.ep == 1:
            raise ValueError(
                f"overlap_chunks={self.overlap_chunks} applies to the expert-parallel dispatcher; ep=1 has none")
        check_dispatch_mode(self.dispatch_mode, self.capacity_factor)
        check_node_size(self.node_size)
        if self.dispatch_mode == "node" and self.ep == 1:
            raise ValueError("dispatch_mode='node' applies to the expert-parallel dispatcher; ep=1 has none")
        if self.max_nodes is not None:
            if isinstance(self.max_nodes, bool) or not isinstance(self.max_nodes, int) or self.max_nodes < 1:
                raise ValueError(f"max_nodes must be a positive int or None, got {self.max_nodes!r}")
            if self.ep == 1:
                raise ValueError(f"max_nodes={self.max_nodes} limits the nodes a token's experts are on; ep=1 keeps "
                                 "every expert on every rank")
        if self.experts_backend is not None and self.experts_backend not in BACKENDS:
            raise ValueError(f"experts_backend must be one of {BACKENDS} or None, got {self.experts_backend!r}")
        options = self.compile_options
        if not isinstance(self.compile_blocks, bool):
            object.__setattr__(self, "compile_blocks", options)  # a copy: the caller's dict may change later
        if options is not None:
            check_compilable_recompute("compile_blocks", self.activation_checkpointing)

    @classmethod
    def from_arguments(cls, **arguments) -> ParallelConfig:
        """The configuration of ``parallelize(model, **arguments)``: the pipeline's own arguments
        (``PipelineConfig``'s fields, None meaning not given) become ``pipeline``, refused with
        ``pp=1``, where there is no pipeline; the others are ``ParallelConfig``'s fields."""
        given = {name: value for name in PIPELINE_ARGUMENTS if (value := arguments.pop(name, None)) is not None}
        pp = arguments.get("pp", 1)
        check_degree("pp", pp)
        if pp == 1 and given:
            name, value = next(iter(given.items()))
            raise ValueError(
                f"{name}={value!r} describes pipeline stages and needs pp > 1, got pp=1 (gradient "
                "accumulation without a pipeline: TrainStep(microbatches=...))"
            )
        if pp == 1:
            return cls(**arguments)
        if "microbatches" not in given:
            raise ValueError(f"pp={pp} needs microbatches: the micro-batches of one step (at least pp)")
        return cls(pipeline=PipelineConfig(**given), **arguments)

    def arguments(self) -> dict:
        """``parallelize``'s keyword arguments that give this configuration, in its order (the
        pipeline's None without one)."""
        pipeline = {name: getattr(self.pipeline, name, None) for name in PIPELINE_ARGUMENTS}
        return dict(ep=self.ep, dp_replicate=self.dp_replicate, dp_shard=self.dp_shard, pp=self.pp, **pipeline,
                    mixed_precision=self.mixed_precision, activation_checkpointing=self.activation_checkpointing,
                    capacity_factor=self.capacity_factor, reshard_after_forward=self.reshard_after_forward,
                    experts_backend=self.experts_backend, dispatch_mode=self.dispatch_mode, node_size=self.node_size,
                    max_nodes=self.max_nodes, compile_blocks=self.compile_blocks,
                    overlap_chunks=self.overlap_chunks)

    @property
    def ep_node_size(self) -> int | None:
        """The node size the expert-parallel dispatch splits the ep group by (node-aware), None
        for the single-stage dispatch (or no ep); ``node_size`` None: the launcher's
        ``LOCAL_WORLD_SIZE``. ValueError where ``dispatch_mode="node"`` cannot apply."""
        if self.ep == 1:
            return None
        return node_size_for(self.dispatch_mode, self.ep, self.node_size, self.capacity_factor)

    @property
    def compile_options(self) -> dict | None:
        """torch.compile's keywords for the dense blocks (``compile_blocks``), None when not compiled."""
        return compile_options("compile_blocks", self.compile_blocks)

    @property
    def fsdp_reshard_after_forward(self) -> bool:
        """FSDP2's ``reshard_after_forward``: by default True without a pipeline and False with
        one, whose schedule keeps a stage's gradients unsharded until its last micro-batch anyway
        (regathering the weights for every micro-batch would multiply the all-gather traffic by
        the micro-batch count)."""
        return self.pp == 1 if self.reshard_after_forward is None else self.reshard_after_forward
