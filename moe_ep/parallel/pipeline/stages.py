"""This rank's share of a pipeline at run time: its stage modules, torch's ``PipelineStage``
wrappers and the schedule that runs them (which ``moe_ep.training.TrainStep`` drives)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
import torch.distributed as dist
from torch import nn

from ...planner.partition import Partition
from ...planner.schedules import INTERLEAVED_OVERLAP, schedule_info
from ..mesh import MoEMeshes
from .tied import check_tied_order


class RecordedContext(Protocol):
    """What the stages read of the ``ParallelContext`` that ``parallelize`` records on them. The
    context module imports this one (a context holds its stages), so the stages name the type by
    what they use of it rather than import it: no import cycle, type-only ones included."""

    @property
    def meshes(self) -> MoEMeshes: ...


class _LatestLoss:
    """The loss function the schedule calls: the one ``PipelineStages.schedule`` got last. A
    separate object, so that the schedule holds no reference back to the stages."""

    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.fn(logits, labels)


@dataclass(eq=False)
class PipelineStages:
    """This rank's share of a pipeline: stage modules (in stage order), their torch
    ``PipelineStage`` wrappers, the partition and the schedule to run them with; ``context`` is
    what ``moe_ep.parallelize`` made of the model (None for stages built by ``build_pipeline``)."""

    modules: list[nn.Module]
    stages: list
    stage_ids: list[int]
    partition: Partition
    schedule_name: str
    microbatches: int
    group: dist.ProcessGroup
    context: RecordedContext | None = None  # a moe_ep.parallel.context.ParallelContext
    # (stage that shards a tied parameter, later stage of this rank that uses it), by stage id.
    tied_stages: tuple[tuple[int, int], ...] = ()
    _schedule: object = field(default=None, repr=False)
    _loss: _LatestLoss = field(default_factory=_LatestLoss, repr=False)
    _loss_input: str | None = field(default=None, repr=False)
    _batch_shape: tuple[int, int] | None = field(default=None, repr=False)

    @property
    def meshes(self) -> MoEMeshes | None:
        """The MoEMeshes of ``moe_ep.parallelize``, or None."""
        return None if self.context is None else self.context.meshes

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

    def check_batch_shape(self, shape: tuple[int, ...]) -> None:
        """Refuse a batch of another ``[batch, seq]`` than the schedule's first step ran: the
        schedule inferred the activations the stages exchange from that step, and a batch of
        another shape would send and receive buffers of the wrong size (an abort in gloo, a hang or
        garbage elsewhere). Every rank of the pipeline holds the batch, so each refuses alike."""
        if self._batch_shape is not None and tuple(shape) != self._batch_shape:
            batch, seq = self._batch_shape
            raise ValueError(
                f"input_ids of shape {tuple(shape)}, but these pipeline stages run batches of shape [{batch}, {seq}] "
                f"({self.microbatches} micro-batches of [{batch // self.microbatches}, {seq}]): the schedule fixed the "
                "shape of the activations its stages exchange at its first step. Pad every batch to that shape "
                "(labels -100 where padded) or build new stages for the new shape"
            )

    @property
    def batch_shape(self) -> tuple[int, int] | None:
        """The ``[batch, seq]`` every step runs (its first step's), None before it."""
        return self._batch_shape

    def ran_batch_shape(self, shape: tuple[int, ...]) -> None:
        """The shape the schedule infers its activations from (its first step's; check_batch_shape)."""
        if self._batch_shape is None:
            self._batch_shape = tuple(shape)

    def schedule(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *, loss_input: str = "logits"):
        """The torch schedule over these stages, computing the loss with ``loss_fn(logits, labels)``
        (``loss_input="hidden"``: ``loss_fn(final hidden states, labels)``, the last stage
        skipping its LM head) until the next call gives another (so every TrainStep on these
        stages calls this before each of its steps). The schedule is built once: it holds the
        stages' communication set-up and shape inference, which a second schedule would redo on
        the same stages; it calls the loss through ``_LatestLoss``, and its ``loss_input`` stays
        that of the first call (the last stage's output shape is inferred once). Gradients are
        not divided by the number of micro-batches: ``loss_fn`` normalises by the tokens of the
        whole step (moe_ep.training.CausalLMLoss)."""
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(logits, labels), got {type(loss_fn).__name__}")
        if loss_input not in ("logits", "hidden"):
            raise ValueError(f"loss_input must be 'logits' or 'hidden', got {loss_input!r}")
        if self._loss_input is None:
            self._loss_input = loss_input
            for module in self.modules:
                module.loss_input = loss_input
        elif loss_input != self._loss_input:
            raise ValueError(
                f"these pipeline stages' schedule computes the loss from their {self._loss_input} (fixed by the first "
                f"TrainStep that ran on them, whose output shapes the schedule inferred), not their {loss_input}: "
                "build new stages for a TrainStep with the other chunked_loss"
            )
        self._loss.fn = loss_fn
        if self._schedule is None:
            # Imported here: torch's pipelining schedules import dynamo (0.7 s of the start-up of
            # a process that builds no transformers model, whose modules import it themselves).
            from torch.distributed.pipelining import schedules

            from .overlap import enable_overlap, overlap_steady_state

            info = schedule_info(self.schedule_name)
            cls = getattr(schedules, info.torch_class)
            stages = self.stages[0] if info.stages_per_rank == 1 else self.stages
            schedule = cls(stages, n_microbatches=self.microbatches, loss_fn=self._loss, scale_grads=False)
            if info.name == INTERLEAVED_OVERLAP:
                overlap_steady_state(schedule)
            if info.overlaps_forward_backward and self.context is not None:
                # parallelize made the backward lanes the two threads need.
                enable_overlap(schedule)
            check_tied_order(schedule, self.pp_rank, self.tied_stages)
            self._schedule = schedule
        return self._schedule
