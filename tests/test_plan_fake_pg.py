"""Proof of the plan at world size 128: full-size Mixtral-8x7B laid out as the planner chose for
16 DGX A100 80 GB nodes (and two pipelined layouts, 1F1B and ZB-V) on torch's fake process group,
one rank at a time in this process; what each rank then holds and every collective it issues must
match the planner's figures: parameter shards, the gradients FSDP2 reduce-scatters to it after a
forward and backward, AdamW's state after a step (within 2%), and the bytes of its all-gathers,
reduce-scatters, all-reduces, all-to-alls and pipeline sends over one step (within 2%).

The layout is applied by moe_ep.parallel.parallelize
to the model built on the meta device, with the mixed precision the planner assumes; the shards
are materialised as fake tensors (FakeTensorMode: shapes, dtypes and devices, no storage), so the
training step runs at full size in seconds and no memory. The harness is moe_ep.bench.planner
(``python -m moe_ep.bench planner`` prints the same figures); what it cannot run as is, it says:
the experts' forward is a stand-in of the same parameters (their dropless dispatch sizes the
exchange from token counts, which fake tensors do not hold), so the expert all-to-all is measured
apart through moe_ep's own dispatcher at full shape (:func:`test_dispatcher_all_to_all_bytes`);
and a pipeline's stages run on their own, their sends read off each stage's output and input
gradient. Without pipeline stages every micro-batch issues the same FSDP collectives (checked on
a small model), so one micro-batch is run and a step is that times the micro-batches.

Which ranks: of each pipeline rank's group of ranks, the first and the last; together they bound
all 128. A rank ``((p x dp_replicate) + r) x dp_shard + i`` (ep innermost, i = edp index x ep +
ep index, as moe_ep.parallel.mesh builds it) holds the modules of pipeline rank p, and of each of
their parameters one shard: FSDP2 takes its shard as piece number i (dense, over dp_shard) or
i // ep (experts, over edp, after an equal E / ep slice per ep rank) of ``torch.chunk`` along the
shard dimension, and those pieces never grow with their number. The replica index r changes no
shape. So within a pipeline rank the bytes of parameters, gradients and AdamW state never
increase with i: the first rank of the group holds the most, the last the least, and each rank
between them lies between."""

from __future__ import annotations

import pytest
import torch

from moe_ep.bench.planner import (
    CollectiveRecorder, dispatcher_checks, fake_step_checks, fake_train_step, held_bytes,
)
from moe_ep.bench.planner import fake_rank as _fake_rank
from moe_ep.planner import Layout, plan

# Lays out full-size Mixtral-8x7B rank by rank (minutes on 2 cores): not in the quick subset
# (bash scripts/test.sh --quick).
pytestmark = pytest.mark.slow

WORLD = 128
CLUSTER = dict(nodes=16, cluster="dgx-a100-80gb")
HELD_TOLERANCE = 0.02
MODELLED_KINDS = {"all-gather", "reduce-scatter", "all-reduce", "all-to-all"}


def fake_rank(rank: int, world_size: int = WORLD):
    return _fake_rank(rank, world_size)


def _bounding_ranks(pp: int) -> list[int]:
    """The first and the last rank of every pipeline rank's group (see the module docstring)."""
    group = WORLD // pp
    return sorted({rank for p in range(pp) for rank in (p * group, (p + 1) * group - 1)})


def _check(best):
    lay = best.layout
    ranks = _bounding_ranks(lay.pp)
    steps, checks = fake_step_checks(best, ranks, world_size=WORLD, collectives_on=(ranks[0], ranks[-1]))
    for rank, step in steps:
        assert step.pp_rank == rank // (WORLD // lay.pp)
        assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in step.params)
        unknown = {kind for kind, _ in step.collectives.calls} - MODELLED_KINDS
        assert not unknown, f"rank {rank} issued collectives the planner does not model: {unknown}"
        table = best.memory_per_rank[step.pp_rank]
        for name, got, want in zip(("parameters", "gradients", "optimizer state"), held_bytes(step),
                                   (table.params, table.grads, table.optim)):
            assert abs(got - want) <= HELD_TOLERANCE * want, (
                f"rank {rank} ({lay.short()}): {name} {got / 2**30:.3f} GiB held, planner says {want / 2**30:.3f} GiB"
            )
    assert {c.check.split(" over")[0] for c in checks} >= {"all-gather", "reduce-scatter"}
    for c in checks:
        assert c.ok, f"{c.case}: {c.check}: measured {c.measured / 2**30:.3f} GiB, planner {c.modelled / 2**30:.3f} GiB"
    return checks


