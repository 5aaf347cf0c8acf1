"""The 4-process cases of test_hf_loops.py and test_transformers_ep.py, in one module.

transformers' Trainer and a hand-written accelerate loop (the examples, launched by ``accelerate
launch`` on 4 gloo processes) with ep=2 and dp_shard=2 (HSDP: two replicas of a 2-rank FSDP group
whose experts are split over its 2 ranks): per-step losses and gradient norms of 6 steps with
gradient accumulation and the load-balancing loss equal, in float32 to 1e-5, those of the same
script without expert parallelism on the same 4 processes and of one process accumulating the same
per-rank batches; the saved models give the baseline's logits under plain transformers.

transformers' ``test_fsdp2_expert_parallel_bf16_grads`` case ``experts_sharded`` (FSDP over 4
ranks, experts split over 2 and FSDP-sharded over the other 2) with moe_ep's experts, for
``ep_implementation`` "auto" and "moe_ep", against one float64 process; and the same over fsdp 2 x
tp 2 (expert parallelism over the tensor-parallel pairs, which share a batch). Skipped, saying so,
where transformers has no expert-parallel registry (5.17)."""

from __future__ import annotations

import pytest

from dist_utils import run_ranks
from hf_loops import SCRIPTS, check_against_baseline_and_one_process, world_fixture
from transformers_ep_cases import case_params, check_case, save_tiny_checkpoints, transformers_ep_vs_one_process

# Launches 4 processes: not in the quick subset (bash scripts/test.sh --quick).
pytestmark = pytest.mark.slow

PROCESSES = 4
LAYOUT = ("--ep", "2", "--dp-replicate", "2")


runs = world_fixture(PROCESSES, LAYOUT, resume=False, bf16=False)


@pytest.mark.parametrize("script", SCRIPTS)
def test_expert_parallel_with_hsdp_matches_data_parallel_and_one_process(runs, script):
    check_against_baseline_and_one_process(runs, script, PROCESSES)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    checkpoints = save_tiny_checkpoints(tmp_path_factory.mktemp("tiny_moe"))
    return run_ranks(transformers_ep_vs_one_process, 4, checkpoints, timeout=300)


@pytest.mark.parametrize("case", case_params(PROCESSES))
def test_transformers_expert_parallel_with_sharded_experts_matches_one_process(world4, case):
    check_case(world4, case)
