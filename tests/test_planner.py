"""The layout planner and `moe-ep plan`: Mixtral-8x7B on 16 nodes of 8 A100-80GB fits; every
figure follows from the stated cost model, recomputed here from the model's sizes and the
cluster's figures (so a change of the model that is not a change of the statement fails); cluster
presets, calibration files, the memory terms, the headroom rule and the alternatives; impossible
requests say what would be needed; inputs out of range are refused with the argument, the value
and the range."""

import itertools
import json
import math
import re
import time
from pathlib import Path

import pytest

from moe_ep.cli import EXIT_IMPOSSIBLE, main
from moe_ep.planner import CLUSTERS, Cluster, Layout, ModelSpec, PlanError, config_from_name, evaluate, plan
from moe_ep.planner.activations import MicroBatch, head_scratch, padded_rows, rank_shares
from moe_ep.planner.report import format_plan
from moe_ep.planner.comm import all_to_all_collective
from moe_ep.planner.memory import FSDP_LAYER_BYTES, build_units, layer_ids, unit_costs
from moe_ep.planner.partition import partition

GiB = 2**30
A100 = dict(gpus_per_node=8, gpu_memory_gib=80)
DGX = dict(cluster="dgx-a100-80gb")
H, I, L, V, E, K = 4096, 14336, 32, 32000, 8, 2


@pytest.fixture(scope="module")
def mixtral_plan():
    # Without pipeline stages (the formulas below are a single stage's); the search over pp is
    # tested on its own below.
    return plan("mixtral-8x7b", nodes=16, pp=1, **DGX)


@pytest.mark.slow
def test_mixtral_spec_matches_the_real_model():
    spec = ModelSpec.resolve("mixtral-8x7b")
    # The parameter count of the released checkpoint (and of MixtralForCausalLM on meta).
    assert spec.total_params == 46_702_792_704
    assert spec.active_params == pytest.approx(12.9e9, rel=0.01)
    cfg = config_from_name("mixtral-8x7b")
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts, cfg.num_experts_per_tok) == (4096, 14336, 8, 2)


@pytest.mark.slow
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


def _layer_flops_by_kind(lay, seq=4096):
    """Forward FLOPs of one micro-batch, by kind, from Mixtral's sizes: dense GEMMs (q, k, v, o,
    the router; norms count as weights), the experts at the mean load, causal attention."""
    T = lay.microbatch_size * seq
    dense = 2 * (H * (H + 2 * 1024) + H * H + 2 * H + E * H) * T
    expert = 2 * K * 3 * H * I * T
    attention = 2 * 32 * (128 + 128) * seq / 2 * T
    return dense, expert, attention, 2 * V * H * T


@pytest.mark.slow
def test_compute_rows_follow_the_stated_efficiencies(mixtral_plan):
    # Each GEMM row is its FLOPs at its stated efficiency: forward + backward = 3 x forward (+1
    # recomputed), attention 3.5 x (flash recomputes the scores), the experts at the busiest
    # rank's load (imbalance 1.2 under ep > 1), over the micro-batches of the step.
    best, lay, c = mixtral_plan.best, mixtral_plan.layout, mixtral_plan.cluster
    assert lay.pp == 1
    eff, peak = c.efficiencies, 312e12
    dense, expert, attention, head = _layer_flops_by_kind(lay)
    # The recompute policy's forward again: everything ("full"), the attention block's projections
    # (q, k, v, o) and kernel ("attention"), no GEMM ("selective": memory-bound kernels only).
    projections = 2 * (H * (H + 2 * 1024) + H * H) * lay.microbatch_size * 4096
    again_dense = {"full": dense, "attention": projections}.get(lay.checkpointing, 0)
    again_expert = expert if lay.checkpointing == "full" else 0
    again_attention = attention if lay.checkpointing in ("full", "attention") else 0
    load = 1.2 if lay.ep > 1 else 1.0
    rows = dict(best.time.rows())
    m = lay.microbatches
    assert rows["dense GEMMs"] == pytest.approx(
        m * (L * (3 * dense + again_dense) + 3 * head) / (peak * eff.dense_gemm), rel=1e-9)
    assert rows["grouped GEMMs (experts, busiest rank)"] == pytest.approx(
        m * L * load * (3 * expert + again_expert) / (peak * eff.grouped_gemm), rel=1e-9)
    assert rows["attention"] == pytest.approx(
        m * L * (3.5 * attention + again_attention) / (peak * eff.attention), rel=1e-9)
    assert rows["total"] == pytest.approx(sum(v for k, v in rows.items() if k != "total"), rel=1e-12)
    assert rows["memory-bound kernels (incl. optimizer)"] > 0.02 * rows["total"]


@pytest.mark.slow
def test_mfu_is_a_consequence_of_the_efficiencies(mixtral_plan):
    # MFU = useful FLOPs / (step x GPUs x peak); its ceiling, the FLOP-weighted efficiency, is what
    # the useful FLOPs alone would reach; the step is the useful FLOPs at the stated efficiencies
    # plus what the report lists, to the second.
    best, lay, c = mixtral_plan.best, mixtral_plan.layout, mixtral_plan.cluster
    t, eff = best.time, c.efficiencies
    dense, expert, attention, head = _layer_flops_by_kind(lay)
    per_replica = 3 * lay.microbatches * (L * (dense + expert + attention) + head)
    assert t.model_flops == pytest.approx(per_replica * lay.dp, rel=1e-9)
    assert t.mfu(c) == pytest.approx(per_replica * lay.dp / (t.total * 128 * 312e12), rel=1e-12)
    weighted = (L * (dense + expert + attention) + head) / (
        (L * dense + head) / eff.dense_gemm + L * expert / eff.grouped_gemm + L * attention / eff.attention)
    assert t.mfu_ceiling(c) == pytest.approx(weighted, rel=1e-9)
    assert t.mfu(c) < t.mfu_ceiling(c) <= max(eff.dense_gemm, eff.grouped_gemm, eff.attention)
    accounted = t.ideal + sum(t.losses.values()) + t.all_to_all + t.fsdp_exposed + t.p2p + t.bubble
    assert accounted == pytest.approx(t.total, rel=1e-9)
    text = mixtral_plan.report()
    assert f"MFU = {t.mfu_ceiling(c):.1%} x {t.ideal:.2f} s / {t.total:.2f} s = {t.mfu(c):.1%}" in text


def test_the_busiest_ranks_expert_load_costs_compute():
    # Only the experts' row grows with the imbalance, in proportion.
    lay = Layout(1, 1, 128, 8, 1, 8, "none", False)
    spec, cluster = ModelSpec.resolve("mixtral-8x7b"), Cluster.from_preset(CLUSTERS["dgx-a100-80gb"], 16)
    from moe_ep.planner.search import Assumptions

    rows = [dict(evaluate(spec, cluster, lay, 4096, Assumptions(imbalance=x)).time.rows()) for x in (1.0, 1.5)]
    key = "grouped GEMMs (experts, busiest rank)"
    assert rows[1][key] == pytest.approx(1.5 * rows[0][key], rel=1e-12)
    assert rows[1]["dense GEMMs"] == rows[0]["dense GEMMs"] and rows[1]["attention"] == rows[0]["attention"]
    assert rows[1]["expert all-to-all"] > rows[0]["expert all-to-all"]


@pytest.mark.slow
def test_recompute_policies_trade_memory_for_work_as_modelled():
    # One layout under each policy: what is kept falls none > attention > selective > full; the
    # GEMMs run again only under "full" (all of them) and "attention" (its projections and
    # kernel); "selective" adds memory-bound work only; the dispatcher's all-to-alls run again
    # under "full" and "selective" alone. The search costs every policy.
    spec = ModelSpec.resolve("mixtral-8x7b")
    cluster = Cluster.from_preset(CLUSTERS["dgx-a100-80gb"], 16)
    results = {policy: evaluate(spec, cluster, Layout(1, 1, 128, 8, 1, 8, "none", policy), 4096)
               for policy in ("none", "attention", "selective", "full")}
    act = {p: c.memory.activations for p, c in results.items()}
    assert act["none"] > act["attention"] > act["selective"] > act["full"]
    rows = {p: dict(c.time.rows()) for p, c in results.items()}
    grouped, dense, a2a = "grouped GEMMs (experts, busiest rank)", "dense GEMMs", "expert all-to-all"
    assert rows["none"][grouped] == rows["attention"][grouped] == rows["selective"][grouped] < rows["full"][grouped]
    assert rows["none"][dense] == rows["selective"][dense] < rows["attention"][dense] < rows["full"][dense]
    assert rows["none"][a2a] == rows["attention"][a2a] < rows["selective"][a2a] == rows["full"][a2a]
    memory_bound = "memory-bound kernels (incl. optimizer)"
    assert rows["none"][memory_bound] < rows["attention"][memory_bound] < rows["selective"][memory_bound]
    assert rows["selective"][memory_bound] == pytest.approx(rows["full"][memory_bound], rel=1e-12)
    from moe_ep.planner.search import Assumptions, _layouts

    fixed = dict.fromkeys(("pp", "dp_replicate", "dp_shard", "ep", "microbatch_size", "schedule", "checkpointing",
                           "virtual_stages"))
    policies = {lay.checkpointing for lay in _layouts(spec, cluster, 4096, 4 * 2**20, fixed, Assumptions())}
    assert policies == {"none", "full", "selective", "attention"}


