"""Loss scaling for fp16: the loss is multiplied by a scale before backward and the gradients
divided by it after. A dynamic scale halves after a step whose gradients overflowed (which
TrainStep skips, as it skips every non-finite step) and doubles after ``growth_interval`` good
steps in a row; a fixed one never changes."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor


class LossScaler:
    """``LossScaler("dynamic")`` or ``LossScaler(fixed_scale)``; the same on every rank."""

    def __init__(self, loss_scale: float | str, *, growth_interval: int = 2000, init_scale: float = 2.0**16):
        if loss_scale == "dynamic":
            self.dynamic, self.scale = True, float(init_scale)
        elif isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool) and 0 < loss_scale < math.inf:
            self.dynamic, self.scale = False, float(loss_scale)
        else:
            raise ValueError(f"loss_scale must be None, 'dynamic' or a finite number > 0, got {loss_scale!r}")
        if not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be a positive int, got {growth_interval!r}")
        self.growth_interval = growth_interval
        self.good_steps = 0

    def unscale_(self, params: list[torch.nn.Parameter]) -> None:
        """Divide this rank's gradients by the scale."""
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
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
