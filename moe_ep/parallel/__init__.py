"""Expert parallelism composed with FSDP2/HSDP and pipeline stages on transformers MoE models:
``parallelize`` (every layout, ``pp > 1`` included) and its ``ParallelConfig``, what it made of a
model (``parallel_context``), the meshes, expert sharding, pipeline stages, gradient norms across
meshes, full state dicts, fail-fast steps, and the check that every rank was given the same
(``RanksDisagree``)."""

from .agreement import RanksDisagree
from .clip import clip_grad_norm_, grad_norm
from .config import DEFAULT_SCHEDULE, ParallelConfig, PipelineConfig
from .context import ParallelContext, meshes_of, parallel_context
from .failure import PeerFailure, fail_fast
from .mesh import MoEMeshes, ParallelDims, build_meshes, resolve_dims
from .parallelize import parallelize, parallelize_with
from .recompute import enable_activation_checkpointing
from .pipeline import CausalLMStage, PipelineStages, build_pipeline
from .state_dict import full_state_dict, load_full_state_dict

__all__ = [
    "DEFAULT_SCHEDULE",
    "CausalLMStage",
    "MoEMeshes",
    "ParallelConfig",
    "ParallelContext",
    "ParallelDims",
    "PeerFailure",
    "PipelineConfig",
    "PipelineStages",
    "RanksDisagree",
    "build_meshes",
    "build_pipeline",
    "clip_grad_norm_",
    "enable_activation_checkpointing",
    "fail_fast",
    "full_state_dict",
    "grad_norm",
    "load_full_state_dict",
    "meshes_of",
    "parallel_context",
    "parallelize",
    "parallelize_with",
    "resolve_dims",
]