def test_memory_bound_work_is_charged_at_hbm_bandwidth():
    lay = Layout(1, 1, 128, 8, 1, 8, "none", False)
    spec = ModelSpec.resolve("mixtral-8x7b")
    fast = Cluster.from_preset(CLUSTERS["dgx-a100-80gb"], 16)
    slow = fast.replace(hbm_gbps=fast.hbm_gbps / 2)
    key = "memory-bound kernels (incl. optimizer)"
    a, b = (dict(evaluate(spec, c, lay, 4096).time.rows())[key] for c in (fast, slow))
    assert b == pytest.approx(2 * a, rel=1e-12) and a > 0


@pytest.mark.slow
def test_report_states_cluster_layout_memory_time_efficiencies_and_alternatives(mixtral_plan):
    text = mixtral_plan.report()
    for needle in ("cluster: dgx-a100-80gb (NVIDIA DGX A100 (80 GB))", "312 TFLOP/s dense bf16", "2039 GB/s",
                   "8 x 200 Gb/s HDR InfiniBand", "sources: NVIDIA A100 datasheet",
                   "pp=", "dp_replicate=", "dp_shard=", "ep=", "micro-batches", "schedule", "checkpointing",
                   "parameters (fp32 master shards)", "gradients (fp32 shards)", "optimizer state (AdamW, 2 x fp32)",
                   "activations kept for backward", "backward scratch", "FSDP2 working set", "expert all-to-all buffers",
                   "reserved (CUDA context, NCCL, fragmentation)", "headroom",
                   "start-up imbalance" if mixtral_plan.layout.ep > 1 else "expert side local", "headroom rule",
                   "estimated step time", "grouped GEMMs (experts, busiest rank)", "attention", "memory-bound kernels",
                   "pipeline bubble", "MFU, as a consequence of the stated efficiencies", "FlashAttention-2",
                   "16 bytes per sharded parameter", "alternatives"):
        assert needle in text, needle
    assert len(mixtral_plan.alternatives) >= 3


@pytest.mark.slow
def test_alternatives_tell_the_truth_about_time_and_memory(mixtral_plan):
    best = mixtral_plan.best
    for cand, reason in mixtral_plan.alternatives:
        if not cand.fits:
            assert "does not fit" in reason and cand.time.total < best.time.total
            continue
        if "more memory" in reason:
            assert cand.memory.total > best.memory.total
        else:
            assert "less memory" in reason and cand.memory.total <= best.memory.total
        if reason.startswith("slower"):
            assert cand.time.total > best.time.total
        elif reason.startswith("faster"):
            assert cand.time.total < best.time.total and "headroom rule" in reason


