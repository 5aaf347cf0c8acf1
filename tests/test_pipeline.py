"""Pipeline stages and the one training-step API on gloo, against ONE process training the same
tiny Mixtral (hidden 32, 4 layers, 4 experts) on the whole batch in float64 with transformers'
own eager experts and its own loss (an independent implementation).

The parallel runs are fp32 through moe_ep's experts implementation; five AdamW steps; every
step's loss must agree within 1e-5. The batch holds ignored labels (-100) spread unevenly over
the micro-batches, so a loss normalised per micro-batch instead of per step would show.

- 2 ranks, pp=2 alone: GPipe, 1F1B, interleaved 1F1B and ZB-V, one process group.
- 4 ranks, through ``moe_ep.parallelize(pp=2, ...)``: pp=2 x ep=2 and pp=2 x dp_shard=2 (FSDP2)
  under GPipe, 1F1B, interleaved 1F1B and ZB-V; pp=2 x dp_replicate=2 (HSDP); pp=2 x ep=2 with
  activation checkpointing and the aux loss, and with dynamic loss scaling; one process group.
  Also a batch whose data-parallel shards hold very different numbers of targets, with and
  without pipeline stages (the same loop): the loss is the global token mean.
- 1 process: TrainStep with gradient accumulation and no stages; loss scaling.

With ``aux_loss_coef`` the objective adds the per-layer load-balancing loss, averaged over
layers and micro-batches; the reference computes it by hand from transformers' router logits.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from conftest import TOLERANCE, rel_err
from dist_utils import run_ranks

TOL = TOLERANCE[torch.float32]
STEPS = 5
LR = 1e-3  # AdamW turns fp32 noise in near-zero gradients into full steps at larger rates
BATCH, SEQ, MICRO = 8, 6, 4
TINY = dict(num_hidden_layers=4, num_local_experts=4, intermediate_size=24)


def _model(dtype, experts_implementation):
    from hf_models import tiny_model
    from moe_ep.hf import register

    register()
    return tiny_model("mixtral", dtype=dtype, experts_implementation=experts_implementation, **TINY).train()


def _batch():
    from hf_models import tiny_batch, tiny_config

    batch = tiny_batch(tiny_config("mixtral", **TINY), batch=BATCH, seq=SEQ, seed=1)
    labels = batch["labels"]
    # Ignored targets per pair of rows (one micro-batch of 4): 3, 1, 3, 1. The two halves (the
    # data-parallel shards below) hold 4 each, so the mean of their means is the batch mean.
    labels[0, 2:5] = -100
    labels[4, 1:4] = -100
    labels[2, 3] = -100
    labels[6, 4] = -100
    return batch


def _unbalanced_batch():
    """``_batch`` with ignored targets piled on the first rows: of the 5 targets of each row, the
    data-parallel halves keep 10 and 16, the quarters 2, 8, 7 and 9. A loss normalised by each
    rank's own tokens would then differ from the global mean."""
    batch = _batch()
    batch["labels"][1, 1:] = -100
    batch["labels"][3, 5] = -100
    return batch


def _aux_by_hand(logits_TE, top_k):
    """One layer's load-balancing loss: E * sum_e (routed pairs of e per token) * (mean prob of e)."""
    probs = logits_TE.softmax(-1)
    chosen = torch.nn.functional.one_hot(probs.topk(top_k, dim=-1).indices, probs.shape[1]).sum(1)
    return probs.shape[1] * (chosen.double().mean(0) * probs.mean(0)).sum()


def _z_by_hand(logits_TE):
    return torch.logsumexp(logits_TE, dim=-1).square().mean()


def _reference_losses(batch, aux_coef=0.0, max_norm=None, norms=None, z_coef=0.0, aux_chunks=None):
    """Whole batch, float64, transformers' eager experts and LM loss; the aux loss (if any) is
    the mean over layers and micro-batches of each layer's loss on that micro-batch's tokens, the
    z-loss likewise. ``aux_chunks``: the rows of each micro-batch the aux loss balances (default:
    MICRO consecutive blocks; a global aux loss joins the data-parallel ranks' micro-batches)."""
    model = _model(torch.float64, "eager")
    model.router_aux_loss_coef = 0.0  # transformers' own pooled aux loss stays out of .loss
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    rows = batch["input_ids"].shape[0]
    chunks = [torch.tensor(c) for c in aux_chunks] if aux_chunks else list(torch.arange(rows).chunk(MICRO))
    losses = []
    for _ in range(STEPS):
        out = model(**batch, output_router_logits=True)
        # router_logits: [B * S, E] per layer, rows of a sequence contiguous.
        per_layer = [layer.view(rows, -1, layer.shape[-1]) for layer in out.router_logits]
        aux = torch.stack([
            _aux_by_hand(layer[chunk].reshape(-1, layer.shape[-1]), model.config.num_experts_per_tok)
            for layer in per_layer for chunk in chunks
        ]).mean()
        z = torch.stack([_z_by_hand(layer[chunk].reshape(-1, layer.shape[-1])) for layer in per_layer
                         for chunk in chunks]).mean()
        loss = out.loss + aux_coef * aux + z_coef * z
        loss.backward()
        if max_norm is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


