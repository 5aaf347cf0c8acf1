"""What a transformers causal LM's own forward does around its decoder layers, for the code that
runs the layers itself (pipeline stages, the chunked loss): the embedding's scale, each layer's
attention mask, and the transforms of the logits after the LM head. Each is the transformers
convention of the families that have it; what no convention here covers is refused by name,
never run as something else.

- Embedding: Granite's base model multiplies it by ``embedding_multiplier``, AFMoE's by
  ``sqrt(hidden_size)`` where ``mup_enabled`` (Gemma's scale lives in its embedding module, so it
  comes with the module).
- Masks: a layer's kind is ``config.layer_types[i]`` where the config lists them (Qwen2-MoE,
  GPT-OSS), else every layer is sliding-window when ``config.sliding_window`` is set (Mixtral,
  Qwen3-MoE, PhiMoE) and full causal otherwise. Recurrent kinds (``linear_attention``,
  ``conv``: Qwen3-Next, Jamba, MiniMax, LFM2) are refused.
- Logits: Granite divides them by ``logits_scaling``, Cohere multiplies them by ``logit_scale``,
  Gemma soft-caps them at ``final_logit_softcapping``."""

from __future__ import annotations

import torch

# Config attributes that change the logits after the head's linear map, and their neutral value.
LOGIT_TRANSFORMS = {"final_logit_softcapping": None, "logits_scaling": 1, "logit_scale": 1}
ATTENTION_KINDS = ("full_attention", "sliding_attention")


def _configs(config) -> list:
    """The config and, for a multimodal one, its text model's (where the decoder's fields live)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return [config] if text is config else [config, text]


def config_field(config, name: str, neutral):
    """``config``'s (or its text model's) value of ``name`` where it is not ``neutral``."""
    for c in _configs(config):
        value = getattr(c, name, neutral)
        if value != neutral:
            return value
    return neutral


def scaled_embeddings(config, embeddings: torch.Tensor) -> torch.Tensor:
    multiplier = config_field(config, "embedding_multiplier", 1)
    if config_field(config, "mup_enabled", False):  # AFMoE's muP input scaling
        multiplier = multiplier * config_field(config, "hidden_size", None) ** 0.5
    return embeddings if multiplier == 1 else embeddings * multiplier


def transformed_logits(config, logits: torch.Tensor) -> torch.Tensor:
    """The LM head's output as the model's forward returns it (one transform per family)."""
    if (scaling := config_field(config, "logits_scaling", 1)) != 1:
        logits = logits / scaling
    if (scale := config_field(config, "logit_scale", 1)) != 1:
        logits = logits * scale
    if (cap := config_field(config, "final_logit_softcapping", None)) is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


def layer_attention_kinds(config, owner: str) -> list[str]:
    """Each decoder layer's attention kind, ``full_attention`` or ``sliding_attention``; a layer of
    another kind raises a ValueError naming it and ``owner`` (what cannot run it)."""
    num_layers = config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        kind = "full_attention" if getattr(config, "sliding_window", None) is None else "sliding_attention"
        return [kind] * num_layers
    kinds = list(layer_types[:num_layers])
    other = next((i for i, kind in enumerate(kinds) if kind not in ATTENTION_KINDS), None)
    if other is not None:
        raise ValueError(f"{owner} runs decoder layers of full or sliding-window causal attention, but layer {other} of "
                         f"this {type(config).__name__} is {kinds[other]!r} (config.layer_types): train this model "
                         "without it")
    return kinds


def attention_masks(config, hidden: torch.Tensor, position_ids: torch.Tensor, kinds) -> dict:
    """``{kind: mask}`` for the kinds ``kinds`` names, as transformers builds them for a batch
    without padding and without a cache (None where the attention kernel applies causality)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    make = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
    # The (absent) cache goes positionally: transformers 5.17 names it past_key_values, later
    # releases cache and warn about the old name.
    return {kind: make[kind](config, hidden, None, None, position_ids=position_ids) for kind in set(kinds)}
