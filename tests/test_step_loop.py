"""moe_ep.runs.StepGuard and step_metrics in one process (no process group, so no fail_fast):
what stops a step becomes one RunError naming the step and the last complete checkpoint, anything
else passes through unchanged; the metrics are read back as the step computed them. The launched
cases (a killed rank, a hung one, non-finite steps on 2 ranks) are tests/faults'."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_ep import NonFiniteStepsError
from moe_ep.runs import RunError, StepGuard, step_metrics


def _raised_in_step(guard: StepGuard, exc: BaseException) -> BaseException:
    with pytest.raises(BaseException) as caught:
        with guard.step(7):
            raise exc
    return caught.value


def test_non_finite_steps_are_an_agreed_run_error_naming_the_last_checkpoint():
    guard = StepGuard(step_timeout=60.0)
    err = _raised_in_step(guard, NonFiniteStepsError("3 consecutive non-finite steps"))
    assert isinstance(err, RunError) and err.agreed
    assert str(err) == "step 7: 3 consecutive non-finite steps; stopped; no checkpoint was written yet"
    guard.last_checkpoint = Path("run/checkpoints/step_5")
    err = _raised_in_step(guard, NonFiniteStepsError("3 consecutive non-finite steps"))
    assert str(err).endswith("; stopped; the last complete checkpoint, run/checkpoints/step_5, holds finite weights")


def test_a_lost_peer_and_a_timeout_are_run_errors_said_by_this_rank():
    guard = StepGuard(step_timeout=8.0, last_checkpoint=Path("ckpt/step_4"), timeout_name="--step-timeout")
    err = _raised_in_step(guard, RuntimeError("[gloo] Connection closed by peer [10.0.0.2]:1234\nmore"))
    assert isinstance(err, RunError) and not err.agreed
    assert str(err) == ("step 7: lost contact with another rank ([gloo] Connection closed by peer [10.0.0.2]:1234); "
                        "it stopped or died (the launcher's report names it); the last complete checkpoint is "
                        "ckpt/step_4")
    err = _raised_in_step(guard, TimeoutError("past the bound"))
    assert isinstance(err, RunError)
    assert str(err).startswith("step 7 did not finish within --step-timeout 8 s (a rank hung, was stopped or is "
                               "swapping); every rank stops; the last complete checkpoint is ckpt/step_4")


@pytest.mark.parametrize("exc", [RuntimeError("CUDA out of memory"), ValueError("a bad batch"), KeyboardInterrupt()])
def test_other_errors_pass_through_unchanged(exc):
    assert _raised_in_step(StepGuard(step_timeout=60.0), exc) is exc


def test_step_metrics_reads_the_norm_and_losses_of_the_last_step():
    class LastStep:
        last_grad_norm, last_lm_loss = torch.tensor(2.5), torch.tensor(1.25, dtype=torch.bfloat16)
        last_aux_loss = last_z_loss = None

    assert step_metrics(LastStep(), torch.device("cpu")) == (2.5, 1.25, None, None)
    LastStep.last_aux_loss, LastStep.last_z_loss = torch.tensor(0.5), torch.tensor(0.125)
    assert step_metrics(LastStep(), torch.device("cpu")) == (2.5, 1.25, 0.5, 0.125)
