"""moe_ep: Mixture-of-Experts kernels and expert parallelism for PyTorch.

Importing it is cheap: the names below load their layer on first use, and importing one kernel
(``moe_ep.kernels.grouped_gemm``) loads no distributed, Hugging Face or planner code. When
transformers is installed, the ``"moe_ep"`` experts implementation
(``experts_implementation="moe_ep"``) and transformers' expert-parallel entry
``ep_implementation="moe_ep"`` are registered as soon as transformers imports its registries
(at once if it already has). No model or class is patched: ``patch(model)`` does that, on
request. The map of the package is ARCHITECTURE.md."""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING

from ._on_import import after_import

if TYPE_CHECKING:
    from .hf import experts_modules, num_experts_of, patch
    from .ops import moe_experts, route_topk
    from .parallel import (
        DEFAULT_SCHEDULE,
        ParallelConfig,
        PeerFailure,
        PipelineConfig,
        RanksDisagree,
        fail_fast,
        full_state_dict,
        load_full_state_dict,
        parallel_context,
        parallelize,
    )
    from .planner import MODEL_NAMES, NO_PIPELINE, Layout, config_from_name, plan, schedule_info
    from .runs import (
        OutputLock,
        Preempted,
        Preemption,
        Reporter,
        RunError,
        UsageError,
        latest_checkpoint,
        load_checkpoint,
        run_reported,
        save_checkpoint,
    )
    from .training import (
        ExpertParallelTrainer,
        ExpertParallelTrainerMixin,
        NonFiniteStepsError,
        TrainStep,
        chunked_causal_lm_loss,
        configure_accelerator,
    )

# Public name -> the module that defines it, imported on first access. By layer: the ops, the
# Hugging Face integration, the layout over ranks, the planner, the training step (moe_ep's own, and
# transformers' Trainer and accelerate's Accelerator on a parallelized model), the run around any loop
# (its folder and lock, checkpoints, metrics, errors; the rest of that layer is moe_ep.runs').
_PUBLIC = {
    "moe_experts": "moe_ep.ops",
    "route_topk": "moe_ep.ops",
    "patch": "moe_ep.hf",
    "experts_modules": "moe_ep.hf",
    "num_experts_of": "moe_ep.hf",
    "parallelize": "moe_ep.parallel",
    "ParallelConfig": "moe_ep.parallel",
    "PipelineConfig": "moe_ep.parallel",
    "DEFAULT_SCHEDULE": "moe_ep.parallel",
    "parallel_context": "moe_ep.parallel",
    "full_state_dict": "moe_ep.parallel",
    "load_full_state_dict": "moe_ep.parallel",
    "fail_fast": "moe_ep.parallel",
    "PeerFailure": "moe_ep.parallel",
    "RanksDisagree": "moe_ep.parallel",
    "plan": "moe_ep.planner",
    "Layout": "moe_ep.planner",
    "schedule_info": "moe_ep.planner",
    "NO_PIPELINE": "moe_ep.planner",
    "MODEL_NAMES": "moe_ep.planner",
    "config_from_name": "moe_ep.planner",
    "TrainStep": "moe_ep.training",
    "AdamW": "moe_ep.training",
    "NonFiniteStepsError": "moe_ep.training",
    "ExpertParallelTrainer": "moe_ep.training",
    "ExpertParallelTrainerMixin": "moe_ep.training",
    "configure_accelerator": "moe_ep.training",
    "chunked_causal_lm_loss": "moe_ep.training",
    "OutputLock": "moe_ep.runs",
    "save_checkpoint": "moe_ep.runs",
    "load_checkpoint": "moe_ep.runs",
    "latest_checkpoint": "moe_ep.runs",
    "Reporter": "moe_ep.runs",
    "UsageError": "moe_ep.runs",
    "RunError": "moe_ep.runs",
    "run_reported": "moe_ep.runs",
    "Preemption": "moe_ep.runs",
    "Preempted": "moe_ep.runs",
}
_SUBPACKAGES = ("bench", "dispatch", "hf", "kernels", "ops", "parallel", "planner", "runs", "training")

__all__ = sorted(_PUBLIC)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    if name in _SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC) | set(_SUBPACKAGES))


def _register_experts(_registry) -> None:
    from .hf import register_if_installed

    try:
        register_if_installed()
    except ValueError as err:  # another function holds the name: say so, keep transformers importable
        warnings.warn(f"moe_ep did not register its experts implementation: {err}", stacklevel=2)


def _register_expert_parallel(_registry) -> None:
    from .hf import register_transformers_ep, require_transformers

    try:
        require_transformers()
    except ImportError:
        return  # the experts registration warns about the version
    try:
        register_transformers_ep()
    except ValueError as err:
        warnings.warn(f"moe_ep did not register its expert-parallel implementation: {err}", stacklevel=2)


after_import("transformers.integrations.moe", _register_experts)
after_import("transformers.distributed.expert_parallel", _register_expert_parallel)