@pytest.fixture(scope="module")
def chosen():
    # The planner's choice for the cluster, searched without pipeline stages (its choice has none,
    # and the layouts with them are proved below): a tenth of the whole search's time.
    best = plan("mixtral-8x7b", pp=1, **CLUSTER).best
    assert best.fits
    return best


def test_chosen_plan_for_mixtral_on_128_a100_matches_bytes_held_and_collectives(chosen):
    _check(chosen)


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_pipelined_plan_matches_bytes_held_and_collectives_on_every_stage(schedule):
    best = plan("mixtral-8x7b", pp=4, schedule=schedule, ep=8, dp_shard=32, checkpointing=True, **CLUSTER).best
    assert best.layout.pp == 4
    checks = _check(best)
    assert any(c.check.startswith("pipeline send") for c in checks)


def test_dispatcher_all_to_all_bytes(chosen):
    # The chosen layout (none when its experts are local), and ep=4 under each recompute policy:
    # rows carrying two experts (with their routing columns) and, under "full" and "selective",
    # the recompute's second forward ("attention" never runs the dispatcher again).
    for layout in (chosen.layout, *(Layout(1, 1, 128, 4, 1, 8, "none", policy)
                                    for policy in ("full", "selective", "attention"))):
        for c in dispatcher_checks(layout, world_size=WORLD):
            assert c.ok, f"{c.case}: measured {c.measured / 2**30:.3f} GiB, planner {c.modelled / 2**30:.3f} GiB"


def test_fsdp_collectives_repeat_every_microbatch():
    # Without pipeline stages FSDP2 gathers and reduces every micro-batch alike, so a step's
    # collectives are one micro-batch's times the micro-batches (what the checks above assume).
    from hf_models import tiny_config
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers import AutoModelForCausalLM

    from moe_ep.hf import patch
    from moe_ep.parallel import parallelize

    recorded = []
    for microbatches in (1, 3):
        with fake_rank(0, 8):
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(tiny_config("mixtral", num_hidden_layers=3))
            patch(model, fused_router=False)
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            parallelize(model, ep=2, dp_shard=8, mixed_precision=policy)
            step = fake_train_step([model], microbatches=microbatches, tokens=4, hidden_size=32)
        recorded.append(step.collectives)
    one, three = recorded
    assert one.bytes and {k: 3 * v for k, v in one.bytes.items()} == three.bytes
    assert {k: 3 * v for k, v in one.calls.items()} == three.calls


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch 2.13 renames the tensor collectives
def test_recorder_counts_what_each_collective_moves():
    # The recorder's conventions, on the fake group: an all-gather's output, a reduce-scatter's
    # input, an all-reduce's tensor, and what an all-to-all sends to the other ranks.
    import torch.distributed as dist

    with fake_rank(1, 4):
        with CollectiveRecorder(mirror=True) as rec:
            shard = torch.ones(3)
            dist.all_gather_into_tensor(torch.empty(12), shard)
            dist.reduce_scatter_tensor(torch.empty(3), torch.ones(12))
            dist.all_reduce(torch.ones(5))
            out, rows = torch.empty(10, 2), torch.arange(20.0).view(10, 2)
            dist.all_to_all_single(out, rows, output_split_sizes=[1, 2, 3, 4], input_split_sizes=[1, 2, 3, 4])
    assert rec.bytes == {("all-gather", 4): 48, ("reduce-scatter", 4): 48, ("all-reduce", 4): 20,
                         ("all-to-all", 4): 8 * 8}  # rank 1 keeps its own 2 rows of 10
    assert torch.equal(out, rows)  # mirrored: every rank receives what it sends
