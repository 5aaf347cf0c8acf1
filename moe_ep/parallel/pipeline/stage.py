"""A pipeline stage of a Hugging Face decoder-only causal LM: some of its decoder layers, with the
embedding on the first stage and the final norm and LM head on the last. Stage modules copy
nothing: they hold the model's own submodules under the model's own names (``model.layers.<i>``,
``lm_head``), so a stage's state dict is a slice of the model's.

Inputs: stage 0 takes ``input_ids [batch, seq]``; positions are ``0..seq-1`` and attention is
causal, or sliding-window where the model's config says so, with no padding mask (right-pad and
set the padded labels to -100). The last stage returns logits, or its final (normed) hidden
states when ``loss_input`` is ``"hidden"`` (the loss then applies the LM head itself, in chunks:
``TrainStep(chunked_loss=True)``). What the model's own forward does around the layers (the
embedding's scale, the masks, the logits' transforms) comes from ``moe_ep.hf.causal_lm``."""

from __future__ import annotations

import inspect
from typing import Sequence

import torch
from torch import nn

from ...hf.causal_lm import attention_masks, layer_attention_kinds, scaled_embeddings, transformed_logits


def decoder_parts(model: nn.Module):
    """(base model, lm_head) of a transformers causal LM, checked for what a stage needs."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    missing = [a for a in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(base, a)]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if base is None or missing or head is None or not hasattr(model, "config"):
        raise TypeError(
            f"model must be a transformers decoder-only *ForCausalLM (base model with embed_tokens, layers, norm, "
            f"rotary_emb and an LM head), got {type(model).__name__}"
            + (f" whose base model lacks {missing}" if base is not None and missing else "")
        )
    return base, head


def stage_parts(model: nn.Module):
    """``decoder_parts`` of a model whose layers pipeline stages can run apart."""
    base, head = decoder_parts(model)
    if hasattr(base, "rotary_embs"):
        # GraniteMoeSWA: one rotary embedding per layer's theta, chosen by the base model's forward.
        raise TypeError(f"a pipeline stage gives every layer the base model's rotary_emb, but {type(model).__name__} "
                        "holds one per layer (rotary_embs): train this model without pipeline stages")
    return base, head


def _rotary_per_kind(rotary_emb: nn.Module) -> bool:
    """Whether the rotary embedding takes the layer's attention kind (Gemma 3, Laguna, Olmo 3:
    ``rotary_emb(x, position_ids, layer_type)``, one table per kind)."""
    return "layer_type" in inspect.signature(rotary_emb.forward).parameters


class CausalLMStage(nn.Module):
    """Decoder layers ``layer_ids`` of ``model``, with the embedding when ``first`` and the final
    norm and LM head when ``last``. Submodules are the model's own, under the model's names."""

    def __init__(self, model: nn.Module, layer_ids: Sequence[int], *, first: bool, last: bool):
        super().__init__()
        base, head = stage_parts(model)
        prefix = getattr(model, "base_model_prefix", "model")
        self.config = model.config
        self.first, self.last = first, last
        self.layer_ids = tuple(layer_ids)
        # FSDP wraps the blocks this names (moe_ep.parallel.fsdp.transformer_blocks).
        self._no_split_modules = getattr(model, "_no_split_modules", None)
        self.prefix = prefix
        trunk = nn.Module()
        if first:
            trunk.embed_tokens = base.embed_tokens
        trunk.layers = nn.ModuleDict({str(i): base.layers[i] for i in self.layer_ids})
        trunk.rotary_emb = base.rotary_emb  # buffers only
        if last:
            trunk.norm = base.norm
        self.add_module(prefix, trunk)
        if last:
            self.lm_head = head
        self.attention_kinds = [layer_attention_kinds(model.config, "a pipeline stage")[i] for i in self.layer_ids]
        self.rotary_per_kind = _rotary_per_kind(base.rotary_emb)
        # What the last stage returns; written once by PipelineStages.schedule, before the
        # schedule infers the stages' output shapes.
        self.loss_input = "logits"

    @property
    def trunk(self) -> nn.Module:
        return getattr(self, self.prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The model's own forward over this stage's part (``moe_ep.hf.causal_lm``: the embedding's
        scale, each layer's mask, the logits' transforms)."""
        trunk = self.trunk
        hidden = scaled_embeddings(self.config, trunk.embed_tokens(x)) if self.first else x
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        kinds = set(self.attention_kinds)
        if self.rotary_per_kind:
            position_embeddings = {kind: trunk.rotary_emb(hidden, position_ids, kind) for kind in kinds}
        else:
            shared = trunk.rotary_emb(hidden, position_ids)
            position_embeddings = dict.fromkeys(kinds, shared)
        masks = attention_masks(self.config, hidden, position_ids, self.attention_kinds)
        for layer, kind in zip(trunk.layers.values(), self.attention_kinds):
            hidden = layer(hidden, attention_mask=masks[kind], position_ids=position_ids,
                           position_embeddings=position_embeddings[kind])
            # Families written before transformers 5 return (hidden_states, ...).
            if isinstance(hidden, tuple):
                hidden = hidden[0]
        if self.last:
            hidden = trunk.norm(hidden)
            if self.loss_input == "logits":
                hidden = transformed_logits(self.config, self.lm_head(hidden))
        return hidden