@pytest.mark.slow
def test_cli_prints_a_fitting_layout(capsys):
    # --pp 1: the JSON the CLI prints is the point, and a search over the other degrees (hundreds
    # of layouts) shows it in a second; the whole search through the CLI is
    # test_cli_help_states_the_figures_a_plan_without_a_cluster_takes's.
    code = main(["plan", "--model", "mixtral-8x7b", "--nodes", "16", "--gpus-per-node", "8", "--gpu-memory", "80",
                 "--pp", "1", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    deg = out["degrees"]
    assert deg["pp"] * deg["dp_replicate"] * deg["dp_shard"] == 128
    assert out["memory_bytes"]["headroom"] >= 0 and out["step_time_s"]["total"] > 0
    assert 0 < out["mfu"] < out["mfu_ceiling"] <= 1
    assert out["efficiencies"]["grouped_gemm"]["source"].startswith("estimated")
    # What the text says, under names that do not change with the plan: the batch, the throughput.
    assert list(out["memory"].values()) == list(out["memory_bytes"].values())
    assert sum(out["memory"][k] for k in ("params", "grads", "optim", "activations", "scratch", "fsdp",
                                          "all_to_all", "p2p", "reserved")) == pytest.approx(out["memory"]["total"])
    assert out["tokens_per_s"] == pytest.approx(out["global_batch_tokens"] / out["step_time_s"]["total"])
    assert out["tokens_per_s_per_gpu"] * 128 == pytest.approx(out["tokens_per_s"]) and out["seq_len"] == 4096
    assert out["layouts_enumerated"] >= out["layouts_costed"] > 1 and out["estimated"] is True


# ---------------------------------------------------------------- cluster presets


def test_every_preset_is_there_with_its_figures():
    assert {"dgx-a100-40gb", "dgx-a100-80gb", "p4d", "p4de", "dgx-h100", "p5", "dgx-h200", "p5e"} <= set(CLUSTERS)
    figures = {name: (p.gpu.peak_tflops, p.gpu.memory_gib, p.gpu.hbm_gbps, p.network_gbps_per_gpu)
               for name, p in CLUSTERS.items()}
    assert figures["dgx-a100-80gb"] == (312, 80, 2039, 25)
    assert figures["dgx-a100-40gb"] == (312, 40, 1555, 25)
    assert figures["p4d"] == (312, 40, 1555, 6.25)  # 400 Gb/s EFA over 8 GPUs
    assert figures["p4de"] == (312, 80, 2039, 6.25)
    assert figures["dgx-h100"] == (989, 80, 3350, 50)
    assert figures["p5"] == (989, 80, 3350, 50)  # 3,200 Gb/s EFA
    assert figures["dgx-h200"] == (989, 140, 4800, 50)
    assert figures["p5e"] == (989, 140, 4800, 50)
    for p in CLUSTERS.values():
        assert p.source and p.gpu.source and p.gpus_per_node == 8


def test_preset_fields_can_each_be_overridden():
    p = plan("mixtral-8x7b", nodes=16, cluster="p4de", inter_node_gbps=25.0, peak_tflops=300.0,
             dense_gemm_efficiency=0.5, checkpointing=True, pp=1, ep=8, microbatch_size=1)
    c = p.cluster
    assert (c.preset, c.inter_node_gbps, c.peak_tflops, c.efficiencies.dense_gemm) == ("p4de", 25.0, 300.0, 0.5)
    assert c.gpu_memory_gib == 80 and c.hbm_gbps == 2039
    assert c.efficiencies.source("dense_gemm") == "given"
    assert "given: inter_node_gbps, peak_tflops, dense_gemm_efficiency" in p.report()


def test_groups_spanning_whole_nodes_get_the_nodes_network():
    c = Cluster.from_preset(CLUSTERS["p4d"], 16)
    GB = 1e9
    assert c.bandwidth(8, 1) == 200 * GB  # inside a node: NVLink
    assert c.bandwidth(128, 1) == 50 * GB  # 8 GPUs per node: the node's 400 Gb/s
    assert c.bandwidth(32, 4) == 2 * 6.25 * GB  # 2 GPUs per node
    assert c.bandwidth(16, 8) == 6.25 * GB  # one GPU per node: its share
    dgx = Cluster.from_preset(CLUSTERS["dgx-a100-80gb"], 16)
    assert dgx.bandwidth(128, 1) == 200 * GB  # 8 x 25 GB/s, capped by NVLink


@pytest.mark.slow
def test_p4d_and_dgx_a100_choose_differently_and_the_reports_say_why():
    # Same GPUs (A100 40 GB), a quarter of the network on p4d: the DGX's layout gathers every
    # expert over all 128 GPUs each micro-batch, which p4d's 400 Gb/s per node cannot hide.
    # Searched without pipeline stages (a twentieth of the layouts): the layouts both clusters choose,
    # and the fastest of each, have none, so these are the choices of the whole search too.
    dgx = plan("mixtral-8x7b", nodes=16, cluster="dgx-a100-40gb", pp=1)
    p4d = plan("mixtral-8x7b", nodes=16, cluster="p4d", pp=1)
    assert dgx.layout != p4d.layout
    on_p4d = evaluate(p4d.spec, p4d.cluster, dgx.layout, 4096)
    assert on_p4d.time.total > p4d.best.time.total
    rows, best_rows = dict(on_p4d.time.rows()), dict(p4d.best.time.rows())
    deltas = {k: rows[k] - best_rows[k] for k in rows if k != "total"}
    assert max(deltas, key=deltas.get) == "FSDP/HSDP traffic not hidden"
    assert "400 Gb/s EFA" in p4d.report() and "8 x 200 Gb/s HDR InfiniBand" in dgx.report()
    fixed = plan("mixtral-8x7b", nodes=16, cluster="p4d", pp=dgx.layout.pp, ep=dgx.layout.ep,
                 dp_shard=dgx.layout.dp_shard, checkpointing=dgx.layout.checkpointing,
                 microbatch_size=dgx.layout.microbatch_size)
    assert dict(fixed.best.time.rows())["FSDP/HSDP traffic not hidden"] == pytest.approx(
        rows["FSDP/HSDP traffic not hidden"])


@pytest.mark.slow
def test_cli_takes_a_cluster_preset(capsys):
    # --pp 1: the preset's figures are the point (p4d's whole search is planned above).
    assert main(["plan", "--model", "mixtral-8x7b", "--cluster", "p4d", "--nodes", "16", "--pp", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cluster"]["preset"] == "p4d" and out["cluster"]["inter_node_gbps"] == 6.25
    assert out["cluster"]["gpu_memory_gib"] == 40


# ---------------------------------------------------------------- calibration

KERNELS_CPU = "benchmarks/results/kernels_cpu_2026-11-25.json"


def _gpu_results(tmp_path, device="NVIDIA A100-SXM4-80GB", dtype="bfloat16", **tflops):
    """The repository's result file of 'python -m moe_ep.bench kernels', as if from a GPU: its own
    rows, with the device, the dtype and the figures the planner reads changed."""
    payload = json.loads(open(KERNELS_CPU).read())
    payload["meta"]["device"] = device
    payload["meta"]["shape"] = payload["meta"]["shape"].rsplit(" ", 1)[0] + f" {dtype}"
    for row in payload["rows"]:
        if row.get("kind") == "op" and row.get("variant") == "moe_ep[torch]":
            row["variant"] = "moe_ep[triton]"
        if row.get("phase") == "fwd+bwd" and row.get("kind") == "op" and row["variant"] == "moe_ep[triton]":
            row["tflops"] = tflops.get("grouped", 150.0)
        if row.get("phase") == "fwd+bwd" and row.get("kind") == "dense":
            row["tflops"] = tflops.get("dense", 220.0)
        if row.get("kind") == "copy":
            row["gbps"] = tflops.get("copy", 1500.0)
    path = tmp_path / "kernels_a100.json"
    path.write_text(json.dumps(payload))
    return path


def test_calibration_file_replaces_the_default_efficiencies(tmp_path):
    path = _gpu_results(tmp_path)
    p = plan("mixtral-8x7b", nodes=16, cluster="dgx-a100-80gb", calibration=path, pp=1, ep=8, microbatch_size=1,
             checkpointing=False)
    eff = p.cluster.efficiencies
    assert eff.grouped_gemm == pytest.approx(150 / 312) and eff.dense_gemm == pytest.approx(220 / 312)
    assert eff.memory == pytest.approx(1500 / 2039)
    assert eff.attention == 0.60  # not measured in a kernels file: the default
    assert eff.source("grouped_gemm").startswith("measured: kernels_a100.json, NVIDIA A100-SXM4-80GB, moe_ep[triton]")
    assert "not measured in kernels_a100.json" in eff.source("attention")
    default = plan("mixtral-8x7b", nodes=16, cluster="dgx-a100-80gb", pp=1, ep=8, microbatch_size=1,
                   checkpointing=False)
    key = "grouped GEMMs (experts, busiest rank)"
    ratio = dict(p.best.time.rows())[key] / dict(default.best.time.rows())[key]
    assert ratio == pytest.approx(default.cluster.efficiencies.grouped_gemm / eff.grouped_gemm, rel=1e-9)
    assert "measured: kernels_a100.json" in p.report()


def test_an_h200_cluster_takes_the_committed_h200_gate_and_an_h100_cluster_refuses_it():
    """The gate measured on an H200 calibrates an H200 cluster (its compute rates with the H100's
    peak, its copy bandwidth against the H200's HBM); an H100 cluster refuses it."""
    gate = Path("benchmarks/results/gpu_check_nvidia-h200_2026-11-28.json")
    kwargs = dict(nodes=8, calibration=gate, pp=1, ep=8, microbatch_size=1, checkpointing="full")
    eff = plan("mixtral-8x7b", cluster="dgx-h200", **kwargs).cluster.efficiencies
    assert eff.grouped_gemm == pytest.approx(605.08 / 989, rel=1e-3)
    assert eff.dense_gemm == pytest.approx(691.23 / 989, rel=1e-3)
    assert eff.memory == pytest.approx(4114.84 / 4800, rel=1e-3)
    assert eff.source("grouped_gemm").startswith(f"measured: {gate.name}, NVIDIA H200, moe_ep[triton] fwd+bwd")
    assert "the H100's (the same GH100 compute)" in eff.source("attention")
    with pytest.raises(ValueError, match="was measured on 'NVIDIA H200', not on a H100"):
        plan("mixtral-8x7b", cluster="dgx-h100", **kwargs)
    # Its fine-grained problems: Qwen3-30B-A3B's own, and for Qwen3-235B-A22B's experts (4096 x
    # 1536) DeepSeek-V3's (7168 x 2048), the nearest. (The layout fixed: the calibration is read
    # before the search, whose size does not change it.)
    for model, problem, tflops in (("qwen3-30b-a3b", "qwen3-30b-a3b", 455.7), ("qwen3-235b-a22b", "deepseek-v3-ep8",
                                                                                545.0)):
        eff = plan(model, cluster="dgx-h200", nodes=32, calibration=gate, checkpointing="full", pp=1, ep=8,
                   microbatch_size=1).cluster.efficiencies
        assert eff.grouped_gemm == pytest.approx(tflops / 989, rel=1e-3)
        assert f" of {problem}: " in eff.source("grouped_gemm")


def test_calibration_from_a_gate_with_several_problems_reads_the_nearest_experts(tmp_path):
    """scripts/gpu_check.sh keeps one kernels result per problem (meta and rows keyed by problem,
    Mixtral-8x7B first): a model's experts run at the rate of the problem nearest their shape, the
    dense and memory rates are the first problem's; a dense model takes the first problem's."""
    from moe_ep.planner.calibration import nearest_problem

    mixtral = json.loads(_gpu_results(tmp_path, grouped=150.0).read_text())
    fine = json.loads(_gpu_results(tmp_path, grouped=60.0, dense=100.0).read_text())
    mixtral["meta"]["shape"] = "H=4096 I=14336 E=8 k=2 bfloat16"
    fine["meta"]["shape"] = "H=2048 I=768 E=128 k=8 bfloat16"
    rows = ([dict(r, problem="mixtral-8x7b") for r in mixtral["rows"]]
            + [dict(r, problem="qwen3-30b-a3b", T=(r.get("T") or 0) * 4) for r in fine["rows"]])
    gate = {"mode": "gpu_check", "meta": {"device": mixtral["meta"]["device"], "results": {"kernels": {
        "meta": {"mixtral-8x7b": mixtral["meta"], "qwen3-30b-a3b": fine["meta"]}, "rows": rows}}}}
    path = tmp_path / "gpu_check_a100.json"
    path.write_text(json.dumps(gate))
    p = plan("mixtral-8x7b", nodes=16, cluster="dgx-a100-80gb", calibration=path, pp=1, ep=8, microbatch_size=1,
             checkpointing=False)
    assert p.cluster.efficiencies.grouped_gemm == pytest.approx(150 / 312)
    fine_plan = plan("qwen3-30b-a3b", nodes=16, cluster="dgx-a100-80gb", calibration=path, pp=1, ep=8,
                     microbatch_size=1, checkpointing="full")
    eff = fine_plan.cluster.efficiencies
    assert eff.grouped_gemm == pytest.approx(60 / 312) and eff.dense_gemm == pytest.approx(220 / 312)
    assert eff.source("grouped_gemm").endswith("of qwen3-30b-a3b: 60.0 TFLOP/s of 312")
    problems = gate["meta"]["results"]["kernels"]["meta"]
    assert nearest_problem(problems, None) == "mixtral-8x7b"  # a dense model
    assert nearest_problem(problems, (6144, 16384)) == "mixtral-8x7b"  # Mixtral-8x22B
    assert nearest_problem(problems, (2048, 1024)) == "qwen3-30b-a3b"  # OLMoE
    assert nearest_problem(dict(problems, unknown={"shape": "?"}), (7, 7)) == "qwen3-30b-a3b"


@pytest.mark.parametrize("change, message", [
    (dict(device="AMD EPYC (2 threads)"), r"was measured on 'AMD EPYC \(2 threads\)', not on a A100"),
    (dict(device="NVIDIA H100 80GB HBM3"), r"not on a A100"),
    (dict(dtype="float32"), r"was measured in 'float32'; the planner models 16-bit training"),
    (dict(grouped=400.0), r"moe_ep\[triton\] fwd\+bwd at T=2048 of H=256 I=512 E=8 k=2 bfloat16 measured 400.0 "
                          r"TFLOP/s, 1.28 x the cluster's peak"),
    (dict(grouped=-3.0), r"moe_ep\[triton\] fwd\+bwd at T=2048 of H=256 I=512 E=8 k=2 bfloat16 holds the rate -3.0 "
                         r"TFLOP/s, not a positive number: the file is damaged"),
])
def test_calibration_files_that_do_not_describe_the_cluster_are_refused(tmp_path, change, message):
    kwargs = {k: v for k, v in change.items() if k in ("device", "dtype")}
    figures = {k: v for k, v in change.items() if k not in kwargs}
    path = _gpu_results(tmp_path, **kwargs, **figures)
    with pytest.raises(ValueError, match=message):
        plan("mixtral-8x7b", nodes=16, cluster="dgx-a100-80gb", calibration=path)


def test_calibration_file_errors_name_the_file(tmp_path):
    with pytest.raises(ValueError, match=r"calibration file .*missing.json' cannot be read"):
        plan("mixtral-8x7b", nodes=16, calibration=tmp_path / "missing.json", **DGX)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"bad.json' is not JSON"):
        plan("mixtral-8x7b", nodes=16, calibration=tmp_path / "bad.json", **DGX)
    (tmp_path / "binary.json").write_bytes(b"\x80\x00PNG")
    with pytest.raises(ValueError, match=r"binary.json' is not JSON \(not UTF-8 text: byte 0 is b'\\x80'\)"):
        plan("mixtral-8x7b", nodes=16, calibration=tmp_path / "binary.json", **DGX)
    # A result of another benchmark mode.
    with pytest.raises(ValueError, match=r"must be a result of 'python -m moe_ep.bench kernels'.*got mode 'model'"):
        plan("mixtral-8x7b", nodes=16, calibration="benchmarks/results/model_cpu_2026-11-25.json", **DGX)
    # The repository's own CPU measurement is a kernels file, but not of an A100.
    with pytest.raises(ValueError, match=r"measured on 'AMD EPYC"):
        plan("mixtral-8x7b", nodes=16, calibration=KERNELS_CPU, **DGX)
    # Hand-made or damaged files whose fields are not what the bench writes: one ValueError each.
    good = json.loads(_gpu_results(tmp_path).read_text())
    damaged = {
        "rows_of_ints": dict(good, rows=[1, 2]),
        "meta_a_list": dict(good, meta=[1]),
        "problem_of_no_width": {"mode": "gpu_check", "meta": {"results": {"kernels": {"rows": [], "meta": {
            name: {"device": "NVIDIA A100-SXM4-80GB", "shape": f"H={h} I=5 bfloat16"}
            for name, h in (("a", 0), ("b", 4))
        }}}}},
        "gate_results_a_list": {"mode": "gpu_check", "meta": {"results": [1]}},
    }
    for name, payload in damaged.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(payload))
        with pytest.raises(ValueError, match=rf"{name}.json' does not hold a result of 'python -m moe_ep.bench "
                                             r"kernels' or scripts/gpu_check.sh as they write it \("):
            plan("mixtral-8x7b", nodes=16, calibration=path, **DGX)
    # Rows of nothing the planner reads: refused, not every default taken silently.
    (tmp_path / "no_rates.json").write_text(json.dumps(dict(good, rows=[{"op": "other", "phase": "fwd"}])))
    with pytest.raises(ValueError, match=r"no_rates.json' calibrates nothing: none of its rows is a measured rate"):
        plan("mixtral-8x7b", nodes=16, calibration=tmp_path / "no_rates.json", **DGX)


def test_hybrid_models_are_refused_not_planned_as_attention_models():
    """Linear-attention (Qwen3-Next) and state-space (Jamba) layers, and Jamba's MoE every other
    layer, are layouts the planner does not model."""
    from transformers import JambaConfig, Qwen3NextConfig

    with pytest.raises(ValueError, match=r"Qwen3NextConfig has linear_attention layers: a layout the planner does "
                                         r"not model"):
        plan(Qwen3NextConfig(), nodes=4, cluster="dgx-h100")
    with pytest.raises(ValueError, match=r"JambaConfig has expert_layer_period=2"):
        plan(JambaConfig(), nodes=4, cluster="dgx-h100")


def test_a_config_file_of_a_layout_the_planner_does_not_model_is_a_value_error(tmp_path):
    """moe-ep plan says it in one line (it reports ValueErrors): an encoder-decoder MoE, DBRX's own
    config fields."""
    from transformers import DbrxConfig, SwitchTransformersConfig

    for config, said in ((DbrxConfig(), "model config must have an int 'intermediate_size'"),
                         (SwitchTransformersConfig(), "model config SwitchTransformersConfig is an encoder-decoder "
                                                      "model: the planner plans decoder-only causal LMs")):
        path = tmp_path / f"{config.model_type}.json"
        path.write_text(config.to_json_string())
        with pytest.raises(ValueError, match=rf"model config '{path}': {re.escape(said)}"):
            plan(str(path), nodes=4, cluster="dgx-h100")


@pytest.mark.parametrize("family, overrides, said", [
    ("gpt_oss", {}, "moe_ep does not run gpt_oss's experts (its experts interleave the gate and up projections"),
    ("jetmoe", {}, "moe_ep does not run jetmoe's experts (its experts are not a transformers experts module"),
    ("mixtral", dict(hidden_act="relu"), "has hidden_act='relu': moe_ep's experts implement 'silu', 'swish', 'gelu' "
                                         "only"),
    ("mixtral", dict(attn_implementation="eager"), "has attn_implementation='eager', which keeps every layer's "
                                                   "[batch, heads, seq, seq] attention probabilities"),
])
def test_a_model_moe_ep_does_not_run_as_planned_is_refused_by_name(family, overrides, said):
    """The planner plans what parallelize runs: a family whose experts moe_ep does not take, an
    activation its kernels lack, and eager attention (its [seq, seq] probabilities per layer, 1.9x
    the planned activations at 256 tokens on a tiny model) are refused, not planned as another."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(family, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=64, vocab_size=128, **overrides)
    with pytest.raises(ValueError, match=re.escape(said)):
        plan(config, nodes=1, cluster="dgx-h100")


def test_a_local_folder_wins_over_the_built_in_model_of_its_name(tmp_path, monkeypatch):
    from hf_models import tiny_config

    (tmp_path / "mixtral-8x7b").mkdir()
    tiny_config("mixtral", attn_implementation="sdpa").save_pretrained(tmp_path / "mixtral-8x7b")
    monkeypatch.chdir(tmp_path)
    assert ModelSpec.resolve("mixtral-8x7b").hidden_size == 32
    monkeypatch.chdir(tmp_path / "mixtral-8x7b")
    assert ModelSpec.resolve("mixtral-8x7b").hidden_size == 4096
    (tmp_path / "mixtral-8x7b" / "mixtral-8x7b").mkdir()  # a folder of that name without a config: a run's output
    assert ModelSpec.resolve("mixtral-8x7b").hidden_size == 4096


@pytest.mark.slow
def test_cli_takes_a_calibration_file(tmp_path, capsys):
    path = _gpu_results(tmp_path)
    # --pp 1: the file's figures reach the plan whatever the search (a second instead of several).
    assert main(["plan", "--model", "mixtral-8x7b", "--cluster", "dgx-a100-80gb", "--nodes", "16",
                 "--calibration", str(path), "--pp", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["efficiencies"]["dense_gemm"]["value"] == pytest.approx(220 / 312)


# ---------------------------------------------------------------- memory terms


def test_backward_scratch_charges_the_logits_and_their_float32_gradient():
    spec = ModelSpec.resolve("mixtral-8x7b")
    lay = Layout(1, 1, 128, 8, 1, 8, "none", False)
    head = build_units(spec, lay, 4096)[-1]
    # The bf16 logits held until the loss returns, the float32 gradient of the log-softmax of the
    # 4095 predicted positions and its bf16 copy: about 0.5 GiB of float32 per 4K tokens.
    assert head.scratch == head_scratch(spec, MicroBatch(1, 4096)) == 2 * V * 4096 + 6 * V * 4095
    assert 4 * V * 4095 > 0.48 * GiB


def test_the_experts_backward_scratch_holds_gemm1s_gradient_only_under_split_backward_schedules():
    """GEMM 1's output gradient goes over its saved output, except where ZB-V and DualPipeV run the
    backward twice (moe_ep.ops.repeatable_backward): one [padded rows, 2I] bf16 buffer more."""
    spec = ModelSpec.resolve("mixtral-8x7b")
    moe_scratch = {
        schedule: next(u.scratch for u in build_units(spec, Layout(2, 1, 1, 1, 1, 4, schedule, "none"), 4096) if u.moe)
        for schedule in ("1f1b", "interleaved-1f1b", "zbv", "dualpipev")}
    gemm1_grad = 2 * padded_rows(4096 * spec.top_k, spec.num_experts) * 2 * spec.intermediate_size
    assert moe_scratch["1f1b"] == moe_scratch["interleaved-1f1b"]
    assert moe_scratch["zbv"] == moe_scratch["dualpipev"] == moe_scratch["1f1b"] + gemm1_grad


def test_fsdp_working_set_without_pipeline_is_14_bytes_per_gathered_parameter_plus_the_root():
    spec = ModelSpec.resolve("mixtral-8x7b")
    lay = Layout(1, 1, 128, 8, 1, 8, "none", False)
    cand = evaluate(spec, Cluster(16, 8, 80), lay, 4096)
    layer = spec.layer_dense_params(0) + spec.layer_expert_params(0) / 8
    root = 2 * (spec.embed_params + spec.head_params) + 2 * spec.head_params  # gathered, and the head's gradient
    assert FSDP_LAYER_BYTES == 14
    assert cand.memory.fsdp == pytest.approx(root + 14 * layer, rel=1e-12)


def test_fsdp_working_set_with_pipeline_stages_is_6_bytes_held_and_2_while_a_layer_runs():
    """Under pipeline stages every gathered parameter of a rank's stages holds its bf16 weight and
    float32 accumulated gradient all step (6 bytes), and the running layer adds its bf16 gradient
    (2 bytes) until FSDP2 accumulates it; the stage's reduction frees the weights before it
    allocates the float32 reduce-scatter input, so it adds no more. Ties the table to those
    constants (tests/test_fsdp_pipeline_memory.py measures them)."""
    from moe_ep.planner.memory import PP_HELD_BYTES, PP_TRANSIENT_BYTES, stage_units

    assert (PP_HELD_BYTES, PP_TRANSIENT_BYTES) == (6, 2)
    spec = ModelSpec.resolve("mixtral-8x7b")
    lay = Layout(2, 1, 8, 8, 1, 4, "1f1b", "full")
    cand = evaluate(spec, Cluster(2, 8, 80), lay, 4096)
    units = build_units(spec, lay, 4096)
    for table in cand.memory_per_rank:
        mine = [u for s in range(cand.partition.num_stages) if cand.partition.rank_of_stage(s) == table.rank
                for u in stage_units(units, cand.partition, s)]
        running = next(u for u in mine if u.name == table.scratch_unit)
        assert table.fsdp == pytest.approx(6 * sum(u.gathered for u in mine) + 2 * running.gathered, rel=1e-12)


def test_expert_side_memory_is_sized_for_the_startup_imbalance():
    spec = ModelSpec.resolve("mixtral-8x7b")
    lay = Layout(1, 1, 128, 8, 1, 8, "none", False)
    cluster = Cluster(16, 8, 80)
    from moe_ep.planner.search import Assumptions

    mem = {s: evaluate(spec, cluster, lay, 4096, Assumptions(startup_imbalance=s)).memory for s in (1.0, 2.0, 4.0, 9.0)}
    assert mem[1.0].activations < mem[2.0].activations < mem[4.0].activations
    assert mem[4.0].activations == mem[9.0].activations  # one row per token and rank: at most 4x at ep=8
    assert mem[1.0].all_to_all < mem[2.0].all_to_all
    # Capacity mode: fixed padded blocks, whatever the start-up imbalance.
    cap = [evaluate(spec, cluster, lay, 4096, Assumptions(startup_imbalance=s, capacity_factor=1.25)).memory
           for s in (1.0, 4.0)]
    assert cap[0].activations == cap[1].activations and cap[0].all_to_all == cap[1].all_to_all
    assert cap[0].activations < mem[2.0].activations


@pytest.mark.slow
def test_headroom_rule_prefers_a_layout_with_headroom_within_the_margin():
    # pp=16: the two layouts the rule weighs on 4 DGX A100 (the fastest, ZB-V, and the one it
    # prefers, 1F1B) are both pp=16 ones, so this search (a twentieth of the layouts) weighs them alike.
    p = plan("mixtral-8x7b", nodes=4, pp=16, **DGX)
    fastest, best = p.rule.fastest, p.best
    assert fastest is not None  # on 4 DGX A100 the fastest layout leaves under 10% free
    assert fastest.time.total < best.time.total <= 1.05 * fastest.time.total
    assert fastest.memory.headroom < 0.10 * 80 * GiB <= best.memory.headroom
    assert "it passed over " + fastest.layout.short() in p.report()
    assert p.alternatives[0][0] is fastest or any(c is fastest for c, _ in p.alternatives)
    bold = plan("mixtral-8x7b", nodes=4, pp=16, min_headroom=0.0, **DGX)
    assert bold.layout == fastest.layout and bold.rule.fastest is None


def test_headroom_rule_says_when_no_layout_near_the_fastest_keeps_the_headroom():
    # Two nodes hold Mixtral-8x7B only tightly: of the layouts within 5% of the fastest, the one
    # with the most headroom wins, and the report says that it is under the rule's 10%.
    from moe_ep.planner.search import choose

    p = plan("mixtral-8x7b", nodes=2, **A100)
    assert p.best.memory.headroom < 0.10 * 80 * GiB
    assert "none of them keeps that much, so the one with the most headroom wins" in p.report()
    fitting = [p.best] + [c for c, _ in p.alternatives if c.fits]
    near = [c for c in fitting if c.time.total <= 1.05 * min(c.time.total for c in fitting)]
    assert choose(fitting, 0.10, 0.05)[0].memory.headroom == max(c.memory.headroom for c in near)


def test_the_headroom_rule_weighs_every_layout_within_a_wide_margin(monkeypatch):
    # The search costs layouts up to a window over the best step time; with --speed-margin wider
    # than that window, layouts the rule may choose were never costed (a 1.0 margin picked pp=32
    # with 2 GiB less headroom and a slower step than pp=1's). With the windows shut to 1.0 the
    # margin alone decides what is weighed: the choice is the exhaustive search's.
    import moe_ep.planner.search as search

    request = dict(nodes=4, cluster="dgx-h100", speed_margin=1.0, min_headroom=0.9, ep=8)
    monkeypatch.setattr(search, "_EXPLAIN_WINDOW", 1e9)
    monkeypatch.setattr(search, "_GIVE_UP_WINDOW", 1e9)
    exhaustive = plan("mixtral-8x7b", **request)
    monkeypatch.setattr(search, "_EXPLAIN_WINDOW", 1.0)
    monkeypatch.setattr(search, "_GIVE_UP_WINDOW", 1.0)
    assert plan("mixtral-8x7b", **request).layout == exhaustive.layout


def test_a_capacity_factor_below_one_counts_no_dropped_pair_as_model_flops():
    # Blocks padded below the mean load drop pairs: the MFU counts only what is computed (a
    # factor of 0.001 reported an MFU of 180%), and the report says how much is dropped.
    full, half = (plan("mixtral-8x7b", nodes=4, cluster="dgx-h100", capacity_factor=f, ep=8, pp=1) for f in (1.25, 0.5))
    assert half.best.time.mfu(half.cluster) < 1 and full.best.time.mfu(full.cluster) < 1
    assert half.best.time.model_flops < full.best.time.model_flops
    assert "0.5x the mean load; a factor below 1 drops at least 50.0% of the routed pairs" in half.report()
    assert "1.25x the mean load" in full.report() and "drops" not in full.report()


# ---------------------------------------------------------------- communication


def test_all_to_all_bytes_are_moe_eps_dispatch_one_row_per_destination_rank():
    # Forward rows, routing columns and the count exchange, against wire_bytes over every top-2
    # choice of 8 experts as one token each, sent from rank 0 (uniform routing, exactly).
    import torch

    from moe_ep.dispatch.wire_bytes import count_exchange_bytes, wire_bytes

    spec = ModelSpec.resolve("mixtral-8x7b")
    choices = torch.tensor(list(itertools.combinations(range(8), 2)))
    for ep in (2, 4, 8):
        lay = Layout(1, 1, 8, ep, 1, 1, "none", False)
        forward = all_to_all_collective(spec, lay, len(choices), 1)
        wire = wire_bytes(choices, 8 // ep, H, source_rank=0)
        counts = count_exchange_bytes(8, ep, 2).moe_ep_bytes
        # The collective counts a forward and a backward (rows again, weight gradients of the multi rows).
        multi = wire.moe_ep_metadata / (8 * min(2, 8 // ep))
        backward = wire.moe_ep_payload + 4 * min(2, 8 // ep) * multi
        assert forward.bytes == pytest.approx(counts + wire.moe_ep_bytes + backward, rel=1e-12)
        rows, _ = rank_shares(spec, ep)
        assert wire.moe_ep_rows == pytest.approx(len(choices) * rows * (ep - 1) / ep)


def test_fsdp_exposure_is_the_first_gather_and_the_last_reduction_at_least():
    spec = ModelSpec.resolve("mixtral-8x7b")
    lay = Layout(1, 1, 128, 8, 1, 8, "none", False)
    fast = Cluster.from_preset(CLUSTERS["dgx-a100-80gb"], 16)
    t = evaluate(spec, fast, lay, 4096).time
    assert 0 < t.fsdp_exposed < t.fsdp_traffic
    slow = evaluate(spec, fast.replace(inter_node_gbps=1.0), lay, 4096).time
    assert slow.fsdp_exposed > t.fsdp_exposed
    assert slow.total == pytest.approx(sum(v for k, v in slow.rows() if k != "total"), rel=1e-12)


def test_a_presets_network_description_is_said_only_for_its_own_figures():
    preset = plan("mixtral-8x7b", nodes=4, pp=1, ep=8, **DGX).report()
    assert "25 GB/s per GPU (8 x 200 Gb/s HDR InfiniBand)" in preset
    given = plan("mixtral-8x7b", nodes=4, pp=1, ep=8, gpus_per_node=4, inter_node_gbps=100, **DGX).report()
    assert "= 100 GB/s per GPU\n" in given and "HDR InfiniBand" not in given


def test_impossible_model_says_how_many_nodes_would_do_at_the_requested_batch():
    fixed = dict(checkpointing=True, microbatch_size=1, **A100)
    with pytest.raises(PlanError) as err:
        plan("mixtral-8x7b", nodes=1, **fixed)
    message = str(err.value)
    assert re.search(r"does not fit 1 node\(s\) x 8 GPUs of 80 GiB.*16 B x 46.7 B", message)
    assert "It would fit on 2 nodes (16 GPUs) at the same global batch of 4194304 tokens" in message
    assert "grown" not in message and "left free" not in message
    # What it proposes does plan.
    assert plan("mixtral-8x7b", nodes=2, global_batch_tokens=4194304, **fixed).best.fits
    # Mesh degrees the request fixed grow with the nodes: the proposal says it left them free.
    with pytest.raises(PlanError, match=r"It would fit on 2 nodes .*\(pp=1 of the request left free\) using"):
        plan("mixtral-8x7b", nodes=1, pp=1, ep=8, **fixed)


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


def test_what_an_impossible_plan_suggests_is_within_what_the_planner_takes():
    """A request at the planner's largest cluster suggests no bigger one (it would refuse it), and no
    global batch beyond its bound is advised."""
    from moe_ep.planner.inputs import BOUNDS

    fixed = dict(gpus_per_node=8, gpu_memory_gib=7.47, reserve_fraction=0, pp=1, ep=8, microbatch_size=1,
                 checkpointing="full")
    with pytest.raises(PlanError) as err:
        plan("mixtral-8x7b", nodes=2048, global_batch_tokens=2**30, **fixed)
    assert "would fit on" not in str(err.value) and (
        "Nothing fits even on 2048 nodes (the planner's limit is 2048 nodes of 8 GPUs)") in str(err.value)
    with pytest.raises(PlanError) as err:
        plan("mixtral-8x7b", nodes=1, microbatch_size=1_000_000, **A100)
    message = str(err.value)
    assert "divides no data-parallel replica's batch" in message and "or a global batch" not in message
    assert max((int(n) for n in re.findall(r"(\d+) tokens", message)), default=0) <= BOUNDS["global_batch_tokens"].hi


def test_no_alternatives_asked_for_is_not_said_to_be_a_single_layout():
    text = format_plan(plan("mixtral-8x7b", nodes=2, num_alternatives=0, **A100))
    assert "none: the constraints leave a single layout" not in text


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

    config = tiny_config("mixtral", num_hidden_layers=14, attn_implementation="sdpa")
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




def test_forced_pipeline_gives_end_stages_fewer_layers_than_the_middle():
    # Mixtral-8x7B with a 320k vocabulary, checkpointed: the LM head costs several decoder layers,
    # so the last stage takes fewer layers; the cut is the time-optimal one, found by brute force
    # over every cut here.
    from transformers import MixtralConfig

    config = config_from_name("mixtral-8x7b").to_dict()
    config.update(vocab_size=320000)
    p = plan(MixtralConfig(**config), nodes=16, pp=4, schedule="1f1b", ep=8, dp_shard=32, checkpointing=True, **DGX)
    part = p.best.partition
    counts = [len(layer_ids(part.stage_names(s))) for s in range(4)]
    assert part.stage_names(0)[0] == "embed+layers.0" and part.stage_names(3)[-1] == "layers.31+head"
    assert counts[-1] < min(counts[1:-1])
    costs = [u.flops for u in part.units]
    best = min(max(sum(costs[a:b]) for a, b in zip((0, *cut), (*cut, 32)))
               for cut in itertools.combinations(range(1, 32), 3))
    assert part.bottleneck_flops == pytest.approx(best, rel=1e-12)
    assert f"decoder layers per stage {counts}" in p.report()


@pytest.mark.parametrize("vocab", [32000, 256000])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_heavy_head_of_a_small_model_leaves_the_other_stages_balanced(vocab, schedule):
    # A 12-layer Mixtral with hidden 256: the LM head costs many decoder layers, so the last stage
    # takes one layer and is the bottleneck; the other 11 layers still split 3/4/4 (minimising
    # only the bottleneck gave [5, 5, 1, 1] and [9, 1, 1, 1] under GPipe).
    from transformers import MixtralConfig

    spec = ModelSpec.from_config(MixtralConfig(
        vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=12, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False,
    ))
    lay = Layout(4, 1, 1, 1, 1, 8, schedule, False)
    part = partition(unit_costs(build_units(spec, lay, 4096, 1.2)), 4, inflight=lay.inflight())
    assert [len(layer_ids(part.stage_names(s))) for s in range(4)] == [3, 4, 4, 1]


def test_evaluate_agrees_with_the_partition_it_reports():
    spec = ModelSpec.resolve("mixtral-8x7b")
    cluster = Cluster(16, 8, 80)
    lay = Layout(4, 1, 32, 8, 1, 32, "zbv", False)
    cand = evaluate(spec, cluster, lay, 4096)
    units = build_units(spec, lay, 4096, 1.2)
    again = partition(unit_costs(units, cluster), 8, placement="v", stages_per_rank=2, inflight=lay.inflight())
    assert again.starts == cand.partition.starts
    assert cand.partition.rank_of_stage(0) == cand.partition.rank_of_stage(7) == 0
    assert math.isclose(cand.time.total, sum(v for k, v in cand.time.rows() if k != "total"))


# ---------------------------------------------------------------- inputs


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_alternatives=-3), r"num_alternatives must be an int in \[0, 100\], got -3"),
    (dict(global_batch_tokens=0), r"global_batch_tokens must be an int in \[1, 1073741824\], got 0"),
    (dict(global_batch_tokens=2**40), r"global_batch_tokens must be an int in \[1, 1073741824\], got 1099511627776"),
    (dict(gpu_memory_gib=float("inf")), r"gpu_memory_gib must be a number in \(0, 4096\], got inf"),
    (dict(gpu_memory_gib=float("nan")), r"gpu_memory_gib must be a number in \(0, 4096\], got nan"),
    (dict(nodes=10**9), r"nodes must be an int in \[1, 2048\], got 1000000000"),
    (dict(nodes=0), r"nodes must be an int in \[1, 2048\], got 0"),
    (dict(nodes=2048, gpus_per_node=16), r"nodes x gpus_per_node = 2048 x 16 = 32768 GPUs; the planner takes at most"),
    (dict(seq_len=0), r"seq_len must be an int in \[1, 1048576\], got 0"),
    (dict(imbalance=0.5), r"imbalance must be a number in \[1, 1024\], got 0.5"),
    (dict(startup_imbalance=float("inf")), r"startup_imbalance must be a number in \[1, 1024\], got inf"),
    (dict(capacity_factor=-1.0), r"capacity_factor must be a number in \(0, 1024\], got -1.0"),
    (dict(peak_tflops=float("nan")), r"peak_tflops must be a number in \(0, 100000\], got nan"),
    (dict(inter_node_gbps=0.0), r"inter_node_gbps must be a number in \(0, 100000\], got 0.0"),
    (dict(dense_gemm_efficiency=1.5), r"dense_gemm_efficiency must be a number in \(0, 1\], got 1.5"),
    (dict(reserve_fraction=0.95), r"reserve_fraction must be a number in \[0, 0.9\], got 0.95"),
    (dict(min_headroom=-0.1), r"min_headroom must be a number in \[0, 0.9\], got -0.1"),
    (dict(microbatch_size=0), r"microbatch_size must be an int in \[1, 1048576\], got 0"),
    (dict(pp=0), r"pp must be an int in \[1, 16384\], got 0"),
    (dict(nodes=16.0), r"nodes must be an int in \[1, 2048\], got 16.0"),
    (dict(gpu_memory_gib=True), r"gpu_memory_gib must be a number in \(0, 4096\], got True"),
    (dict(cluster="dgx-a200"), r"cluster must be one of \('dgx-a100-40gb'"),
])
def test_inputs_out_of_range_are_refused_naming_the_argument(kwargs, message):
    args = dict(nodes=16, gpus_per_node=8, gpu_memory_gib=80)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        plan("mixtral-8x7b", **args)


@pytest.mark.parametrize("args, message", [
    (["--alternatives", "-3"], "argument --alternatives: must be an int in [0, 100], got '-3'"),
    (["--global-batch-tokens", "0"], "argument --global-batch-tokens: must be an int in [1, 1073741824], got '0'"),
    (["--gpu-memory", "inf"], "argument --gpu-memory: must be a number in (0, 4096], got 'inf'"),
    (["--nodes", "1e9"], "argument --nodes: must be an int in [1, 2048], got '1e9'"),
    (["--global-batch-tokens", "99999999999"], "argument --global-batch-tokens: must be an int in [1, 1073741824], "
                                               "got '99999999999'"),
    (["--imbalance", "nan"], "argument --imbalance: must be a number in [1, 1024], got 'nan'"),
    (["--nodes", "2.5"], "argument --nodes: must be an int in [1, 2048], got '2.5'"),
    (["--cluster", "p4x"], "argument --cluster: invalid choice: 'p4x'"),
])
def test_cli_refuses_inputs_out_of_range(capsys, args, message):
    base = {"--nodes": "16", "--gpus-per-node": "8", "--gpu-memory": "80"}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--model", "mixtral-8x7b", *itertools.chain.from_iterable(base.items())])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_needs_the_cluster_or_its_size(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--model", "mixtral-8x7b", "--nodes", "16"])
    assert "--gpus-per-node and --gpu-memory are required without --cluster" in capsys.readouterr().err


def test_cli_help_states_the_figures_a_plan_without_a_cluster_takes(capsys):
    # Each figure the help promises without --cluster is the one the plan then uses.
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--help"])
    assert exit_.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines anywhere
    assert "without it --gpus-per-node and --gpu-memory are required and every other figure is dgx-a100-80gb's" \
        in help_text
    stated = dict(re.findall(r"--([a-z-]+) [A-Z_]+ [^-]*?(?:--cluster preset's, )?without one dgx-a100-80gb's "
                             r"([0-9.]+)", help_text))
    assert main(["plan", "--model", "mixtral-8x7b", "--nodes", "2", "--gpus-per-node", "8", "--gpu-memory", "80",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    used = {"intra-node-bw": out["cluster"]["intra_node_gbps"], "inter-node-bw": out["cluster"]["inter_node_gbps"],
            "peak-tflops": out["cluster"]["peak_tflops"], "hbm-bw": out["cluster"]["hbm_gbps"]}
    used.update({f"{kind.replace('_', '-')}-efficiency": figure["value"] for kind, figure in out["efficiencies"].items()})
    assert {flag: float(value) for flag, value in stated.items()} == used
    assert out["cluster"]["preset"] is None and out["cluster"]["gpu"] == "A100-SXM4-80GB"


@pytest.mark.slow
def test_the_largest_requests_plan_in_seconds():
    # Huge global batches and the widest clusters the planner accepts: layouts and micro-batch
    # splits grow with the divisors of the world and of the sequences, never with their values.
    start = time.perf_counter()
    plan("mixtral-8x7b", nodes=16, cluster="dgx-a100-80gb", global_batch_tokens=2**30)
    with pytest.raises(PlanError):
        plan("mixtral-8x7b", nodes=2048, cluster="dgx-a100-80gb")
    assert time.perf_counter() - start < 120  # about 9 s on an idle core


def test_argument_errors():
    with pytest.raises(ValueError, match="model must be a Hugging Face config or one of"):
        plan("mixtral-7x9b", nodes=1, **A100)
    with pytest.raises(ValueError, match=r"grouped_gemm efficiency must be a number in \(0, 1\], got 1.5"):
        from moe_ep.planner import Efficiencies

        Efficiencies(grouped_gemm=1.5, dense_gemm=0.5, attention=0.5, memory=0.5)
    with pytest.raises(ValueError, match="gpus_per_node is required unless a cluster preset is named"):
        plan("mixtral-8x7b", nodes=16)
    with pytest.raises(ValueError, match="schedule must be one of"):
        plan("mixtral-8x7b", nodes=16, schedule="pipedream", **A100)
    with pytest.raises(ValueError, match="capacity_factor=1.25 applies to the expert-parallel dispatcher; ep=1"):
        plan("mixtral-8x7b", nodes=16, capacity_factor=1.25, ep=1, **A100)
    with pytest.raises(ValueError, match="ep=8 must divide dp_shard=4"):
        Layout(1, 1, 4, 8, 1, 1, "none", False)
    with pytest.raises(ValueError, match="schedule must be 'none' exactly when pp == 1"):
        Layout(2, 1, 4, 1, 1, 2, "none", False)
    with pytest.raises(TypeError, match="model config must have an int 'vocab_size'"):
        ModelSpec.resolve(object())
    with pytest.raises(ValueError, match=r"latency_us must be a finite number >= 0, got inf"):
        Cluster(1, 8, 80, latency_us=float("inf"))


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


@pytest.mark.slow
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




BROKEN_CONFIGS = {
    "truncated": (lambda p: p.write_text('{"model_type": "mixtral", "hidden_size": '),
                  r"^model config '{file}' cannot be loaded: It looks like the config file at '{file}' is not a valid "
                  r"JSON file\.$"),
    "binary": (lambda p: p.write_bytes(bytes(range(256))), r"^model config '{file}' cannot be loaded: .*not a valid JSON"),
    "empty": (lambda p: p.write_text(""), r"^model config '{file}' cannot be loaded: .*not a valid JSON"),
    "no_model_type": (lambda p: p.write_text('{"hidden_size": 32}'),
                      r"^model config '{file}' cannot be loaded: Unrecognized model"),
    "unknown_family": (lambda p: p.write_text('{"model_type": "no_such_family"}'),
                       r"^model config '{file}' cannot be loaded: .*model type `no_such_family`"),
    "unsupported_layout": (lambda p: p.write_text('{"model_type": "mixtral", "mlp_bias": true}'),
                           r"^model config '{given}': model config MixtralConfig has mlp_bias=True: a layout the planner "
                           r"does not model"),
}


@pytest.mark.parametrize("name, given_as", [(name, given_as) for name in BROKEN_CONFIGS for given_as in ("file", "folder")]
                         + [("folder_without_config", "folder")])
def test_a_config_file_that_fails_to_load_is_named(tmp_path, capsys, name, given_as):
    """plan() and `moe-ep plan --model PATH`: the file is named in one line, never a traceback."""
    file = tmp_path / "config.json"
    if name in BROKEN_CONFIGS:
        write, message = BROKEN_CONFIGS[name]
        write(file)
    else:
        message = r"^model folder '{given}' has no config.json$"
    given = tmp_path if given_as == "folder" else file
    expected = message.format(file=re.escape(str(file)), given=re.escape(str(given)))
    with pytest.raises(ValueError, match=expected):
        plan(str(given), nodes=1, **A100)
    assert main(["plan", "--model", str(given), "--nodes", "1", "--gpus-per-node", "8", "--gpu-memory", "80"]) != 0
    err = capsys.readouterr().err
    assert re.search(expected.replace("^", "^moe-ep plan: "), err.strip()) and "Traceback" not in err, err


def test_exposed_exchange_follows_the_overlapped_layers_schedule():
    from moe_ep.planner.timing import exposed_exchange_seconds

    assert exposed_exchange_seconds(8.0, 5.0, 1) == 8.0  # nothing overlaps
    # Two chunks behind slow experts: chunk 1's dispatch and chunk 2's combine, 2 s each.
    assert exposed_exchange_seconds(8.0, 100.0, 2) == pytest.approx(4.0)
    # Two chunks, no experts to hide behind: the link runs every exchange back to back.
    assert exposed_exchange_seconds(8.0, 0.0, 2) == pytest.approx(8.0)
    # Hand-simulated: dispatches end at 1 and 2; experts 1 at 1..2.5, combine 1 at 2.5..3.5;
    # experts 2 at 2.5..4, combine 2 at 4..5: 5 - 3 s of experts.
    assert exposed_exchange_seconds(4.0, 3.0, 2) == pytest.approx(2.0)
    for chunks in (2, 3, 4):
        for experts in (0.0, 1.0, 4.0, 50.0):
            assert 0 <= exposed_exchange_seconds(8.0, experts, chunks) <= 8.0


def test_exposed_node_aware_exchange_follows_its_two_links():
    from moe_ep.planner.timing import exposed_exchange_seconds, exposed_node_exchange_seconds

    # Nothing inside the node: the single-stage schedule on the network alone.
    for network, experts, chunks in ((8.0, 100.0, 2), (8.0, 0.0, 2), (4.0, 3.0, 2), (6.0, 2.0, 3)):
        assert exposed_node_exchange_seconds(network, 0.0, experts, chunks) == pytest.approx(
            exposed_exchange_seconds(network, experts, chunks))
    # Hand-simulated, 2 chunks behind slow experts, network 8 s and node 2 s (each stage 2 s and
    # 0.5 s per chunk and direction): chunk 1's S1 and S2 before any expert; between the chunks'
    # experts, chunk 1's C2 and chunk 2's S2 on the node link; after them chunk 2's C2 and C1;
    # chunk 2's S1 and chunk 1's C1 hide behind the experts.
    assert exposed_node_exchange_seconds(8.0, 2.0, 100.0, 2) == pytest.approx(2 + 0.5 + 1.0 + 0.5 + 2)
    # One chunk: nothing overlaps, the stages one after another.
    assert exposed_node_exchange_seconds(8.0, 2.0, 100.0, 1) == pytest.approx(10.0)
    for chunks in (2, 3, 4):
        for experts in (0.0, 1.0, 4.0, 50.0):
            assert 0 <= exposed_node_exchange_seconds(8.0, 2.0, experts, chunks) <= 10.0


@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
def test_plan_with_overlap_chunks_counts_only_the_exposed_all_to_all(checkpointing):
    fixed = dict(pp=1, dp_shard=128, ep=8, microbatch_size=1, checkpointing=checkpointing)
    plain = plan("mixtral-8x7b", nodes=16, **DGX, **fixed)
    overlapped = plan("mixtral-8x7b", nodes=16, **DGX, **fixed, overlap_chunks=2)
    assert overlapped.layout == plain.layout
    assert overlapped.best.time.compute == plain.best.time.compute
    assert 0 < overlapped.best.time.all_to_all < plain.best.time.all_to_all
    assert overlapped.best.time.total < plain.best.time.total
    assert "overlapped with the experts in 2 chunks" in overlapped.report()
    assert overlapped.to_dict()["assumptions"]["overlap_chunks"] == 2


def test_overlap_chunks_keep_the_node_aware_dispatch_across_nodes():
    # Qwen3-30B-A3B at ep=16 over 8-GPU nodes: parallelize's "auto" dispatches node-aware with or
    # without overlap, so the planner costs the two stages and hides part of them.
    from moe_ep.planner.search import Assumptions, _units

    spec = ModelSpec.resolve("qwen3-30b-a3b")
    layout = Layout(1, 1, 16, 16, 1, 1, "none", False)
    cluster = Cluster.from_preset(CLUSTERS["dgx-h100"], nodes=2)
    for chunks in (1, 2):
        moe = next(u for u in _units(spec, layout, 4096, Assumptions(overlap_chunks=chunks), cluster) if u.moe)
        assert [c.group for c in moe.a2a] == ["ep-inter", "ep-intra"], chunks
    fixed = dict(pp=1, dp_shard=16, ep=16, microbatch_size=1, checkpointing="full")
    plain = plan("qwen3-30b-a3b", nodes=2, cluster="dgx-h100", **fixed)
    overlapped = plan("qwen3-30b-a3b", nodes=2, cluster="dgx-h100", **fixed, overlap_chunks=2)
    assert 0 < overlapped.best.time.all_to_all < plain.best.time.all_to_all


def test_plan_refuses_overlap_chunks_it_cannot_apply():
    with pytest.raises(ValueError, match=r"overlap_chunks must be an int in \[1, 64\], got 0"):
        plan("mixtral-8x7b", nodes=16, overlap_chunks=0, **A100)
    with pytest.raises(ValueError, match="overlap_chunks=2 overlaps the dropless expert-parallel dispatcher's "
                                         "exchanges; capacity_factor=1.25 is capacity mode"):
        plan("mixtral-8x7b", nodes=16, overlap_chunks=2, capacity_factor=1.25, **A100)
    with pytest.raises(ValueError, match="overlap_chunks=2 overlaps .*; ep=1 has none"):
        plan("mixtral-8x7b", nodes=16, overlap_chunks=2, ep=1, **A100)


# ---------------------------------------------------------------- the chunked loss


def test_chunked_loss_saved_is_what_the_loss_keeps_for_backward():
    """The planner's figure for what moe_ep's chunked loss keeps from forward to backward equals
    the bytes its autograd function saves (saved_tensors_hooks), bf16 hidden states and weight."""
    import torch

    from moe_ep.ops.linear_cross_entropy import linear_cross_entropy
    from moe_ep.planner.activations import chunked_loss_saved

    T, H, V = 37, 24, 101
    hidden = torch.randn(T, H, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(V, H, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        linear_cross_entropy(hidden, weight, torch.randint(0, V, (T,)), chunk_tokens=5)
    assert sum(saved) == chunked_loss_saved(T, H, V)


def test_chunked_loss_makes_the_published_qwen3_layout_fit():
    """AutoModel's Qwen3-30B-A3B layout (8 H100, ep8 fsdp8, 4 x 4096 tokens per micro-batch, full
    recompute): 21.7 GiB over with the full logits of its 151,936-token vocabulary, inside 80 GiB
    with the chunked loss, whose head keeps the weight's float32 gradient instead."""
    from moe_ep.planner.activations import chunked_head_saved, chunked_head_scratch

    fixed = dict(nodes=1, cluster="dgx-h100", pp=1, dp_replicate=1, dp_shard=8, ep=8, microbatch_size=4,
                 checkpointing="full", global_batch_tokens=512 * 4096, imbalance=1.0, startup_imbalance=1.0)
    with pytest.raises(PlanError, match="does not fit"):
        plan("qwen3-30b-a3b", **fixed)
    chunked = plan("qwen3-30b-a3b", chunked_loss=True, **fixed)
    assert chunked.best.memory.total <= chunked.cluster.gpu_memory_gib * 2**30
    assert chunked.assumptions.chunked_loss and "chunked loss" in chunked.report()
    spec, mb = chunked.spec, MicroBatch(4, 4096)
    units = build_units(spec, chunked.layout, 4096, chunked_loss=True)
    assert units[-1].scratch == chunked_head_scratch(spec, mb) < head_scratch(spec, mb) / 10
    assert units[-1].act == chunked_head_saved(spec, mb)
    with pytest.raises(TypeError, match="chunked_loss must be True or False"):
        plan("qwen3-30b-a3b", chunked_loss="yes", **fixed)


def test_bf16_moments_are_the_optimizer_state_moe_ep_adamw_holds():
    """plan(bf16_moments=True): AdamW's moments as moe_ep.training.AdamW stores them, 2 bytes each
    per sharded parameter (its state measured below), and nothing else of the table changes; its
    unfused step moves more DRAM bytes than torch's AdamW, which the step time counts."""
    import torch

    from moe_ep.planner.compute import BF16_MOMENTS_OPTIMIZER_BYTES, OPTIMIZER_BYTES_PER_PARAM
    from moe_ep.training import AdamW

    fixed = dict(nodes=1, cluster="dgx-h100", pp=1, dp_replicate=1, dp_shard=8, ep=8, microbatch_size=4,
                 checkpointing="full", global_batch_tokens=512 * 4096, imbalance=1.0, startup_imbalance=1.0,
                 chunked_loss=True)
    plans = [plan("qwen3-30b-a3b", bf16_moments=b, **fixed) for b in (False, True)]
    fp32, bf16 = (p.best.memory for p in plans)
    cluster = plans[0].cluster
    extra = (BF16_MOMENTS_OPTIMIZER_BYTES - OPTIMIZER_BYTES_PER_PARAM) * fp32.params / 4
    assert plans[1].best.time.compute.memory - plans[0].best.time.compute.memory == pytest.approx(
        extra / (cluster.hbm_bytes_per_s * cluster.efficiencies.memory), rel=1e-9)
    assert bf16.optim == fp32.optim / 2 == fp32.params
    assert bf16.total == pytest.approx(fp32.total - fp32.optim / 2, rel=1e-12)
    assert dict(bf16.rows())["optimizer state (AdamW, 2 x bf16)"] == bf16.optim
    assert "optimizer: AdamW with its two moments in bf16" in plan("qwen3-30b-a3b", bf16_moments=True, **fixed).report()

    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    optimizer = AdamW(params)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    held = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in (s["exp_avg"], s["exp_avg_sq"]))
    fp32_master = sum(p.numel() * p.element_size() for p in params)
    assert held / fp32_master == bf16.optim / bf16.params
    with pytest.raises(TypeError, match="bf16_moments must be True or False"):
        plan("qwen3-30b-a3b", bf16_moments="yes", **fixed)


