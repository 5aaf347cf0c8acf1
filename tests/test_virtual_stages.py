"""Interleaved 1F1B with any number of stages per rank (Megatron-Core's virtual pipeline size):
the schedule table, the planner's layouts and search, the CLI, and the pipeline configuration
parallelize builds from it, with their refusals. The 2-rank run with 4 virtual stages against one
process is in test_pipeline.py (``mixtral_interleaved_4_virtual_stages``)."""

from __future__ import annotations

import re

import pytest

from moe_ep.planner import Layout, plan, schedule_info
from moe_ep.planner.schedules import INTERLEAVED_SCHEDULES


def test_schedule_info_takes_any_virtual_stage_count_for_interleaved_1f1b_only():
    info = schedule_info("interleaved-1f1b", 8)
    assert info.stages_per_rank == 8 and info.description == "1F1B over 8 chunks per rank"
    assert schedule_info("interleaved-1f1b").stages_per_rank == 2
    assert info.bubble(4) == pytest.approx(3 / 8)  # (pp - 1) / V micro-batch times
    # Megatron's warm-up: rank r's first backward comes after 2 (pp - r - 1) + (V - 1) pp + 1
    # chunk forwards, spread over its V stages.
    assert info.inflight(4, 64)[0] == pytest.approx((2 * 3 + 7 * 4 + 1) / 8)
    with pytest.raises(ValueError, match=r"virtual_stages applies to schedules 'interleaved-1f1b' and 'interleaved-1f1b-overlap' only; '1f1b' runs "
                                         r"1 stage\(s\) per rank, got virtual_stages=4"):
        schedule_info("1f1b", 4)
    for bad in (1, True, 2.0):
        with pytest.raises(ValueError, match=r"virtual_stages must be an int >= 2 \(stages per pipeline rank\)"):
            schedule_info("interleaved-1f1b", bad)


def test_a_layout_with_virtual_stages():
    lay = Layout(4, 1, 16, 8, 1, 64, "interleaved-1f1b", False, 8)
    assert lay.num_stages == 32 and lay.stages_per_rank == 8 and lay.bubble() == pytest.approx(3 / 8)
    assert lay.short().endswith("interleaved-1f1b v=8")
    assert Layout(4, 1, 16, 8, 1, 64, "interleaved-1f1b", False).stages_per_rank == 2
    with pytest.raises(ValueError, match="virtual_stages=4 needs pipeline stages"):
        Layout(1, 1, 16, 8, 1, 64, "none", False, 4)
    with pytest.raises(ValueError, match="virtual_stages applies to schedules 'interleaved-1f1b' and 'interleaved-1f1b-overlap' only"):
        Layout(4, 1, 16, 8, 1, 64, "zbv", False, 4)


def test_the_search_tries_every_virtual_stage_count_that_splits_the_layers():
    from moe_ep.planner.search import _virtual_stages
    from moe_ep.planner.spec import ModelSpec

    spec = ModelSpec.resolve("mixtral-8x7b")  # 32 decoder layers
    free = dict(virtual_stages=None)
    assert _virtual_stages(spec, 4, "interleaved-1f1b", free) == [None, 4, 8]
    assert _virtual_stages(spec, 2, "interleaved-1f1b", free) == [None, 4, 8, 16]
    assert _virtual_stages(spec, 4, "1f1b", free) == [None]
    assert _virtual_stages(spec, 4, "interleaved-1f1b", dict(virtual_stages=3)) == [3]
    assert _virtual_stages(spec, 4, "interleaved-1f1b", dict(virtual_stages=16)) == []  # 64 stages > 32 layers


def test_plan_with_fixed_virtual_stages_and_forced_balanced_routing():
    common = dict(nodes=8, cluster="dgx-h100", pp=4, ep=8, imbalance=1.0, startup_imbalance=1.0)
    deep = plan("mixtral-8x7b", virtual_stages=8, **common)
    shallow = plan("mixtral-8x7b", virtual_stages=None, schedule="interleaved-1f1b", checkpointing=False,
                   microbatch_size=deep.layout.microbatch_size, **common)
    # Fixed virtual stages leave the two forms of interleaved 1F1B.
    assert deep.layout.schedule in INTERLEAVED_SCHEDULES and deep.layout.virtual_stages == 8
    assert deep.layout.bubble() < shallow.layout.bubble()
    with pytest.raises(ValueError, match="virtual_stages applies to schedules 'interleaved-1f1b' and 'interleaved-1f1b-overlap' only; 'zbv'"):
        plan("mixtral-8x7b", virtual_stages=4, schedule="zbv", **common)


def test_the_cli_fixes_virtual_stages_and_balances_routing(capsys):
    from moe_ep.cli import main

    main(["plan", "--model", "mixtral-8x7b", "--cluster", "dgx-h100", "--nodes", "8", "--pp", "4", "--ep", "8",
          "--virtual-stages", "8", "--balanced-routing"])
    out = capsys.readouterr().out
    assert re.search(r"interleaved-1f1b(-overlap)? \(1F1B over 8 chunks per rank", out)
    assert "start-up imbalance of 1x the mean load" in out
    with pytest.raises(SystemExit):
        main(["plan", "--model", "mixtral-8x7b", "--cluster", "dgx-h100", "--nodes", "8", "--balanced-routing",
              "--imbalance", "1.2"])
    assert "--balanced-routing sets --imbalance and --startup-imbalance to 1: give either" in capsys.readouterr().err


def test_the_pipeline_configuration_takes_virtual_stages():
    from moe_ep.parallel import ParallelConfig, PipelineConfig

    pipeline = PipelineConfig(microbatches=4, schedule="interleaved-1f1b", virtual_stages=4)
    assert pipeline.num_stages(2) == 8
    pipeline.check(2, 8)
    with pytest.raises(ValueError, match=r"8 stages \(2 ranks x 4 for 'interleaved-1f1b'\) need at least as many "
                                         r"decoder layers, the model has 4"):
        pipeline.check(2, 4)
    with pytest.raises(ValueError, match="virtual_stages applies to schedules 'interleaved-1f1b' and 'interleaved-1f1b-overlap' only"):
        PipelineConfig(microbatches=4, schedule="1f1b", virtual_stages=4)
    with pytest.raises(ValueError, match=r"virtual_stages=4 describes pipeline stages and needs pp > 1, got pp=1"):
        ParallelConfig.from_arguments(ep=1, virtual_stages=4)
    config = ParallelConfig.from_arguments(pp=2, microbatches=4, schedule="interleaved-1f1b", virtual_stages=4)
    assert config.pipeline.virtual_stages == 4 and config.arguments()["virtual_stages"] == 4
