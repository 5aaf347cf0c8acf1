"""The sizes of a decoder-only (MoE) transformer that the planner needs, read from a Hugging Face
config, with parameter counts, FLOPs and activation bytes per token for each unit of the chain
(embedding, decoder layer, head).

Modelled layouts (parameter counts exact for each; tests compare them with the models built on
the meta device):
- attention: grouped-query attention with optional biases (Qwen2-MoE's ``qkv_bias``, Llama-style
  ``attention_bias``) and q/k norms (Qwen3-MoE per head, OLMoE over the whole projection), or
  DeepSeek's multi-head latent attention (``kv_lora_rank``, optional ``q_lora_rank``);
- MLP: MoE layers of ``E`` SwiGLU experts and a router, optionally with a shared expert every
  token runs (Qwen2-MoE's ``shared_expert`` with its sigmoid ``shared_expert_gate``, DeepSeek's
  ``n_shared_experts``); dense SwiGLU layers inside an MoE model (DeepSeek's
  ``first_k_dense_replace``, Qwen's ``mlp_only_layers`` / ``decoder_sparse_step``); dense models
  (Llama / Mistral).
Layouts it does not describe (MLP biases, other interleavings of dense and MoE layers) are
rejected rather than mis-modelled.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from ..ops.routing import check_expert_groups

BF16 = 2
FP32 = 4

# Attributes that describe a layout this model does not, when set to anything but these values.
_UNSUPPORTED = {"mlp_bias": (None, False), "moe_layer_freq": (None, 1), "interleave_moe_layer_step": (None, 1),
                "expert_layer_period": (None, 1)}
# The layer types of a config's ``layer_types`` that the planner models (hybrid models' linear
# attention or state-space layers it does not).
_ATTENTION_LAYERS = {"full_attention", "sliding_attention"}
# Families whose attention normalises queries and keys: per head (one head_dim weight each for q
# and k) or over the whole projection (the q and k widths). Read from the modeling files.
_QK_NORM = {"qwen3_moe": "head", "qwen3": "head", "dots1": "head", "olmoe": "full", "flex_olmo": "full",
            "minimax_m2": "full"}
# Families whose attention_bias biases q, k and v and not o_proj (GLM-4.5), and those whose q/k
# norms per head are switched on by config.use_qk_norm.
_QKV_ONLY_BIAS = ("glm4_moe",)
_QK_NORM_SWITCHED = ("glm4_moe",)
# Routers as moe_ep.hf.routers runs them: sigmoid scores (DeepSeek-V3), and the families whose
# routing weights go to the experts in the logits' dtype rather than float32.
_SIGMOID_ROUTERS = ("deepseek_v3",)
_WEIGHTS_IN_LOGITS_DTYPE = ("qwen2_moe", "qwen3_moe", "olmoe")
# MoE families whose experts moe_ep does not run (moe_ep.hf.patch refuses them), so the planner
# would plan a stack that does not exist: why, as patch says it.
_EXPERTS_NOT_RUN = {
    "gpt_oss": "its experts interleave the gate and up projections, not the [gate; up] layout moe_ep's kernels read",
    "jetmoe": "its experts are not a transformers experts module (one decorated with @use_experts_implementation)",
    "longcat_flash": "its experts are not a transformers experts module (one decorated with "
                     "@use_experts_implementation)",
}
# MoE families whose layers the planner's counts do not describe (their parameters would be
# miscounted, not refused by a field above): why, naming what it does not read.
_LAYERS_NOT_MODELLED = {
    "ernie4_5_moe": "its MoE layers run from moe_layer_start_index to moe_layer_end_index every moe_layer_interval, "
                    "beside moe_num_shared_experts shared experts",
    "hunyuan_v1_moe": "every layer runs a shared MLP beside its experts and normalises q and k (query_layernorm, "
                      "key_layernorm)",
    "phimoe": "its norms are LayerNorms with biases, and lm_head_bias biases the head",
    "afmoe": "its first num_dense_layers are dense, its MoE layers run num_shared_experts shared experts and its "
             "attention is gated",
}
# The experts' activations moe_ep's kernels implement, by transformers' hidden_act names.
_EXPERT_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu"}
# Attention implementations whose memory the planner models: the flash and memory-efficient
# kernels keep O(seq) per head. transformers' "eager" keeps the [batch, heads, seq, seq]
# probabilities of every layer (6 bytes each in bf16), which it does not.
_QUADRATIC_ATTENTION = ("eager",)


def _named_configs():
    """The sizes of each named model as its Hugging Face ``config.json`` states them (the
    mistralai, Qwen and deepseek-ai repositories of the same names); the Qwen3 and DeepSeek-V3
    ones are the models of the planner's published anchors (``moe_ep.planner.anchors``)."""
    from transformers import DeepseekV3Config, MixtralConfig, Qwen3MoeConfig

    def qwen3_moe(hidden, intermediate, moe_intermediate, layers, heads):
        return Qwen3MoeConfig(
            vocab_size=151936, hidden_size=hidden, intermediate_size=intermediate,
            moe_intermediate_size=moe_intermediate, num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
            decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960, tie_word_embeddings=False,
            rms_norm_eps=1e-6,
        )

    return {
        "qwen3-30b-a3b": lambda: qwen3_moe(2048, 6144, 768, 48, 32),
        "qwen3-235b-a22b": lambda: qwen3_moe(4096, 12288, 1536, 94, 64),
        "deepseek-v3": lambda: DeepseekV3Config(
            vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
            num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
            n_routed_experts=256, num_experts_per_tok=8, first_k_dense_replace=3, n_group=8, topk_group=4,
            routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=512, q_lora_rank=1536,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=163840,
            tie_word_embeddings=False, rms_norm_eps=1e-6,
        ),
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


MODEL_NAMES = ("mixtral-8x7b", "mixtral-8x22b", "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3")


def config_from_name(name: str):
    """A transformers config with the real sizes of a named model; nothing is downloaded."""
    table = _named_configs()
    if name not in table:
        raise ValueError(f"model must be a Hugging Face config or one of {MODEL_NAMES}, got {name!r}")
    return table[name]()


def config_from_file(path):
    """The transformers config of a local ``config.json`` (or another JSON file of one) or of a
    model folder; nothing is downloaded. A file that cannot be read or parsed is named."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"model folder {str(path)!r} has no config.json")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as err:  # transformers' loaders raise many types; each is named with the file
        # One line, all of it: a validation error's first line only names the field.
        cause = " ".join(line.strip() for line in str(err).splitlines() if line.strip()) or type(err).__name__
        raise ValueError(f"model config {str(file)!r} cannot be loaded: {cause}") from err


def _require_int(where: str, name: str, value, low: int, high: int | None = None, high_text: str | None = None):
    """``value`` if it is an int in [low, high], else ValueError naming ``name``, the value and the
    range: sizes the cost model divides by or multiplies with, where a zero or a negative would
    plan a model that cannot exist (or fail with an unrelated error deep inside the search)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= low and (high is None or value <= high):
        return value
    expected = f"an int >= {low}" if high is None else f"an int in [{low}, {high_text or high}]"
    raise ValueError(f"{where}: {name} must be {expected}, got {value!r}")


def _experts_field(config) -> str | None:
    """The config attribute holding the routed expert count, by the name the family's config
    itself uses (transformers aliases num_local_experts, num_experts and DeepSeek's
    n_routed_experts to one another); None for a dense model's config, which has none of them."""
    present = [a for a in ("num_local_experts", "num_experts", "n_routed_experts")
               if getattr(config, a, None) is not None]
    aliases = getattr(config, "attribute_map", None) or {}
    return next((a for a in present if a not in aliases), present[0] if present else None)


def _check_family(config) -> None:
    """A decoder-only model whose layers moe_ep runs and whose attention the planner models."""
    where = f"model config {type(config).__name__}"
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{where} is an encoder-decoder model: the planner plans decoder-only causal LMs")
    family = getattr(config, "model_type", None)
    if _experts_field(config) is not None and family in _EXPERTS_NOT_RUN:
        raise ValueError(f"{where}: moe_ep does not run {family}'s experts ({_EXPERTS_NOT_RUN[family]}), so there is "
                         "no moe_ep stack to plan")
    activation = getattr(config, "hidden_act", None)
    if _experts_field(config) is not None and isinstance(activation, str) and activation not in _EXPERT_ACTIVATIONS:
        raise ValueError(f"{where} has hidden_act={activation!r}: moe_ep's experts implement "
                         f"{', '.join(map(repr, _EXPERT_ACTIVATIONS))} only, so there is no moe_ep stack to plan")
    attention = getattr(config, "_attn_implementation", None)
    if attention in _QUADRATIC_ATTENTION:
        raise ValueError(f"{where} has attn_implementation={attention!r}, which keeps every layer's [batch, heads, seq, "
                         "seq] attention probabilities for backward: the planner models the flash and "
                         "memory-efficient kernels (O(seq) per head); plan and train with attn_implementation='sdpa' "
                         "(transformers' default) or a flash attention")


def _check_config_sizes(config, where: str) -> None:
    """The sizes from_config reads, in the config's own names, before anything is derived."""
    def get(attr):
        return getattr(config, attr, None)

    heads = _require_int(where, "num_attention_heads", config.num_attention_heads, 1)
    for attr in ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size"):
        _require_int(where, attr, getattr(config, attr), 1)
    if get("num_key_value_heads") is not None:
        kv_heads = _require_int(where, "num_key_value_heads", get("num_key_value_heads"), 1, heads,
                                f"num_attention_heads={heads}")
        if heads % kv_heads:
            raise ValueError(f"{where}: num_key_value_heads must divide num_attention_heads={heads} (each key/value "
                             f"head serves a whole group of query heads), got {kv_heads}")
    field = _experts_field(config)
    if field is not None:
        experts = _require_int(where, field, get(field), 1)
        top_k = _require_int(where, "num_experts_per_tok", getattr(config, "num_experts_per_tok", 1), 1, experts,
                             f"{field}={experts}")
        if get("n_group") is not None or get("topk_group") is not None:
            try:
                check_expert_groups(experts, top_k, 1 if get("n_group") is None else get("n_group"),
                                    1 if get("topk_group") is None else get("topk_group"), experts=field,
                                    top_k_name="num_experts_per_tok")
            except ValueError as err:
                raise ValueError(f"{where}: {err}") from None
    for attr, low in (("moe_intermediate_size", 1), ("shared_expert_intermediate_size", 0), ("n_shared_experts", 0),
                      ("shared_intermediate_size", 0), ("first_k_dense_replace", 0), ("decoder_sparse_step", 1),
                      ("kv_lora_rank", 0), ("q_lora_rank", 0)):
        if get(attr) is not None:
            _require_int(where, attr, get(attr), low)
    if get("kv_lora_rank"):
        for attr, low in (("qk_nope_head_dim", 0), ("qk_rope_head_dim", 0), ("v_head_dim", 1)):
            _require_int(where, attr, get(attr), low)
        _require_int(where, "qk_nope_head_dim + qk_rope_head_dim", get("qk_nope_head_dim") + get("qk_rope_head_dim"), 1)
    elif get("head_dim") is not None:
        _require_int(where, "head_dim", get("head_dim"), 1)
    elif config.hidden_size < heads:
        raise ValueError(f"{where}: hidden_size={config.hidden_size} over num_attention_heads={heads} leaves a "
                         f"head_dim of 0; expected hidden_size >= num_attention_heads, or head_dim set")


def format_count(n: float) -> str:
    """A parameter count in billions ("46.7 B"), below 0.1 B in millions ("15.2 M")."""
    return f"{n / 1e9:.1f} B" if n >= 1e8 else f"{n / 1e6:.1f} M"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # of queries and keys (DeepSeek: qk_nope_head_dim + qk_rope_head_dim)
    intermediate_size: int  # of one routed expert, or of the dense MLP when num_experts == 0
    num_experts: int
    top_k: int
    tie_word_embeddings: bool
    v_head_dim: int | None = None  # None: head_dim
    # Multi-head latent attention when kv_lora_rank > 0; q_lora_rank 0 projects queries directly.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    attn_extra_params: int = 0  # biases and q/k norms of one layer's attention
    dense_layers: tuple[int, ...] = ()  # layers of an MoE model whose MLP is dense
    dense_intermediate_size: int = 0  # their MLP width
    shared_intermediate_size: int = 0  # the shared expert of every MoE layer (0: none)
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(Linear(H, 1)) scales the shared expert
    # What the activation model needs to know of the family's code (moe_ep.planner.activations).
    family: str = "mixtral"  # config.model_type
    qk_norm: str | None = None  # "head": RMSNorm per head on q and k (Qwen3); "full": over the projection (OLMoE)
    normalize_topk: bool = True  # the router renormalises its top-k weights
    sigmoid_router: bool = False  # DeepSeek-V3: sigmoid scores from float32 copies of input and weight
    fp32_routing_weights: bool = True  # the experts get float32 weights (Mixtral, DeepSeek) or the logits' dtype
    sliding_window: int | None = None  # tokens a sliding-window layer attends to
    sliding_layers: tuple[int, ...] = ()  # the layers of sliding-window attention
    clip_qkv: bool = False  # OLMoE clamps q, k and v in place (autograd keeps each)
    # DeepSeek-V3's n_group: the router's groups of experts (node-limited routing needs 1 or the nodes).
    expert_groups: int = 1

    def __post_init__(self):
        # from_config checked the config's own fields; this catches a ModelSpec built directly.
        where = f"ModelSpec {self.name!r}"
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "intermediate_size"):
            _require_int(where, name, getattr(self, name), 1)
        _require_int(where, "num_kv_heads", self.num_kv_heads, 1, self.num_heads, f"num_heads={self.num_heads}")
        for name in ("num_experts", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "attn_extra_params",
                     "dense_intermediate_size", "shared_intermediate_size"):
            _require_int(where, name, getattr(self, name), 0)
        if self.v_head_dim is not None:
            _require_int(where, "v_head_dim", self.v_head_dim, 1)
        if self.sliding_layers:
            _require_int(where, "sliding_window", self.sliding_window, 1)
            if not all(isinstance(i, int) and 0 <= i < self.num_layers for i in self.sliding_layers):
                raise ValueError(f"{where}: sliding_layers must be layer indices in [0, {self.num_layers}), got "
                                 f"{self.sliding_layers!r}")
        if self.num_experts:
            _require_int(where, "top_k", self.top_k, 1, self.num_experts, f"num_experts={self.num_experts}")
        elif self.top_k != 0:
            raise ValueError(f"{where}: top_k must be 0 for a dense model (num_experts=0), got {self.top_k!r}")

    @classmethod
    def from_config(cls, config, name: str | None = None) -> "ModelSpec":
        for attr in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
            if not isinstance(getattr(config, attr, None), int):
                raise TypeError(
                    f"model config must have an int {attr!r} (a decoder-only Hugging Face config), "
                    f"got {type(config).__name__} without it"
                )
        for attr, allowed in _UNSUPPORTED.items():
            if getattr(config, attr, None) not in allowed:
                raise ValueError(
                    f"model config {type(config).__name__} has {attr}={getattr(config, attr)!r}: a layout the "
                    f"planner does not model (expected {attr} unset or {allowed[-1]!r})"
                )
        family = getattr(config, "model_type", None) or type(config).__name__
        if family in _LAYERS_NOT_MODELLED and _experts_field(config) is not None:
            raise ValueError(f"model config {type(config).__name__}: the planner does not model {family}'s layers "
                             f"({_LAYERS_NOT_MODELLED[family]})")
        layer_types = set(getattr(config, "layer_types", None) or ()) - _ATTENTION_LAYERS
        if layer_types:
            modelled = " or ".join(sorted(_ATTENTION_LAYERS))
            raise ValueError(
                f"model config {type(config).__name__} has {', '.join(sorted(layer_types))} layers: a layout the "
                f"planner does not model (it models decoder layers of attention, {modelled})"
            )
        _check_config_sizes(config, f"model config {type(config).__name__}")
        H, L, heads = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
        experts_field = _experts_field(config)
        experts = getattr(config, experts_field) if experts_field else 0
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        kv_lora = getattr(config, "kv_lora_rank", None) or 0
        switched = family in _QK_NORM_SWITCHED and getattr(config, "use_qk_norm", False)
        qk_norm = "head" if switched else _QK_NORM.get(family)
        if kv_lora:
            q_lora, rope = getattr(config, "q_lora_rank", None) or 0, config.qk_rope_head_dim
            head_dim, v_head_dim = config.qk_nope_head_dim + rope, config.v_head_dim
            # Biased when attention_bias: q_a_proj (only with q_lora), kv_a_proj_with_mqa, o_proj;
            # RMSNorms on the two latents.
            bias = (q_lora + kv_lora + rope + H) if attention_bias else 0
            extra = bias + q_lora + kv_lora
        else:
            q_lora = rope = 0
            head_dim = getattr(config, "head_dim", None) or H // heads
            v_head_dim = head_dim
            q, kv = heads * head_dim, kv_heads * head_dim
            # Qwen2-MoE (and GLM-4.5's attention_bias) bias q, k and v; attention_bias (Llama, Qwen3,
            # OLMoE) also o_proj.
            qkv_only = getattr(config, "qkv_bias", False) or (attention_bias and family in _QKV_ONLY_BIAS)
            bias = q + 2 * kv if qkv_only else (q + 2 * kv + H if attention_bias else 0)
            norms = {"head": 2 * head_dim, "full": q + kv, None: 0}[qk_norm]
            extra = bias + norms
        if experts:
            first_dense = getattr(config, "first_k_dense_replace", None) or 0
            mlp_only = set(getattr(config, "mlp_only_layers", None) or ())
            step = getattr(config, "decoder_sparse_step", None) or 1
            dense_layers = tuple(i for i in range(L) if i < first_dense or i in mlp_only or (i + 1) % step)
        else:
            dense_layers = ()
        # As transformers assigns the masks: by config.layer_types where the config lists them,
        # else to every layer when config.sliding_window is set.
        # A sliding layer without a window (sliding_window None) masks nothing more than causality.
        window = getattr(config, "sliding_window", None)
        kinds = (getattr(config, "layer_types", None) or ["sliding_attention"] * L) if window is not None else []
        sliding_layers = tuple(i for i, kind in enumerate(kinds[:L]) if kind == "sliding_attention")
        expert_width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        # Qwen2-MoE's shared_expert_intermediate_size, Granite-MoE-Shared's shared_intermediate_size,
        # DeepSeek's n_shared_experts of the routed experts' width.
        shared_width = getattr(config, "shared_expert_intermediate_size", None) or getattr(
            config, "shared_intermediate_size", None) or (getattr(config, "n_shared_experts", None) or 0) * expert_width
        return cls(
            name=name or getattr(config, "model_type", type(config).__name__),
            vocab_size=config.vocab_size,
            hidden_size=H,
            num_layers=L,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=expert_width if experts else config.intermediate_size,
            num_experts=experts,
            top_k=getattr(config, "num_experts_per_tok", 1) if experts else 0,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            v_head_dim=v_head_dim,
            q_lora_rank=q_lora,
            kv_lora_rank=kv_lora,
            qk_rope_head_dim=rope,
            attn_extra_params=extra,
            dense_layers=dense_layers,
            dense_intermediate_size=config.intermediate_size if dense_layers else 0,
            shared_intermediate_size=shared_width if experts else 0,
            shared_expert_gate=bool(experts and getattr(config, "shared_expert_intermediate_size", None)),
            family=family,
            qk_norm=None if kv_lora else qk_norm,
            normalize_topk=bool(getattr(config, "norm_topk_prob", True)),
            sigmoid_router=family in _SIGMOID_ROUTERS,
            fp32_routing_weights=family not in _WEIGHTS_IN_LOGITS_DTYPE,
            sliding_window=window if sliding_layers else None,
            sliding_layers=sliding_layers,
            clip_qkv=getattr(config, "clip_qkv", None) is not None and not kv_lora,
            expert_groups=getattr(config, "n_group", None) or 1,
        )

    @classmethod
    def resolve(cls, model) -> "ModelSpec":
        """What a plan is of: a local config.json or model folder (which wins over a name of
        MODEL_NAMES when it holds a config, as ``from_pretrained``'s local folder wins over the
        Hub's; a run's output folder of that name does not), a name from
        MODEL_NAMES, a transformers config, or a ModelSpec. A config of a model moe_ep does not run
        as the planner models it (its experts, their activation, eager attention) is refused here,
        not in ``from_config``, which also costs a running model's pipeline cut."""
        if isinstance(model, ModelSpec):
            return model
        if isinstance(model, (str, Path)):
            path = Path(model)
            if str(model) and path.exists() and (str(model) not in MODEL_NAMES or path.is_file()
                                                 or (path / "config.json").is_file()):
                config = config_from_file(model)
                try:
                    _check_family(config)
                    return cls.from_config(config)
                except (TypeError, ValueError) as err:  # a layout it does not model: said with the file
                    raise ValueError(f"model config {str(model)!r}: {err}") from None
            if str(model) in MODEL_NAMES:
                return cls.from_config(config_from_name(str(model)), name=str(model))
            raise ValueError(f"model must be a Hugging Face config or one of {MODEL_NAMES}, or a local config.json or "
                             f"model folder, got {str(model)!r}")
        _check_family(model)
        return cls.from_config(model)

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    @cached_property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def value_head_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    # Parameter counts.
    @property
    def embed_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def head_params(self) -> int:
        """Final norm and LM head; a tied head reuses the embedding and adds only the norm."""
        return self.hidden_size + (0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size)

    @cached_property  # the search asks once per layer and layout
    def attn_params(self) -> int:
        H, nh, qk, v = self.hidden_size, self.num_heads, self.head_dim, self.value_head_dim
        if self.kv_lora_rank:
            q = H * self.q_lora_rank + self.q_lora_rank * nh * qk if self.q_lora_rank else H * nh * qk
            nope = qk - self.qk_rope_head_dim
            kv = H * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * nh * (nope + v)
            return q + kv + nh * v * H + self.attn_extra_params
        kv = self.num_kv_heads * qk
        return H * (nh * qk + 2 * kv) + nh * v * H + self.attn_extra_params

    def _mlp_params(self, width: int) -> int:
        return 3 * self.hidden_size * width

    def layer_dense_params(self, layer: int) -> int:
        """Parameters of decoder layer ``layer`` sharded over the dense mesh: attention, norms and
        either the dense MLP or the router and shared expert (with its gate)."""
        common = self.attn_params + 2 * self.hidden_size
        if not self.num_experts:
            return common + self._mlp_params(self.intermediate_size)
        if not self.is_moe_layer(layer):
            return common + self._mlp_params(self.dense_intermediate_size)
        gate = self.hidden_size if self.shared_expert_gate else 0
        return common + self.num_experts * self.hidden_size + self._mlp_params(self.shared_intermediate_size) + gate

    def layer_expert_params(self, layer: int) -> int:
        """Parameters of the routed experts of decoder layer ``layer`` (sharded over ep, then edp)."""
        return self.num_experts * self._mlp_params(self.intermediate_size) if self.is_moe_layer(layer) else 0

    def layer_params(self, layer: int) -> int:
        return self.layer_dense_params(layer) + self.layer_expert_params(layer)

    def _layer_active_params(self, layer: int) -> int:
        """Parameters one token touches in decoder layer ``layer`` (its top-k routed experts)."""
        routed = self.top_k * self._mlp_params(self.intermediate_size) if self.is_moe_layer(layer) else 0
        return self.layer_dense_params(layer) + routed

    @property
    def total_params(self) -> int:
        return self.embed_params + sum(self.layer_params(i) for i in range(self.num_layers)) + self.head_params

    @property
    def active_params(self) -> int:
        """Parameters one token touches (top-k experts per MoE layer)."""
        return self.embed_params + sum(self._layer_active_params(i) for i in range(self.num_layers)) + self.head_params

    # Forward FLOPs per token by the kind of kernel that runs them (a multiply-add counts 2).
    def layer_dense_flops(self, layer: int) -> float:
        """Dense GEMMs of decoder layer ``layer``: attention projections, router, shared expert or
        dense MLP (norm weights and biases counted as GEMM weights: a rounding error)."""
        return 2.0 * self.layer_dense_params(layer)

    def layer_expert_flops(self, layer: int) -> float:
        """Grouped GEMMs of the routed experts, at the mean load: top-k experts per token."""
        return 2.0 * self.top_k * self._mlp_params(self.intermediate_size) if self.is_moe_layer(layer) else 0.0

    def attention_flops(self, seq_len: int) -> float:
        """Causal attention's two batched GEMMs (scores, weighted values): on average a token scores
        against seq_len / 2 keys."""
        return 2.0 * self.num_heads * (self.head_dim + self.value_head_dim) * seq_len / 2

    def layer_flops(self, layer: int, seq_len: int) -> float:
        return self.layer_dense_flops(layer) + self.layer_expert_flops(layer) + self.attention_flops(seq_len)

    @property
    def head_flops(self) -> float:
        return 2.0 * self.vocab_size * self.hidden_size