@pytest.mark.parametrize("model, kwargs, said", [
    # Left free, ep is chosen among the degrees that run the options: never ep=1.
    ("mixtral-8x7b", dict(nodes=2, cluster="dgx-a100-80gb", capacity_factor=1.25), None),
    ("mixtral-8x7b", dict(nodes=4, cluster="dgx-a100-80gb", overlap_chunks=2), None),
    ("deepseek-v3", dict(nodes=64, cluster="dgx-h100", max_nodes=4), None),
    # Mixtral's 8 experts cannot span two nodes of 8 GPUs: no node-aware dispatch to bound.
    ("mixtral-8x7b", dict(nodes=16, cluster="dgx-a100-80gb", max_nodes=2),
     "no expert-parallel degree runs what was asked (the largest: max_nodes=2 bounds the nodes a token reaches, which "
     "needs the node-aware dispatch: ep=8 must be a multiple of the node's 8 GPUs larger than it)"),
    ("mixtral-8x7b", dict(nodes=16, cluster="dgx-a100-80gb", max_nodes=2, ep=8),
     "max_nodes=2 bounds the nodes a token reaches, which needs the node-aware dispatch: ep=8"),
    ("mixtral-8x7b", dict(nodes=8, gpus_per_node=2, gpu_memory_gib=80, ep=8, capacity_factor=1.25, max_nodes=2),
     "max_nodes=2 bounds the nodes of the node-aware dispatch, which is dropless: not with capacity_factor=1.25"),
    ("mixtral-8x7b", dict(nodes=8, gpus_per_node=2, gpu_memory_gib=80, ep=8, max_nodes=5),
     "max_nodes=5 over ep=8 (4 nodes): max_nodes must be an int in [1, nodes=4] or None, got 5"),
    ("mixtral-8x7b", dict(nodes=16, cluster="dgx-a100-80gb", ep="8", max_nodes=2), "ep must be an int"),
    ("deepseek-v3", dict(nodes=16, cluster="dgx-h100", ep=32, max_nodes=2),
     "max_nodes=2 over ep=32 (4 nodes): max_nodes needs the router's expert groups to be the nodes: n_group=8"),
])
def test_dispatcher_options_are_planned_only_where_parallelize_runs_them(model, kwargs, said):
    """capacity_factor, overlap_chunks and max_nodes apply to the expert-parallel dispatcher, and
    max_nodes to the node-aware one over whole nodes with groups it can bound: a layout without
    them is never planned (ep=1 was), a fixed ep that cannot is refused by name, as parallelize
    refuses it."""
    from moe_ep.parallel.config import ParallelConfig

    if said is not None:
        with pytest.raises((ValueError, PlanError), match=re.escape(said)):
            plan(model, num_alternatives=0, **kwargs)
        return
    lay = plan(model, num_alternatives=0, **kwargs).layout
    options = {k: v for k, v in kwargs.items() if k in ("capacity_factor", "overlap_chunks", "max_nodes")}
    assert lay.ep > 1
    ParallelConfig.from_arguments(ep=lay.ep, dp_shard=lay.dp_shard, dp_replicate=lay.dp_replicate, pp=lay.pp,
                                  **({"microbatches": lay.microbatches} if lay.pp > 1 else {}), **options)
    if "max_nodes" in options:
        assert lay.ep % 8 == 0 and lay.ep > 8


