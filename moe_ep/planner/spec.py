"""The sizes of a decoder-only (MoE) transformer that the planner needs, read from a Hugging Face
config, with parameter counts, FLOPs and activation bytes per token for each unit of the chain
(embedding, decoder layer, head).

Supported: configs with Mixtral's layout (every layer an MoE block of ``E`` SwiGLU experts and a
router, no shared expert) and dense Llama/Mistral-style configs. Configs with shared experts or
dense-first layers are rejected rather than mis-modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

BF16 = 2
FP32 = 4

# Attributes whose presence means a layout this model does not describe.
_UNSUPPORTED = ("shared_expert_intermediate_size", "n_shared_experts", "first_k_dense_replace")


def _named_configs():
    from transformers import MixtralConfig

    return {
        "mixtral-8x7b": lambda: MixtralConfig(
            vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
            max_position_embeddings=32768, tie_word_embeddings=False, rms_norm_eps=1e-5,
        ),
        "mixtral-8x22b": lambda: MixtralConfig(
            vocab_size=32768, hidden_size=6144, intermediate_size=16384, num_hidden_layers=56,
            num_attention_heads=48, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
            max_position_embeddings=65536, tie_word_embeddings=False, rms_norm_eps=1e-5,
        ),
    }


MODEL_NAMES = ("mixtral-8x7b", "mixtral-8x22b")


def config_from_name(name: str):
    """A transformers config with the real sizes of a named model; nothing is downloaded."""
    table = _named_configs()
    if name not in table:
        raise ValueError(f"model must be a Hugging Face config or one of {MODEL_NAMES}, got {name!r}")
    return table[name]()


@dataclass(frozen=True)
class ModelSpec:
    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # of one expert, or of the dense MLP when num_experts == 0
    num_experts: int
    top_k: int
    tie_word_embeddings: bool

    @classmethod
    def from_config(cls, config, name: str | None = None) -> "ModelSpec":
        for attr in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
            if not isinstance(getattr(config, attr, None), int):
                raise TypeError(
                    f"model config must have an int {attr!r} (a decoder-only Hugging Face config), "
                    f"got {type(config).__name__} without it"
                )
        for attr in _UNSUPPORTED:
            if getattr(config, attr, None):
                raise ValueError(
                    f"model config {type(config).__name__} has {attr}={getattr(config, attr)!r}: shared experts and "
                    f"dense-first layers are not modelled by the planner"
                )
        if getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) != 1:
            raise ValueError(
                f"model config {type(config).__name__} mixes dense and MoE layers "
                f"(mlp_only_layers / decoder_sparse_step): not modelled by the planner"
            )
        experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0
        heads = config.num_attention_heads
        return cls(
            name=name or getattr(config, "model_type", type(config).__name__),
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate_size=getattr(config, "moe_intermediate_size", None) or config.intermediate_size,
            num_experts=experts,
            top_k=getattr(config, "num_experts_per_tok", 1) if experts else 0,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )

    @classmethod
    def resolve(cls, model) -> "ModelSpec":
        """A name from MODEL_NAMES, a transformers config, or a ModelSpec."""
        if isinstance(model, ModelSpec):
            return model
        if isinstance(model, str):
            return cls.from_config(config_from_name(model), name=model)
        return cls.from_config(model)

    # Parameter counts.
    @property
    def embed_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def head_params(self) -> int:
        """Final norm and LM head; a tied head reuses the embedding and adds only the norm."""
        return self.hidden_size + (0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size)

    @property
    def attn_params(self) -> int:
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        return self.hidden_size * (2 * q + 2 * kv)

    @property
    def layer_dense_params(self) -> int:
        """Parameters of a decoder layer sharded over the dense mesh: attention, norms, router
        (and the MLP of a dense model)."""
        mlp = 0 if self.num_experts else 3 * self.hidden_size * self.intermediate_size
        return self.attn_params + 2 * self.hidden_size + self.num_experts * self.hidden_size + mlp

    @property
    def layer_expert_params(self) -> int:
        return self.num_experts * 3 * self.hidden_size * self.intermediate_size

    @property
    def layer_params(self) -> int:
        return self.layer_dense_params + self.layer_expert_params

    @property
    def total_params(self) -> int:
        return self.embed_params + self.num_layers * self.layer_params + self.head_params

    @property
    def active_params(self) -> int:
        """Parameters one token touches (top-k experts per layer)."""
        expert = self.top_k * 3 * self.hidden_size * self.intermediate_size
        return self.embed_params + self.num_layers * (self.layer_dense_params + expert) + self.head_params

    # Forward FLOPs per token (a multiply-add counts 2).
    def layer_flops(self, seq_len: int) -> float:
        expert = self.top_k * 3 * self.hidden_size * self.intermediate_size
        # Causal attention: on average a token scores against seq_len / 2 keys, for QK^T and for AV.
        attention_core = 2 * 2 * self.num_heads * self.head_dim * seq_len / 2
        return 2.0 * (self.layer_dense_params + expert) + attention_core

    @property
    def head_flops(self) -> float:
        return 2.0 * self.vocab_size * self.hidden_size

    # Activation bytes per token kept for the backward, bf16 compute with fp32 norms and loss,
    # flash/SDPA attention (no seq x seq score matrix).
    @property
    def layer_expert_act_bytes(self) -> float:
        """The expert side of layer_act_bytes: per routed slot the gathered row, the gate/up
        output, the SwiGLU output and the down output."""
        if not self.num_experts:
            return 0.0
        H, I = self.hidden_size, self.intermediate_size
        return self.top_k * BF16 * (H + 2 * I + I + H)

    @property
    def layer_act_bytes(self) -> float:
        H, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        norm = FP32 * H + BF16 * H  # RMSNorm: fp32 copy of its input and the bf16 output
        attention = (
            norm
            + BF16 * (q + 2 * kv)  # q, k, v projections
            + BF16 * (q + kv)  # q, k after rotary embedding
            + BF16 * q  # attention output, input of o_proj
        )
        if not self.num_experts:
            return attention + norm + BF16 * 3 * self.intermediate_size
        router = FP32 * 2 * self.num_experts  # fp32 logits and probabilities
        return attention + norm + router + self.layer_expert_act_bytes

    @property
    def layer_input_bytes(self) -> float:
        """What a checkpointed decoder layer keeps: its input."""
        return BF16 * self.hidden_size

    @property
    def embed_act_bytes(self) -> float:
        return BF16 * self.hidden_size

    @property
    def head_act_bytes(self) -> float:
        """Final norm, bf16 logits, their fp32 copy and the fp32 log-softmax the loss keeps."""
        return FP32 * self.hidden_size + BF16 * self.hidden_size + (BF16 + FP32 + FP32) * self.vocab_size
