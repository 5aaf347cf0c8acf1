"""Which model to train and how its weights come to exist on each rank.

* ``tiny``: a small Mixtral built in full on every rank from ``--seed`` (identical everywhere, and
  identical to a single-process run, which is what the tests compare against).
* ``mixtral-8x7b``: built on the meta device; after the layout is applied each rank allocates and
  initialises only the shards it owns (delayed initialisation).
* a Hugging Face id or local folder: built on the meta device; each rank reads only its own slices of
  the safetensors files (``pretrained.py``).
"""

from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from moe_ep.runs import UsageError


def tiny_config():
    from transformers import MixtralConfig

    # Byte tokenizer: 256 bytes + BOS/EOS/PAD. No padding_idx: packed sequences never pad.
    return MixtralConfig(
        vocab_size=259, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=1024, router_aux_loss_coef=0.02, bos_token_id=256, eos_token_id=257,
        pad_token_id=None, tie_word_embeddings=False,
    )


def named_configs() -> dict:
    """Name -> (config factory, build on the meta device). The full-size Mixtral shapes are the
    planner's, so what is trained is what was planned."""
    from moe_ep import MODEL_NAMES, config_from_name

    table = {"tiny": (tiny_config, False)}
    for name in MODEL_NAMES:
        table[name] = (lambda name=name: config_from_name(name), True)
    return table


@dataclass
class ModelSource:
    name: str
    config: object
    pretrained_dir: Path | None  # a folder with safetensors weights, or None for random init
    meta_init: bool


def resolve_model(spec: str) -> ModelSource:
    """``--model`` to a config and where its weights come from; a bad name fails here."""
    named = named_configs()
    if spec in named:
        make, meta = named[spec]
        return ModelSource(spec, make(), None, meta)
    path = Path(spec).expanduser()
    if path.is_dir():
        folder = path
    elif path.exists():
        raise UsageError(f"--model: {spec} is a file; expected a folder with config.json and *.safetensors")
    elif spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        folder = download_snapshot(spec)
    else:
        raise UsageError(
            f"--model: {spec!r} is neither a named config ({', '.join(named)}), a local folder, "
            "nor a Hugging Face id (owner/name)"
        )
    if not (folder / "config.json").is_file():
        raise UsageError(f"--model: {folder} has no config.json")
    if not any(folder.glob("*.safetensors")):
        raise UsageError(f"--model: {folder} has no *.safetensors weights (only safetensors checkpoints are read)")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as err:
        raise UsageError(f"--model: {folder / 'config.json'} cannot be read as a model config "
                         f"({str(err).splitlines()[0]})") from None
    check_weight_files(folder)
    if not num_experts_in(config):
        raise UsageError(f"--model: {folder} is a {config.model_type} model, not a mixture of experts")
    return ModelSource(str(spec), config, folder, True)


def check_weight_files(folder: Path) -> None:
    """Every safetensors file's header (and the index, if any) parses: a damaged file is named
    before any work. The tensors' bytes carry no checksum in this format; their header does say
    each tensor's extent, which safetensors checks against the file's size."""
    from safetensors import SafetensorError, safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            json.loads(index.read_text())["weight_map"].items()
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise UsageError(f"--model: {index} is not a safetensors index ({err})") from None
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except (SafetensorError, OSError) as err:
            raise UsageError(f"--model: {file} is not a readable safetensors file ({err})") from None


def num_experts_in(config) -> int:
    """The experts of each MoE layer, 0 for a dense config. Families name it differently
    (Mixtral ``num_local_experts``, Qwen2-MoE ``num_experts``; transformers aliases some, not all);
    moe_ep.planner's ModelSpec reads it alike but refuses the shared-expert and dense-first families
    that this example trains."""
    return getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0


def download_snapshot(repo_id: str) -> Path:
    """The config, tokenizer and safetensors files of a Hub model, from the local cache when there.
    Every rank calls it; the Hub client's file locks let one process download while the others wait."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model"]))
    except LocalEntryNotFoundError:
        raise UsageError(f"--model {repo_id}: not in the local cache and the Hub cannot be reached") from None


def build_model(source: ModelSource, *, seed: int, meta: bool):
    """The model with Hugging Face's own classes; on the meta device when ``meta``."""
    from transformers import AutoModelForCausalLM

    if meta:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(source.config, dtype=torch.float32)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(source.config, dtype=torch.float32)


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(total, active per token): only ``top_k`` of the ``E`` experts of a layer run for a token.
    Works on meta models and on sharded ones (DTensor ``numel`` is global)."""
    config = model.config
    n_experts = num_experts_in(config)
    top_k = getattr(config, "num_experts_per_tok", 1)
    total = active = 0
    for name, p in model.named_parameters():
        total += p.numel()
        active += p.numel() * top_k // n_experts if ".experts." in name else p.numel()
    return total, active


def local_chunk(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(this rank's local tensor, its offset in the global tensor). A plain tensor is its own chunk."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t, (0,) * t.dim()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = t.to_local()
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(shape) != tuple(local.shape):
        raise RuntimeError(f"local shard {tuple(local.shape)} does not match its layout {tuple(shape)}")
    return local, tuple(offset)


@contextmanager
def local_parameters(module: nn.Module):
    """Temporarily give ``module`` its local shards as plain parameters (views of the same storage),
    so Hugging Face's ``_init_weights`` writes straight into this rank's shards."""
    saved = dict(module._parameters)
    try:
        for name, p in saved.items():
            if p is not None:
                module._parameters[name] = nn.Parameter(local_chunk(p)[0], requires_grad=False)
        yield
    finally:
        module._parameters.update(saved)


def materialize(model: nn.Module, device: torch.device, *, seed: int, part: nn.Module | None = None) -> None:
    """Allocate a meta model's (possibly sharded) storage on ``device`` and initialise it with the
    model's own ``_init_weights``. Each local chunk is seeded from (seed, module, chunk offset), so a
    chunk gets the same values whichever rank holds it (replicas agree) and distinct chunks differ.
    ``part``: what this rank holds under the model's names (its pipeline stages, so that a chunk's
    seed does not depend on the stage it lands on); the other stages' layers stay on the meta
    device."""
    part = model if part is None else part
    part.to_empty(device=device)
    for module_name, module in part.named_modules():
        params = [p for p in module._parameters.values() if p is not None]
        offsets = [local_chunk(p)[1] for p in params]
        digest = hashlib.sha256(f"{seed}|{module_name}|{offsets}".encode()).digest()
        embedding_pad = getattr(module, "padding_idx", None) if isinstance(module, nn.Embedding) else None
        with local_parameters(module), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
            if embedding_pad is not None:
                # padding_idx is a global row; shift it into this rank's rows, or drop it if not owned.
                row0, rows = offsets[0][0], module.weight.shape[0]
                module.padding_idx = embedding_pad - row0 if row0 <= embedding_pad < row0 + rows else None
            with torch.no_grad():
                model._init_weights(module)
            if embedding_pad is not None:
                module.padding_idx = embedding_pad


def configure_experts(model: nn.Module, implementation: str, backend: str | None):
    """Switch the expert kernels. ``moe_ep`` goes through moe_ep.hf.patch (kernels and fused
    router); transformers' own implementations through its registry."""
    if implementation == "moe_ep":
        from moe_ep import patch

        return patch(model, backend=backend, fused_router=True)
    if backend is not None:
        raise UsageError(f"--backend {backend} applies to --experts-implementation moe_ep only, got {implementation}")
    model.set_experts_implementation(implementation)
    return model


def seed_everything(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
