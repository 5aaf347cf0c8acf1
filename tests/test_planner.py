"""The layout planner and `moe-ep plan`: Mixtral-8x7B on 16 nodes of 8 A100-80GB fits, the
figures follow from the stated cost model, impossible requests say what would be needed."""

import itertools
import json
import math
import re

import pytest

from moe_ep.cli import EXIT_IMPOSSIBLE, main
from moe_ep.planner.partition import partition
from moe_ep.planner import Cluster, Layout, ModelSpec, PlanError, config_from_name, evaluate, plan
from moe_ep.planner.memory import build_units, layer_ids, unit_costs
from moe_ep.planner.timing import remote_ranks_per_token

GiB = 2**30
A100 = dict(gpus_per_node=8, gpu_memory_gib=80)


@pytest.fixture(scope="module")
def mixtral_plan():
    return plan("mixtral-8x7b", nodes=16, **A100)


def test_mixtral_spec_matches_the_real_model():
    spec = ModelSpec.resolve("mixtral-8x7b")
    # The parameter count of the released checkpoint (and of MixtralForCausalLM on meta).
    assert spec.total_params == 46_702_792_704
    assert spec.active_params == pytest.approx(12.9e9, rel=0.01)
    cfg = config_from_name("mixtral-8x7b")
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts, cfg.num_experts_per_tok) == (4096, 14336, 8, 2)


def test_mixtral_on_16_nodes_of_a100_80gb_fits(mixtral_plan):
    lay, best = mixtral_plan.layout, mixtral_plan.best
    assert lay.world_size == 128 and lay.dp_shard % lay.ep == 0 and 8 % lay.ep == 0
    assert best.fits and best.memory.total <= 80 * GiB
    assert lay.dp * lay.microbatch_size * lay.microbatches * 4096 == 4 * 2**20
    # Per-rank parameter bytes straight from the model's counts: fp32 shards over dp_shard of the
    # units on the fullest pipeline rank.
    spec = mixtral_plan.spec
    part = best.partition
    names = [piece for s in range(part.num_stages) if part.rank_of_stage(s) == best.memory.rank
             for n in part.stage_names(s) for piece in n.split("+")]
    count = sum(
        spec.embed_params if n == "embed" else spec.head_params if n == "head" else spec.layer_params(layer_ids([n])[0])
        for n in names
    )
    assert best.memory.params == pytest.approx(4 * count / lay.dp_shard, rel=1e-12)
    assert best.memory.grads == best.memory.params and best.memory.optim == 2 * best.memory.params


def test_step_time_follows_the_stated_cost_model(mixtral_plan):
    best, lay, cluster = mixtral_plan.best, mixtral_plan.layout, mixtral_plan.cluster
    rows = dict(best.time.rows())
    assert rows["total"] == pytest.approx(sum(v for k, v in rows.items() if k != "total"))
    # Compute: 2 FLOPs per multiply-add over active weights, causal attention, 3x forward for
    # forward + backward (4x for checkpointed layers), at 40% of 312 TFLOP/s.
    tokens = lay.microbatch_size * 4096
    H, I, L, V = 4096, 14336, 32, 32000
    attn_w = H * (2 * 4096 + 2 * 1024)
    layer = 2 * (attn_w + 2 * H + 8 * H + 2 * 3 * H * I) + 2 * 2 * 4096 * 4096 / 2
    per_mb = tokens * (L * layer * (4 if lay.checkpointing else 3) + 3 * 2 * V * H)
    if lay.pp == 1:
        assert rows["compute (incl. recompute)"] == pytest.approx(lay.microbatches * per_mb / (312e12 * 0.4), rel=1e-9)
    assert best.time.total > 0 and rows["pipeline bubble"] >= 0
    mfu = best.time.model_flops / (best.time.total * 128 * 312e12)
    assert 0.2 < mfu < 0.4  # at 40% GEMM efficiency the overheads only subtract
    assert cluster.world_size == 128


def test_report_states_layout_memory_time_assumptions_and_alternatives(mixtral_plan):
    text = mixtral_plan.report()
    for needle in ("pp=", "dp_replicate=", "dp_shard=", "ep=", "micro-batches", "schedule", "checkpointing",
                   "parameters (fp32 master shards)", "gradients (fp32 shards)", "optimizer state (AdamW, 2 x fp32)",
                   "activations", "communication buffers", "headroom", "estimated step time", "pipeline bubble",
                   "cost model: compute at 40% of 312 TFLOP/s", "16 bytes per sharded parameter", "alternatives"):
        assert needle in text, needle
    assert len(mixtral_plan.alternatives) >= 3
    for cand, reason in mixtral_plan.alternatives:
        assert cand.key != mixtral_plan.best.key or not cand.fits
        assert (" s " in reason or " s per step" in reason) and ("GiB" in reason or "%" in reason)
        if not cand.fits:
            assert cand.time.total < mixtral_plan.best.time.total and "does not fit" in reason
        else:
            assert cand.time.total >= mixtral_plan.best.time.total


