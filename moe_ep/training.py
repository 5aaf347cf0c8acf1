"""One training step, the same with and without pipeline stages.

``TrainStep(model_or_stages, optimizer, microbatches=M)`` then ``loss = step(batch)`` for every
step: the batch is cut into M equal micro-batches (its size must be a multiple of M, checked
before any work), each runs forward and backward (through the pipeline schedule when given
``PipelineStages``), gradients accumulate, then the optimizer steps and the gradients are
cleared. Without stages FSDP2 reduce-scatters the gradients after every micro-batch, so they
stay sharded in between (deferring it to the last one would hold every unsharded gradient of the
model meanwhile). ``model_or_stages`` is what ``moe_ep.parallelize`` returns (the model
when ``pp=1``, this rank's ``PipelineStages`` when ``pp>1``), so the training loop does not
change when ``pp`` does.

The loss is the causal-LM cross-entropy summed over the step's predicted tokens and divided by
their number, counted over the whole batch before it is cut and summed over the data-parallel
ranks of ``moe_ep.parallelize``'s meshes (an all-reduce of one count, no host sync): the step's
objective is the mean over every token of the global batch, however the ignored labels (-100)
fall on micro-batches and ranks. FSDP averages gradients over the ``dp`` data-parallel ranks
(parallelize's divide factor), so each rank backpropagates ``dp`` x its tokens' share of that
mean; the average is then exactly the global mean's gradient. A model that parallelize did not
prepare is normalised by its own batch's tokens.

Non-finite steps: a step whose loss or gradient norm is not finite on any rank is skipped on
every rank, in every precision: the loss is the all-reduced global one and the norm the global
one over every stage and mesh, so every rank reads the same two values (one host sync per step)
and takes the same decision. A skipped step moves nothing: no optimizer step, no lr scheduler
step, no expert-bias update; the gradients are cleared. ``max_consecutive_skips`` such steps in a
row raise ``NonFiniteStepsError`` on every rank.

Loss scaling (fp16): ``loss_scale="dynamic"`` multiplies the loss by a scale before backward and
unscales the gradients after; an overflow shows as a non-finite gradient norm, so the step is
skipped as above and the scale halves, doubling again after ``growth_interval`` good steps. A
float keeps the scale fixed.

Load balancing (``aux_loss_coef > 0``): every MoE layer's load-balancing loss (transformers'
formula, ``moe_ep.losses.load_balancing_loss``, on that layer's router output for that
micro-batch) enters the objective as ``coef x`` its mean over layers and micro-batches. With
``global_aux_loss=True`` each layer's statistics of a micro-batch are summed over the
data-parallel ranks first (Megatron-Core's global aux loss: the balance of the whole global
micro-batch, not of each rank's share). The router z-loss (``z_loss_coef > 0``, ST-MoE,
``moe_ep.losses.router_z_loss``) enters the same way. Both are injected where they arise: a forward hook on each MoE block passes the block's output through
an identity whose backward also feeds the layer's aux loss its gradient (Megatron-Core's
technique), so it works unchanged on any pipeline stage, under any schedule, and with
activation checkpointing. The returned loss is the LM loss plus ``coef x`` that mean. Note that
transformers' own ``output_router_logits`` loss pools the statistics of all layers before the
product; a pipeline cannot (the layers live on different ranks), so both paths here use the
per-layer mean, as Megatron-Core does.

Aux-loss-free balancing (``expert_bias_rate > 0``, DeepSeek-V3): the same hooks count each MoE
block's routed (token, slot) pairs per expert over the step's micro-batches, on the device; after
each optimizer step that was taken (not a skipped one) every local block's
``gate.e_score_correction_bias`` moves by ``rate x sign(mean load - load)``
(``moe_ep.losses.update_expert_bias_``), with the loads summed over the data-parallel ranks, so
every rank applies the identical update and the biases never need a broadcast. The bias steers
the routers' choice only, so no gradient flows through it. Counts are recorded in the backward
of the identity above, so a micro-batch counts once however often its forward runs (activation
checkpointing recomputes it; torch's pipelining runs an extra shape-inference pass before its
first step, whose records are dropped). A router without that buffer is refused at construction.

The hooks act only during their own TrainStep's step: several TrainSteps may share a model (or
stages), and forwards outside a step are untouched. ``close()`` removes them for good."""

