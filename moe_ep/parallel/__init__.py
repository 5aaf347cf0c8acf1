"""Expert parallelism composed with FSDP2/HSDP and pipeline stages on transformers MoE models:
the meshes, expert sharding, ``parallelize`` (every layout, ``pp > 1`` included), pipeline
stages, gradient clipping across meshes, full state dicts, fail-fast steps."""

from .clip import clip_grad_norm_, grad_norm
from .failure import PeerFailure, fail_fast
from .mesh import MoEMeshes, ParallelDims, build_meshes, resolve_dims
from .parallelize import meshes_of, parallelize
from .pipeline import CausalLMStage, PipelineStages, build_pipeline, parallelize_pipeline
from .state_dict import full_state_dict, load_full_state_dict

__all__ = [
    "CausalLMStage",
    "MoEMeshes",
    "ParallelDims",
    "PeerFailure",
    "PipelineStages",
    "build_meshes",
    "build_pipeline",
    "clip_grad_norm_",
    "fail_fast",
    "full_state_dict",
    "grad_norm",
    "load_full_state_dict",
    "meshes_of",
    "parallelize",
    "parallelize_pipeline",
    "resolve_dims",
]
