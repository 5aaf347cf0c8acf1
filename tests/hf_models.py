"""Tiny Hugging Face MoE models built from config classes (no downloads), shared by the HF tests
and by anyone who needs a small real model: one builder per family, random weights scaled so
that routing is decisive (no near ties that rounding could flip) and every code path is live
(a non-zero DeepSeek-V3 correction bias, a dense first layer, shared experts)."""

from __future__ import annotations

import torch

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3")

# Small on purpose: hidden 32, 2 layers, 4-8 experts; sizes that are not multiples of 8 exercise
# the padding paths of the kernels.
_COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    attn_implementation="eager",
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

_FAMILY_KWARGS = {
    "mixtral": dict(intermediate_size=20, num_local_experts=6, num_experts_per_tok=2, router_aux_loss_coef=0.05),
    "qwen2_moe": dict(
        intermediate_size=48,
        moe_intermediate_size=12,
        shared_expert_intermediate_size=24,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=False,
        router_aux_loss_coef=0.05,
    ),
    "qwen3_moe": dict(
        intermediate_size=48,
        moe_intermediate_size=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        head_dim=8,
        router_aux_loss_coef=0.05,
    ),
    "olmoe": dict(intermediate_size=24, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, router_aux_loss_coef=0.05),
    "deepseek_v3": dict(
        intermediate_size=48,
        moe_intermediate_size=12,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        num_key_value_heads=4,
    ),
}


def config_class(family: str):
    import transformers

    return {
        "mixtral": transformers.MixtralConfig,
        "qwen2_moe": transformers.Qwen2MoeConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "olmoe": transformers.OlmoeConfig,
        "deepseek_v3": transformers.DeepseekV3Config,
    }[family]


def tiny_config(family: str, **overrides):
    """A 2-layer config of ``family``; ``overrides`` replace any field (e.g. ``hidden_act``)."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    attn = overrides.pop("attn_implementation", _COMMON["attn_implementation"])
    kwargs = {k: v for k, v in _COMMON.items() if k != "attn_implementation"}
    kwargs.update(_FAMILY_KWARGS[family])
    kwargs.update(overrides)
    config = config_class(family)(**kwargs)
    config._attn_implementation = attn
    return config


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Deterministic weights with unit-scale activations: matrices ~ N(0, 1/fan_in), norms ~ 1,
    routers wide enough that top-k choices are far from ties, a non-zero correction bias."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 1:
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            continue
        std = p.shape[-1] ** -0.5
        if name.endswith("gate.weight"):
            std *= 4  # routers: logits of a few units, so rounding never flips a choice
        p.copy_(torch.randn(p.shape, generator=g) * std)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.3 * torch.randn(b.shape, generator=g))
    return model


def tiny_model(family: str, *, dtype=torch.float32, seed: int = 0, experts_implementation: str = "eager", **overrides):
    """A randomly initialised ``*ForCausalLM`` of ``family`` in ``dtype`` (eval mode)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(config, experts_implementation=experts_implementation)
    randomize_(model, seed)
    return model.to(dtype).eval()


def tiny_batch(config, *, batch: int = 2, seq: int = 7, seed: int = 0) -> dict:
    """``input_ids`` and ``labels`` avoiding the special tokens 0-2."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, config.vocab_size, (batch, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}