def test_cli_prints_a_fitting_layout(capsys):
    code = main(["plan", "--model", "mixtral-8x7b", "--nodes", "16", "--gpus-per-node", "8", "--gpu-memory", "80",
                 "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    deg = out["degrees"]
    assert deg["pp"] * deg["dp_replicate"] * deg["dp_shard"] == 128
    assert out["memory_bytes"]["headroom"] >= 0 and out["step_time_s"]["total"] > 0


def test_forced_pipeline_gives_end_stages_fewer_layers_than_the_middle():
    # Mixtral-8x7B with a 320k vocabulary, checkpointed: the LM head costs 2.4 decoder layers of
    # compute (its 3 passes against a recomputed layer's 4), so the last stage must take fewer
    # layers: 6 + head = 8.4 layers' worth against 9 in the middle (7 + head would be the slowest
    # stage). The embedding costs no FLOPs, but it and 1F1B's most micro-batches in flight make
    # stage 0 the fullest, so of the time-optimal cuts (26 layers over the first three stages: 9,
    # 9 and 8 in some order) the one with the 8 there wins.
    from transformers import MixtralConfig

    config = config_from_name("mixtral-8x7b").to_dict()
    config.update(vocab_size=320000)
    p = plan(MixtralConfig(**config), nodes=16, pp=4, schedule="1f1b", ep=8, dp_shard=32, checkpointing=True, **A100)
    part = p.best.partition
    counts = [len(layer_ids(part.stage_names(s))) for s in range(4)]
    assert part.stage_names(0)[0] == "embed+layers.0" and part.stage_names(3)[-1] == "layers.31+head"
    assert counts == [8, 9, 9, 6]
    assert max(counts[0], counts[-1]) < min(counts[1:-1])
    assert "decoder layers per stage [8, 9, 9, 6]" in p.report()


@pytest.mark.parametrize("vocab", [32000, 256000])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_heavy_head_of_a_small_model_leaves_the_other_stages_balanced(vocab, schedule):
    # A 12-layer Mixtral with hidden 256: the LM head costs 5 (32k) or 33 (256k) decoder layers,
    # so the last stage takes one layer and is the bottleneck; the other 11 layers still split
    # 3/4/4 (minimising only the bottleneck gave [5, 5, 1, 1] and [9, 1, 1, 1] under GPipe).
    from transformers import MixtralConfig

    spec = ModelSpec.from_config(MixtralConfig(
        vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=12, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False,
    ))
    lay = Layout(4, 1, 1, 1, 1, 8, schedule, False)
    part = partition(unit_costs(build_units(spec, lay, 4096, 1.2)), 4, inflight=lay.inflight())
    assert [len(layer_ids(part.stage_names(s))) for s in range(4)] == [3, 4, 4, 1]


def test_impossible_model_says_how_many_nodes_would_do_at_the_requested_batch():
    fixed = dict(checkpointing=True, microbatch_size=1, **A100)
    with pytest.raises(PlanError) as err:
        plan("mixtral-8x7b", nodes=1, **fixed)
    message = str(err.value)
    assert re.search(r"does not fit 1 node\(s\) x 8 GPUs of 80 GiB.*16 B x 46.7 B", message)
    assert "It would fit on 2 nodes (16 GPUs) at the same global batch of 4194304 tokens" in message
    assert "grown" not in message
    # What it proposes does plan.
    assert plan("mixtral-8x7b", nodes=2, global_batch_tokens=4194304, **fixed).best.fits


def test_impossible_model_grows_the_batch_only_when_the_requested_one_cannot_spread():
    # 8 sequences give at most 8 GPUs a sequence each, and 8 GPUs cannot hold the model.
    fixed = dict(checkpointing=True, microbatch_size=1, **A100)
    with pytest.raises(PlanError) as err:
        plan("mixtral-8x7b", nodes=1, global_batch_tokens=8 * 4096, **fixed)
    message = str(err.value)
    assert (
        "No cluster of up to 64 nodes fits it at the requested global batch of 32768 tokens (8 sequences): every "
        "layout needs at least one sequence per GPU" in message
    )
    assert "it would fit on 2 nodes (16 GPUs) at a global batch of 65536 tokens (16 sequences)" in message
    with pytest.raises(PlanError):
        plan("mixtral-8x7b", nodes=2, global_batch_tokens=8 * 4096, **fixed)
    assert plan("mixtral-8x7b", nodes=2, global_batch_tokens=16 * 4096, **fixed).best.fits


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(pp=3), r"pp=3 does not divide the world of 16 nodes x 8 GPUs = 128; choose pp from \[1, 2, 4"),
        (dict(ep=3), r"ep=3 does not divide the 8 experts of mixtral-8x7b; choose ep from \[1, 2, 4, 8\]"),
        (dict(pp=2, dp_replicate=2, dp_shard=16), r"pp x dp_replicate x dp_shard = 2 x 2 x 16 = 64, but the world"),
        (dict(dp_shard=4, ep=8), r"ep=8 must divide dp_shard=4"),
        (dict(pp=64), r"pp=64 exceeds the 32 decoder layers"),
        (dict(global_batch_tokens=1000), r"not a whole number of sequences of seq_len=4096; use a multiple of 4096"),
        (dict(global_batch_tokens=64 * 4096, pp=1), r"must hold a multiple of dp = world / pp sequences \(at least 128"),
        # Two chunks per rank: 64 stages for 32 layers (not the batch, which divides fine).
        (dict(pp=32, schedule="zbv"), r"schedule='zbv' runs 2 stages on each pipeline rank, so pp=32 needs 64 stages"
                                      r".* mixtral-8x7b has 32; use pp at most 16 with 'zbv', or .*\(gpipe, 1f1b\)"),
        (dict(pp=32, schedule="interleaved-1f1b"),
         r"pp=32 needs 64 stages.*use pp at most 16 with 'interleaved-1f1b'"),
        (dict(schedule="1f1b", dp_shard=128),
         r"schedule='1f1b' is a pipeline schedule and needs pp > 1, .* leave pp=1"),
        (dict(schedule="none", dp_replicate=1, dp_shard=8),
         r"schedule='none' means no pipeline \(pp=1\), .* pp in \[16\]"),
        # 1024 sequences over dp = 4 ... 128 replicas: 8 ... 256 per replica, all powers of two.
        (dict(microbatch_size=3), r"microbatch_size=3 divides no data-parallel replica's batch.* give \[8, 16, 32, 64, "
                                  r"128, 256\] sequences per replica; .* or a global batch of 384 sequences"),
        (dict(pp=16, microbatch_size=64), r"pp=16 with dp=8 leaves 128 sequences per replica, 2 micro-batches of 64, "
                                          r"and schedule 'gpipe' needs at least pp=16 micro-batches, got 2"),
        (dict(pp=16, global_batch_tokens=64 * 4096), r"needs at least pp=16 micro-batches, got 8; a global batch of "
                                                     r"world x microbatch_size = 128 sequences"),
        (dict(pp=8, schedule="interleaved-1f1b", global_batch_tokens=192 * 4096),
         r"'interleaved-1f1b' needs a multiple of pp=8 micro-batches, got 12"),
        # ep=8 inside dp_shard, with 128 / 32 = 4 ranks per pipeline stage.
        (dict(pp=32, ep=8), r"ep=8 must divide dp_shard .* with pp=32 dp_shard = 128 / \(pp x dp_replicate\) is at "
                            r"most 4; choose pp x dp_replicate dividing 16 \(= 128 / ep\), or ep from \[1, 2, 4\]"),
        (dict(dp_replicate=32, ep=8), r"ep=8 must divide dp_shard .* with dp_replicate=32 .* at most 4"),
        (dict(pp=32, dp_shard=8), r"pp x dp_shard = 32 x 8 = 256 does not divide the world of 128 GPUs"),
        (dict(dp_replicate=1, dp_shard=1), r"leaves pp = 128 / 1 = 128 pipeline ranks, more than the 32 decoder layers"
                                           r".*choose dp_replicate x dp_shard from \[4, 8, 16, 32, 64, 128\]"),
    ],
)
def test_impossible_degrees_say_what_would_be_needed(kwargs, message):
    with pytest.raises(PlanError, match=message):
        plan("mixtral-8x7b", nodes=16, **A100, **kwargs)


