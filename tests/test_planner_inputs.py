"""The planner's model inputs: a config or ModelSpec whose sizes no model can have (top-k above
the expert count, zero experts, zero or negative sizes, key/value heads that do not group the
query heads) is refused naming the field, the value and what was expected, by plan() and by
`moe-ep plan` (one line, exit status 2, no traceback), before any costing."""

import re

import pytest
from transformers import DeepseekV3Config, MixtralConfig, Qwen2MoeConfig

from moe_ep.cli import EXIT_IMPOSSIBLE, main
from moe_ep.planner import ModelSpec, plan

SMALL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=8)
A100 = dict(gpus_per_node=8, gpu_memory_gib=80)


def mixtral(**overrides):
    return MixtralConfig(**{**SMALL, "num_local_experts": 8, "num_experts_per_tok": 2, **overrides})


BAD_CONFIGS = {
    "top_k_above_experts": (mixtral(num_experts_per_tok=9),
                            "num_experts_per_tok must be an int in [1, num_local_experts=8], got 9"),
    "top_k_zero": (mixtral(num_experts_per_tok=0),
                   "num_experts_per_tok must be an int in [1, num_local_experts=8], got 0"),
    "zero_experts": (mixtral(num_local_experts=0), "num_local_experts must be an int >= 1, got 0"),
    "negative_hidden": (mixtral(hidden_size=-1024), "hidden_size must be an int >= 1, got -1024"),
    "zero_intermediate": (mixtral(intermediate_size=0), "intermediate_size must be an int >= 1, got 0"),
    "zero_layers": (mixtral(num_hidden_layers=0), "num_hidden_layers must be an int >= 1, got 0"),
    "zero_heads": (mixtral(num_attention_heads=0), "num_attention_heads must be an int >= 1, got 0"),
    "zero_vocab": (mixtral(vocab_size=0), "vocab_size must be an int >= 1, got 0"),
    "zero_kv_heads": (mixtral(num_key_value_heads=0),
                      "num_key_value_heads must be an int in [1, num_attention_heads=8], got 0"),
    "ungrouped_kv_heads": (mixtral(num_key_value_heads=3),
                           "num_key_value_heads must divide num_attention_heads=8 (each key/value head serves a "
                           "whole group of query heads), got 3"),
    "zero_head_dim": (mixtral(head_dim=0), "head_dim must be an int >= 1, got 0"),
    "hidden_below_heads": (mixtral(hidden_size=4),
                           "hidden_size=4 over num_attention_heads=8 leaves a head_dim of 0; expected hidden_size >= "
                           "num_attention_heads, or head_dim set"),
    "qwen_zero_expert_width": (Qwen2MoeConfig(**SMALL, moe_intermediate_size=0),
                               "moe_intermediate_size must be an int >= 1, got 0"),
    "qwen_zero_sparse_step": (Qwen2MoeConfig(**SMALL, decoder_sparse_step=0),
                              "decoder_sparse_step must be an int >= 1, got 0"),
    "deepseek_top_k_above_experts": (
        DeepseekV3Config(**SMALL, n_routed_experts=4, num_experts_per_tok=8, n_group=1, topk_group=1),
        "num_experts_per_tok must be an int in [1, n_routed_experts=4], got 8",
    ),
    "deepseek_negative_latent": (DeepseekV3Config(**SMALL, kv_lora_rank=-16),
                                 "kv_lora_rank must be an int >= 0, got -16"),
    # Group-limited routing as route_topk refuses it at run time.
    "deepseek_groups_of_part_experts": (
        DeepseekV3Config(**SMALL, n_routed_experts=8, num_experts_per_tok=2, n_group=3, topk_group=1),
        "n_group must be a positive divisor of n_routed_experts=8, got 3"),
    "deepseek_more_groups_kept_than_made": (
        DeepseekV3Config(**SMALL, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=5),
        "topk_group must be an int in [1, n_group=4], got 5"),
    "deepseek_top_k_beyond_the_groups_kept": (
        DeepseekV3Config(**SMALL, n_routed_experts=8, num_experts_per_tok=6, n_group=4, topk_group=1),
        "num_experts_per_tok=6 exceeds the 2 experts left by topk_group=1 of n_group=4"),
    "deepseek_more_groups_kept_than_one": (
        DeepseekV3Config(**SMALL, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=4),
        "topk_group must be an int in [1, n_group=1], got 4"),
}


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_impossible_config_sizes_are_refused_naming_the_field(name):
    config, message = BAD_CONFIGS[name]
    expected = f"model config {type(config).__name__}: {message}"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        ModelSpec.from_config(config)
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        plan(config, nodes=1, **A100)


