"""The step's objective: causal-LM cross-entropy summed over the step's predicted tokens and
divided by their number over the whole global batch (``normalizer``), so that it is the mean over
every token however the ignored labels fall on micro-batches and ranks. ``CausalLMLoss`` takes the
model's logits; ``ChunkedCausalLMLoss`` (``TrainStep(chunked_loss=True)``) the final hidden states
and the LM head, through ``moe_ep.ops.linear_cross_entropy``, so the full logits never exist.
``chunked_causal_lm_loss`` is the same objective for the loops moe_ep does not drive (an accelerate
loop; ``ExpertParallelTrainer(chunked_loss=True)``): transformers' causal-LM loss, the model's own
load-balancing loss included, without the logits."""

from __future__ import annotations

import inspect
import weakref
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from ..hf.causal_lm import LOGIT_TRANSFORMS, config_field
from ..ops.linear_cross_entropy import IGNORE_INDEX, linear_cross_entropy, shift_labels
from ..ops.validate import check_index, check_targets_in_range, check_tensor



class CausalLMLoss:
    """``loss_fn(logits [batch, seq, V], labels [batch, seq])``: next-token cross-entropy in fp32,
    summed, divided by ``normalizer`` (the step's predicted-token count) and multiplied by
    ``scale`` (the loss scale)."""

    def __init__(self):
        self.normalizer: torch.Tensor | float = 1.0
        self.scale: float = 1.0

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits_TV = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
        target_T = labels[:, 1:].reshape(-1).to(logits.device)
        total = F.cross_entropy(logits_TV, target_T, ignore_index=IGNORE_INDEX, reduction="sum")
        return total / self.normalizer * self.scale


