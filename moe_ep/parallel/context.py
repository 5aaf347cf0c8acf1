"""What ``parallelize`` made of a model, as one typed object: its configuration, the meshes and,
with ``pp > 1``, this rank's pipeline stages. ``parallel_context(model_or_stages)`` is the one
way to find it (TrainStep, state dicts and integrations read it there); it is kept beside the
model, not in attributes set on it."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
import torch

from .config import ParallelConfig
from .mesh import MoEMeshes
from .pipeline.stages import PipelineStages


@dataclass(frozen=True, eq=False)
class ParallelContext:
    """A model as ``parallelize`` laid it out on this rank."""

    config: ParallelConfig
    meshes: MoEMeshes
    stages: PipelineStages | None = None  # this rank's stages when pp > 1, else None

    @property
    def dp(self) -> int:
        """Ranks that see different data (the gradient average runs over them)."""
        return self.meshes.dims.dp


# Keyed by the parallelized model, weakly: a model that is dropped takes its entry with it (the
# context refers to its stages, never back to the model). Stages hold their context themselves.
_CONTEXTS: weakref.WeakKeyDictionary[torch.nn.Module, ParallelContext] = weakref.WeakKeyDictionary()


def parallel_context(model_or_stages) -> ParallelContext | None:
    """The context ``moe_ep.parallelize`` recorded for this model, or for the PipelineStages it
    returned; None for anything it did not prepare."""
    if isinstance(model_or_stages, PipelineStages):
        return model_or_stages.context
    if isinstance(model_or_stages, torch.nn.Module):
        return _CONTEXTS.get(model_or_stages)
    return None


def record_context(model: torch.nn.Module, context: ParallelContext) -> None:
    if context.stages is not None:
        context.stages.context = context
    _CONTEXTS[model] = context


def meshes_of(model: torch.nn.Module) -> MoEMeshes:
    """The meshes of a model that ``parallelize`` prepared with ``pp=1`` (ValueError otherwise);
    pipeline stages give theirs as ``PipelineStages.meshes``."""
    context = parallel_context(model)
    if context is None:
        raise ValueError(f"{type(model).__name__} was not prepared by moe_ep.parallel.parallelize")
    if context.stages is not None:
        raise ValueError(
            f"{type(model).__name__} was cut into pipeline stages; their meshes are on the PipelineStages that "
            "parallelize returned (.meshes)"
        )
    return context.meshes