def test_stages_are_counted_against_the_decoder_layers_alone():
    # The embedding and the head ride with the first and the last decoder layer, so 14 layers
    # make at most 14 stages: ZB-V over pp=8 (16 stages) is refused up front with that reason.
    from hf_models import tiny_config

    config = tiny_config("mixtral", num_hidden_layers=14)
    small = dict(nodes=1, gpus_per_node=8, gpu_memory_gib=80, seq_len=64, global_batch_tokens=64 * 64)
    with pytest.raises(PlanError, match=r"pp=8 needs 16 stages of at least one decoder layer each, but .* has 14; "
                                        r"use pp at most 7 with 'zbv'"):
        plan(config, pp=8, schedule="zbv", **small)
    assert plan(config, pp=8, schedule="1f1b", **small).best.partition.num_stages == 8


def test_tied_model_under_a_loop_schedule_says_why_no_layout_can_be_cut():
    # Embedding and head share a weight and ride with the first and the last layer: GPipe and
    # 1F1B would separate them at every cut; only pp=1 or a V schedule keeps them on one rank.
    from transformers import MixtralConfig

    config = config_from_name("mixtral-8x7b").to_dict()
    config.update(tie_word_embeddings=True)
    with pytest.raises(PlanError, match=r"no layout under the fixed choices \{'schedule': '1f1b'\} can be cut into "
                                        r"pipeline stages; e.g. pp=\d+ .*shared parameters \['model.embed_tokens"):
        plan(MixtralConfig(**config), nodes=16, schedule="1f1b", **A100)


