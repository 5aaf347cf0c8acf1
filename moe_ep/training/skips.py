"""Steps that are not taken: a step whose loss or gradient norm is not finite on some rank, or
whose global batch has no predicted token, is skipped on every rank (every rank reads the same
global loss, norm and token flag, so every rank decides alike); too many in a row stop the run
with ``NonFiniteStepsError``."""

from __future__ import annotations

import math


class NonFiniteStepsError(RuntimeError):
    """``TrainStep`` skipped ``max_consecutive_skips`` steps in a row because their loss or gradient
    norm was not finite or their batch had no predicted token; raised on every rank at the same
    step."""


def check_max_consecutive_skips(value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"max_consecutive_skips must be a positive int or None, got {value!r}")


class SkipCounter:
    """``last_step_skipped``, ``steps_skipped`` (all) and ``consecutive_skips`` (since the last step
    taken); ``record`` raises NonFiniteStepsError at ``max_consecutive_skips`` in a row."""

    def __init__(self, max_consecutive_skips: int | None):
        check_max_consecutive_skips(max_consecutive_skips)
        self.max_consecutive_skips = max_consecutive_skips
        self.last_step_skipped = False
        self.steps_skipped = 0
        self.consecutive_skips = 0

    @staticmethod
    def takes(loss: float, grad_norm: float) -> bool:
        return math.isfinite(loss) and math.isfinite(grad_norm)

    def record(self, skipped: bool, loss: float, grad_norm: float, *, no_tokens: bool = False) -> None:
        self.last_step_skipped = skipped
        if not skipped:
            self.consecutive_skips = 0
            return
        self.steps_skipped += 1
        self.consecutive_skips += 1
        limit = self.max_consecutive_skips
        if limit is not None and self.consecutive_skips >= limit:
            if no_tokens:
                raise NonFiniteStepsError(
                    f"{self.consecutive_skips} steps in a row were skipped (max_consecutive_skips={limit}): the last "
                    "had no predicted token (every label of the global batch was the ignore index -100), and such a "
                    "step is never applied. Check the data of these steps: their labels mask every token"
                )
            raise NonFiniteStepsError(
                f"{self.consecutive_skips} steps in a row were skipped (max_consecutive_skips={limit}): the last had "
                f"loss {loss} and gradient norm {grad_norm}, and a step with a non-finite loss or gradient norm is "
                "never applied. Lower the learning rate, clip the gradients (max_grad_norm), check the data of these "
                "steps, or train in bf16 or with loss_scale='dynamic' instead of plain fp16"
            )
