"""Expert parallelism composed with FSDP2/HSDP on transformers MoE models: the meshes, expert
sharding, ``parallelize``, gradient clipping across meshes, full state dicts, fail-fast steps."""

from .clip import clip_grad_norm_
from .failure import PeerFailure, fail_fast
from .mesh import MoEMeshes, ParallelDims, build_meshes, resolve_dims
from .parallelize import meshes_of, parallelize
from .state_dict import full_state_dict, load_full_state_dict

__all__ = [
    "MoEMeshes",
    "ParallelDims",
    "PeerFailure",
    "build_meshes",
    "clip_grad_norm_",
    "fail_fast",
    "full_state_dict",
    "load_full_state_dict",
    "meshes_of",
    "parallelize",
    "resolve_dims",
]