AUX = 0.1
Z = 0.01
MAX_NORM = 1.0
# A global aux loss on 2 data-parallel halves of 2 micro-batches: micro-batch m joins rows
# 2m, 2m+1 of each half.
GLOBAL_CHUNKS = [[0, 1, 4, 5], [2, 3, 6, 7]]


@pytest.fixture(scope="module")
def reference():
    batch = _batch()
    return batch, _reference_losses(batch)


@pytest.fixture(scope="module")
def reference_unbalanced():
    batch = _unbalanced_batch()
    # The case has teeth: the mean of the halves' own token means is far from the batch mean.
    model = _model(torch.float64, "eager")
    with torch.no_grad():
        per_half = sum(model(**{k: v.chunk(2)[i] for k, v in batch.items()}).loss.item() for i in range(2)) / 2
        whole = model(**batch).loss.item()
    assert abs(per_half - whole) > 1e-3 * whole
    return batch, _reference_losses(batch)


@pytest.fixture(scope="module")
def reference_aux(reference):
    batch, _ = reference
    return batch, _reference_losses(batch, AUX)


@pytest.fixture(scope="module")
def reference_global_aux_z(reference):
    batch, _ = reference
    return batch, _reference_losses(batch, AUX, z_coef=Z, aux_chunks=GLOBAL_CHUNKS)


@pytest.fixture(scope="module")
def reference_clipped(reference):
    batch, _ = reference
    norms = []
    losses = _reference_losses(batch, AUX, MAX_NORM, norms)
    assert max(norms) > MAX_NORM  # clipping is active
    return losses, norms


def _pp_alone(rank, world, batch, schedules):
    import torch.distributed as dist

    from moe_ep.parallel.pipeline import build_pipeline
    from moe_ep.training import TrainStep

    out = {}
    for run in schedules:
        schedule, coef, max_norm = run
        model = _model(torch.float32, "moe_ep")
        stages = build_pipeline(model, dist.group.WORLD, schedule=schedule, microbatches=MICRO)
        step = TrainStep(stages, torch.optim.AdamW(stages.parameters(), lr=LR), aux_loss_coef=coef,
                         max_grad_norm=max_norm)
        losses, norms = [], []
        for _ in range(STEPS):
            losses.append(step(batch).item())
            norms.append(step.last_grad_norm.item() if max_norm else None)
        layers = [list(m.layer_ids) for m in stages.modules]
        out[run] = (losses, layers, stages.stage_ids, norms)
    return out


def _check(losses, expected):
    for step, (got, want) in enumerate(zip(losses, expected)):
        assert rel_err(torch.tensor(got), torch.tensor(want)) <= TOL, f"step {step}: {got} vs {want}"


def test_pp2_alone_tracks_single_process_losses_for_every_schedule(reference, reference_aux, reference_clipped):
    batch, expected = reference
    _, expected_aux = reference_aux
    expected_clipped, expected_norms = reference_clipped
    runs = [("gpipe", 0.0, None), ("1f1b", 0.0, None), ("interleaved-1f1b", 0.0, None), ("zbv", 0.0, None),
            ("1f1b", AUX, None), ("zbv", AUX, None), ("interleaved-1f1b", AUX, MAX_NORM)]
    ranks = run_ranks(_pp_alone, 2, batch, runs, timeout=300)
    for run in runs:
        for result in ranks:
            _check(result[run][0], expected_clipped if run[2] else expected_aux if run[1] else expected)
            if run[2]:
                # The first step's norm, before fp32 and float64 weights part: later norms drift
                # by ~1e-5 legitimately (AdamW amplifies rounding in near-zero gradients), while
                # the losses above confirm every clipped update.
                _check(result[run][3][:1], expected_norms[:1])
        # Every decoder layer on exactly one stage, stages where the schedule puts them.
        all_layers = sorted(i for result in ranks for ls in result[run][1] for i in ls)
        assert all_layers == [0, 1, 2, 3], run
    assert ranks[0]["zbv", 0.0, None][2] == [0, 3] and ranks[1]["zbv", 0.0, None][2] == [1, 2]
    assert ranks[0]["interleaved-1f1b", 0.0, None][2] == [0, 2] and ranks[1]["interleaved-1f1b", 0.0, None][2] == [1, 3]


