"""The step's objective: causal-LM cross-entropy summed over the step's predicted tokens and
divided by their number over the whole global batch (``normalizer``), so that it is the mean over
every token however the ignored labels fall on micro-batches and ranks. ``CausalLMLoss`` takes the
model's logits; ``ChunkedCausalLMLoss`` (``TrainStep(chunked_loss=True)``) the final hidden states
and the LM head, through ``moe_ep.ops.linear_cross_entropy``, so the full logits never exist."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.linear_cross_entropy import IGNORE_INDEX, linear_cross_entropy, shift_labels

# Model attributes that change the logits after the head's linear map: the chunked loss computes
# ``hidden @ W.T + b`` only, so a model with one of them set is refused rather than trained on
# another objective (Gemma's soft-capping, Granite's and MiniCPM's divisor, Cohere's multiplier).
_LOGIT_TRANSFORMS = {"final_logit_softcapping": None, "logits_scaling": 1, "logit_scale": 1}


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
        target_T = shift_labels(labels.to(hidden.device))
        total, _ = linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), self.head.weight, target_T,
                                        self.head.bias)
        return total / self.normalizer * self.scale


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
    configs = [config] + ([config.get_text_config()] if hasattr(config, "get_text_config") else [])
    for name, neutral in _LOGIT_TRANSFORMS.items():
        for c in configs:
            value = getattr(c, name, neutral)
            if value != neutral:
                raise ValueError(
                    f"chunked_loss=True computes the logits as the LM head's linear map only, but {owner}'s config has "
                    f"{name}={value!r} (expected {neutral!r}), which the model applies to its logits: use "
                    "chunked_loss=False for this model"
                )
    return head if holds_head else None


def predicted_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Tokens whose next token is a target, as a tensor (no host sync)."""
    return (labels[:, 1:] != IGNORE_INDEX).sum()