def test_a_dense_models_config_has_no_experts_and_still_plans():
    # No experts field at all is a dense model, not "zero experts".
    from transformers import MistralConfig

    spec = ModelSpec.from_config(MistralConfig(**SMALL))
    assert (spec.num_experts, spec.top_k) == (0, 0)


def test_expert_parallelism_of_a_model_whose_layers_are_all_dense_is_refused():
    from moe_ep.planner import PlanError

    config = Qwen2MoeConfig(**SMALL, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[0, 1, 2, 3])
    with pytest.raises(PlanError, match=r"^ep=8 shards the experts of MoE layers; every layer of qwen2_moe is dense"):
        plan(config, nodes=1, ep=8, **A100)
    assert plan(config, nodes=1, **A100).best.layout.ep == 1


def test_sliding_layers_without_a_window_are_planned_as_causal_ones():
    config = Qwen2MoeConfig(**SMALL, num_experts=8, num_experts_per_tok=2, use_sliding_window=True,
                            sliding_window=None, max_window_layers=1)
    assert ModelSpec.from_config(config).sliding_layers == ()
    assert plan(config, nodes=1, **A100).best is not None


def test_a_model_argument_that_is_an_empty_string_is_refused_as_such():
    with pytest.raises(ValueError, match=r"or a local config.json or model folder, got ''$"):
        plan("", nodes=1, **A100)


def _spec(**overrides) -> ModelSpec:
    fields = dict(name="tiny", vocab_size=32000, hidden_size=1024, num_layers=4, num_heads=8, num_kv_heads=8,
                  head_dim=128, intermediate_size=2048, num_experts=8, top_k=2, tie_word_embeddings=False)
    return ModelSpec(**{**fields, **overrides})


@pytest.mark.parametrize("overrides, message", [
    (dict(top_k=9), "top_k must be an int in [1, num_experts=8], got 9"),
    (dict(num_experts=0), "top_k must be 0 for a dense model (num_experts=0), got 2"),
    (dict(num_experts=-8), "num_experts must be an int >= 0, got -8"),
    (dict(hidden_size=0), "hidden_size must be an int >= 1, got 0"),
    (dict(num_layers=-1), "num_layers must be an int >= 1, got -1"),
    (dict(num_kv_heads=16), "num_kv_heads must be an int in [1, num_heads=8], got 16"),
    (dict(v_head_dim=0), "v_head_dim must be an int >= 1, got 0"),
    (dict(intermediate_size=2048.0), "intermediate_size must be an int >= 1, got 2048.0"),
    (dict(sliding_layers=(0, 1)), "sliding_window must be an int >= 1, got None"),
    (dict(sliding_layers=(4,), sliding_window=16), "sliding_layers must be layer indices in [0, 4), got (4,)"),
])
def test_a_model_spec_built_directly_is_checked_too(overrides, message):
    expected = f"ModelSpec 'tiny': {message}"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        _spec(**overrides)


def test_a_valid_model_spec_plans():
    assert plan(_spec(), nodes=1, global_batch_tokens=32 * 4096, **A100).best.fits


@pytest.mark.parametrize("name", ["top_k_above_experts", "zero_experts", "negative_hidden", "zero_layers"])
def test_cli_refuses_an_impossible_config_file_in_one_line(tmp_path, capsys, name):
    config, message = BAD_CONFIGS[name]
    config.save_pretrained(tmp_path)
    code = main(["plan", "--model", str(tmp_path), "--nodes", "1", "--gpus-per-node", "8", "--gpu-memory", "80"])
    err = capsys.readouterr().err
    assert code == EXIT_IMPOSSIBLE == 2
    assert err.strip() == f"moe-ep plan: model config {str(tmp_path)!r}: model config MixtralConfig: {message}", err


