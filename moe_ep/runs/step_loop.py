"""What a loop over ``moe_ep.TrainStep`` needs at every step, for examples/mixtral/train.py and a
user's own loop alike:

- ``StepGuard.step(n)``: the step's body under ``fail_fast`` (a rank that fails or hangs stops
  every rank at once, naming itself), and what stops it said as a ``RunError`` naming the step and
  the last complete checkpoint: non-finite steps past ``TrainStep``'s limit (raised alike on every
  rank, so said once), a lost peer, a step past the timeout;
- ``step_metrics``: the step's gradient norm and losses, read back in one host sync.

::

    guard = StepGuard(step_timeout=1800.0, last_checkpoint=resumed_from)
    for step in range(start, steps):
        with guard.step(step + 1):
            train_step(batch)
            grad_norm, loss, aux_loss, z_loss = step_metrics(train_step, device)
            if checkpoint_due(step + 1, every=500, last=steps):
                guard.last_checkpoint = save_checkpoint(...)
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist

from ..parallel import PeerFailure, fail_fast
from ..training import NonFiniteStepsError, TrainStep
from .errors import RunError, lost_peer


class StepGuard:
    """``step_timeout``: seconds one step may take on any rank (``fail_fast``'s bound; used only
    with an initialised process group), named in its message as ``timeout_name`` (a script's
    flag, say). ``last_checkpoint``: the last complete checkpoint, which the loop updates as it
    saves and every message names."""

    def __init__(self, *, step_timeout: float, last_checkpoint: Path | None = None,
                 timeout_name: str = "the step timeout"):
        self.step_timeout = step_timeout
        self.last_checkpoint = last_checkpoint
        self.timeout_name = timeout_name

    def _last_checkpoint(self) -> str:
        return (f"the last complete checkpoint is {self.last_checkpoint}" if self.last_checkpoint
                else "no checkpoint was written yet")

    @contextlib.contextmanager
    def step(self, number: int):
        """The body of step ``number`` (counted from 1)."""
        guard = fail_fast(timeout=self.step_timeout) if dist.is_initialized() else contextlib.nullcontext()
        try:
            with guard:
                try:
                    yield
                except NonFiniteStepsError as err:
                    # Raised on every rank at the same step (their loss and norm are the global
                    # ones); turned into the run's error inside fail_fast, which posts it as such.
                    raise RunError(f"step {number}: {err}; stopped; "
                                   + (f"the last complete checkpoint, {self.last_checkpoint}, holds finite weights"
                                      if self.last_checkpoint else "no checkpoint was written yet"),
                                   agreed=True) from None
        except RuntimeError as err:
            if isinstance(err, PeerFailure) or not lost_peer(err):
                raise
            raise RunError(f"step {number}: lost contact with another rank ({str(err).splitlines()[0]}); it stopped "
                           f"or died (the launcher's report names it); {self._last_checkpoint()}") from err
        except TimeoutError as err:
            # fail_fast's: this rank waited past the bound (its peers stop with PeerFailure).
            raise RunError(f"step {number} did not finish within {self.timeout_name} {self.step_timeout:g} s (a rank "
                           f"hung, was stopped or is swapping); every rank stops; {self._last_checkpoint()}") from err


def step_metrics(train_step: TrainStep, device: torch.device) -> tuple[float, float, float | None, float | None]:
    """``(grad_norm, lm_loss, aux_loss, z_loss)`` of ``train_step``'s last step, means over the
    global batch and the same on every rank; the aux and z losses None where the step computes
    none. One host sync."""
    measured = [train_step.last_grad_norm, train_step.last_lm_loss]
    if train_step.last_aux_loss is not None:
        measured += [train_step.last_aux_loss, train_step.last_z_loss]
    grad_norm, loss, *aux_z = torch.stack([t.to(device, torch.float32) for t in measured]).tolist()
    aux_loss, z_loss = aux_z if aux_z else (None, None)
    return grad_norm, loss, aux_loss, z_loss
