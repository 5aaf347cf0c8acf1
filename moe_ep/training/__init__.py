"""The training step: ``TrainStep`` runs one optimizer step of a causal LM over micro-batches,
the same with and without pipeline stages. Its parts: the executors (how micro-batches run), the
loss, loss scaling, the load-balancing terms, the batch's checks and the skipping of steps.

The same models also train in the loops people already have: ``configure_accelerator`` for
accelerate's ``Accelerator`` (``hf_accelerate.py``) and ``ExpertParallelTrainer`` for transformers'
``Trainer`` (``hf_trainer.py``), loaded on first use (they import accelerate and transformers)."""

import importlib


from .balancing import AuxLossHooks, Balancing
from .executors import Executor, GradientAccumulation, PipelineSchedule, executor_for
from .loss import IGNORE_INDEX, CausalLMLoss, chunked_causal_lm_loss, predicted_tokens
from .loss_scale import LossScaler
from .optim import AdamW
from .skips import NonFiniteStepsError
from .step import TrainStep

# Loaded on first access: importing them imports accelerate (and transformers' Trainer).
_LAZY = {
    "configure_accelerator": "hf_accelerate",
    "ExpertParallelTrainer": "hf_trainer",
    "ExpertParallelTrainerMixin": "hf_trainer",
}

__all__ = [
    "AdamW",
    "AuxLossHooks",
    "Balancing",
    "CausalLMLoss",
    "Executor",
    "ExpertParallelTrainer",
    "ExpertParallelTrainerMixin",
    "GradientAccumulation",
    "IGNORE_INDEX",
    "LossScaler",
    "NonFiniteStepsError",
    "PipelineSchedule",
    "TrainStep",
    "chunked_causal_lm_loss",
    "configure_accelerator",
    "executor_for",
    "predicted_tokens",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