class ChunkedCausalLMLoss(CausalLMLoss):
    """``loss_fn(hidden [batch, seq, H], labels [batch, seq])``: ``CausalLMLoss``'s objective from
    the final (normed) hidden states through ``head`` in chunks of tokens, never holding the
    logits (``head`` None on a pipeline rank without the last stage, which computes no loss).
    ``head``'s weight is read at each call, after the model's (or stage's) forward: under FSDP it
    is then the gathered one, which the root keeps until backward (``moe_ep.parallel.fsdp``)."""

    def __init__(self, head: nn.Linear | None):
        super().__init__()
        self.head = head

    def __call__(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        total, _ = head_loss_sum(hidden, self.head, labels)
        return total / self.normalizer * self.scale


def head_loss_sum(hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor, *,
                  shifted: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(summed token cross-entropy, target_T)`` of the hidden states ``[batch, seq, H]`` through
    ``head`` against ``labels [batch, seq]``, shifted here (each position predicts the next label)
    or, ``shifted``, already the target of each position (transformers' ``shift_labels``), in
    chunks of tokens."""
    name = "shift_labels" if shifted else "labels"
    if shifted:
        check_tensor(name, labels, ndim=2)
        check_index(name, labels)
        target_T = labels.to(hidden.device).long().reshape(-1)
    else:
        target_T = shift_labels(labels.to(hidden.device))
    if labels.shape != hidden.shape[:2]:
        raise ValueError(f"{name} must be [batch, seq] = {tuple(hidden.shape[:2])} as the hidden states, got "
                         f"shape {tuple(labels.shape)}")
    if shifted:
        check_targets_in_range(name, labels, head.weight.shape[0], IGNORE_INDEX)
    else:
        check_targets_in_range("labels[:, 1:]", labels[:, 1:], head.weight.shape[0], IGNORE_INDEX)
    total, _ = linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), head.weight, target_T, head.bias)
    return total, target_T


def check_chunked_head(head, config, owner: str, *, holds_head: bool = True) -> nn.Linear | None:
    """``head`` (the LM head of ``owner``, a model or a pipeline stage, with ``config``) if the
    chunked loss computes exactly its logits; otherwise a ValueError naming what it cannot do.
    ``holds_head=False`` (a pipeline rank without the last stage) checks the config only, so that
    every rank refuses alike, and gives None."""
    if holds_head and not isinstance(head, nn.Linear):
        raise ValueError(
            f"chunked_loss=True needs a causal LM whose LM head is a torch.nn.Linear, got {type(head).__name__} "
            f"from {owner}"
        )
    # The chunked loss computes ``hidden @ W.T + b`` only: a model that transforms its logits after
    # the head is refused rather than trained on another objective.
    for name, neutral in LOGIT_TRANSFORMS.items():
        if (value := config_field(config, name, neutral)) != neutral:
            raise ValueError(
                f"chunked_loss=True computes the logits as the LM head's linear map only, but {owner}'s config has "
                f"{name}={value!r} (expected {neutral!r}), which the model applies to its logits: use "
                "chunked_loss=False for this model"
            )
    return head if holds_head else None


def chunked_loss_parts(model: nn.Module) -> tuple[nn.Linear, nn.Module]:
    """``(head, base)`` of a transformers causal LM that the chunked loss can run: its LM head
    (checked by check_chunked_head) and its base model, whose output are the final hidden states;
    otherwise a ValueError. Its forward must take ``logits_to_keep``, so that it computes no
    logits."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = check_chunked_head(head, getattr(model, "config", None), type(model).__name__)
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if not isinstance(base, nn.Module) or "logits_to_keep" not in inspect.signature(model.forward).parameters:
        raise ValueError(
            f"chunked_loss=True needs a transformers causal LM whose forward takes logits_to_keep (so that it "
            f"computes no logits) and whose base model is its base_model_prefix attribute; "
            f"{type(model).__name__} is not one: use chunked_loss=False"
        )
    return head, base


def no_logits(input_ids: torch.Tensor) -> torch.Tensor:
    """``logits_to_keep`` selecting no position: the model's own forward runs (so that FSDP's hooks
    gather and reduce as usual) and its LM head multiplies nothing."""
    return input_ids.new_empty(0, dtype=torch.long)


# Models whose logits check_head_logits has compared with their LM head's linear map.
_HEADS_CHECKED: weakref.WeakSet = weakref.WeakSet()


def chunked_logits_to_keep(model: nn.Module, input_ids: torch.Tensor):
    """``logits_to_keep`` for a forward of ``model`` whose loss is chunked: the last position on
    its first such forward (for check_head_logits), no position after."""
    return no_logits(input_ids) if model in _HEADS_CHECKED else 1


def check_head_logits(model: nn.Module, head: nn.Linear, hidden: torch.Tensor, outputs) -> None:
    """Once per model, on the forward that kept the last position's logits: those logits must be
    ``head``'s linear map of the final hidden states ``[batch, seq, H]``, which is all the chunked
    loss computes. check_chunked_head refuses the logit transforms it knows by their config fields;
    this catches a family that transforms its logits otherwise (a scaled hidden state before the
    head, a vocabulary cut to its unpadded size), which would train on another objective. One host
    sync, on the model's first forward with finite logits; the logits are set to an empty tensor
    afterwards."""
    if model in _HEADS_CHECKED:
        return
    logits = outputs.logits
    if logits.shape[1] != 1:
        raise ValueError(
            f"chunked_loss=True has the model compute no logits through logits_to_keep, but {type(model).__name__}'s "
            f"forward returned logits of {logits.shape[1]} positions for 1 asked: use chunked_loss=False for this "
            "model")
    with torch.no_grad():
        bias = None if head.bias is None else head.bias.float()
        ours = F.linear(hidden[:, -1:].float(), head.weight.float(), bias)
        theirs = logits.float()
        same = False
        if theirs.shape == ours.shape:  # else a vocabulary cut or padded after the head
            # bf16 rounding of the model's own product stays far inside 2% of the largest logit.
            # host sync: once per model, on its first chunked forward.
            finite, same = torch.stack([
                torch.isfinite(ours).all() & torch.isfinite(theirs).all(),
                (theirs - ours).abs().max() <= 0.02 * ours.abs().max() + 1e-6]).tolist()
            if not finite:
                # A non-finite forward (the step will be skipped) proves nothing: the next one checks.
                outputs.logits = logits[:, :0]
                return
    if not same:
        raise ValueError(
            f"chunked_loss=True computes the logits as the LM head's linear map of the final hidden states, but "
            f"{type(model).__name__}'s forward returns other logits (it transforms them, or the hidden states, "
            f"around its head): use chunked_loss=False for this model")
    _HEADS_CHECKED.add(model)
    outputs.logits = logits[:, :0]


def autocast_dtype_now(device: torch.device) -> torch.dtype | None:
    """The dtype autocast computes in on ``device``'s type here, None where it is off."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


@contextmanager
def final_hidden_states(base: nn.Module):
    """Yields a list to which each forward of ``base`` while inside appends ``(its output hidden
    states, the autocast dtype it ran under or None)``."""
    kept: list[tuple[torch.Tensor, torch.dtype | None]] = []

    def keep(module, args, out):
        hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
        kept.append((hidden, autocast_dtype_now(hidden.device)))

    handle = base.register_forward_hook(keep)
    try:
        yield kept
    finally:
        handle.remove()


def chunked_lm_loss(hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor, outputs, model: nn.Module,
                    num_items_in_batch: torch.Tensor | int | None = None, *, shifted: bool = False) -> torch.Tensor:
    """transformers' causal-LM loss from the final hidden states ``[batch, seq, H]``: the token
    cross-entropy summed, divided by ``num_items_in_batch`` (the Trainer's count over the
    accumulated batch) or else by this batch's predicted tokens, plus the model's weighted
    load-balancing loss when ``outputs`` carry one (``output_router_logits``), as the model's
    forward adds it when given labels. ``shifted``: ``labels`` are transformers' ``shift_labels``."""
    total, target_T = head_loss_sum(hidden, head, labels, shifted=shifted)
    count = num_items_in_batch if num_items_in_batch is not None else (target_T != IGNORE_INDEX).sum()
    loss = total / (count.to(total.device) if isinstance(count, torch.Tensor) else count)
    aux = outputs.get("aux_loss") if hasattr(outputs, "get") else None
    if aux is not None:
        coef = getattr(model, "router_aux_loss_coef", None)
        if coef is None:
            coef = model.config.router_aux_loss_coef
        loss = loss + coef * aux.to(loss.device)
    return loss


def chunked_causal_lm_loss(model: nn.Module, labels: torch.Tensor | None, *, num_items_in_batch=None,
                           shift_labels: torch.Tensor | None = None, **inputs):
    """``(loss, outputs)``: ``model(**inputs, labels=labels).loss`` of a transformers causal LM
    (shift, ``ignore_index`` -100, the mean over predicted tokens or the sum over
    ``num_items_in_batch``, the load-balancing loss), computed in chunks of tokens from the final
    hidden states so that the float32 logits of the whole batch never exist; ``outputs.logits``
    is empty. ``shift_labels`` (the target of each position, as a packing collator gives them)
    are the targets as given where the batch has them, as transformers' loss takes them. For a
    hand-written loop: ``loss, _ = moe_ep.chunked_causal_lm_loss(model, labels, input_ids=ids)``
    in place of ``model(input_ids=ids, labels=labels).loss``."""
    head, base = chunked_loss_parts(model)
    if "logits_to_keep" in inputs:
        raise ValueError("chunked_causal_lm_loss computes no logits: do not pass logits_to_keep")
    if labels is None and shift_labels is None:
        raise ValueError("chunked_causal_lm_loss needs labels or shift_labels")
    targets = labels if shift_labels is None else shift_labels
    with final_hidden_states(base) as kept:
        outputs = model(**inputs, logits_to_keep=chunked_logits_to_keep(model, targets))
    hidden, autocast_dtype = kept[-1]
    check_head_logits(model, head, hidden, outputs)
    # The head's GEMMs in the dtype the model's own head would have run in: accelerate's autocast
    # wraps the model's forward only, not this loss after it, where they ran in float32.
    with torch.autocast(hidden.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        loss = chunked_lm_loss(hidden, head, targets, outputs, model, num_items_in_batch,
                               shifted=shift_labels is not None)
    return loss, outputs


def predicted_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Tokens whose next token is a target, as a tensor (no host sync)."""
    return (labels[:, 1:] != IGNORE_INDEX).sum()
