"""The planner against published runs (moe_ep.planner.anchors, moe-ep plan --anchors): every
anchor is planned on its published layout or says why not, the table keeps its columns and width,
each row cites a source, and the CLI flag prints the table and JSON."""

import dataclasses
import json
from pathlib import Path

import pytest

from moe_ep.cli import main
from moe_ep.planner import MODEL_NAMES, plan
from moe_ep.planner.anchors import ANCHORS, STEP_SECONDS, TOKENS_PER_GPU, Anchor, anchor_report, plan_anchor
from moe_ep.planner.recompute import COMPILED_BLOCKS_POLICIES
from moe_ep.planner.spec import ModelSpec

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
GPU_CHECK = RESULTS / "gpu_check_nvidia-h100-80gb-hbm3_2026-11-25.json"


@pytest.fixture(scope="module")
def report():
    return anchor_report()


def test_every_anchor_is_planned_on_its_published_layout(report):
    assert len(report.rows) == len(ANCHORS) >= 4
    for row in report.rows:
        a = row.anchor
        assert a.model in MODEL_NAMES
        if row.candidate is None:  # not plannable: the row says why
            assert row.why and row.status().startswith("not planned: ")
            continue
        lay = row.candidate.layout
        assert (lay.pp, lay.dp_replicate, lay.dp_shard, lay.ep, lay.microbatch_size) == (
            a.pp, a.dp_replicate, a.dp_shard, a.ep, a.microbatch_size)
        # Open virtual stages: the planner's pick among those that split the layers evenly.
        assert lay.virtual_stages == a.virtual_stages or (
            a.virtual_stages is None and a.schedule == "interleaved-1f1b"
            and ModelSpec.resolve(a.model).num_layers % (a.pp * lay.virtual_stages) == 0)
        assert lay.world_size == a.nodes * 8 and lay.microbatches * lay.microbatch_size * lay.dp == a.global_batch
        assert a.checkpointing in (None, lay.checkpointing)
        assert row.step_s > 0 and 0 <= row.all_to_all_share < 1
        assert row.tokens_per_gpu == pytest.approx(a.global_batch_tokens / row.step_s / lay.world_size)
        assert row.status().startswith("fits" if row.candidate.fits else "does not fit")
        expected = row.tokens_per_gpu / a.published if a.unit == TOKENS_PER_GPU else a.published / row.step_s
        assert row.ratio == pytest.approx(expected)
        if row.compiled_blocks:  # an option of moe_ep's stack, with the recompute it runs with
            assert lay.checkpointing in COMPILED_BLOCKS_POLICIES and "dense blocks compiled" in row.status()
    assert any(row.compiled_blocks for row in report.rows)


def test_pipelined_anchors_are_also_planned_under_dualpipev(report):
    # moe_ep's micro-batch overlap beside each pipelined anchor's published schedule: the same
    # layout and batch on DualPipeV, in the notes and the JSON.
    from moe_ep.planner.anchors import anchors_to_dict

    rows = {row.anchor.name: row for row in report.rows}
    for row in report.rows:
        assert (row.dualpipev is not None) == (row.anchor.pp > 1)
    qwen = rows["Megatron Qwen3-235B-A22B"].dualpipev
    lay = qwen.candidate.layout
    assert (lay.schedule, lay.pp, lay.ep, lay.microbatches) == ("dualpipev", 8, 32, 64) and qwen.dualpipev is None
    # Its exchanges hide behind another micro-batch's compute: about half as exposed as under the
    # published interleaved schedule, although its split backward recomputes (and exchanges) twice.
    published = rows["Megatron Qwen3-235B-A22B"]
    assert qwen.candidate.time.all_to_all < 0.55 * published.candidate.time.all_to_all
    assert "under DualPipeV instead: " in report.format()
    entry = next(e for e in anchors_to_dict(report)["anchors"] if e["name"] == "Megatron Qwen3-235B-A22B")
    assert entry["dualpipev"]["layout"] == lay.short()


def test_a_fitting_anchor_matches_plan_with_the_same_fixed_arguments():
    # An anchor's figures are plan()'s for the same forced layout: Qwen3-30B-A3B's anchor on two
    # nodes with micro-batches of one sequence, which fits the planner's memory model.
    qwen = next(a for a in ANCHORS if a.model == "qwen3-30b-a3b")
    a = dataclasses.replace(qwen, nodes=2, dp_shard=16, ep=8, microbatch_size=1)
    row = plan_anchor(a)
    assert row.candidate.fits
    p = plan(a.model, nodes=a.nodes, cluster=a.cluster, seq_len=a.seq_len, global_batch_tokens=a.global_batch_tokens,
             pp=a.pp, dp_replicate=a.dp_replicate, dp_shard=a.dp_shard, ep=a.ep, microbatch_size=a.microbatch_size,
             checkpointing=a.checkpointing, imbalance=1.0, startup_imbalance=1.0, chunked_loss=row.chunked_loss,
             overlap_chunks=row.overlap_chunks, bf16_moments=a.bf16_moments, compiled_blocks=row.compiled_blocks,
             num_alternatives=0)
    assert p.layout == row.candidate.layout
    assert p.best.time.total == pytest.approx(row.step_s)
    assert p.best.memory.total == pytest.approx(row.candidate.memory.total)


