"""``python -m moe_ep.bench attention``: causal SDPA forward and backward at the anchors' attention
shapes, on SDPA's own backend and each backend alone; its FLOP count is the planner's; and the
planner's calibration takes the gate's attention rate at the measured model nearest the planned
one (the default without that step)."""

import argparse
import json

import pytest
import torch

from moe_ep.bench import attention
from moe_ep.planner import plan
from moe_ep.planner.calibration import nearest_attention
from moe_ep.planner.compute import ATTENTION_PASSES
from moe_ep.planner.spec import ModelSpec, config_from_name


def _args(**changes):
    base = dict(models=["qwen3-30b-a3b", "deepseek-v3"], backends=list(attention.BACKENDS), dtype=None, seed=0,
                warmup=0, reps=1)
    return argparse.Namespace(**{**base, **changes})


def test_the_cpu_run_times_the_default_and_names_what_is_unavailable():
    report = attention.run(_args(), torch.device("cpu"))
    rows = {(r["model"], r["variant"]): r for r in report.rows}
    assert len(rows) == 2 * len(attention.BACKENDS)
    seq_len, sequences = attention.SIZES["cpu"]
    for model in ("qwen3-30b-a3b", "deepseek-v3"):
        default = rows[model, "sdpa[default]"]
        assert default["status"] == "ok" and default["vs_default"] == 1.0
        shape = attention.AttentionShape(default["heads"], default["kv_heads"], default["qk_dim"], default["v_dim"])
        flops = attention.FWD_BWD_PASSES * shape.forward_flops(seq_len, sequences)
        assert default["tflops"] == pytest.approx(flops / (default["ms"] / 1e3) / 1e12)
        assert rows[model, "sdpa[math]"]["status"] == "ok"
        # No CUDA here: cuDNN's kernel cannot take CPU tensors, and SDPA says so.
        assert rows[model, "sdpa[cudnn]"]["status"].startswith("unavailable: ")
    assert rows["deepseek-v3", "sdpa[default]"]["qk_dim"] == 192 and rows["deepseek-v3", "sdpa[default]"]["v_dim"] == 128
    assert sum(n.startswith("qwen3-30b-a3b: SDPA's own choice") for n in report.notes) == 1


def test_its_flop_count_is_the_planners():
    assert attention.FWD_BWD_PASSES == ATTENTION_PASSES
    for name in attention.MODELS:
        spec = ModelSpec.from_config(config_from_name(name), name)
        shape = attention.AttentionShape.of(spec)
        assert shape.forward_flops(4096, 3) == pytest.approx(spec.attention_flops(4096) * 4096 * 3)


def test_the_default_is_what_transformers_sdpa_computes():
    """GQA through enable_gqa, causal: the same output as the math kernel on repeated heads."""
    shape = attention.AttentionShape(heads=4, kv_heads=2, qk_dim=8, v_dim=8)
    q, k, v, _ = attention._inputs(shape, 16, 2, torch.float64, torch.device("cpu"), seed=0)
    y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    repeat = shape.heads // shape.kv_heads
    y_ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1), is_causal=True)
    torch.testing.assert_close(y, y_ref)


def _gate(tmp_path, rows: list[dict]) -> str:
    """The committed H100 gate with an attention step of ``rows`` added."""
    payload = json.loads(open("benchmarks/results/gpu_check_nvidia-h100-80gb-hbm3_2026-11-25.json").read())
    payload["meta"]["results"]["attention"] = {"rows": rows, "parts": {"sdpa": "done"}, "meta": {}, "notes": []}
    path = tmp_path / "gpu_check_h100_attention.json"
    path.write_text(json.dumps(payload))
    return str(path)


def _row(model: str, tflops: float, variant: str = "sdpa[default]", status: str = "ok") -> dict:
    spec = ModelSpec.from_config(config_from_name(model), model)
    shape = attention.AttentionShape.of(spec)
    return dict(model=model, kind="attention", variant=variant, phase="fwd+bwd", tokens=16384, heads=shape.heads,
                kv_heads=shape.kv_heads, qk_dim=shape.qk_dim, v_dim=shape.v_dim, tflops=tflops, status=status)


def test_the_planner_takes_the_attention_rate_of_the_nearest_measured_model(tmp_path):
    gate = _gate(tmp_path, [_row("mixtral-8x7b", 420.0), _row("deepseek-v3", 380.0),
                            _row("mixtral-8x7b", 600.0, variant="sdpa[cudnn]"),
                            _row("qwen3-235b-a22b", 700.0, status="unavailable: no kernel")])
    kwargs = dict(cluster="dgx-h100", nodes=32, calibration=gate, checkpointing="full")
    # The layout fixed (a search of seconds per model otherwise): the calibration is read before
    # the search, whose size does not change it.
    fixed = dict(pp=1, ep=64, microbatch_size=1)
    for model, measured, tflops in (("qwen3-30b-a3b", "mixtral-8x7b", 420.0), ("qwen3-235b-a22b", "mixtral-8x7b", 420.0),
                                    ("deepseek-v3", "deepseek-v3", 380.0)):
        eff = plan(model, **kwargs, **fixed).cluster.efficiencies
        assert eff.attention == pytest.approx(tflops / 989)
        assert eff.source("attention").startswith(
            f"measured: gpu_check_h100_attention.json, NVIDIA H100 80GB HBM3, sdpa[default] fwd+bwd of {measured}'s "
            f"attention at 16384 tokens: {tflops:.1f} TFLOP/s of 989")
    without = plan("qwen3-30b-a3b", cluster="dgx-h100", nodes=32, checkpointing="full", **fixed,
                   calibration="benchmarks/results/gpu_check_nvidia-h100-80gb-hbm3_2026-11-25.json")
    assert without.cluster.efficiencies.attention == pytest.approx(0.35)
    assert "not measured in gpu_check_nvidia-h100-80gb-hbm3_2026-11-25.json" in without.cluster.efficiencies.source(
        "attention")


def test_nearest_attention():
    rows = [_row("mixtral-8x7b", 1.0), _row("deepseek-v3", 2.0)]
    assert nearest_attention(rows, None) is rows[0]
    assert nearest_attention(rows, (128, 192, 128)) is rows[1]
    assert nearest_attention(rows, (16, 64, 64)) is rows[0]
    assert nearest_attention([], (1, 1, 1)) is None
