"""Full (gathered) state dicts of a parallelized model, with the model's own Hugging Face names
and global shapes: what ``model.state_dict()`` gives before ``parallelize``, so ``save_pretrained``
(``state_dict=``), safetensors and DCP see an ordinary checkpoint. Built on
``torch.distributed.checkpoint.state_dict``, which gathers FSDP shards and our expert DTensors
alike. For sharded checkpoints at scale use DCP on ``model.state_dict()`` directly."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from .context import meshes_of


def full_state_dict(model: torch.nn.Module, *, cpu_offload: bool = True) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer as a full tensor. With ``cpu_offload`` (the default,
    one copy in host memory) rank 0 gets CPU tensors and the other ranks an empty dict; without,
    every rank gets them on the model's device. Collective."""
    meshes_of(model)
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload))


def load_full_state_dict(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], *, from_rank0: bool = True) -> None:
    """Load a full state dict (HF names, global shapes) into a parallelized model, each rank
    keeping its shards. With ``from_rank0`` only rank 0's ``state_dict`` is read (the others may
    pass ``{}``) and broadcast. Strict: missing or unexpected keys raise. Collective."""
    meshes_of(model)
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict of tensors, got {type(state_dict).__name__}")
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=from_rank0, strict=True)
    # A shallow copy: set_model_state_dict replaces the dict's values with the distributed ones,
    # and the caller's full tensors must stay what they were.
    set_model_state_dict(model, dict(state_dict), options=options)