from __future__ import annotations

import collections
import functools
import math
from contextlib import nullcontext
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from .losses import expert_counts, load_balancing_loss, router_z_loss, update_expert_bias_
from .parallel.clip import grad_norm, scale_grads_
from .parallel.parallelize import MESHES_ATTRIBUTE
from .parallel.pipeline import PipelineStages

IGNORE_INDEX = -100


class CausalLMLoss:
    """``loss_fn(logits [B, S, V], labels [B, S])``: next-token cross-entropy in fp32, summed,
    divided by ``normalizer`` (the step's predicted-token count) and multiplied by ``scale``."""

    def __init__(self):
        self.normalizer: torch.Tensor | float = 1.0
        self.scale: float = 1.0

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits_NV = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
        target_N = labels[:, 1:].reshape(-1).to(logits.device)
        total = F.cross_entropy(logits_NV, target_N, ignore_index=IGNORE_INDEX, reduction="sum")
        return total / self.normalizer * self.scale


def predicted_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Tokens whose next token is a target, as a tensor (no host sync)."""
    return (labels[:, 1:] != IGNORE_INDEX).sum()


class LossScaler:
    """Dynamic or static loss scale shared by every rank (see the module docstring)."""

    def __init__(self, loss_scale: float | str, *, growth_interval: int = 2000, init_scale: float = 2.0**16):
        if loss_scale == "dynamic":
            self.dynamic, self.scale = True, float(init_scale)
        elif isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool) and loss_scale > 0:
            self.dynamic, self.scale = False, float(loss_scale)
        else:
            raise ValueError(f"loss_scale must be None, 'dynamic' or a positive number, got {loss_scale!r}")
        if not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be a positive int, got {growth_interval!r}")
        self.growth_interval = growth_interval
        self.good_steps = 0

    def unscale_(self, params: list[torch.nn.Parameter]) -> None:
        """Divide this rank's gradients by the scale."""
        grads = [_local(p.grad) for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)

    def update(self, finite: bool) -> None:
        """After a step: a dynamic scale halves when the gradients overflowed and doubles after
        ``growth_interval`` finite steps in a row."""
        if not self.dynamic:
            return
        if finite:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= 2.0
        else:
            self.scale /= 2.0
            self.good_steps = 0


class NonFiniteStepsError(RuntimeError):
    """``TrainStep`` skipped ``max_consecutive_skips`` steps in a row because their loss or gradient
    norm was not finite; raised on every rank at the same step."""


