"""The training step: ``TrainStep`` runs one optimizer step of a causal LM over micro-batches,
the same with and without pipeline stages."""

from .step import IGNORE_INDEX, AuxLossHooks, CausalLMLoss, LossScaler, NonFiniteStepsError, TrainStep, predicted_tokens

__all__ = ["AuxLossHooks", "CausalLMLoss", "IGNORE_INDEX", "LossScaler", "NonFiniteStepsError", "TrainStep",
           "predicted_tokens"]
