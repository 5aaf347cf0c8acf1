"""``TrainStep``: one optimizer step of a causal LM over micro-batches, the same code with and
without pipeline stages (the difference lives in the executor), on what ``moe_ep.parallelize``
returns. The objective is the mean over every token of the global batch plus the weighted
balancing terms; a step that is not finite is skipped on every rank. How the pieces fit:
ARCHITECTURE.md, "Training step"."""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

from ..ops.routing import SCORES
from ..ops.validate import check_number
from ..parallel.agreement import Description, parameter_fields, ranks_agree, shown
from ..parallel.clip import clip_grads_, grad_norm
from ..parallel.context import parallel_context
from ..parallel.pipeline import PipelineStages
from .balancing import Balancing
from .batch import refusal, screened, stand_in
from .executors import executor_for
from .loss import IGNORE_INDEX, CausalLMLoss, ChunkedCausalLMLoss, predicted_tokens
from .loss_scale import LossScaler
from .skips import SkipCounter


def _ranks_agree(target, context, optimizer, options: dict):
    """The check that every rank of the step's collectives was given the same step: the world for
    what ``parallelize`` returned, the pipeline's group for stages of ``build_pipeline``; nothing
    to agree on for a model that no parallelize prepared (its step runs no collective)."""
    if context is not None:
        group = None
    elif isinstance(target, PipelineStages):
        group = target.group
    else:
        return nullcontext()
    shared = {name: shown(value) for name, value in options.items()}
    shared["optimizer"] = type(optimizer).__qualname__
    if hasattr(optimizer, "moments_dtype"):  # moe_ep.AdamW's: not in its groups
        shared["optimizer moments"] = shown(optimizer.moments_dtype)
    local = {}
    groups = optimizer.param_groups if isinstance(optimizer, torch.optim.Optimizer) else ()
    for i, param_group in enumerate(groups):
        hyper = {k: v for k, v in param_group.items() if k != "params"}
        local[f"optimizer group {i}"] = f"{shown(hyper)} over {len(param_group['params'])} parameters"
    if isinstance(target, (torch.nn.Module, PipelineStages)):
        local.update(parameter_fields(target.named_parameters()))
    peers = f"pipeline stages {target.stage_ids}" if isinstance(target, PipelineStages) else ""
    return ranks_agree("TrainStep", Description(shared, peers, local), group=group)


def _check_optimizer_holds(target, optimizer: torch.optim.Optimizer) -> None:
    """Every parameter of ``target`` (this rank's stages) that requires grad must be one of the
    optimizer's, by identity: ``parallelize`` replaces the model's parameters with sharded ones, so
    an optimizer built before it (or another model's) holds tensors the step never touches, and
    every step would leave the model as it is without a word. Frozen parameters may be absent."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    trainable = [(name, p) for name, p in target.named_parameters() if p.requires_grad]
    missing = [name for name, p in trainable if id(p) not in held]
    if not missing:
        return
    foreign = len(held - {id(p) for _, p in target.named_parameters()})
    shown_names = ", ".join(repr(name) for name in missing[:3]) + (", ..." if len(missing) > 3 else "")
    holds = f"; it holds {foreign} parameters that are not the model's" if foreign else ""
    raise ValueError(
        f"optimizer does not hold {len(missing)} of the {len(trainable)} trainable parameters of model_or_stages "
        f"({shown_names}){holds}: the step would never change them. An optimizer built before moe_ep.parallelize "
        "holds the parameters parallelize replaced, and another model's optimizer that model's: build the optimizer "
        "after parallelize, over the model's parameters() (or the stages' parameters())"
    )


def _check_lr_scheduler(lr_scheduler, optimizer: torch.optim.Optimizer) -> None:
    """None, or what the step calls ``.step()`` on after each optimizer step: a scheduler of
    another optimizer would leave this one's learning rate as it is, step after step."""
    if lr_scheduler is None:
        return
    if not callable(getattr(lr_scheduler, "step", None)):
        raise TypeError(f"lr_scheduler must be None or a learning-rate scheduler with a step() method, "
                        f"got {lr_scheduler!r}")
    scheduled = getattr(lr_scheduler, "optimizer", optimizer)
    if scheduled is not optimizer:
        raise ValueError("lr_scheduler schedules another optimizer than the step's: build it on the optimizer "
                         "passed to TrainStep")