@pytest.mark.parametrize("args, start", [
    (["--pp", "3"], "moe-ep plan: pp=3 does not divide"),
    (["--pp", "32", "--schedule", "zbv"], "moe-ep plan: schedule='zbv' runs 2 stages on each pipeline rank"),
])
def test_cli_reports_impossible_requests_without_a_traceback(capsys, args, start):
    code = main(["plan", "--model", "mixtral-8x7b", "--nodes", "16", "--gpus-per-node", "8", "--gpu-memory", "80",
                 *args])
    assert code == EXIT_IMPOSSIBLE
    err = capsys.readouterr().err
    assert err.startswith(start) and "Traceback" not in err


def test_argument_errors():
    with pytest.raises(ValueError, match="model must be a Hugging Face config or one of"):
        plan("mixtral-7x9b", nodes=1, **A100)
    with pytest.raises(ValueError, match="nodes must be a positive int, got 0"):
        plan("mixtral-8x7b", nodes=0, **A100)
    with pytest.raises(ValueError, match=r"efficiency must lie in \(0, 1\], got 1.5"):
        Cluster(1, 8, 80, efficiency=1.5)
    with pytest.raises(ValueError, match="schedule must be one of"):
        plan("mixtral-8x7b", nodes=16, schedule="pipedream", **A100)
    with pytest.raises(ValueError, match="imbalance must be a number >= 1"):
        plan("mixtral-8x7b", nodes=16, imbalance=0.5, **A100)
    with pytest.raises(ValueError, match="ep=8 must divide dp_shard=4"):
        Layout(1, 1, 4, 8, 1, 1, "none", False)
    with pytest.raises(ValueError, match="schedule must be 'none' exactly when pp == 1"):
        Layout(2, 1, 4, 1, 1, 2, "none", False)
    with pytest.raises(TypeError, match="model config must have an int 'vocab_size'"):
        ModelSpec.resolve(object())


# Each family's layout, with the switches that change its parameter count.
FAMILY_VARIANTS = {
    "mixtral": ("mixtral", {}),
    "mixtral_tied": ("mixtral", dict(tie_word_embeddings=True)),
    "qwen2_moe": ("qwen2_moe", {}),
    "qwen2_moe_dense_layers_no_bias": ("qwen2_moe", dict(mlp_only_layers=[1], decoder_sparse_step=2, qkv_bias=False)),
    "qwen3_moe_biased": ("qwen3_moe", dict(attention_bias=True, decoder_sparse_step=2)),
    "olmoe_biased": ("olmoe", dict(attention_bias=True)),
    "deepseek_v3": ("deepseek_v3", {}),
    "deepseek_v3_direct_q_biased": (
        "deepseek_v3", dict(q_lora_rank=None, attention_bias=True, first_k_dense_replace=2, n_shared_experts=2),
    ),
}


def _meta_model(config):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _count(module) -> int:
    return sum(p.numel() for p in module.parameters())


def _experts_count(layer) -> int:
    from moe_ep.parallel.expert_sharding import experts_modules

    return sum(_count(m) for _, m in experts_modules(layer))


