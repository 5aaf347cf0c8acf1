"""Full (gathered) state dicts of a parallelized model, with the model's own Hugging Face names
and global shapes: what ``model.state_dict()`` gives before ``parallelize``, so ``save_pretrained``
(``state_dict=``), safetensors and DCP see an ordinary checkpoint. Built on
``torch.distributed.checkpoint.state_dict``, which gathers FSDP shards and our expert DTensors
alike. For sharded checkpoints at scale use DCP on ``model.state_dict()`` directly."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from .context import meshes_of


def full_state_dict(model: torch.nn.Module, *, cpu_offload: bool = True) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer as a full tensor. With ``cpu_offload`` (the default,
    one copy in host memory) rank 0 gets CPU tensors and the other ranks an empty dict; without,
    every rank gets them on the model's device. Collective."""
    meshes_of(model)
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload))


def _mismatch(model: torch.nn.Module, state_dict: dict) -> str | None:
    """What keeps ``state_dict`` from loading into ``model`` (keys, global shapes), or None. A key
    of a tied parameter may be left out where its twin is given (Hugging Face files of tied
    embeddings hold one name); it is then filled in from the twin, in ``state_dict``."""
    expected = model.state_dict()
    names_of: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    for names in names_of.values():
        given = next((n for n in names if n in state_dict), None)
        for name in names:
            if given is not None and name not in state_dict:
                state_dict[name] = state_dict[given]
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    bad = [f"{name}: a {type(t).__name__}" for name, t in state_dict.items() if not torch.is_tensor(t)]
    bad += [f"{name}: shape {tuple(t.shape)}, the model's {tuple(expected[name].shape)}" for name, t in state_dict.items()
            if name in expected and torch.is_tensor(t) and tuple(t.shape) != tuple(expected[name].shape)]
    shown = lambda names: ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")  # noqa: E731
    problems = ([f"missing {shown(missing)}"] if missing else []) + ([f"unexpected {shown(unexpected)}"] if unexpected
                                                                      else []) + bad[:3]
    return "; ".join(problems) or None


def load_full_state_dict(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], *, from_rank0: bool = True) -> None:
    """Load a full state dict (HF names, global shapes) into a parallelized model, each rank
    keeping its shards. With ``from_rank0`` only rank 0's ``state_dict`` is read (the others may
    pass ``{}``) and broadcast. Strict: missing or unexpected keys and other global shapes raise
    the same ValueError naming them on every rank, before anything is loaded (a tied parameter's
    second name may be left out). Collective."""
    meshes_of(model)
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict of tensors, got {type(state_dict).__name__}")
    # A shallow copy: set_model_state_dict replaces the dict's values with the distributed ones,
    # and the caller's full tensors must stay what they were.
    state_dict = dict(state_dict)
    reads = not from_rank0 or dist.get_rank() == 0
    found = [_mismatch(model, state_dict) if reads else None]
    if from_rank0:
        # host sync: once per load; every rank learns rank 0's verdict before any collective of the load.
        dist.broadcast_object_list(found, src=0)
        problem = found[0]
    else:
        verdicts = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, found[0])
        problem = next((f"rank {r}'s state_dict: {v}" for r, v in enumerate(verdicts) if v), None)
    if problem:
        raise ValueError(f"load_full_state_dict: the state dict does not fit {type(model).__name__} ({problem}); "
                         "nothing was loaded")
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=from_rank0, strict=True)
    set_model_state_dict(model, state_dict, options=options)