class TrainStep:
    """``TrainStep(model_or_stages, optimizer, *, microbatches=1, ...)``, then ``loss = step(batch)``.

    Args:
        model_or_stages: what ``moe_ep.parallelize`` returns: a transformers causal LM
            (parallelized or not) or ``PipelineStages`` (also from ``build_pipeline``); with stages
            the micro-batch count is theirs and ``microbatches`` must be None or equal to it.
            How the model runs (recompute, compiled dense blocks: ``compile_blocks``) is
            parallelize's to set; the step calls the model or stages as they are.
        optimizer: over ``model.parameters()`` or ``stages.parameters()``, built after
            ``parallelize`` (which replaces the parameters with sharded ones): every parameter of
            this rank's model or stages that requires grad must be one of the optimizer's, by
            identity, or the step refuses it (ValueError naming how many are missing and a few of
            them). Frozen parameters (``requires_grad=False``) may be absent; parameters beyond
            the model's are allowed.
        microbatches: gradient-accumulation micro-batches per step (batch dim split evenly).
        loss_scale: None, ``"dynamic"`` (fp16) or a fixed positive scale.
        aux_loss_coef: weight of the per-layer load-balancing loss (0: none); with the router's
            own probabilities: the softmax, or for a sigmoid router (DeepSeek-V3's and the routers
            copied from it) its sigmoid scores normalised over the experts, as DeepSeek-V3's balance
            loss takes them.
        router_score: how the routers score their experts for the aux loss: None reads it from
            each router's class (refused, by name, where the forward computes both or neither),
            ``"softmax"`` or ``"sigmoid"`` states it for every router.
        global_aux_loss: compute it from the statistics of every data-parallel rank.
        sequence_aux_loss: compute it for each sequence of the batch on its own and average them
            (DeepSeek-V3's sequence-wise balance loss, Megatron-Core's ``seq_aux_loss``; with a
            sigmoid router ``top_k`` times DeepSeek-V3's, so its ``alpha`` is ``aux_loss_coef x
            top_k``: set ``aux_loss_coef = alpha / top_k``); not with ``global_aux_loss``.
        z_loss_coef: weight of the per-layer router z-loss (0: none).
        expert_bias_rate: step size of DeepSeek-V3's aux-loss-free expert bias (0: none; every
            MoE router must hold a float32 ``e_score_correction_bias``).
        max_grad_norm: clip the gradients' global 2-norm (all stages, all meshes) to this.
        max_consecutive_skips: raise ``moe_ep.NonFiniteStepsError`` on every rank when this many
            steps in a row were skipped for a non-finite loss or gradient norm (None: never).
        lr_scheduler: stepped after every optimizer step that was taken.
        autocast_dtype: run the forward (without pipeline stages) under ``torch.autocast`` in
            this dtype, for a model that FSDP's ``MixedPrecisionPolicy`` does not cast (one
            process); the loss is computed in fp32 and backward runs outside autocast.
        chunked_loss: compute the LM loss from the final hidden states through the LM head in
            chunks of tokens (``moe_ep.ops.linear_cross_entropy``), never holding the full
            float32 logits and their gradient (memory O(chunk x V) instead of O(tokens x V); the
            head's two gradient GEMMs run during forward). The same objective: equal losses and
            updates to float32 rounding. Off by default. With pipeline stages the last stage
            returns its final hidden states; the first TrainStep that runs on the stages fixes
            which, and a later one with the other choice raises ValueError at its first step.
            Refused (ValueError) for a model whose head is not a torch.nn.Linear or that changes
            its logits after the head (soft-capping, logit scaling).

    ``step(batch)`` takes ``{"input_ids": [batch, seq], "labels": [batch, seq] (optional, defaults
    to input_ids)}`` (this rank's share of the global batch, ``batch`` a multiple of the
    micro-batches, checked before any work) and returns the step's loss (LM loss plus the
    weighted aux and z losses; the parts are ``last_lm_loss``, ``last_aux_loss`` and
    ``last_z_loss``): the mean over the global batch, a detached scalar equal on every rank.
    Token ids and labels are int64 or int32 (``torch.nn.Embedding``'s index dtypes; labels are
    cast to int64 for the loss) in ``[0, config.vocab_size)``, labels also -100 (ignored, as in
    transformers). Their values are checked on their device without a host sync of their own:
    a batch outside that on any rank runs with the bad entries neutralised, then every rank
    raises the same ValueError naming the tensor, the range and how many ranks had it, at the
    step's one host sync, with nothing applied (the gradients cleared, no step counted); the
    TrainStep stays usable.

    Each step: the micro-batches run forward and backward (gradients accumulate; FSDP2
    reduce-scatters after each, so they stay sharded in between), then the global loss and
    gradient norm decide (one host sync) whether the optimizer steps: a non-finite one on any rank
    skips the step on every rank (optimizer, lr scheduler and expert bias stay as they were), and
    the gradients are cleared either way. A step whose global batch has no predicted token (every
    label -100 on every rank; one micro-batch or rank without any is fine) is skipped the same way
    (the loss would be 0 and the optimizer would still apply weight decay and momentum), without
    changing the loss scale. ``last_grad_norm`` is the step's global gradient norm before
    clipping; ``last_step_skipped``, ``steps_skipped`` and ``consecutive_skips`` count the skipped
    steps (an fp16 overflow and a step without a predicted token included). ``close()`` removes
    the step's hooks from the model (the step cannot run afterwards).

    Building it on what ``parallelize`` (or ``build_pipeline``) returned is collective: every rank
    must pass the same options and optimizer (the ranks holding a pipeline stage also the same
    parameters and optimizer groups), which one all-gather confirms before any hook or collective;
    otherwise every rank raises ``moe_ep.RanksDisagree`` naming the first difference (a rank
    whose optimizer is refused raises its ValueError, the others ``RanksDisagree`` naming it)."""

    def __init__(self, model_or_stages, optimizer: torch.optim.Optimizer, *, microbatches: int | None = None,
                 loss_scale: float | str | None = None, aux_loss_coef: float = 0.0, global_aux_loss: bool = False,
                 z_loss_coef: float = 0.0, expert_bias_rate: float = 0.0, max_grad_norm: float | None = None,
                 max_consecutive_skips: int | None = 20, lr_scheduler=None, autocast_dtype: torch.dtype | None = None,
                 chunked_loss: bool = False, router_score: str | None = None, sequence_aux_loss: bool = False):
        options = dict(microbatches=microbatches, loss_scale=loss_scale, aux_loss_coef=aux_loss_coef,
                       global_aux_loss=global_aux_loss, sequence_aux_loss=sequence_aux_loss,
                       router_score=router_score, z_loss_coef=z_loss_coef,
                       expert_bias_rate=expert_bias_rate,
                       max_grad_norm=max_grad_norm, max_consecutive_skips=max_consecutive_skips,
                       lr_scheduler=lr_scheduler, autocast_dtype=autocast_dtype, chunked_loss=chunked_loss)
        context = parallel_context(model_or_stages)
        with _ranks_agree(model_or_stages, context, optimizer, options):
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
            self.executor = executor_for(model_or_stages, microbatches=microbatches, autocast_dtype=autocast_dtype,
                                         chunked_loss=chunked_loss)
            _check_optimizer_holds(model_or_stages, optimizer)
            for name, coef in (("aux_loss_coef", aux_loss_coef), ("z_loss_coef", z_loss_coef),
                               ("expert_bias_rate", expert_bias_rate)):
                check_number(name, coef, at_least=0)
            for name, flag in (("global_aux_loss", global_aux_loss), ("sequence_aux_loss", sequence_aux_loss)):
                if not isinstance(flag, bool):
                    raise TypeError(f"{name} must be a bool, got {flag!r}")
                if flag and not aux_loss_coef:
                    raise ValueError(f"{name}=True needs aux_loss_coef > 0")
            if global_aux_loss and sequence_aux_loss:
                raise ValueError("global_aux_loss and sequence_aux_loss exclude each other: a sequence's balance is "
                                 "its own, not summed over the data-parallel ranks")
            if router_score is not None:
                if router_score not in SCORES:
                    raise ValueError(f"router_score must be one of {SCORES} or None, got {router_score!r}")
                if not aux_loss_coef:
                    raise ValueError(f"router_score={router_score!r} needs aux_loss_coef > 0")
            check_number("max_grad_norm", max_grad_norm, above=0, or_none=True)
            _check_lr_scheduler(lr_scheduler, optimizer)
            self.skips = SkipCounter(max_consecutive_skips)
            self.scaler = None if loss_scale is None else LossScaler(loss_scale)
        self.target = model_or_stages
        # The data-parallel ranks: the loss's token count and its parts are summed over them.
        self.dp = context.dp if context is not None else 1
        self.dp_group = context.meshes.dp_group if self.dp > 1 else None
        self.optimizer = optimizer
        self.microbatches = self.executor.microbatches
        self.max_grad_norm = max_grad_norm
        self.lr_scheduler = lr_scheduler
        self.loss_fn = ChunkedCausalLMLoss(self.executor.head) if chunked_loss else CausalLMLoss()
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.aux = None
        if aux_loss_coef or z_loss_coef or expert_bias_rate:
            self.aux = Balancing(self.executor, aux_loss_coef=float(aux_loss_coef), z_loss_coef=float(z_loss_coef),
                                 expert_bias_rate=float(expert_bias_rate),
                                 group=self.dp_group if global_aux_loss else None, router_score=router_score,
                                 per_sequence=sequence_aux_loss)
        self.closed = False
        self.last_lm_loss = self.last_aux_loss = self.last_z_loss = self.last_grad_norm = None
        # Other ranks meet this one in the step's collectives: a batch this rank cannot run is run
        # as a stand-in and refused by every rank together (batch.stand_in), not here alone.
        self.spans_ranks = self.dp_group is not None or (
            isinstance(model_or_stages, PipelineStages) and model_or_stages.group.size() > 1)
        self._own_refusal: Exception | None = None  # why this rank ran a stand-in this step

    @property
    def last_step_skipped(self) -> bool:
        return self.skips.last_step_skipped

    @property
    def steps_skipped(self) -> int:
        return self.skips.steps_skipped

    @property
    def consecutive_skips(self) -> int:
        return self.skips.consecutive_skips

    def close(self) -> None:
        """Remove this step's hooks from the model; the step cannot run afterwards."""
        if self.aux is not None:
            self.aux.close()
        self.closed = True

    def __call__(self, batch) -> torch.Tensor:
        if self.closed:
            raise RuntimeError("this TrainStep was closed (its hooks are removed); build a new one")
        ids, labels, flags = self._inputs(batch)
        tokens = self._tokens(labels)
        # Clamped so that a batch with every label ignored gives a zero loss, not NaN (and is skipped).
        self.loss_fn.normalizer = tokens.clamp(min=1) / self.dp
        self.loss_fn.scale = self.scaler.scale if self.scaler else 1.0
        with self.aux.armed(self.loss_fn.scale) if self.aux is not None else nullcontext():
            loss = self.executor.run(ids, labels, self.loss_fn)
        records = self.aux.step_records() if self.aux is not None else None
        parts = [loss / self.loss_fn.scale]
        if self.aux is not None and self.aux.losses:
            parts.extend(self.aux.means(records, loss.device).unbind())
        # The batch's problems and "no predicted token", one flag each, summed over every rank by
        # the collectives the step makes anyway (here over dp, in _finish over the pipeline).
        flags = torch.cat([flags.to(loss.device), (tokens == 0).reshape(1).to(loss.device, torch.float32)])
        if self.dp_group is not None:
            # The LM parts add up to the global mean (times dp); the aux parts are means of
            # equally many micro-batches per rank, so their mean is the global one.
            summed = torch.cat([torch.stack(parts), flags])
            dist.all_reduce(summed, group=self.dp_group)
            parts, flags = list((summed[:len(parts)] / self.dp).unbind()), summed[len(parts):]
        self.last_lm_loss = loss = parts[0]
        if self.aux is not None and self.aux.losses:
            self.last_aux_loss, self.last_z_loss = parts[1], parts[2]
            loss = loss + self.aux.aux_loss_coef * self.last_aux_loss + self.aux.z_loss_coef * self.last_z_loss
        self._finish(loss, records, flags)
        return loss

    def _finish(self, loss: torch.Tensor, records, flags: torch.Tensor) -> None:
        """Unscale, measure, then refuse, step or skip alike on every rank, and clear the gradients."""
        if self.scaler:
            self.scaler.unscale_(self.params)
        norm, flags = self.executor.over_stages(grad_norm(self.params), flags)
        self.last_grad_norm = norm
        # host sync: the step's one, for the skip decision and the batch's checks. Every rank holds
        # the same global loss, norm and flags, so every rank decides alike without a collective
        # of its own.
        loss_value, norm_value, *counts = torch.cat([torch.stack([loss.float(), norm.to(loss.device)]),
                                                     flags.to(loss.device)]).tolist()
        *problems, no_tokens = counts
        refused = refusal(problems, self.executor.vocab_size)
        if refused is not None:
            self.optimizer.zero_grad(set_to_none=True)
            self.last_lm_loss = self.last_aux_loss = self.last_z_loss = self.last_grad_norm = None
            own = self._own_refusal
            if own is not None:
                raise type(own)(f"{refused} (this rank's batch: {own})") from None
            raise ValueError(refused)
        took_step = not no_tokens and self.skips.takes(loss_value, norm_value)
        if self.scaler and not no_tokens:  # no token is no overflow: the scale stays
            self.scaler.update(took_step)
        if took_step:
            if self.max_grad_norm is not None:
                clip_grads_(self.params, norm, self.max_grad_norm)
            self.optimizer.step()
            if self.aux is not None and self.aux.expert_bias_rate:
                self.aux.update_expert_bias(records, self.dp_group)
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.skips.record(not took_step, loss_value, norm_value, no_tokens=bool(no_tokens))

    def _tokens(self, labels: torch.Tensor) -> torch.Tensor:
        """The global batch's predicted tokens (int64: exact at any batch size). The loss divisor
        of this rank is that over ``dp``: FSDP averages gradients over the ``dp`` ranks, so each
        backpropagates ``dp`` x its tokens' share of the global mean, and the average is the
        global mean's gradient."""
        tokens = predicted_tokens(labels)
        if self.dp_group is not None:
            tokens = tokens.to(self.executor.device)
            dist.all_reduce(tokens, group=self.dp_group)
        return tokens

    def _inputs(self, batch):
        """``screened``'s (ids, labels, flags) of ``batch``; one whose type, keys or shape this step
        cannot run raises here alone, or, where other ranks meet this one in the step's
        collectives, is replaced by a stand-in that every rank then refuses together."""
        self._own_refusal = None
        try:
            ids, labels = self._checked_form(batch)
        except (TypeError, ValueError) as err:
            shape = self.executor.stand_in_shape() if self.spans_ranks else None
            if shape is None:
                self.executor.agree_on_batch_shape(None, self.dp_group)
                raise
            self._own_refusal = err
            return stand_in(shape, self.executor.device, self.executor.vocab_size)
        self.executor.agree_on_batch_shape(tuple(ids.shape), self.dp_group)
        # Their values are checked on the device and refused at the step's read-back, on every rank.
        return screened(ids, labels, self.executor.vocab_size)

    def _checked_form(self, batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``input_ids`` and ``labels`` (None: none given) of a batch this step can run."""
        if not isinstance(batch, dict) or "input_ids" not in batch:
            raise TypeError(f"batch must be a dict with 'input_ids' (and optionally 'labels'), got {type(batch).__name__}")
        extra = sorted(set(batch) - {"input_ids", "labels"})
        if extra:
            raise ValueError(
                f"batch keys {extra} are not supported: stages compute positions 0..seq-1 and a causal mask; "
                f"right-pad and set padded labels to {IGNORE_INDEX}"
            )
        ids, given = batch["input_ids"], batch.get("labels")
        labels = ids if given is None else given
        for name, t in (("input_ids", ids), ("labels", labels)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"batch['{name}'] must be a torch.Tensor, got {type(t).__name__}")
        if ids.dim() != 2 or labels.shape != ids.shape:
            raise ValueError(
                f"input_ids must be [batch, seq] and labels the same shape, got {tuple(ids.shape)} and "
                f"{tuple(labels.shape)}"
            )
        if ids.shape[1] < 1:
            raise ValueError(f"input_ids must hold at least one token per sequence, got shape {tuple(ids.shape)}")
        if ids.shape[0] < self.microbatches or ids.shape[0] % self.microbatches:
            # Checked before any work: an uneven cut would run fewer micro-batches than the loss
            # and the aux loss are scaled for.
            raise ValueError(
                f"batch of {ids.shape[0]} sequences cannot be cut into {self.microbatches} micro-batches: "
                f"microbatches={self.microbatches} must divide input_ids' first dimension, got shape "
                f"{tuple(ids.shape)}"
            )
        self.executor.check_batch_shape(tuple(ids.shape))
        return ids, given
