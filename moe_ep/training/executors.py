"""How one step's micro-batches run on this rank, behind one interface so that ``TrainStep`` holds
the step's logic once: ``GradientAccumulation`` runs them one after another through a model,
``PipelineSchedule`` through the schedule of this rank's pipeline stages. An executor also says
where the step's scalars live (``device``), the model's vocabulary size (``vocab_size``, the range
of the batch's token ids) and sums a value over the pipeline's stages (``sum_over_stages``;
nothing to sum without stages); data parallelism is the same for both and stays with TrainStep."""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import nullcontext
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.pipeline import PipelineStages
from .loss import check_chunked_head, check_head_logits, chunked_logits_to_keep, chunked_loss_parts, final_hidden_states

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Executor(ABC):
    microbatches: int
    modules: list[nn.Module]  # the modules the step runs on this rank (its aux-loss hooks go there)
    head: nn.Linear | None  # with the chunked loss, the LM head the loss applies (None: no loss here)

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where the step's scalars (token counts, losses, norms) live."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """The model's ``config.vocab_size``: token ids and labels lie in ``[0, vocab_size)``."""

    @abstractmethod
    def run(self, ids: torch.Tensor, labels: torch.Tensor, loss_fn: LossFn) -> torch.Tensor:
        """Forward and backward of every micro-batch of ``ids [batch, seq]`` (gradients
        accumulate); returns the sum of their losses, detached, in float32, equal on every stage
        of this rank."""

    @abstractmethod
    def sum_over_stages(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over this rank's pipeline (in place; collective there)."""

    def check_batch_shape(self, shape: tuple[int, ...]) -> None:
        """Refuse, before any collective, an ``input_ids`` shape this executor cannot run."""

    @abstractmethod
    def stand_in_shape(self) -> tuple[int, int] | None:
        """The ``[batch, seq]`` of a harmless batch this rank can run in place of one it cannot,
        so that the step's collectives still meet the other ranks' (batch.stand_in); None where
        no shape is sure to."""

    def agree_on_batch_shape(self, shape: tuple[int, ...] | None, dp_group) -> None:
        """Where the ranks must run one ``[batch, seq]`` and no stand-in shape is known yet:
        raise on every rank alike, the data-parallel ranks of ``dp_group`` (None: none) included,
        unless each has a batch of one shape (``shape`` None: this rank refused its batch and
        raises its own error after)."""

    def over_stages(self, stage_norm: torch.Tensor, flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the 2-norm of the whole model's gradients, ``flags`` summed over the pipeline) from
        this rank's stages' norm and flags, in one collective."""
        summed = self.sum_over_stages(
            torch.cat([stage_norm.to(self.device, torch.float32).square().reshape(1), flags.to(self.device)]))
        return summed[0].sqrt(), summed[1:]


class GradientAccumulation(Executor):
    """The micro-batches through ``model`` one after another; with ``autocast_dtype`` the forward
    and the loss run under ``torch.autocast`` (for a model that no FSDP ``MixedPrecisionPolicy``
    casts; the loss's softmax and sums in fp32), the backward outside it. With ``chunked_loss`` the loss takes the final
    hidden states instead of the logits: the model's own forward runs (so FSDP's hooks gather and
    reduce as usual) with ``logits_to_keep`` selecting no position, and a forward hook on the base
    model keeps its output."""

    def __init__(self, model: nn.Module, microbatches: int | None, autocast_dtype: torch.dtype | None,
                 chunked_loss: bool = False):
        microbatches = 1 if microbatches is None else microbatches
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"microbatches must be a positive int, got {microbatches!r}")
        if autocast_dtype is not None and not isinstance(autocast_dtype, torch.dtype):
            raise TypeError(f"autocast_dtype must be torch.bfloat16, torch.float16 or None, got {autocast_dtype!r}")
        if autocast_dtype not in (None, torch.bfloat16, torch.float16):
            # torch.autocast takes only a half dtype: it would warn and run the model as it is.
            raise ValueError(f"autocast_dtype must be torch.bfloat16, torch.float16 or None, got {autocast_dtype}")
        self.model, self.microbatches, self.autocast_dtype = model, microbatches, autocast_dtype
        self.modules = [model]
        # A transformers model would otherwise fill a key/value cache that training never reads.
        self.forward_kwargs = {"use_cache": False} if hasattr(getattr(model, "config", None), "use_cache") else {}
        self.head = self.base = None
        if chunked_loss:
            self.head, self.base = chunked_loss_parts(model)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def vocab_size(self) -> int:
        return _vocab_size(self.model)

    def run(self, ids, labels, loss_fn):
        total = torch.zeros((), device=ids.device)
        for ids_mb, labels_mb in zip(ids.chunk(self.microbatches), labels.chunk(self.microbatches)):
            with self._autocast(ids.device):
                outputs = self._forward(ids_mb)
                # Under autocast too: the chunked loss's head GEMMs run in its dtype, as the
                # model's own head does (the logits' loss is float32 either way).
                loss = loss_fn(outputs, labels_mb)
            loss.backward()
            total = total + loss.detach().to(total.device)
        return total

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        """What the loss takes: the logits, or with the chunked loss the final hidden states."""
        if self.head is None:
            out = self.model(input_ids=ids, **self.forward_kwargs)
            return out.logits if hasattr(out, "logits") else out
        with final_hidden_states(self.base) as kept:
            outputs = self.model(input_ids=ids, logits_to_keep=chunked_logits_to_keep(self.model, ids),
                                 **self.forward_kwargs)
        hidden, _ = kept[-1]
        check_head_logits(self.model, self.head, hidden, outputs)
        return hidden

    def sum_over_stages(self, t):
        return t

    def stand_in_shape(self) -> tuple[int, int]:
        # Data-parallel ranks' batches need not share a shape: one sequence per micro-batch.
        return self.microbatches, 2

    def over_stages(self, stage_norm, flags):
        return stage_norm, flags

    def _autocast(self, device: torch.device):
        return nullcontext() if self.autocast_dtype is None else torch.autocast(device.type, dtype=self.autocast_dtype)


class PipelineSchedule(Executor):
    """The micro-batches through the schedule of this rank's pipeline stages; the loss, computed
    on the last stage, is broadcast over the pipeline. With ``chunked_loss`` the last stage
    returns its final hidden states and the loss applies its LM head in chunks."""

    def __init__(self, stages: PipelineStages, microbatches: int | None, autocast_dtype: torch.dtype | None,
                 chunked_loss: bool = False):
        if microbatches not in (None, stages.microbatches):
            raise ValueError(
                f"microbatches={microbatches} differs from the pipeline's {stages.microbatches}; the schedule fixes it "
                "(parallelize(microbatches=...))"
            )
        if autocast_dtype is not None:
            raise ValueError(
                f"autocast_dtype={autocast_dtype} applies without pipeline stages; stages compute in low precision "
                "through parallelize(mixed_precision=MixedPrecisionPolicy(param_dtype=...))"
            )
        self.stages, self.microbatches = stages, stages.microbatches
        self.modules = stages.modules
        self.loss_input = "hidden" if chunked_loss else "logits"
        self.head = None
        if chunked_loss:
            # Every rank checks the model's config (each stage holds it), so ranks refuse alike.
            last = stages.modules[-1]
            self.head = check_chunked_head(getattr(last, "lm_head", None), last.config, type(last).__name__,
                                           holds_head=stages.has_last)

    @property
    def device(self) -> torch.device:
        return self.stages.stages[0].device

    @property
    def vocab_size(self) -> int:
        return _vocab_size(self.stages.modules[0])

    def check_batch_shape(self, shape: tuple[int, ...]) -> None:
        self.stages.check_batch_shape(shape)

    def stand_in_shape(self) -> tuple[int, int] | None:
        # The stages exchange activations of the first step's shape; before it none is known.
        return self.stages.batch_shape

    def agree_on_batch_shape(self, shape: tuple[int, ...] | None, dp_group) -> None:
        """Before the first step, which fixes the shape of the activations the stages exchange,
        one all-gather over the pipeline and one all-reduce over ``dp_group``: a rank with a batch
        of another shape, or none it can run, would otherwise meet its peers' sends with buffers
        of the wrong size (a crash in the schedule's shape inference, or in the loss, on one rank;
        a lost connection on the others), and the other pipelines in their data-parallel
        collectives."""
        group = self.stages.group
        if self.stages.batch_shape is not None or (group.size() == 1 and dp_group is None):
            return
        refused_by = mismatch = None
        if group.size() > 1:
            mine = torch.tensor([0, 0] if shape is None else list(shape), dtype=torch.long, device=self.device)
            everyone = [torch.empty_like(mine) for _ in range(group.size())]
            dist.all_gather(everyone, mine, group=group)
            # host sync: once, before the first step.
            shapes = [tuple(t.tolist()) for t in everyone]
            refusing = [rank for rank, s in enumerate(shapes) if s == (0, 0)]
            if refusing:
                refused_by = f"pipeline rank {refusing[0]}"
            elif len(set(shapes)) > 1:
                mismatch = (f"the ranks of a pipeline must run batches of one [batch, seq] shape, the activations "
                            f"their stages exchange have it; got {shapes} (pipeline rank 0, 1, ...): pad every batch "
                            "to one shape (labels -100 where padded)")
        if dp_group is not None:
            # The other pipelines meet this one in the step's data-parallel collectives.
            stopped = torch.tensor([float(shape is None or refused_by is not None or mismatch is not None)],
                                   device=self.device)
            dist.all_reduce(stopped, op=dist.ReduceOp.MAX, group=dp_group)
            # host sync: once, before the first step.
            if stopped.item() and refused_by is None and mismatch is None:
                refused_by = "a rank of another data-parallel pipeline"
        if shape is None:
            return
        if mismatch is not None:
            raise ValueError(mismatch)
        if refused_by is not None:
            raise ValueError(f"{refused_by} cannot run its first batch (its own error says why), so this rank's batch "
                             f"of shape {tuple(shape)} is not run either")

    def run(self, ids, labels, loss_fn):
        stages = self.stages
        schedule = stages.schedule(loss_fn, loss_input=self.loss_input)
        stages.ran_batch_shape(ids.shape)
        args = (ids,) if stages.has_first else ()
        losses = [] if stages.has_last else None
        schedule.step(*args, target=labels if stages.has_last else None, losses=losses)
        loss = torch.stack(losses).sum().detach() if stages.has_last else torch.zeros((), device=self.device)
        loss = loss.to(device=self.device, dtype=torch.float32)
        dist.broadcast(loss, src=stages.last_stage_global_rank, group=stages.group)
        return loss

    def sum_over_stages(self, t):
        dist.all_reduce(t, group=self.stages.group)
        return t


def _vocab_size(module: nn.Module) -> int:
    vocab_size = getattr(getattr(module, "config", None), "vocab_size", None)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise TypeError(
            f"model_or_stages must be a transformers causal LM whose config.vocab_size (a positive int) is the range "
            f"of the batch's token ids; {type(module).__name__} has config.vocab_size={vocab_size!r}"
        )
    return vocab_size


def executor_for(target, *, microbatches: int | None, autocast_dtype: torch.dtype | None,
                 chunked_loss: bool = False) -> Executor:
    """The executor of what ``moe_ep.parallelize`` returned: PipelineStages or a model."""
    if not isinstance(chunked_loss, bool):
        raise TypeError(f"chunked_loss must be a bool, got {chunked_loss!r}")
    if isinstance(target, PipelineStages):
        return PipelineSchedule(target, microbatches, autocast_dtype, chunked_loss)
    if isinstance(target, nn.Module):
        return GradientAccumulation(target, microbatches, autocast_dtype, chunked_loss)
    raise TypeError(f"model_or_stages must be a torch.nn.Module or PipelineStages, got {type(target).__name__}")