def test_cli_refuses_a_zero_sequence_length(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--model", "mixtral-8x7b", "--cluster", "p4d", "--nodes", "1", "--seq-len", "0"])
    assert exit_.value.code == 2
    assert "argument --seq-len: must be an int in [1, 1048576], got '0'" in capsys.readouterr().err


def _meta_count(config) -> int:
    """The parameters of the model ``config`` builds (on the meta device: no memory): the
    independent count the planner's is compared with."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def _config_class(name: str):
    """A config class of transformers by name; the test skips where the installed release lacks it
    (the device machine's 5.17 predates some families)."""
    import transformers

    if not hasattr(transformers, name):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    return getattr(transformers, name)


@pytest.mark.parametrize("config_class, fields", [
    ("Dots1Config", dict(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=512,
                         first_k_dense_replace=1, n_group=1, topk_group=1, head_dim=128)),  # per head
    ("FlexOlmoConfig", dict(num_experts=4, num_experts_per_tok=2, pad_token_id=1)),  # over the whole projections
    ("MiniMaxM2Config", dict(num_local_experts=8, num_experts_per_tok=2, head_dim=96)),
])
def test_q_and_k_norms_of_more_families_are_counted(config_class, fields):
    config = _config_class(config_class)(**{**SMALL, "num_key_value_heads": 2, **fields})
    assert ModelSpec.from_config(config).total_params == _meta_count(config)


@pytest.mark.parametrize("use_qk_norm", [False, True])  # GLM-4.5-Air, GLM-4.5
def test_glm4_moe_biases_q_k_and_v_not_o_proj_and_counts_its_q_and_k_norms(use_qk_norm):
    config = _config_class("Glm4MoeConfig")(
        **{**SMALL, "num_key_value_heads": 2}, head_dim=128, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        moe_intermediate_size=512, first_k_dense_replace=1, n_group=1, topk_group=1, attention_bias=True,
        use_qk_norm=use_qk_norm)
    spec = ModelSpec.from_config(config)
    assert spec.total_params == _meta_count(config)
    assert spec.qk_norm == ("head" if use_qk_norm else None)


def test_granite_moe_shareds_shared_expert_is_counted():
    config = _config_class("GraniteMoeSharedConfig")(**SMALL, num_local_experts=8, num_experts_per_tok=2,
                                                      shared_intermediate_size=1024)
    spec = ModelSpec.from_config(config)
    assert spec.shared_intermediate_size == 1024
    assert spec.total_params == _meta_count(config)
    # A token skips 6 of the 8 routed experts (3 x 1024 x 2048 each) in each of the 4 layers, never the shared one.
    assert spec.active_params == spec.total_params - 4 * 6 * 3 * 1024 * 2048


def test_a_negative_shared_expert_width_is_refused_naming_it():
    config = _config_class("GraniteMoeSharedConfig")(**SMALL, num_local_experts=8, num_experts_per_tok=2,
                                                      shared_intermediate_size=-1)
    with pytest.raises(ValueError, match=r"^model config GraniteMoeSharedConfig: shared_intermediate_size must be an "
                                         r"int >= 0, got -1$"):
        ModelSpec.from_config(config)


@pytest.mark.parametrize("config_class, family, fields, why", [
    ("Ernie4_5_MoeConfig", "ernie4_5_moe", dict(moe_num_experts=8, moe_k=2, moe_intermediate_size=512),
     "its MoE layers run from moe_layer_start_index to moe_layer_end_index every moe_layer_interval, beside "
     "moe_num_shared_experts shared experts"),
    ("HunYuanMoEV1Config", "hunyuan_v1_moe", dict(num_experts=8, moe_topk=2),
     "every layer runs a shared MLP beside its experts and normalises q and k (query_layernorm, key_layernorm)"),
    ("PhimoeConfig", "phimoe", dict(num_local_experts=8, num_experts_per_tok=2),
     "its norms are LayerNorms with biases, and lm_head_bias biases the head"),
    ("AfmoeConfig", "afmoe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512),
     "its first num_dense_layers are dense, its MoE layers run num_shared_experts shared experts and its attention "
     "is gated"),
])
def test_moe_families_whose_layers_are_not_modelled_are_refused_naming_what(tmp_path, capsys, config_class, family,
                                                                            fields, why):
    # Planned as Mixtral-like layers their parameter counts were wrong (ERNIE-4.5-21B-A3B's active
    # ones by 0.66 B, Hunyuan-A13B's by 1.2 B), with no word of it.
    config = _config_class(config_class)(**SMALL, **fields)
    expected = f"model config {config_class}: the planner does not model {family}'s layers ({why})"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        ModelSpec.from_config(config)
    config.save_pretrained(tmp_path)
    code = main(["plan", "--model", str(tmp_path), "--nodes", "1", "--gpus-per-node", "8", "--gpu-memory", "80"])
    assert code == EXIT_IMPOSSIBLE
    assert capsys.readouterr().err.strip() == f"moe-ep plan: model config {str(tmp_path)!r}: {expected}"