class _Record(NamedTuple):
    """What one MoE block's backward of one micro-batch leaves (see ``_AttachAuxLoss``)."""

    block: int  # index into AuxLossHooks.blocks
    terms: torch.Tensor | None  # (aux loss, z-loss) values; None when neither is weighted
    counts_E: torch.Tensor | None  # routed (token, slot) pairs per expert; None unless counting


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``hidden``; in backward it also gives the layer's ``terms`` (aux loss, z-loss)
    the gradients ``weights`` and records their values and ``counts_E`` for ``block``. Recording in
    backward counts each micro-batch and layer once: activation checkpointing recomputes the
    forward, never this backward."""

    @staticmethod
    def forward(ctx, hidden, terms, counts_E, weights, record, block):
        ctx.weights, ctx.record, ctx.block = weights, record, block
        ctx.save_for_backward(None if terms is None else terms.detach(), counts_E)
        return hidden

    @staticmethod
    def backward(ctx, grad_hidden):
        terms, counts_E = ctx.saved_tensors
        ctx.record.append(_Record(ctx.block, terms, counts_E))
        grad_terms = None if terms is None else torch.tensor(ctx.weights, dtype=terms.dtype, device=terms.device)
        return grad_hidden, grad_terms, None, None, None, None


class AuxLossHooks:
    """Forward hooks on every MoE block of ``modules`` (a block is a module with a ``gate``
    router returning ``(logits [T, E], weights, indices [T, K])`` and an ``experts`` module); a
    pipeline rank may have none. ``losses``: attach the aux loss and z-loss; ``counts``: record the
    routed pairs per expert. ``group``: sum the aux loss statistics over it (global aux loss;
    collective, every rank of it runs the same blocks in the same order).

    The hooks act only while ``active`` (TrainStep sets it for its own step): a forward outside
    the step, or inside another TrainStep's step on the same model, is left alone, so TrainSteps
    sharing a model never feed each other's losses or records. ``close()`` removes the hooks."""

    def __init__(self, modules, *, losses: bool, counts: bool, group: dist.ProcessGroup | None = None):
        found = [(name, m) for root in modules for name, m in root.named_modules()
                 if hasattr(m, "gate") and hasattr(m, "experts")]
        self.names = [name for name, _ in found]
        self.blocks = [m for _, m in found]
        self.losses, self.counts, self.group = losses, counts, group
        self.weights = (0.0, 0.0)  # gradient weights of (aux loss, z-loss)
        self.record: list[_Record] = []
        self.active = False
        self._routing: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # by id(router), router to block hook
        self.handles = []
        for i, block in enumerate(self.blocks):
            self.handles.append(block.gate.register_forward_hook(self._router_hook))
            self.handles.append(block.register_forward_hook(functools.partial(self._block_hook, i)))

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _router_hook(self, router, args, output):
        if not self.active:
            return
        if not (isinstance(output, tuple) and len(output) == 3 and output[0].dim() == 2 and output[2].dim() == 2):
            raise TypeError(
                f"{type(router).__name__} must return (logits [T, E], weights, indices [T, K]) for the aux loss"
            )
        self._routing[id(router)] = (output[0], output[2])

    def _block_hook(self, index, block, args, output):
        if not self.active:
            return output
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"{type(block).__name__} must return a tensor for the aux loss, got {type(output).__name__}")
        logits_TE, idx_TK = self._routing.pop(id(block.gate))
        if not torch.is_grad_enabled():
            return output
        terms = counts_E = None
        if self.losses:
            aux = load_balancing_loss(logits_TE, idx_TK.shape[1], top_k_index=idx_TK, group=self.group)
            terms = torch.stack([aux, router_z_loss(logits_TE).to(aux.dtype)])
        if self.counts:
            counts_E = expert_counts(idx_TK, logits_TE.shape[1])
        return _AttachAuxLoss.apply(output, terms, counts_E, self.weights, self.record, index)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class TrainStep:
    """``TrainStep(model_or_stages, optimizer, *, microbatches=1, loss_scale=None, lr_scheduler=None)``.

    Args:
        model_or_stages: what ``moe_ep.parallelize`` returns: a transformers causal LM
            (parallelized or not) or ``PipelineStages`` (also from ``build_pipeline``); with stages
            the micro-batch count is theirs and ``microbatches`` must be None or equal to it.
        optimizer: over ``model.parameters()`` or ``stages.parameters()``.
        microbatches: gradient-accumulation micro-batches per step (batch dim split evenly).
        loss_scale: None, ``"dynamic"`` (fp16) or a fixed positive scale.
        aux_loss_coef: weight of the per-layer load-balancing loss (0: none); see the module doc.
        global_aux_loss: compute it from the statistics of every data-parallel rank.
        z_loss_coef: weight of the per-layer router z-loss (0: none).
        expert_bias_rate: step size of DeepSeek-V3's aux-loss-free expert bias (0: none; every
            MoE router must hold ``e_score_correction_bias``); see the module doc.
        max_grad_norm: clip the gradients' global 2-norm (all stages, all meshes) to this.
        max_consecutive_skips: raise ``NonFiniteStepsError`` when this many steps in a row were
            skipped for a non-finite loss or gradient norm (None: never).
        lr_scheduler: stepped after every optimizer step that was taken.
        autocast_dtype: run the forward (without pipeline stages) under ``torch.autocast`` in
            this dtype, for a model that FSDP's ``MixedPrecisionPolicy`` does not cast (one
            process); the loss is computed in fp32 and backward runs outside autocast.

    ``step(batch)`` takes ``{"input_ids": [B, S], "labels": [B, S] (optional, defaults to
    input_ids)}`` (this rank's share of the global batch, ``B`` a multiple of the micro-batches)
    and returns the step's loss (LM loss plus the weighted aux and z losses; the parts are
    ``last_lm_loss``, ``last_aux_loss`` and ``last_z_loss``): the mean over the global batch, a
    detached scalar equal on every rank (broadcast from the pipeline rank
    that computes it, averaged over the data-parallel ranks). ``last_grad_norm`` is the step's
    global gradient norm before clipping (unscaled), ``last_step_skipped`` whether the step was
    skipped (non-finite loss or gradient norm, fp16 overflow included); ``steps_skipped`` and
    ``consecutive_skips`` count the skipped steps in all and since the last step taken. One host
    sync per step, for that decision.
    ``close()`` removes the step's hooks from the model (the step cannot run afterwards).
    """

    def __init__(self, model_or_stages, optimizer: torch.optim.Optimizer, *, microbatches: int | None = None,
                 loss_scale: float | str | None = None, aux_loss_coef: float = 0.0, global_aux_loss: bool = False,
                 z_loss_coef: float = 0.0, expert_bias_rate: float = 0.0, max_grad_norm: float | None = None,
                 max_consecutive_skips: int | None = 20, lr_scheduler=None, autocast_dtype: torch.dtype | None = None):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.pipelined = isinstance(model_or_stages, PipelineStages)
        if not self.pipelined and not isinstance(model_or_stages, torch.nn.Module):
            raise TypeError(
                f"model_or_stages must be a torch.nn.Module or PipelineStages, got {type(model_or_stages).__name__}"
            )
        if self.pipelined:
            if microbatches not in (None, model_or_stages.microbatches):
                raise ValueError(
                    f"microbatches={microbatches} differs from the pipeline's {model_or_stages.microbatches}; the "
                    f"schedule fixes it (parallelize(microbatches=...))"
                )
            microbatches = model_or_stages.microbatches
        elif microbatches is None:
            microbatches = 1
        if not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"microbatches must be a positive int, got {microbatches!r}")
        self.target = model_or_stages
        meshes = model_or_stages.meshes if self.pipelined else getattr(model_or_stages, MESHES_ATTRIBUTE, None)
        self.dp = meshes.dims.dp if meshes is not None else 1
        self.dp_group = meshes.dp_group if self.dp > 1 else None
        self.optimizer = optimizer
        self.microbatches = microbatches
        self.scaler = None if loss_scale is None else LossScaler(loss_scale)
        self.lr_scheduler = lr_scheduler
        self.loss_fn = CausalLMLoss()
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.steps_skipped = 0
        for name, coef in (("aux_loss_coef", aux_loss_coef), ("z_loss_coef", z_loss_coef),
                           ("expert_bias_rate", expert_bias_rate)):
            if isinstance(coef, bool) or not isinstance(coef, (int, float)) or coef < 0:
                raise ValueError(f"{name} must be a number >= 0, got {coef!r}")
        if global_aux_loss and not aux_loss_coef:
            raise ValueError("global_aux_loss=True needs aux_loss_coef > 0")
        self.aux_loss_coef, self.z_loss_coef = float(aux_loss_coef), float(z_loss_coef)
        self.expert_bias_rate = float(expert_bias_rate)
        if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float))
                                          or not max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be a positive number or None, got {max_grad_norm!r}")
        self.max_grad_norm = max_grad_norm
        if max_consecutive_skips is not None and (isinstance(max_consecutive_skips, bool)
                                                  or not isinstance(max_consecutive_skips, int)
                                                  or max_consecutive_skips < 1):
            raise ValueError(f"max_consecutive_skips must be a positive int or None, got {max_consecutive_skips!r}")
        self.max_consecutive_skips = max_consecutive_skips
        self.last_grad_norm = None
        self.last_step_skipped = False
        self.consecutive_skips = 0
        if autocast_dtype is not None:
            if not isinstance(autocast_dtype, torch.dtype) or not autocast_dtype.is_floating_point:
                raise TypeError(f"autocast_dtype must be a floating torch.dtype or None, got {autocast_dtype!r}")
            if self.pipelined:
                raise ValueError(
                    f"autocast_dtype={autocast_dtype} applies without pipeline stages; stages compute in low "
                    "precision through parallelize(mixed_precision=MixedPrecisionPolicy(param_dtype=...))"
                )
        self.autocast_dtype = autocast_dtype
        # A transformers model would otherwise fill a key/value cache that training never reads.
        config = None if self.pipelined else getattr(model_or_stages, "config", None)
        self.forward_kwargs = {"use_cache": False} if hasattr(config, "use_cache") else {}
        modules = model_or_stages.modules if self.pipelined else [model_or_stages]
        self.aux = None
        losses = bool(self.aux_loss_coef or self.z_loss_coef)
        if losses or self.expert_bias_rate:
            self.aux = AuxLossHooks(modules, losses=losses, counts=bool(self.expert_bias_rate),
                                    group=self.dp_group if global_aux_loss else None)
        self.num_moe_layers = 0
        if self.aux is not None:
            try:
                self.num_moe_layers = self._count_moe_layers()
                if not self.num_moe_layers:
                    needs = "aux_loss_coef or z_loss_coef" if losses else "expert_bias_rate"
                    raise ValueError(f"{needs} > 0 needs MoE blocks (modules with a 'gate' router and 'experts')")
                if self.expert_bias_rate:
                    self._check_expert_bias()
            except BaseException:
                self.aux.close()  # a refused TrainStep leaves no hooks on the model
                raise
        self.closed = False
        self.last_lm_loss = self.last_aux_loss = self.last_z_loss = None

    def _check_expert_bias(self) -> None:
        """Every local router must hold a 1-D bias of at least float32 precision. With pipeline
        stages every rank learns whether any stage refused: a stage without MoE blocks passes,
        and would otherwise go on to wait in a collective that its refusing peers never enter."""
        problem = self._expert_bias_problem()
        if self.pipelined:
            refused = torch.tensor([float(problem is not None)], device=self.target.stages[0].device)
            dist.all_reduce(refused, op=dist.ReduceOp.MAX, group=self.target.group)
            # host sync: once, at construction.
            if problem is None and refused.item():
                problem = (f"expert_bias_rate={self.expert_bias_rate} was refused by another pipeline stage (its "
                           "error names the router)")
        if problem is not None:
            raise ValueError(problem)

    def _expert_bias_problem(self) -> str | None:
        for name, block in zip(self.aux.names, self.aux.blocks):
            bias = getattr(block.gate, "e_score_correction_bias", None)
            if not isinstance(bias, torch.Tensor) or bias.dim() != 1:
                found = "none" if bias is None else (
                    f"one of shape {tuple(bias.shape)}" if isinstance(bias, torch.Tensor) else type(bias).__name__
                )
                return (
                    f"expert_bias_rate={self.expert_bias_rate} needs every MoE block's router to hold a 1-D "
                    f"'e_score_correction_bias' (DeepSeek-V3's aux-loss-free bias); the gate of {name!r} "
                    f"({type(block.gate).__name__}) has {found}"
                )
            if not bias.is_floating_point() or torch.finfo(bias.dtype).bits < 32:
                # In bfloat16 a step of 1e-3 rounds away once |bias| >= 0.5: the bias would stop
                # moving. transformers keeps it in float32 when it loads a model in low precision.
                return (
                    f"expert_bias_rate={self.expert_bias_rate} needs e_score_correction_bias in float32 or "
                    f"float64; the gate of {name!r} holds it in {bias.dtype} (cast the model's parameters, not "
                    "its buffers, to low precision)"
                )
        return None

    def close(self) -> None:
        """Remove this step's hooks from the model; the step cannot run afterwards."""
        if self.aux is not None:
            self.aux.close()
        self.closed = True

    def _inputs(self, batch):
        if not isinstance(batch, dict) or "input_ids" not in batch:
            raise TypeError(f"batch must be a dict with 'input_ids' (and optionally 'labels'), got {type(batch).__name__}")
        extra = sorted(set(batch) - {"input_ids", "labels"})
        if extra:
            raise ValueError(
                f"batch keys {extra} are not supported: stages compute positions 0..S-1 and a causal mask; "
                f"right-pad and set padded labels to {IGNORE_INDEX}"
            )
        ids = batch["input_ids"]
        labels = batch.get("labels", ids)
        if ids.dim() != 2 or labels.shape != ids.shape:
            raise ValueError(
                f"input_ids must be [B, S] and labels the same shape, got {tuple(ids.shape)} and {tuple(labels.shape)}"
            )
        if ids.shape[0] < self.microbatches or ids.shape[0] % self.microbatches:
            # Checked before any work: an uneven cut would run fewer micro-batches than the loss
            # and the aux loss are scaled for.
            raise ValueError(
                f"batch of {ids.shape[0]} sequences cannot be cut into {self.microbatches} micro-batches: "
                f"microbatches={self.microbatches} must divide input_ids' first dimension, got shape "
                f"{tuple(ids.shape)}"
            )
        return ids, labels

    def __call__(self, batch) -> torch.Tensor:
        if self.closed:
            raise RuntimeError("this TrainStep was closed (its hooks are removed); build a new one")
        ids, labels = self._inputs(batch)
        self.loss_fn.normalizer = self._normalizer(labels)
        self.loss_fn.scale = self.scaler.scale if self.scaler else 1.0
        if self.aux is not None:
            per_term = self.loss_fn.scale / (self.num_moe_layers * self.microbatches)
            self.aux.weights = (self.aux_loss_coef * per_term, self.z_loss_coef * per_term)
            self.aux.record.clear()
            self.aux.active = True
        try:
            loss = self._pipelined(ids, labels) if self.pipelined else self._accumulated(ids, labels)
        finally:
            if self.aux is not None:
                self.aux.active = False
        records = self._step_records() if self.aux is not None else None
        parts = [loss / self.loss_fn.scale]
        if self.aux is not None and self.aux.losses:
            parts.extend(self._aux_mean(records, loss.device).unbind())
        if self.dp_group is not None:
            # The LM parts add up to the global mean (times dp); the aux parts are means of
            # equally many micro-batches per rank, so their mean is the global one.
            summed = torch.stack(parts)
            dist.all_reduce(summed, group=self.dp_group)
            parts = list((summed / self.dp).unbind())
        self.last_lm_loss = loss = parts[0]
        if self.aux is not None and self.aux.losses:
            self.last_aux_loss, self.last_z_loss = parts[1], parts[2]
            loss = loss + self.aux_loss_coef * self.last_aux_loss + self.z_loss_coef * self.last_z_loss
        if self.scaler:
            self.scaler.unscale_(self.params)
        self.last_grad_norm = norm = self._grad_norm()
        # host sync: the skip decision. Every rank holds the same global loss and norm, so every
        # rank decides alike without a collective of its own.
        loss_value, norm_value = torch.stack([loss.float(), norm.to(loss.device)]).tolist()
        took_step = math.isfinite(loss_value) and math.isfinite(norm_value)
        if self.scaler:
            self.scaler.update(took_step)
        if took_step:
            if self.max_grad_norm is not None:
                scale_grads_(self.params, torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0))
            self.optimizer.step()
            if self.expert_bias_rate:
                self._update_expert_bias(records)
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._count_skip(not took_step, loss_value, norm_value)
        return loss

    def _count_skip(self, skipped: bool, loss: float, norm: float) -> None:
        self.last_step_skipped = skipped
        if not skipped:
            self.consecutive_skips = 0
            return
        self.steps_skipped += 1
        self.consecutive_skips += 1
        if self.max_consecutive_skips is not None and self.consecutive_skips >= self.max_consecutive_skips:
            raise NonFiniteStepsError(
                f"{self.consecutive_skips} steps in a row were skipped (max_consecutive_skips="
                f"{self.max_consecutive_skips}): the last had loss {loss} and gradient norm {norm}, and a step with "
                "a non-finite loss or gradient norm is never applied. Lower the learning rate, clip the gradients "
                "(max_grad_norm), check the data of these steps, or train in bf16 or with loss_scale='dynamic' "
                "instead of plain fp16"
            )

    def _normalizer(self, labels: torch.Tensor) -> torch.Tensor:
        """The loss divisor of this rank: the global batch's predicted tokens over ``dp`` (see
        the module docstring); at least 1/dp so that a batch with every label ignored gives a
        zero loss, not NaN."""
        tokens = predicted_tokens(labels)  # int64: exact at any batch size
        if self.dp_group is not None:
            device = self.target.stages[0].device if self.pipelined else next(self.target.parameters()).device
            tokens = tokens.to(device)
            dist.all_reduce(tokens, group=self.dp_group)
        return tokens.clamp(min=1) / self.dp

    def _grad_norm(self) -> torch.Tensor:
        """The global 2-norm of the gradients. moe_ep.parallel.grad_norm gives it over this rank's
        parameters across the dense and expert meshes; a pipeline adds the other stages' (sum of
        squares over the pipeline group)."""
        norm = grad_norm(self.params)
        if not self.pipelined:
            return norm
        squares = norm.to(self.target.stages[0].device, torch.float32).square()
        dist.all_reduce(squares, group=self.target.group)
        return squares.sqrt()

    def _count_moe_layers(self) -> int:
        """MoE layers of the whole model (on every pipeline stage): the aux loss is their mean."""
        local = len(self.aux.blocks)
        if not self.pipelined:
            return local
        count = torch.tensor([float(local)], device=self.target.stages[0].device)
        dist.all_reduce(count, group=self.target.group)
        # host sync: once, at construction.
        return int(count.item())

    def _step_records(self) -> list[_Record]:
        """The step's records: one per local MoE layer and micro-batch. torch's pipelining (2.12+)
        also runs one forward and backward before the first step to infer the stages' shapes,
        whose records come first and are not the step's, so the last ones are kept."""
        blocks = len(self.aux.blocks)
        expected = blocks * self.microbatches
        records = self.aux.record[max(len(self.aux.record) - expected, 0):]
        per_block = collections.Counter(r.block for r in records)
        if len(records) < expected or any(per_block[i] != self.microbatches for i in range(blocks)):
            raise RuntimeError(
                f"the MoE layers were recorded {len(self.aux.record)} times this step, expected {expected} "
                f"({blocks} MoE layers x {self.microbatches} micro-batches), the last {expected} of them once per "
                f"layer and micro-batch"
            )
        return records

    def _aux_mean(self, records: list[_Record], device) -> torch.Tensor:
        """The step's (aux loss, z-loss), means over layers and micro-batches, summed over the
        pipeline."""
        terms = [r.terms for r in records]
        total = torch.stack(terms).sum(0).to(device) if terms else torch.zeros(2, device=device)
        if self.pipelined:
            dist.all_reduce(total, group=self.target.group)
        return total / (self.num_moe_layers * self.microbatches)

    def _update_expert_bias(self, records: list[_Record]) -> None:
        """Every local block's bias moved by its step's load: the routed pairs of all its
        micro-batches, summed over the data-parallel ranks (one all-reduce for all layers), so that
        every rank applies the same update. A pipeline rank updates its own stages' blocks; the
        data-parallel peers of a stage hold the same blocks, so the collective matches."""
        if not self.aux.blocks:
            return
        counts = [[] for _ in self.aux.blocks]
        for r in records:
            counts[r.block].append(r.counts_E)
        # float64: integer counts stay exact however many tokens a step routes.
        load = [torch.stack(c).to(torch.float64).sum(0) for c in counts]
        biases = [block.gate.e_score_correction_bias for block in self.aux.blocks]
        update_expert_bias_(biases, load, rate=self.expert_bias_rate, group=self.dp_group)

    def _accumulated(self, ids, labels) -> torch.Tensor:
        total = torch.zeros((), device=ids.device)
        for ids_mb, labels_mb in zip(ids.chunk(self.microbatches), labels.chunk(self.microbatches)):
            autocast = nullcontext() if self.autocast_dtype is None else torch.autocast(ids.device.type,
                                                                                      dtype=self.autocast_dtype)
            with autocast:
                out = self.target(input_ids=ids_mb, **self.forward_kwargs)
            logits = out.logits if hasattr(out, "logits") else out
            loss = self.loss_fn(logits, labels_mb)
            loss.backward()
            total = total + loss.detach().to(total.device)
        return total

    def _pipelined(self, ids, labels) -> torch.Tensor:
        stages: PipelineStages = self.target
        schedule = stages.schedule(self.loss_fn)
        args = (ids,) if stages.has_first else ()
        losses = [] if stages.has_last else None
        schedule.step(*args, target=labels if stages.has_last else None, losses=losses)
        device = stages.stages[0].device
        loss = torch.stack(losses).sum().detach() if stages.has_last else torch.zeros((), device=device)
        loss = loss.to(device=device, dtype=torch.float32)
        dist.broadcast(loss, src=stages.last_stage_global_rank, group=stages.group)
        return loss