class Composed(NamedTuple):
    """One 4-rank run: pp=2 (by default) composed with the other degrees (dp = 4 / pp ranks of
    data); ``unbalanced``: the batch whose data-parallel shards hold different numbers of targets."""

    pp: int = 2
    ep: int = 1
    dp_replicate: int = 1
    schedule: str = "1f1b"
    checkpointing: bool = False
    aux: float = 0.0
    global_aux: bool = False
    z: float = 0.0
    loss_scale: str | None = None
    unbalanced: bool = False


# Each data-parallel half runs 2 micro-batches: the reference's 4 micro-batches of the whole batch.
COMPOSED = {
    "ep2_gpipe": Composed(ep=2, schedule="gpipe"),
    "ep2_1f1b": Composed(ep=2),
    "fsdp2_gpipe": Composed(schedule="gpipe"),
    "fsdp2_1f1b": Composed(),
    "ep2_1f1b_checkpointing_aux": Composed(ep=2, checkpointing=True, aux=AUX),
    "ep2_1f1b_checkpointing_global_aux_z": Composed(ep=2, checkpointing=True, aux=AUX, global_aux=True, z=Z),
    "ep2_interleaved": Composed(ep=2, schedule="interleaved-1f1b"),
    "ep2_zbv": Composed(ep=2, schedule="zbv"),
    "fsdp2_interleaved": Composed(schedule="interleaved-1f1b"),
    "fsdp2_zbv": Composed(schedule="zbv"),
    "hsdp_dp_replicate2_1f1b": Composed(dp_replicate=2),
    "ep2_1f1b_dynamic_loss_scale": Composed(ep=2, loss_scale="dynamic"),
    "unbalanced_fsdp2_1f1b": Composed(unbalanced=True),
    "unbalanced_ep2_zbv": Composed(ep=2, schedule="zbv", unbalanced=True),
    # No pipeline, the same loop: parallelize returns the model, 4 data-parallel quarters.
    "unbalanced_pp1_ep2_dp_shard4": Composed(pp=1, ep=2, schedule=None, unbalanced=True),
}


def _composed(rank, world, batches, runs):
    import moe_ep
    from moe_ep.hf import patch
    from moe_ep.parallel import meshes_of
    from moe_ep.training import TrainStep

    out = {}
    for name, run in runs.items():
        batch = batches[run.unbalanced]
        model = patch(_model(torch.float32, "eager"), fused_router=False)
        # dp_shard takes what pp and dp_replicate leave: ep=2 borrows both of its ranks from it.
        target = moe_ep.parallelize(model, pp=run.pp, ep=run.ep, dp_replicate=run.dp_replicate, schedule=run.schedule,
                                    microbatches=2 if run.pp > 1 else None, activation_checkpointing=run.checkpointing)
        meshes = target.meshes if run.pp > 1 else meshes_of(target)
        # Each data-parallel rank trains on its share of the batch; every stage of a pipeline
        # sees the same share.
        dp_rank, dp = meshes.dp.get_local_rank(), meshes.dims.dp
        share = {k: v.chunk(dp)[dp_rank] for k, v in batch.items()}
        step = TrainStep(target, torch.optim.AdamW(target.parameters(), lr=LR), microbatches=2, aux_loss_coef=run.aux,
                         global_aux_loss=run.global_aux, z_loss_coef=run.z, loss_scale=run.loss_scale)
        if run.loss_scale == "dynamic":
            step.scaler.scale = 2.0**130  # the scaled loss overflows fp32: skipped, scale halved until finite
        losses = []
        while len(losses) < STEPS:
            skipped = step.steps_skipped
            loss = step(share).item()
            if step.steps_skipped == skipped:
                losses.append(loss)
        out[name] = {"losses": losses, "skipped": step.steps_skipped,
                     "scale": step.scaler.scale if step.scaler else None, "dp": dp}
    return out


@pytest.fixture(scope="module")
def world4(reference, reference_unbalanced):
    """Every 4-rank run in ONE process group."""
    batches = {False: reference[0], True: reference_unbalanced[0]}
    return run_ranks(_composed, 4, batches, COMPOSED, timeout=600)