def test_report_columns_width_and_sources(report):
    text = report.format()
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("#  anchor"))
    for column in ("anchor", "GPUs", "layout", "tok/s/GPU", "step s", "GiB/GPU", "fits", "a2a", "published", "ratio"):
        assert column in header
    assert max(map(len, lines)) <= 120
    assert "planned (estimated, not measured) with" in text
    sources = text[text.index("notes and sources"):]
    for i, a in enumerate(ANCHORS, 1):
        assert f"[{i}] {a.name}:" in sources
        assert a.source and ("https://" in a.source or "source not confirmed here" in a.source)
    assert sources.count("\n    source: ") == len(ANCHORS)


def test_anchor_definitions_are_checked():
    a = ANCHORS[1]
    with pytest.raises(ValueError, match="model must be one of"):
        dataclasses.replace(a, model="llama")
    with pytest.raises(ValueError, match="unit must be one of"):
        dataclasses.replace(a, unit="TFLOP/s")
    with pytest.raises(ValueError, match="source must say"):
        dataclasses.replace(a, source="")
    with pytest.raises(ValueError, match="global_batch=500 is not a whole number of micro-batches"):
        dataclasses.replace(a, global_batch=500)
    with pytest.raises(ValueError, match=r"pp x dp_replicate x dp_shard must be the world of 16 GPUs"):
        dataclasses.replace(a, nodes=2)
    with pytest.raises(ValueError, match="anchors must share one cluster preset"):
        anchor_report(anchors=(a, dataclasses.replace(a, cluster="p5")))
    assert {x.unit for x in ANCHORS} <= {TOKENS_PER_GPU, STEP_SECONDS}


def test_an_unplannable_layout_says_why_instead_of_failing():
    # Interleaved 1F1B needs a multiple of pp micro-batches: 6 on pp=4 is refused on the row.
    a = dataclasses.replace(ANCHORS[0], global_batch=96)
    row = plan_anchor(a)
    assert row.candidate is None and "interleaved-1f1b" in row.why
    assert row.status().startswith("not planned: ")


def test_calibration_from_the_committed_gpu_check(report):
    calibrated = anchor_report(GPU_CHECK, anchors=ANCHORS[1:2])
    eff = calibrated.cluster.efficiencies
    assert "measured: gpu_check_nvidia-h100-80gb-hbm3_2026-11-25.json" in eff.source("grouped_gemm")
    assert eff.grouped_gemm != report.cluster.efficiencies.grouped_gemm
    assert GPU_CHECK.name in calibrated.format()


