"""Proof of the plan: full-size Mixtral-8x7B on the meta device, laid out as the planner chose for
16 nodes of 8 A100-80GB on torch's fake process group at world size 128, one rank at a time in
this process; the bytes each rank then holds (parameter shards, the gradients FSDP2 gives them,
AdamW's state after a real optimizer step) must match the planner's figures within 2%.

The layout is applied by moe_ep.parallel.parallelize (pp = 1) or parallelize_pipeline (pp > 1),
with the mixed precision the planner assumes (bf16 compute, fp32 master weights and reduction).
Besides the chosen layout, a pipelined one (pp=4, 1F1B) is checked stage by stage."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

WORLD = 128
CLUSTER = dict(nodes=16, gpus_per_node=8, gpu_memory_gib=80)
TOLERANCE = 0.02


@contextlib.contextmanager
def fake_rank(rank: int):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def _apply_plan(best):
    """The meta model with ``best``'s layout applied on this rank: (parameters, pipeline rank)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers import MixtralForCausalLM

    from moe_ep.hf import patch
    from moe_ep.parallel import parallelize
    from moe_ep.parallel.pipeline import parallelize_pipeline
    from moe_ep.planner import config_from_name

    lay = best.layout
    with torch.device("meta"):
        model = MixtralForCausalLM(config_from_name("mixtral-8x7b"))
    patch(model, fused_router=False)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    common = dict(ep=lay.ep, dp_replicate=lay.dp_replicate, dp_shard=lay.dp_shard, mixed_precision=policy,
                  activation_checkpointing=lay.checkpointing)
    if lay.pp == 1:
        parallelize(model, **common)
        return list(model.parameters()), 0
    stages = parallelize_pipeline(model, pp=lay.pp, schedule=lay.schedule, microbatches=lay.microbatches,
                                  split_points=best.split_points, **common)
    return list(stages.parameters()), stages.pp_rank


def _held_bytes(params):
    """(parameters, gradients, optimizer state) bytes this rank holds."""
    for p in params:
        p.grad = torch.zeros_like(p)  # what FSDP2's reduce-scatter leaves: a shard like the parameter
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    optimizer.step()  # creates exp_avg and exp_avg_sq the way training does (meta: no data)
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return (sum(_local_bytes(p) for p in params), sum(_local_bytes(p.grad) for p in params),
            sum(_local_bytes(v) for v in state))


def _check_ranks(best, ranks):
    lay = best.layout
    for rank in ranks:
        with fake_rank(rank):
            params, pp_rank = _apply_plan(best)
            assert pp_rank == rank // (WORLD // lay.pp)
            assert all(p.dtype == torch.float32 for p in params)
            held = _held_bytes(params)
        table = best.memory_per_rank[pp_rank]
        for name, got, want in zip(("parameters", "gradients", "optimizer state"), held,
                                   (table.params, table.grads, table.optim)):
            assert abs(got - want) <= TOLERANCE * want, (
                f"rank {rank} ({lay.short()}): {name} {got / 2**30:.3f} GiB held, planner says {want / 2**30:.3f} GiB"
            )


def test_chosen_plan_for_mixtral_on_128_a100_matches_bytes_held():
    from moe_ep.planner import plan

    best = plan("mixtral-8x7b", **CLUSTER).best
    assert best.fits
    # The first and the last rank, and the first rank of every pipeline stage.
    ranks = sorted({0, WORLD - 1, *(s * WORLD // best.layout.pp for s in range(best.layout.pp))})
    _check_ranks(best, ranks)


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_pipelined_plan_matches_bytes_held_on_every_stage(schedule):
    from moe_ep.planner import plan

    best = plan("mixtral-8x7b", pp=4, schedule=schedule, ep=8, dp_shard=32, checkpointing=True, **CLUSTER).best
    assert best.layout.pp == 4
    _check_ranks(best, [0, 32, 64, 96, 127])