@pytest.mark.parametrize("name", list(COMPOSED))
def test_pp2_composes_with_ep_fsdp2_and_hsdp_for_every_schedule(world4, reference, reference_aux,
                                                                reference_unbalanced, reference_global_aux_z, name):
    run = COMPOSED[name]
    expected = (reference_unbalanced if run.unbalanced else reference_global_aux_z if run.global_aux
                else reference_aux if run.aux else reference)[1]
    by_rank = [r[name] for r in world4]
    assert all(r["dp"] == 4 // run.pp for r in by_rank)
    # Every rank returns the loss of the global batch, though it trained on its share only.
    for result in by_rank:
        _check(result["losses"], expected)
    if COMPOSED[name].loss_scale:
        # Every rank skipped the same overflowing steps and lowered the scale alike.
        assert len({(r["skipped"], r["scale"]) for r in by_rank}) == 1
        assert by_rank[0]["skipped"] >= 1 and by_rank[0]["scale"] < 2.0**130


def test_train_step_z_loss_without_stages(reference):
    from moe_ep.training import TrainStep

    batch, _ = reference
    expected = _reference_losses(batch, AUX, z_coef=Z)
    model = _model(torch.float32, "moe_ep")
    step = TrainStep(model, torch.optim.AdamW(model.parameters(), lr=LR), microbatches=MICRO, aux_loss_coef=AUX,
                     z_loss_coef=Z)
    _check([step(batch).item() for _ in range(STEPS)], expected)
    assert step.last_z_loss > 0


@pytest.mark.parametrize("coef", [0.0, AUX])
def test_train_step_without_stages_accumulates_microbatches(reference, reference_aux, coef):
    from moe_ep.training import TrainStep

    batch, expected = reference_aux if coef else reference
    model = _model(torch.float32, "moe_ep")
    step = TrainStep(model, torch.optim.AdamW(model.parameters(), lr=LR), microbatches=MICRO, aux_loss_coef=coef)
    _check([step(batch).item() for _ in range(STEPS)], expected)
    if coef:
        assert step.last_aux_loss > 0 and torch.isclose(step.last_lm_loss + coef * step.last_aux_loss,
                                                       torch.tensor(expected[-1], dtype=torch.float32), rtol=1e-5)


def test_dynamic_loss_scaling_skips_overflowing_steps_and_recovers(reference):
    from moe_ep.training import TrainStep

    batch, expected = reference
    model = _model(torch.float32, "moe_ep")
    step = TrainStep(model, torch.optim.AdamW(model.parameters(), lr=LR), microbatches=2, loss_scale="dynamic")
    step.scaler.scale = 2.0**130  # the scaled loss overflows fp32: skipped, scale halved until finite
    losses = []
    while len(losses) < STEPS:
        before = step.steps_skipped
        loss = step(batch)
        if step.steps_skipped == before:
            losses.append(loss.item())
    assert step.steps_skipped >= 1 and step.scaler.scale < 2.0**130
    _check(losses, expected)


def test_errors():
    from moe_ep.parallel.pipeline import build_pipeline
    from moe_ep.training import LossScaler, TrainStep

    model = _model(torch.float32, "moe_ep")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        TrainStep(model, object())
    with pytest.raises(TypeError, match="model_or_stages must be a torch.nn.Module or PipelineStages"):
        TrainStep("model", opt)
    with pytest.raises(ValueError, match="loss_scale must be None, 'dynamic' or a positive number, got -1"):
        LossScaler(-1)
    with pytest.raises(ValueError, match="max_grad_norm must be a positive number or None, got 0"):
        TrainStep(model, opt, max_grad_norm=0)
    with pytest.raises(ValueError, match="aux_loss_coef must be a number >= 0, got -0.1"):
        TrainStep(model, opt, aux_loss_coef=-0.1)
    with pytest.raises(ValueError, match="z_loss_coef must be a number >= 0, got -1"):
        TrainStep(model, opt, z_loss_coef=-1)
    with pytest.raises(ValueError, match="global_aux_loss=True needs aux_loss_coef > 0"):
        TrainStep(model, opt, global_aux_loss=True)
    dense = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="aux_loss_coef or z_loss_coef > 0 needs MoE blocks"):
        TrainStep(dense, torch.optim.SGD(dense.parameters(), lr=0.1), aux_loss_coef=0.1)
    step = TrainStep(model, opt, microbatches=3)
    with pytest.raises(ValueError, match=r"batch keys \['attention_mask'\] are not supported"):
        step({"input_ids": torch.ones(4, 5, dtype=torch.long), "attention_mask": torch.ones(4, 5)})
    with pytest.raises(ValueError, match="batch of 2 sequences cannot be cut into 3 micro-batches"):
        step({"input_ids": torch.ones(2, 5, dtype=torch.long)})
    with pytest.raises(TypeError, match="pp_mesh must be a 1-D DeviceMesh or a ProcessGroup"):
        build_pipeline(model, "pp", microbatches=2)
    with pytest.raises(TypeError, match="must be a transformers decoder-only"):
        from moe_ep.parallel.pipeline import CausalLMStage

        CausalLMStage(torch.nn.Linear(2, 2), [0], first=True, last=True)