def test_cli_anchors_table_and_json(capsys):
    assert main(["plan", "--anchors"]) == 0
    out = capsys.readouterr().out
    assert "moe-ep plan --anchors" in out and all(a.name in out for a in ANCHORS)
    assert main(["plan", "--anchors", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["estimated"] is True and len(payload["anchors"]) == len(ANCHORS)
    assert all(row["published"]["source"] for row in payload["anchors"])


def test_cli_anchors_refuses_other_flags_and_plan_still_needs_model(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--anchors", "--nodes", "2"])
    assert "--anchors plans the published layouts and takes only --calibration and --json, got --nodes" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):  # a flag given its default value is given all the same
        main(["plan", "--anchors", "--seq-len", "4096"])
    assert "takes only --calibration and --json, got --seq-len" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--cluster", "dgx-h100"])
    assert "moe-ep plan: error: --model and --nodes are required (or give --anchors)" in capsys.readouterr().err


def test_anchor_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ANCHORS[0].nodes = 1  # type: ignore[misc]
    assert isinstance(ANCHORS[0], Anchor)


@pytest.mark.parametrize("name, total, active", [
    ("qwen3-30b-a3b", 30.5e9, 3.3e9), ("qwen3-235b-a22b", 235e9, 22e9), ("deepseek-v3", 671e9, 37e9),
])
def test_the_anchor_models_have_their_published_sizes(name, total, active):
    # The sizes the model cards state (DeepSeek-V3: 671 B without its multi-token-prediction module).
    from moe_ep.planner import ModelSpec

    spec = ModelSpec.resolve(name)
    assert spec.total_params == pytest.approx(total, rel=0.01)
    assert spec.active_params == pytest.approx(active, rel=0.03)


def test_each_row_says_what_the_experts_would_have_to_reach(report):
    """The experts' efficiency that plans the published figure, the rest as planned: replanned at
    it the row reaches the published figure, a little below it does not; where not even the whole
    peak gets there, the row says so."""
    from moe_ep.planner.anchors import AnchorReport, AnchorRow, _units, anchors_to_dict, evaluate, plan_anchor
    from moe_ep.planner.search import Assumptions
    from moe_ep.planner.spec import ModelSpec

    def ratio_at(row, efficiency):
        a = row.anchor
        imbalance = dict(imbalance=1.0, startup_imbalance=1.0) if a.balanced_routing else {}
        assumptions = Assumptions(**imbalance, chunked_loss=row.chunked_loss, overlap_chunks=row.overlap_chunks,
                                  bf16_moments=a.bf16_moments, compiled_blocks=row.compiled_blocks)
        cluster = dataclasses.replace(report.cluster, efficiencies=dataclasses.replace(
            report.cluster.efficiencies, grouped_gemm=efficiency))
        spec, layout = ModelSpec.resolve(a.model), row.candidate.layout
        candidate = evaluate(spec, cluster, layout, a.seq_len, assumptions,
                             _units(spec, layout, a.seq_len, assumptions, cluster))
        return AnchorRow(a, candidate).ratio

    text, payload = report.format(), anchors_to_dict(report)
    assert any(row.experts_efficiency_to_match is not None for row in report.rows)
    for row, entry in zip(report.rows, payload["anchors"]):
        needed = row.experts_efficiency_to_match
        assert entry["experts_efficiency_to_match"] == needed
        assert entry["experts_efficiency"] == row.experts_efficiency == report.cluster.efficiencies.grouped_gemm
        if needed is None:
            assert ratio_at(row, 1.0) < 1
            continue
        assert ratio_at(row, needed) >= 1 > ratio_at(row, needed - 2e-3)
        assert f"the experts' grouped GEMMs at {needed * report.cluster.peak_tflops:,.0f} TFLOP/s" in text
    # A published figure beyond what even the whole peak plans: the row says so.
    beyond = plan_anchor(dataclasses.replace(ANCHORS[1], published=ANCHORS[1].published * 10))
    assert beyond.experts_efficiency_to_match is None and ratio_at(beyond, 1.0) < 1
    assert "to match the published figure: not by the experts alone" in AnchorReport(
        (beyond,), report.cluster, None).format()


def test_a_gate_of_several_problems_plans_each_row_at_its_nearest(tmp_path):
    """A gate that timed several expert problems (the H200's of 2026-11-28, its device renamed so
    that an H100 cluster takes it): each anchor's experts run at the problem nearest its model's,
    which its notes and the JSON say, and the header says so."""
    from moe_ep.planner.anchors import anchors_to_dict

    gate = json.loads((RESULTS / "gpu_check_nvidia-h200_2026-11-28.json").read_text())
    kernels = gate["meta"]["results"]["kernels"]
    for meta in kernels["meta"].values():
        meta["device"] = "NVIDIA H100 80GB HBM3"
    for r in kernels["rows"]:
        if r.get("kind") == "copy":
            r["gbps"] = 2834.6  # the H100's: the H200's is beyond the H100's HBM peak
    path = tmp_path / "gate.json"
    path.write_text(json.dumps(gate))
    report = anchor_report(path)
    rates = {row.anchor.model: row.experts_efficiency for row in report.rows}
    measured = {problem: next(r["tflops"] for r in kernels["rows"] if r.get("problem") == problem
                              and r.get("variant") == "moe_ep[triton]" and r.get("phase") == "fwd+bwd"
                              and r.get("routing") == "uniform") / 989
                for problem in kernels["meta"]}
    assert rates == pytest.approx({"mixtral-8x7b": measured["mixtral-8x7b"], "qwen3-30b-a3b": measured["qwen3-30b-a3b"],
                                   "deepseek-v3": measured["deepseek-v3-ep8"],
                                   "qwen3-235b-a22b": measured["deepseek-v3-ep8"]})
    text = report.format()
    assert "the experts of each row at the measured problem nearest its model's" in text
    assert f"planned here at {measured['qwen3-30b-a3b'] * 989:,.0f})" in text
    assert [a["experts_efficiency"] for a in anchors_to_dict(report)["anchors"]] == [
        row.experts_efficiency for row in report.rows]