@pytest.mark.parametrize("kwargs, said", [
    (dict(virtual_stages=2, pp=1), "virtual_stages=2 runs 2 stages on each rank of an interleaved pipeline: it needs "
                                   "pp > 1 and pp x 2 at most the 32 decoder layers of mixtral-8x7b, but the mesh "
                                   "degrees under the fixed choices {'pp': 1, 'virtual_stages': 2} leave pp in [1]"),
    (dict(virtual_stages=32), "virtual_stages=32 runs 32 stages on each rank of an interleaved pipeline"),
    (dict(virtual_stages=2, schedule="none"), "virtual_stages=2 sets the stages per rank of an interleaved pipeline "
                                              "schedule; schedule='none' has no pipeline"),
])
def test_virtual_stages_no_layout_can_use_are_named(kwargs, said):
    with pytest.raises((ValueError, PlanError), match=re.escape(said)):
        plan("mixtral-8x7b", nodes=2, cluster="dgx-h100", num_alternatives=0, **kwargs)


def test_the_report_and_its_json_state_the_optimizer_the_stages_per_rank_and_max_nodes():
    from moe_ep.planner.report import plan_to_dict

    bf16 = plan("mixtral-8x7b", nodes=16, cluster="dgx-h100", bf16_moments=True, pp=4, virtual_stages=4,
                num_alternatives=0)
    text = format_plan(bf16)
    assert "AdamW with two bf16 moments (moe_ep.training.AdamW): 12 bytes" in text and "two fp32 moments" not in text
    assert plan_to_dict(bf16)["stages_per_rank"] == 4
    limited = plan("deepseek-v3", nodes=64, cluster="dgx-h100", max_nodes=4, num_alternatives=0)
    assert plan_to_dict(limited)["assumptions"]["max_nodes"] == 4
