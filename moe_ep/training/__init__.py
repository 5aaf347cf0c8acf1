"""The training step: ``TrainStep`` runs one optimizer step of a causal LM over micro-batches,
the same with and without pipeline stages. Its parts: the executors (how micro-batches run), the
loss, loss scaling, the load-balancing terms and the skipping of non-finite steps."""

from .balancing import AuxLossHooks, Balancing
from .executors import Executor, GradientAccumulation, PipelineSchedule, executor_for
from .loss import IGNORE_INDEX, CausalLMLoss, predicted_tokens
from .loss_scale import LossScaler
from .skips import NonFiniteStepsError
from .step import TrainStep

__all__ = [
    "AuxLossHooks",
    "Balancing",
    "CausalLMLoss",
    "Executor",
    "GradientAccumulation",
    "IGNORE_INDEX",
    "LossScaler",
    "NonFiniteStepsError",
    "PipelineSchedule",
    "TrainStep",
    "executor_for",
    "predicted_tokens",
]
