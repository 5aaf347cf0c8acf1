"""The step's objective: causal-LM cross-entropy summed over the step's predicted tokens and
divided by their number over the whole global batch (``normalizer``), so that it is the mean over
every token however the ignored labels fall on micro-batches and ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


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


def predicted_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Tokens whose next token is a target, as a tensor (no host sync)."""
    return (labels[:, 1:] != IGNORE_INDEX).sum()