@pytest.mark.parametrize("variant", list(FAMILY_VARIANTS))
def test_spec_counts_every_parameter_of_the_model_built_on_meta(variant):
    from hf_models import tiny_config

    family, overrides = FAMILY_VARIANTS[variant]
    config = tiny_config(family, num_hidden_layers=4, **overrides)
    model, spec = _meta_model(config), ModelSpec.from_config(config)
    layers = model.model.layers
    assert [spec.is_moe_layer(i) for i in range(4)] == [_experts_count(layer) > 0 for layer in layers]
    assert [spec.layer_params(i) for i in range(4)] == [_count(layer) for layer in layers]
    assert [spec.layer_expert_params(i) for i in range(4)] == [_experts_count(layer) for layer in layers]
    assert spec.embed_params == _count(model.model.embed_tokens)
    assert spec.total_params == _count(model)
    if family in ("qwen2_moe", "deepseek_v3"):
        assert spec.shared_intermediate_size > 0


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_planner_memory_of_shared_expert_families_matches_the_model(family):
    # Each pipeline rank's fp32 shards, from the parameters of the modules its stages hold in the
    # model built on meta: DeepSeek's dense first layer and MLA, Qwen2-MoE's shared expert and its
    # gate included. Only the MoE layers dispatch tokens.
    from hf_models import tiny_config

    config = tiny_config(family, num_hidden_layers=6)
    spec, model = ModelSpec.from_config(config), _meta_model(config)
    lay = Layout(2, 1, 4, 2, 1, 4, "1f1b", False)
    cand = evaluate(spec, Cluster(1, 8, 80), lay, 64)
    units = build_units(spec, lay, 64, 1.2)
    assert [u.moe for u in units[1:-1]] == [_experts_count(layer) > 0 for layer in model.model.layers]
    assert family != "deepseek_v3" or not units[1].moe
    part = cand.partition
    for rank in range(2):
        names = [piece for s in range(part.num_stages) if part.rank_of_stage(s) == rank
                 for n in part.stage_names(s) for piece in n.split("+")]
        held = [model.model.embed_tokens] if "embed" in names else []
        held += [model.model.layers[i] for i in layer_ids(names)]
        held += [model.model.norm, model.lm_head] if "head" in names else []
        table = cand.memory_per_rank[rank]
        assert table.params == pytest.approx(4 * sum(_count(m) for m in held) / lay.dp_shard, rel=1e-12)
        assert table.grads == table.params and table.optim == 2 * table.params


def test_unsupported_and_dense_configs():
    from transformers import LlamaConfig, MistralConfig

    with pytest.raises(ValueError, match="mlp_bias=True: a layout the planner does not model"):
        ModelSpec.resolve(LlamaConfig(mlp_bias=True))
    dense = MistralConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8,
                          num_key_value_heads=8, vocab_size=32000)
    assert ModelSpec.resolve(dense).total_params == _count(_meta_model(dense))
    p = plan(dense, nodes=1, global_batch_tokens=32 * 4096, **A100)
    assert p.layout.ep == 1 and p.best.fits


def test_cli_reads_the_config_file_it_is_given(tmp_path, capsys):
    # A folder's config.json and another file beside it: a path to the file plans that file.
    from hf_models import tiny_config

    tiny_config("mixtral").save_pretrained(tmp_path)
    (tmp_path / "qwen.json").write_text(tiny_config("qwen2_moe").to_json_string())
    args = ["--nodes", "1", "--gpus-per-node", "2", "--gpu-memory", "80", "--seq-len", "64",
            "--global-batch-tokens", "512", "--json"]
    for path, model_type in ((tmp_path / "qwen.json", "qwen2_moe"), (tmp_path, "mixtral"),
                             (tmp_path / "config.json", "mixtral")):
        assert main(["plan", "--model", str(path), *args]) == 0
        assert json.loads(capsys.readouterr().out)["model"] == model_type


def test_remote_ranks_per_token_matches_enumeration():
    spec = ModelSpec.resolve("mixtral-8x7b")
    for ep in (1, 2, 4, 8):
        per_rank = 8 // ep
        choices = list(itertools.combinations(range(8), 2))
        expected = sum(len({e // per_rank for e in c} - {0}) for c in choices) / len(choices)
        assert remote_ranks_per_token(spec, ep) == pytest.approx(expected)


def test_evaluate_agrees_with_the_partition_it_reports():
    spec = ModelSpec.resolve("mixtral-8x7b")
    cluster = Cluster(16, 8, 80)
    lay = Layout(4, 1, 32, 8, 1, 32, "zbv", False)
    cand = evaluate(spec, cluster, lay, 4096)
    units = build_units(spec, lay, 4096, 1.2)
    again = partition(unit_costs(units), 8, placement="v", stages_per_rank=2, inflight=lay.inflight())
    assert again.starts == cand.partition.starts
    assert cand.partition.rank_of_stage(0) == cand.partition.rank_of_stage(7) == 0
    assert math.isclose(cand.time.total, sum(v for k, v in cand.time.rows() if k != "total"))
