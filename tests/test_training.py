"""moe_ep.training.TrainStep in one process: what it refuses before any work (an optimizer
without the model's parameters included), and the forward options the example's single-process
runs use (autocast, no key/value cache); the aux-loss-free expert bias against a hand-computed
update (with activation checkpointing), and on 2 gloo ranks (data-parallel, and pipeline stages)
against one process on the whole batch; TrainSteps sharing a model or pipeline stages without
leaking hooks or loss functions into each other; skipped steps (non-finite, no predicted token)
and refused batches (ids or labels out of range or of a wrong dtype), in one process and on 2
gloo ranks. The losses of every layout against float64 are in test_pipeline.py."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import NamedTuple

import pytest
import torch

import torch.distributed as dist

from dist_utils import run_ranks
from hf_models import tiny_batch, tiny_config, tiny_model
from markers import requires_cuda
from numerics import TOLERANCE, rel_err

TINY = dict(num_hidden_layers=2, num_local_experts=4, intermediate_size=24)


def _model():
    from moe_ep.hf import patch

    return patch(tiny_model("mixtral", **TINY), fused_router=True).train()


@pytest.mark.slow
@pytest.mark.parametrize("aux_loss_coef", [0.0, 0.1])
def test_a_batch_that_micro_batches_do_not_divide_is_refused_before_any_work(aux_loss_coef):
    """5 sequences in 4 micro-batches: ``chunk`` would give 3 of 2, 2 and 1, scaled as 4."""
    from moe_ep.training import TrainStep

    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = TrainStep(model, opt, microbatches=4, aux_loss_coef=aux_loss_coef)
    batch = tiny_batch(tiny_config("mixtral", **TINY), batch=5, seq=6)
    message = (r"batch of 5 sequences cannot be cut into 4 micro-batches: microbatches=4 must divide input_ids' "
               r"first dimension, got shape \(5, 6\)")
    with pytest.raises(ValueError, match=message):
        step(batch)
    assert all(p.grad is None for p in model.parameters()) and not opt.state
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    if step.aux is not None:
        assert step.aux.record == []
    # The same step takes a batch that divides.
    batch = tiny_batch(tiny_config("mixtral", **TINY), batch=8, seq=6)
    assert torch.isfinite(step(batch))


def test_autocast_forward_without_cache():
    """``autocast_dtype``: the forward runs in bf16 (a lone process; FSDP's policy casts parallel
    runs), the loss is fp32 cross-entropy of the bf16 logits, and no key/value cache is built."""
    from moe_ep.training import TrainStep

    model = _model()
    batch = tiny_batch(tiny_config("mixtral", **TINY), batch=4, seq=6)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=batch["input_ids"], use_cache=False).logits
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten())

    seen = []
    model.register_forward_hook(lambda m, args, kwargs, out: seen.append((kwargs.get("use_cache"), out.logits.dtype,
                                                                          out.past_key_values)), with_kwargs=True)
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.0), microbatches=2,
                     autocast_dtype=torch.bfloat16)
    loss = step(batch)
    assert seen == [(False, torch.bfloat16, None)] * 2
    assert loss.dtype == torch.float32
    # The micro-batches' sums over the batch's tokens: the batch's mean, up to fp32 rounding.
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with pytest.raises(TypeError, match="autocast_dtype must be torch.bfloat16, torch.float16 or None, got 'bf16'"):
        TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.0), autocast_dtype="bf16")


# DeepSeek-V3 with a dense first layer: MoE blocks at layers 1 and 2 (8 experts, top-3, biased choice).
DSV3 = dict(num_hidden_layers=3)
RATE, DSV3_LR = 0.01, 1e-2


def _dsv3(seed=0):
    return tiny_model("deepseek_v3", dtype=torch.float64, seed=seed, **DSV3).train()


def _dsv3_batch(batch=8, seed=3):
    return tiny_batch(tiny_config("deepseek_v3", **DSV3), batch=batch, seq=5, seed=seed)


def _biases(modules) -> list[torch.Tensor]:
    return [m.gate.e_score_correction_bias.clone() for root in modules for m in root.modules()
            if type(m).__name__ == "DeepseekV3MoE"]


def _hand_update(model, ids) -> list[torch.Tensor]:
    """Each MoE layer's bias after one update on ``ids``: the routers' choices counted per expert
    by hand, then ``bias + RATE`` below the mean load, ``- RATE`` above it."""
    chosen = []
    routers = [m.gate for m in model.modules() if type(m).__name__ == "DeepseekV3MoE"]
    handles = [r.register_forward_hook(lambda mod, args, out: chosen.append(out[2])) for r in routers]
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for h in handles:
        h.remove()
    updated = []
    for router, idx in zip(routers, chosen):
        load = [int((idx == e).sum()) for e in range(router.e_score_correction_bias.numel())]
        mean = sum(load) / len(load)
        delta = [RATE if n < mean else -RATE if n > mean else 0.0 for n in load]
        updated.append(router.e_score_correction_bias + torch.tensor(delta, dtype=torch.float64))
    return updated


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True])
def test_expert_bias_follows_each_steps_routed_load(checkpointing):
    """Two AdamW steps of 2 micro-batches: after each, every MoE layer's bias is the hand-computed
    update from that step's routing (parameters and bias as the step found them); each layer and
    micro-batch is recorded once, recompute or not."""
    from moe_ep.parallel.parallelize import enable_activation_checkpointing
    from moe_ep.training import TrainStep

    model = _dsv3()
    if checkpointing:
        enable_activation_checkpointing(model)
    batch = _dsv3_batch()
    step = TrainStep(model, torch.optim.AdamW(model.parameters(), lr=DSV3_LR), microbatches=2,
                     expert_bias_rate=RATE)
    start = _biases([model])
    for _ in range(2):
        expected = _hand_update(model, batch["input_ids"])
        step(batch)
        assert all(torch.equal(b, e) for b, e in zip(_biases([model]), expected))
        assert len(step.aux.record) == 2 * 2  # MoE layers x micro-batches
        tokens_mb = batch["input_ids"].numel() // 2
        assert all(r.counts_E.sum() == tokens_mb * model.config.num_experts_per_tok for r in step.aux.record)
    assert not any(torch.equal(b, s) for b, s in zip(_biases([model]), start))


def test_a_deepseek_v3_routers_aux_loss_takes_its_normalised_sigmoid_scores():
    """TrainStep's aux loss of DeepSeek-V3's sigmoid router: per MoE layer, E * sum_e f_e * P_e with
    P_e the mean of sigmoid(logit_e) over the token's sum of sigmoid scores (DeepSeek-V3's balance
    loss times top-k), f_e from the router's own (biased, group-limited) choice; a softmax of the
    sigmoid router's logits was taken before. The mean over layers, against float64 by hand."""
    from moe_ep.training import TrainStep

    model, batch = _dsv3(), _dsv3_batch(batch=2)
    routers = [m.gate for m in model.modules() if type(m).__name__ == "DeepseekV3MoE"]
    for i, router in enumerate(routers):  # choices the bias steers
        router.e_score_correction_bias.copy_(torch.linspace(-0.2, 0.2, 8, dtype=torch.float64).roll(i))
    seen = []
    handles = [r.register_forward_hook(lambda mod, args, out: seen.append((out[0].detach(), out[2]))) for r in routers]
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.0), aux_loss_coef=0.1)
    step(batch)
    for h in handles:
        h.remove()
    E_ = model.config.n_routed_experts
    per_layer = []
    for logits_TE, idx_TK in seen:
        s_TE = logits_TE.double().sigmoid() / logits_TE.double().sigmoid().sum(-1, keepdim=True)
        f_E = torch.stack([(idx_TK == e).any(-1).double().mean() for e in range(E_)])
        per_layer.append(E_ * (f_E * s_TE.mean(0)).sum())
    assert len(per_layer) == len(routers) == 2
    # The router's logits are float32 (DeepSeek-V3 computes them so, in a float64 model too).
    assert rel_err(step.last_aux_loss, torch.stack(per_layer).double().mean()) <= TOLERANCE[torch.float32]


def test_the_sequence_wise_aux_loss_balances_each_sequence_on_its_own():
    """``sequence_aux_loss``: per MoE layer and micro-batch, the mean over its sequences of each
    sequence's E * sum_e f_e * P_e (DeepSeek-V3's sequence-wise balance loss times top-k), the mean
    over layers and micro-batches, against float64 by hand; another value than the batch-pooled
    loss, and refused with a global aux loss or without an aux loss."""
    from moe_ep.training import TrainStep

    model, batch = _dsv3(), _dsv3_batch(batch=4)
    seq = batch["input_ids"].shape[1]
    routers = [m.gate for m in model.modules() if type(m).__name__ == "DeepseekV3MoE"]
    seen = []
    handles = [r.register_forward_hook(lambda mod, args, out: seen.append((out[0].detach(), out[2]))) for r in routers]
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.0), aux_loss_coef=0.1, microbatches=2,
                     sequence_aux_loss=True)
    step(batch)
    for h in handles:
        h.remove()
    E_ = model.config.n_routed_experts
    per_layer_and_microbatch = []
    for logits_TE, idx_TK in seen:
        sequences = []
        for b in range(logits_TE.shape[0] // seq):
            rows = slice(b * seq, (b + 1) * seq)
            s_TE = logits_TE[rows].double().sigmoid() / logits_TE[rows].double().sigmoid().sum(-1, keepdim=True)
            f_E = torch.stack([(idx_TK[rows] == e).any(-1).double().mean() for e in range(E_)])
            sequences.append(E_ * (f_E * s_TE.mean(0)).sum())
        assert len(sequences) == 2  # a micro-batch holds two sequences
        per_layer_and_microbatch.append(torch.stack(sequences).mean())
    assert len(per_layer_and_microbatch) == 2 * len(routers)
    assert rel_err(step.last_aux_loss, torch.stack(per_layer_and_microbatch).mean()) <= TOLERANCE[torch.float32]
    step.close()
    pooled = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.0), aux_loss_coef=0.1, microbatches=2)
    pooled(batch)
    pooled.close()
    assert rel_err(pooled.last_aux_loss, step.last_aux_loss) > 1e-3
    with pytest.raises(ValueError, match="global_aux_loss and sequence_aux_loss exclude each other"):
        TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.0), aux_loss_coef=0.1, global_aux_loss=True,
                  sequence_aux_loss=True)
    with pytest.raises(ValueError, match=r"^sequence_aux_loss=True needs aux_loss_coef > 0$"):
        TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.0), sequence_aux_loss=True)


def test_each_routers_scoring_is_read_from_its_class_or_stated():
    """The aux loss's probabilities follow how the router scores: read from the class's forward
    (Mixtral's softmax, DeepSeek-V3's sigmoid and the routers copied from it), a parent's where the
    forward delegates; a router whose forward computes both (the config's choice) is refused by
    name until ``router_score`` states it, and then gives the loss the family's router gives."""
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    from moe_ep.hf.routers import router_score
    from moe_ep.training import TrainStep

    model = _model()
    dsv3 = _dsv3()
    assert {router_score(m.gate) for m in model.modules() if hasattr(m, "experts") and hasattr(m, "gate")} == {
        "softmax"}
    assert {router_score(m.gate) for m in dsv3.modules() if hasattr(m, "experts") and hasattr(m, "gate")} == {
        "sigmoid"}

    class DelegatingRouter(MixtralTopKRouter):
        def forward(self, hidden_states):
            return super().forward(hidden_states)

    class ConfigChosenRouter(MixtralTopKRouter):
        def forward(self, hidden_states):  # a config would choose the softmax or the sigmoid here
            return super().forward(hidden_states)

    batch = tiny_batch(tiny_config("mixtral", **TINY), batch=2, seq=6)
    own = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.0), aux_loss_coef=0.1)
    own(batch)
    own.close()
    for layer in model.model.layers:
        layer.mlp.gate.__class__ = DelegatingRouter
    delegating = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.0), aux_loss_coef=0.1)
    delegating(batch)
    delegating.close()
    assert torch.equal(delegating.last_aux_loss, own.last_aux_loss)
    for layer in model.model.layers:
        layer.mlp.gate.__class__ = ConfigChosenRouter
    hooks = sum(len(m._forward_hooks) for m in model.modules())
    with pytest.raises(ValueError, match=r"aux_loss_coef > 0 needs to know how each router scores its experts "
                                         r"\(softmax or sigmoid\); the gate of 'model.layers.0.mlp' "
                                         r"\(ConfigChosenRouter\) computes both or neither in its forward: pass "
                                         r"router_score='softmax' or 'sigmoid'"):
        TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.0), aux_loss_coef=0.1)
    assert sum(len(m._forward_hooks) for m in model.modules()) == hooks
    TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.0), z_loss_coef=0.1).close()  # no aux loss: no need
    stated = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.0), aux_loss_coef=0.1, router_score="softmax")
    stated(batch)
    assert torch.equal(stated.last_aux_loss, own.last_aux_loss)
    with pytest.raises(ValueError, match=r"router_score must be one of \('softmax', 'sigmoid'\) or None, got 'tanh'"):
        TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.0), aux_loss_coef=0.1, router_score="tanh")
    with pytest.raises(ValueError, match=r"router_score='sigmoid' needs aux_loss_coef > 0"):
        TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.0), router_score="sigmoid")


def test_a_stage_without_moe_layers_learns_that_another_refused_a_routers_scoring():
    """On pipeline stages the refusal of a router whose scoring cannot be told rides on the count
    of MoE layers summed over the stages: a stage of dense layers raises too, instead of waiting
    in the next collective for the refusing stage (the other stage's refusal is played here)."""
    from moe_ep.training.balancing import Balancing

    class StageOfDenseLayers:
        modules = [torch.nn.Sequential(torch.nn.Linear(2, 2))]
        device = torch.device("cpu")
        microbatches = 1

        @staticmethod
        def sum_over_stages(t):
            return t + torch.tensor([2.0, 1.0])  # the other stage: 2 MoE layers, one refused router

    with pytest.raises(ValueError, match=r"^aux_loss_coef > 0 was refused by another pipeline stage \(its error "
                                         r"names the router\)$"):
        Balancing(StageOfDenseLayers(), aux_loss_coef=0.1, z_loss_coef=0.0, expert_bias_rate=0.0, group=None)


def test_expert_bias_refused_without_a_correction_bias():
    from moe_ep.training import TrainStep

    model = _model()
    hooks = [len(m._forward_hooks) for m in model.modules()]
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    message = (r"expert_bias_rate=0.01 needs every MoE block's router to hold a 1-D 'e_score_correction_bias' "
               r"\(DeepSeek-V3's aux-loss-free bias\); the gate of 'model.layers.0.mlp' \(MixtralTopKRouter\) has none")
    with pytest.raises(ValueError, match=message):
        TrainStep(model, opt, expert_bias_rate=0.01)
    assert [len(m._forward_hooks) for m in model.modules()] == hooks  # refused: no hooks left behind
    dense = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="expert_bias_rate > 0 needs MoE blocks"):
        TrainStep(dense, torch.optim.SGD(dense.parameters(), lr=0.1), expert_bias_rate=0.01)
    with pytest.raises(ValueError, match="expert_bias_rate must be a finite number >= 0, got -0.1"):
        TrainStep(model, opt, expert_bias_rate=-0.1)
    # A bfloat16 bias would stop moving: a step of 1e-3 rounds away once |bias| >= 0.5.
    dsv3 = _dsv3()
    dsv3.model.layers[1].mlp.gate.e_score_correction_bias = torch.zeros(8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"needs e_score_correction_bias in float32 or float64; the gate of "
                                         r"'model.layers.1.mlp' holds it in torch.bfloat16"):
        TrainStep(dsv3, torch.optim.SGD(dsv3.parameters(), lr=0.1), expert_bias_rate=1e-3)


def test_train_steps_sharing_a_model_keep_their_hooks_apart():
    """Hooks act only in their own TrainStep's step: a second step on the same model neither
    fails on the first one's hooks nor receives its aux-loss gradient; ``close`` removes them."""
    from moe_ep.training import TrainStep

    model = _model()
    batch = tiny_batch(tiny_config("mixtral", **TINY), batch=4, seq=6)
    hooks = sum(len(m._forward_hooks) for m in model.modules())
    a = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.0), aux_loss_coef=0.5)
    b = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.0), aux_loss_coef=0.1, microbatches=2)
    c = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.0))
    loss_a = a(batch)
    records_a = list(a.aux.record)
    loss_b, loss_c = b(batch), c(batch)
    model(input_ids=batch["input_ids"]).logits.sum().backward()  # a forward outside any step
    assert a.aux.record == records_a and len(b.aux.record) == 2 * 2  # layers x b's micro-batches
    torch.testing.assert_close(a.last_lm_loss, loss_c, rtol=1e-6, atol=0)
    torch.testing.assert_close(loss_a - 0.5 * a.last_aux_loss, loss_b - 0.1 * b.last_aux_loss, rtol=1e-6, atol=0)
    assert sum(len(m._forward_hooks) for m in model.modules()) == hooks + 2 * 2 * 2  # a's and b's: router, block
    a.close()
    b.close()
    c.close()
    assert sum(len(m._forward_hooks) for m in model.modules()) == hooks
    with pytest.raises(RuntimeError, match="this TrainStep was closed"):
        a(batch)


def _one_stage(model):
    """``model`` as a one-stage pipeline on a one-rank gloo group (the caller's, in this process)."""
    from moe_ep.parallel.pipeline import build_pipeline

    return build_pipeline(model, dist.group.WORLD, schedule="gpipe", microbatches=2, split_points=[])


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_train_steps_sharing_pipeline_stages_use_their_own_loss(one_rank):
    """The stages' schedule is built once; each TrainStep's steps must still use its own loss
    function (here: its own loss scale), in any order."""
    from moe_ep.training import TrainStep

    stages = _one_stage(_model())
    batch = tiny_batch(tiny_config("mixtral", **TINY), batch=4, seq=6)
    plain = TrainStep(stages, torch.optim.SGD(stages.parameters(), lr=0.0))
    scaled = TrainStep(stages, torch.optim.SGD(stages.parameters(), lr=0.0), loss_scale=4.0)
    losses = [plain(batch), scaled(batch), plain(batch)]
    assert losses[0] > 0 and all(torch.equal(loss, losses[0]) for loss in losses)
    with pytest.raises(TypeError, match="loss_fn must be callable as loss_fn\\(logits, labels\\), got str"):
        stages.schedule("cross-entropy")


def _expert_bias_two_ranks(rank, world):
    """(biases after 2 steps with FSDP2 over dp_shard=2, each rank holding half the batch;
    this rank's stage's biases after 2 steps as one of 2 pipeline stages, with the whole batch;
    the records of the pipeline's first step, shape inference included)."""
    import moe_ep
    from moe_ep.parallel.pipeline import build_pipeline
    from moe_ep.training import TrainStep

    model = moe_ep.parallelize(_dsv3(), dp_shard=world, activation_checkpointing=True)
    step = TrainStep(model, torch.optim.AdamW(model.parameters(), lr=DSV3_LR), microbatches=2, expert_bias_rate=RATE)
    batch = {k: v.chunk(world)[rank] for k, v in _dsv3_batch().items()}
    for _ in range(2):
        step(batch)
    # Layers 0-1 (dense, MoE) on stage 0, layer 2 (MoE) on stage 1.
    stages = build_pipeline(_dsv3(), dist.group.WORLD, schedule="1f1b", microbatches=2, split_points=[2])
    piped = TrainStep(stages, torch.optim.AdamW(stages.parameters(), lr=DSV3_LR), expert_bias_rate=RATE)
    piped(_dsv3_batch())
    first_records = len(piped.aux.record)
    piped(_dsv3_batch())
    # floats: tensors would travel through shared memory that dies with the rank
    return [b.tolist() for b in _biases([model])], [b.tolist() for b in _biases(stages.modules)], first_records


@pytest.mark.slow
def test_expert_bias_identical_on_data_parallel_ranks_and_equal_to_one_process():
    """2 gloo ranks, against one process stepping on the whole batch for 2 steps: with FSDP2
    (dp_shard=2, activation checkpointing) and half the batch each, every rank holds the same
    biases, the one-process ones; as 2 pipeline stages, each rank holds its layer's. torch's
    pipelining runs an extra forward and backward to infer shapes before the first step: its
    records must not count."""
    from moe_ep.training import TrainStep

    ranks = run_ranks(_expert_bias_two_ranks, 2)
    model = _dsv3()
    step = TrainStep(model, torch.optim.AdamW(model.parameters(), lr=DSV3_LR), microbatches=4,
                     expert_bias_rate=RATE)
    for _ in range(2):
        step(_dsv3_batch())
    expected = [b.tolist() for b in _biases([model])]
    assert [dp for dp, _, _ in ranks] == [expected, expected]
    assert [pp for _, pp, _ in ranks] == [[expected[0]], [expected[1]]]
    assert max(r for _, _, r in ranks) > 2  # the shape inference did record: the case is exercised


class _Poison:
    """While ``armed``, makes ``module``'s output gradient NaN (``"grad"``: every gradient behind it
    turns NaN, the loss stays finite) or one element of its output NaN (``"output"``)."""

    def __init__(self, module, what: str):
        self.what, self.armed = what, False
        module.register_forward_hook(self._hook)

    def _hook(self, module, args, out):
        if not self.armed:
            return None
        if self.what == "grad":
            out.register_hook(lambda grad: torch.full_like(grad, float("nan")))
            return None
        out = out.clone()
        out.view(-1)[0] = float("nan")
        return out


def _local_state(params, optimizer) -> list[torch.Tensor]:
    """This rank's parameters and optimizer state, as plain tensors, in a fixed order."""
    from torch.distributed.tensor import DTensor

    def local(t):
        return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()

    state = [local(p) for p in params]
    for p in params:
        state.extend(local(v) for _, v in sorted(optimizer.state.get(p, {}).items()) if isinstance(v, torch.Tensor))
    return state


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.slow
def test_a_non_finite_step_is_skipped_in_one_process():
    """One parameter's gradient NaN with a finite loss, then a NaN loss: both steps are skipped
    (weights, optimizer state and lr schedule untouched, gradients cleared), and the step after
    them is bit-equal to the one of a run that never saw them; fixed loss scale alike."""
    from moe_ep.training import TrainStep

    config = tiny_config("mixtral", **TINY)
    batches = [tiny_batch(config, batch=4, seq=6, seed=s) for s in range(3)]

    def run(poisoned: bool, **kwargs):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (i + 1))
        step = TrainStep(model, opt, microbatches=2, lr_scheduler=sched, **kwargs)
        armed = []
        model.lm_head.weight.register_hook(lambda g: g * float("nan") if armed else g)
        bad_loss = _Poison(model.lm_head, "output")
        step(batches[0])
        before = _local_state(list(model.parameters()), opt)
        if poisoned:
            armed.append(True)
            loss = step(batches[1])
            assert torch.isfinite(loss) and not math.isfinite(step.last_grad_norm.item())
            assert step.last_step_skipped and (step.steps_skipped, step.consecutive_skips) == (1, 1)
            armed.clear()
            bad_loss.armed = True
            assert torch.isnan(step(batches[1])) and step.last_step_skipped
            bad_loss.armed = False
            assert (step.steps_skipped, step.consecutive_skips) == (2, 2)
            assert _equal(_local_state(list(model.parameters()), opt), before)
            assert all(p.grad is None for p in model.parameters()) and sched.last_epoch == 1
        loss = step(batches[2])
        assert not step.last_step_skipped and step.consecutive_skips == 0
        return loss, _local_state(list(model.parameters()), opt)

    for kwargs in ({}, {"loss_scale": 8.0, "max_grad_norm": 0.5}):
        loss, state = run(True, **kwargs)
        clean_loss, clean_state = run(False, **kwargs)
        assert torch.equal(loss, clean_loss) and _equal(state, clean_state)


def test_dynamic_loss_scale_halves_on_a_skipped_step():
    from moe_ep.training import TrainStep

    model = _model()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=1e-2), loss_scale="dynamic")
    poison = _Poison(model.model.embed_tokens, "grad")
    batch = tiny_batch(tiny_config("mixtral", **TINY), batch=2, seq=6)
    scale = step.scaler.scale
    poison.armed = True
    step(batch)
    assert step.last_step_skipped and step.scaler.scale == scale / 2
    poison.armed = False
    step(batch)
    assert not step.last_step_skipped and step.scaler.good_steps == 1


def test_consecutive_non_finite_steps_raise():
    import moe_ep
    from moe_ep.training import NonFiniteStepsError, TrainStep

    assert moe_ep.NonFiniteStepsError is NonFiniteStepsError and issubclass(NonFiniteStepsError, RuntimeError)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for bad in (0, -1, 1.5, True, "3"):
        with pytest.raises(ValueError, match=f"max_consecutive_skips must be a positive int or None, got {bad!r}"):
            TrainStep(model, opt, max_consecutive_skips=bad)
    step = TrainStep(model, opt, max_consecutive_skips=3)
    poison = _Poison(model.lm_head, "output")
    batch = tiny_batch(tiny_config("mixtral", **TINY), batch=2, seq=6)
    poison.armed = True
    step(batch)
    step(batch)
    poison.armed = False
    step(batch)  # a step taken resets the count
    poison.armed = True
    step(batch)
    step(batch)
    with pytest.raises(NonFiniteStepsError, match=r"3 steps in a row were skipped \(max_consecutive_skips=3\): the "
                                                  r"last had loss nan and gradient norm nan.*Lower the learning rate"):
        step(batch)
    assert step.steps_skipped == 5 and all(p.grad is None for p in model.parameters())
    unlimited = TrainStep(model, opt, max_consecutive_skips=None)
    for _ in range(3):
        unlimited(batch)
    assert unlimited.consecutive_skips == 3



class BadBatch(NamedTuple):
    """A batch spoiled one way (``spoiled``), and the problem TrainStep names for it."""

    tensor: str  # "input_ids" or "labels"
    edit: str  # "float", "int16", "at_vocab" (one entry = vocab_size), "negative" (one entry = -2)
    problem: str


V = tiny_config("mixtral", **TINY).vocab_size
RANGE = rf"outside \[0, {V}\) \(config.vocab_size\)"
IDS_DTYPE = r"input_ids are not int64 or int32 on {n} \(token ids are integers, in one of the two dtypes " \
            r"torch.nn.Embedding takes\)"
IDS_RANGE = rf"input_ids hold ids {RANGE} on {{n}} \(pad input_ids with a token id; -100 belongs in labels\)"
BAD_BATCHES = {
    "float_ids": BadBatch("input_ids", "float", IDS_DTYPE),
    "int16_ids": BadBatch("input_ids", "int16", IDS_DTYPE),
    "id_at_vocab_size": BadBatch("input_ids", "at_vocab", IDS_RANGE),
    "negative_id": BadBatch("input_ids", "negative", IDS_RANGE),
    "float_labels": BadBatch("labels", "float", r"labels are not int64 or int32 on {n} \(labels are token ids or "
                                                r"-100; int32 ones are cast to int64 for cross-entropy\)"),
    "label_at_vocab_size": BadBatch("labels", "at_vocab", rf"labels hold values {RANGE} other than the ignore index "
                                                          r"-100 on {n}"),
    "negative_label": BadBatch("labels", "negative", rf"labels hold values {RANGE} other than the ignore index -100 "
                                                     r"on {n}"),
}


def _spoiled(batch: dict, bad: BadBatch) -> dict:
    spoiled = dict(batch)
    t = batch[bad.tensor].clone()
    if bad.edit == "float":
        t = t.float()
    elif bad.edit == "int16":
        t = t.to(torch.int16)
    else:
        t[-1, -1] = V if bad.edit == "at_vocab" else -2
    spoiled[bad.tensor] = t
    return spoiled


def _refusal(bad: BadBatch, ranks: int) -> str:
    n = f"{ranks} rank" + ("s" if ranks != 1 else "")
    return r"^TrainStep refused the batch on every rank, nothing was applied: " + bad.problem.format(n=n) + "$"


@pytest.mark.parametrize("name", list(BAD_BATCHES))
def test_a_bad_batch_is_refused_naming_the_tensor_and_the_range(name):
    """Token ids or labels outside [0, vocab_size) (labels may be -100), or not int64/int32: a
    ValueError naming the tensor and the range; nothing applied (weights, optimizer state, lr
    schedule, skip counts as before, gradients cleared) and the next step bit-equal to that of a
    run that never met the batch. (On CUDA the same check needs no host sync of its own: it is
    read back with the loss, test_a_bad_batch_on_cuda_is_refused_without_a_host_sync_of_its_own.)"""
    from moe_ep.training import TrainStep

    config = tiny_config("mixtral", **TINY)
    batches = [tiny_batch(config, batch=4, seq=6, seed=s) for s in range(2)]

    def run(bad: BadBatch | None):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (i + 1))
        step = TrainStep(model, opt, microbatches=2, lr_scheduler=sched, aux_loss_coef=0.01)
        step(batches[0])
        if bad is not None:
            before = _local_state(list(model.parameters()), opt)
            with pytest.raises(ValueError, match=_refusal(bad, 1)):
                step(_spoiled(batches[1], bad))
            assert _equal(_local_state(list(model.parameters()), opt), before)
            assert all(p.grad is None for p in model.parameters()) and sched.last_epoch == 1
            assert (step.steps_skipped, step.last_step_skipped) == (0, False) and step.last_lm_loss is None
        return step(batches[1]), _local_state(list(model.parameters()), opt)

    loss, state = run(BAD_BATCHES[name])
    clean_loss, clean_state = run(None)
    assert torch.equal(loss, clean_loss) and _equal(state, clean_state)


@requires_cuda
def test_a_bad_batch_on_cuda_is_refused_without_a_host_sync_of_its_own():
    """On CUDA the batch's values are checked on the device and read back with the loss: no host
    sync comes from the checks, a bad batch makes no more syncs than a good step, each is refused
    with the CPU's message, and the process goes on (no device-side assert from the embedding or
    cross-entropy)."""
    import warnings

    from moe_ep.training import TrainStep

    model = _model().cuda()
    step = TrainStep(model, torch.optim.AdamW(model.parameters(), lr=1e-2), microbatches=2)
    batch = {k: v.cuda() for k, v in tiny_batch(tiny_config("mixtral", **TINY), batch=4, seq=6).items()}
    step(batch)  # the first call also chooses the experts' backend (timed, with syncs)

    def syncs(b) -> tuple[list, str | None]:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    step(b)
                    outcome = None
                except ValueError as exc:
                    outcome = str(exc)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return [w for w in caught if "synchroniz" in str(w.message)], outcome

    good, outcome = syncs(batch)
    assert outcome is None and len(good) >= 1  # the step's read-back at least
    for bad in BAD_BATCHES.values():
        found, outcome = syncs(_spoiled(batch, bad))
        assert outcome is not None and re.search(_refusal(bad, 1), outcome), outcome
        assert len(found) <= len(good) and not any(w.filename.endswith("batch.py") for w in found), (
            [(w.filename, w.lineno) for w in found], [(w.filename, w.lineno) for w in good])
    assert torch.isfinite(step(batch)) and not step.last_step_skipped


def test_int32_token_ids_and_labels_train_as_int64_ones():
    """int32 ids and labels (torch.nn.Embedding takes them; cross-entropy takes int64, so labels
    are cast): the same losses and weights, bit for bit, with and without separate labels."""
    from moe_ep.training import TrainStep

    batch = tiny_batch(tiny_config("mixtral", **TINY), batch=4, seq=6)

    def run(dtype):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step = TrainStep(model, opt, microbatches=2)
        losses = [step({k: v.to(dtype) for k, v in batch.items()}), step({"input_ids": batch["input_ids"].to(dtype)})]
        return losses, _local_state(list(model.parameters()), opt)

    losses, state = run(torch.int32)
    losses64, state64 = run(torch.int64)
    assert all(torch.equal(a, b) for a, b in zip(losses, losses64)) and _equal(state, state64)


def test_a_step_without_a_predicted_token_is_skipped():
    """Every label -100 in the whole batch: the step is skipped and counted like a non-finite one
    (no weight decay, optimizer, lr schedule or expert-bias step; the dynamic loss scale kept,
    there was no overflow); a step with one micro-batch all ignored is taken. Afterwards bit-equal
    to a run that never met the empty step; too many in a row raise NonFiniteStepsError."""
    from moe_ep.training import NonFiniteStepsError, TrainStep

    config = tiny_config("mixtral", **TINY)
    batches = [tiny_batch(config, batch=4, seq=6, seed=s) for s in range(3)]
    ignored = dict(batches[1], labels=torch.full_like(batches[1]["labels"], -100))
    half = dict(batches[1], labels=batches[1]["labels"].clone())
    half["labels"][:2] = -100  # the first of the 2 micro-batches predicts nothing

    def run(empty: bool):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (i + 1))
        step = TrainStep(model, opt, microbatches=2, lr_scheduler=sched, loss_scale="dynamic")
        step(batches[0])
        if empty:
            before, scale = _local_state(list(model.parameters()), opt), step.scaler.scale
            assert step(ignored) == 0 and step.last_step_skipped
            assert (step.steps_skipped, step.consecutive_skips) == (1, 1) and step.scaler.scale == scale
            assert _equal(_local_state(list(model.parameters()), opt), before)
            assert all(p.grad is None for p in model.parameters()) and sched.last_epoch == 1
        step(half)
        assert not step.last_step_skipped and step.consecutive_skips == 0
        return step(batches[2]), _local_state(list(model.parameters()), opt), step

    loss, state, step = run(True)
    clean_loss, clean_state, _ = run(False)
    assert torch.equal(loss, clean_loss) and _equal(state, clean_state)
    limited = TrainStep(step.target, step.optimizer, max_consecutive_skips=2)
    limited(ignored)
    with pytest.raises(NonFiniteStepsError, match=r"^2 steps in a row were skipped \(max_consecutive_skips=2\): the "
                                                  r"last had no predicted token \(every label of the global batch was "
                                                  r"the ignore index -100\)"):
        limited(ignored)


def test_expert_bias_stays_on_a_step_without_a_predicted_token():
    from moe_ep.training import TrainStep

    model = _dsv3()
    step = TrainStep(model, torch.optim.AdamW(model.parameters(), lr=DSV3_LR), expert_bias_rate=RATE)
    batch = _dsv3_batch()
    start = _biases([model])
    step(dict(batch, labels=torch.full_like(batch["labels"], -100)))
    assert step.last_step_skipped and all(torch.equal(b, s) for b, s in zip(_biases([model]), start))


@pytest.mark.parametrize("case", ["before_parallelize", "another_models", "one_missing", "frozen_absent"])
def test_an_optimizer_without_the_models_parameters_is_refused(one_rank, case):
    """The optimizer must hold every trainable parameter of the model as parallelize left it (by
    identity): one built before parallelize (the unsharded parameters) or another model's would
    leave the model unchanged forever; refused naming how many are missing and the first ones,
    before any hook. A frozen parameter may be absent, and the step then trains the others."""
    import moe_ep
    from moe_ep.training import TrainStep

    model = _model()
    names = [name for name, _ in model.named_parameters()]
    first = ", ".join(repr(n) for n in names[:3])
    if case == "before_parallelize":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        target = moe_ep.parallelize(model)
        message = rf"optimizer does not hold {len(names)} of the {len(names)} trainable parameters of " \
                  rf"model_or_stages \({re.escape(first)}, \.\.\.\); it holds {len(names)} parameters that are not " \
                  r"the model's: the step would never change them\. An optimizer built before moe_ep\.parallelize"
    elif case == "another_models":
        target = moe_ep.parallelize(model)
        opt = torch.optim.AdamW(moe_ep.parallelize(_model()).parameters(), lr=1e-2)
        message = rf"optimizer does not hold {len(names)} of the {len(names)} trainable parameters .* it holds " \
                  rf"{len(names)} parameters that are not the model's"
    elif case == "one_missing":
        target = moe_ep.parallelize(model)
        opt = torch.optim.AdamW([p for n, p in target.named_parameters() if n != "lm_head.weight"], lr=1e-2)
        message = rf"^optimizer does not hold 1 of the {len(names)} trainable parameters of model_or_stages " \
                  r"\('lm_head.weight'\): the step would never change them\..* build the optimizer after parallelize"
    else:
        target = moe_ep.parallelize(model)
        target.model.embed_tokens.weight.requires_grad_(False)
        opt = torch.optim.AdamW([p for p in target.parameters() if p.requires_grad], lr=1e-2)
        message = None
    hooks = sum(len(m._forward_hooks) for m in target.modules())
    if message is not None:
        with pytest.raises(ValueError, match=message):
            TrainStep(target, opt, aux_loss_coef=0.01)
        assert sum(len(m._forward_hooks) for m in target.modules()) == hooks
        return
    frozen = target.model.embed_tokens.weight.full_tensor().clone()
    head = target.lm_head.weight.full_tensor().clone()
    TrainStep(target, opt)(tiny_batch(tiny_config("mixtral", **TINY), batch=2, seq=6))
    assert torch.equal(target.model.embed_tokens.weight.full_tensor(), frozen)
    assert not torch.equal(target.lm_head.weight.full_tensor(), head)

@dataclass(frozen=True)
class SkipRun:
    """A 2-rank layout of the skip test: parallelize's degrees, and bf16 compute (FSDP mixed
    precision, fp32 reduction) or not."""

    dp_shard: int | None = None
    pp: int = 1
    microbatches: int | None = None
    bf16: bool = False

    def parallelize_kwargs(self) -> dict:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if self.bf16 else None
        return dict(dp_shard=self.dp_shard, pp=self.pp, microbatches=self.microbatches, mixed_precision=policy)


# Data-parallel halves in fp32 and with bf16 compute, and two pipeline stages.
SKIP_RUNS = {
    "dp2_fp32": SkipRun(dp_shard=2),
    "dp2_bf16": SkipRun(dp_shard=2, bf16=True),
    "pp2": SkipRun(pp=2, microbatches=2),
}


def _skips_on_two_ranks(rank, world, runs):
    """For each layout: a run that meets a NaN gradient of the embedding on rank 0 (finite loss),
    then a NaN logit on rank 1, between clean steps, against a run that never sees them; then a
    step limited to 2 consecutive skips. Compared here, on the rank: tensors do not travel back."""
    import moe_ep
    from moe_ep.training import NonFiniteStepsError, TrainStep

    config = tiny_config("mixtral", **TINY)
    batches = [tiny_batch(config, batch=4, seq=6, seed=s) for s in range(3)]
    out = {}
    for name, run in runs.items():

        def build():
            model = _model()
            target = moe_ep.parallelize(model, **run.parallelize_kwargs())
            meshes = moe_ep.parallel_context(target).meshes
            share = [{k: v.chunk(meshes.dims.dp)[meshes.dp.get_local_rank()] for k, v in b.items()} for b in batches]
            opt = torch.optim.AdamW(target.parameters(), lr=1e-2)
            return model, TrainStep(target, opt, microbatches=2), opt, share

        model, step, opt, share = build()
        params = list(step.params)
        bad_grad = _Poison(model.model.embed_tokens, "grad")
        bad_loss = _Poison(model.lm_head, "output")
        step(share[0])
        before = _local_state(params, opt)
        skipped = []
        for poison, poisoned_rank in ((bad_grad, 0), (bad_loss, 1)):
            poison.armed = rank == poisoned_rank
            loss = step(share[1])
            poison.armed = False
            skipped.append((step.last_step_skipped, math.isfinite(loss.item())))
        untouched = _equal(_local_state(params, opt), before) and all(p.grad is None for p in params)
        loss = step(share[2]).item()
        state = _local_state(params, opt)

        _, clean, clean_opt, _ = build()
        clean(share[0])
        clean_loss = clean(share[2]).item()
        same = loss == clean_loss and _equal(state, _local_state(list(clean.params), clean_opt))

        limited = TrainStep(step.target, opt, microbatches=2, max_consecutive_skips=2)
        bad_grad.armed = rank == 0
        limited(share[1])
        try:
            limited(share[1])
            raised = None
        except NonFiniteStepsError as err:
            raised = str(err)
        out[name] = {"skipped": skipped, "untouched": untouched, "same": same, "raised": raised,
                     "counts": (step.steps_skipped, step.consecutive_skips)}
    return out


@dataclass(frozen=True)
class StepDisagreement:
    """Rank r builds ``TrainStep(target, optimizer, **options[r])`` on the model parallelized with
    ``layout`` (the same on both ranks), its optimizer ``optimizers[r]`` (class name, keyword
    arguments; None: AdamW with lr=1e-3 on both), built before parallelize (over a fresh model's
    parameters, then parallelized) where ``built_before[r]``. ``message``: what every rank raises,
    or each rank's (a rank refusing its own arguments raises its error, the others name it)."""

    options: tuple[dict, dict]
    message: str | tuple[str, str]
    optimizers: tuple[tuple[str, dict], tuple[str, dict]] | None = None
    layout: str = "dp2"
    built_before: tuple[bool, bool] = (False, False)


STEP_AGREE = r"\. Every rank must pass the same arguments and the same model; stopped on every rank$"
STEP_DISAGREEMENTS = {
    "microbatches": StepDisagreement(({}, dict(microbatches=2)), r"^RanksDisagree: TrainStep: ranks disagree on "
                                     r"microbatches: rank 1 has 2, rank 0 has None" + STEP_AGREE),
    "aux_loss_coef": StepDisagreement((dict(aux_loss_coef=0.01), dict(aux_loss_coef=0.02)),
                                      r"^RanksDisagree: TrainStep: ranks disagree on aux_loss_coef: rank 1 has 0.02, "
                                      r"rank 0 has 0.01" + STEP_AGREE),
    "global_aux_loss": StepDisagreement((dict(aux_loss_coef=0.01), dict(aux_loss_coef=0.01, global_aux_loss=True)),
                                        r"^RanksDisagree: TrainStep: ranks disagree on global_aux_loss: rank 1 has True, "
                                        r"rank 0 has False" + STEP_AGREE),
    "z_loss_coef": StepDisagreement(({}, dict(z_loss_coef=1e-3)), r"^RanksDisagree: TrainStep: ranks disagree on "
                                    r"z_loss_coef: rank 1 has 0.001, rank 0 has 0.0" + STEP_AGREE),
    "max_grad_norm": StepDisagreement((dict(max_grad_norm=1.0), {}), r"^RanksDisagree: TrainStep: ranks disagree on "
                                      r"max_grad_norm: rank 1 has None, rank 0 has 1.0" + STEP_AGREE),
    "max_grad_norm_pipeline": StepDisagreement((dict(max_grad_norm=1.0), dict(max_grad_norm=0.5)),
                                               r"^RanksDisagree: TrainStep: ranks disagree on max_grad_norm: rank 1 has "
                                               r"0.5, rank 0 has 1.0" + STEP_AGREE, layout="pp2"),
    "max_consecutive_skips": StepDisagreement(({}, dict(max_consecutive_skips=5)), r"^RanksDisagree: TrainStep: ranks "
                                              r"disagree on max_consecutive_skips: rank 1 has 5, rank 0 has 20" + STEP_AGREE),
    "loss_scale": StepDisagreement(({}, dict(loss_scale="dynamic")), r"^RanksDisagree: TrainStep: ranks disagree on "
                                   r"loss_scale: rank 1 has 'dynamic', rank 0 has None" + STEP_AGREE),
    "learning_rate": StepDisagreement(({}, {}), r"^RanksDisagree: TrainStep: ranks disagree on optimizer group 0: rank 1 "
                                      r"has \{'lr': 0.01, .* over \d+ parameters, rank 0 has \{'lr': 0.001, ",
                                      optimizers=(("AdamW", dict(lr=1e-3)), ("AdamW", dict(lr=1e-2)))),
    "optimizer": StepDisagreement(({}, {}), r"^RanksDisagree: TrainStep: ranks disagree on optimizer: rank 1 has SGD, "
                                  r"rank 0 has AdamW" + STEP_AGREE,
                                  optimizers=(("AdamW", dict(lr=1e-3)), ("SGD", dict(lr=1e-3)))),
    # moe_ep.AdamW's moments dtype is the optimizer's, not its groups'.
    "moments_dtype": StepDisagreement(({}, {}), r"^RanksDisagree: TrainStep: ranks disagree on optimizer moments: rank 1 "
                                      r"has torch.float32, rank 0 has torch.bfloat16" + STEP_AGREE,
                                      optimizers=(("moe_ep.AdamW", dict(lr=1e-3)),
                                                  ("moe_ep.AdamW", dict(lr=1e-3, moments_dtype=torch.float32)))),
    # A NaN coefficient is refused on its rank, and that rank still meets the other.
    "one_rank_nan_coefficient": StepDisagreement((dict(aux_loss_coef=0.01), dict(aux_loss_coef=float("nan"))),
                                                 r"^RanksDisagree: TrainStep: ranks disagree on aux_loss_coef: rank 1 "
                                                 r"has nan, rank 0 has 0.01" + STEP_AGREE),
    # The same refused value on every rank: each raises its own error, no disagreement.
    "nan_coefficient_everywhere": StepDisagreement((dict(z_loss_coef=float("inf")),) * 2,
                                                   r"^ValueError: z_loss_coef must be a finite number >= 0, got inf$"),
    # An optimizer over the unsharded parameters, on one rank: refused there, and the other rank
    # stops naming that refusal instead of waiting for it.
    "one_rank_optimizer_built_before_parallelize": StepDisagreement(
        ({}, {}), (r"^RanksDisagree: TrainStep: rank 1 refused its arguments \(ValueError: optimizer does not hold 21 "
                   r"of the 21 trainable parameters of model_or_stages .*\); stopped on every rank \(rank 0's were "
                   r"accepted\)$",
                   r"^ValueError: optimizer does not hold 21 of the 21 trainable parameters of model_or_stages "
                   r"\('model.embed_tokens.weight', .*it holds 21 parameters that are not the model's"),
        built_before=(False, True)),
    "optimizer_built_before_parallelize_everywhere": StepDisagreement(
        ({}, {}), r"^ValueError: optimizer does not hold 21 of the 21 trainable parameters of model_or_stages "
                  r"\('model.embed_tokens.weight', .*build the optimizer after parallelize", built_before=(True, True)),
    # Each pipeline rank names its own stage's parameters.
    "optimizer_built_before_parallelize_pipeline": StepDisagreement(
        ({}, {}), (r"^ValueError: optimizer does not hold \d+ of the \d+ trainable parameters of model_or_stages "
                   r"\('model.embed_tokens.weight', ",
                   r"^ValueError: optimizer does not hold \d+ of the \d+ trainable parameters of model_or_stages "
                   r"\('model.layers.1."), layout="pp2", built_before=(True, True)),
}
PARALLELIZE = {"dp2": dict(dp_shard=2), "pp2": dict(pp=2, microbatches=2)}


def _step_disagreements(rank, world) -> dict:
    """Each STEP_DISAGREEMENTS case: (what TrainStep raised, seconds, forward hooks it left)."""
    import time

    import moe_ep
    from moe_ep.training import TrainStep

    targets = {layout: moe_ep.parallelize(_model(), **kwargs) for layout, kwargs in PARALLELIZE.items()}
    out = {}
    for name, case in STEP_DISAGREEMENTS.items():
        optimizer_name, kwargs = case.optimizers[rank] if case.optimizers else ("AdamW", dict(lr=1e-3))
        if any(case.built_before):
            model = _model()
            unsharded = list(model.parameters())
            target = moe_ep.parallelize(model, **PARALLELIZE[case.layout])
        else:
            target = targets[case.layout]
        params = unsharded if case.built_before[rank] else target.parameters()
        factory = moe_ep.AdamW if optimizer_name == "moe_ep.AdamW" else getattr(torch.optim, optimizer_name)
        optimizer = factory(params, **kwargs)
        modules = target.modules if case.layout == "pp2" else [target]
        hooks = sum(len(m._forward_hooks) for module in modules for m in module.modules())  # FSDP's own
        start = time.monotonic()
        try:
            TrainStep(target, optimizer, **case.options[rank])
            message = "no error"
        except Exception as exc:  # the test asserts the type and the text
            message = f"{type(exc).__name__}: {exc}"
        seconds = time.monotonic() - start
        hooks_added = sum(len(m._forward_hooks) for module in modules for m in module.modules()) - hooks
        out[name] = (message, seconds, hooks_added)
    return out


class RankBadBatch(NamedTuple):
    """``BAD_BATCHES[bad]`` in the batch of the ranks ``on`` of a 2-rank ``layout``."""

    layout: str
    bad: str
    on: tuple[int, ...]


# Data-parallel halves: each rank checks its own; pipeline stages: both ranks get the whole batch,
# and the rank whose stage never reads the spoiled tensor refuses it too.
RANK_BAD_BATCHES = {
    "dp2_id_at_vocab_size_on_rank_0": RankBadBatch("dp2", "id_at_vocab_size", (0,)),
    "dp2_negative_label_on_rank_1": RankBadBatch("dp2", "negative_label", (1,)),
    "dp2_float_ids_on_both": RankBadBatch("dp2", "float_ids", (0, 1)),
    "pp2_label_at_vocab_size_on_the_last_stage": RankBadBatch("pp2", "label_at_vocab_size", (1,)),
    "pp2_negative_id_on_the_first_stage": RankBadBatch("pp2", "negative_id", (0,)),
    "pp2_float_labels_on_the_first_stage": RankBadBatch("pp2", "float_labels", (0,)),
}


class RankBadForm(NamedTuple):
    """A batch the step cannot run at all, given by the ranks ``on`` of a 2-rank ``layout``: that
    rank's own error (its type, and a pattern of its text) follows the refusal every rank says."""

    layout: str
    spoil: object  # the rank's share of the batch -> what it passes instead
    on: tuple[int, ...]
    error_type: str
    error: str


RANK_BAD_FORMS = {
    "dp2_odd_rows_on_rank_1": RankBadForm(
        "dp2", lambda b: {k: v[:1] for k, v in b.items()}, (1,), "ValueError",
        r"batch of 1 sequences cannot be cut into 2 micro-batches"),
    "pp2_not_a_dict_on_the_first_stage": RankBadForm(
        "pp2", lambda b: [b], (0,), "TypeError", r"batch must be a dict with 'input_ids'"),
    "pp2_another_shape_on_the_last_stage": RankBadForm(
        "pp2", lambda b: {k: v[:, :-1] for k, v in b.items()}, (1,), "ValueError",
        r"input_ids of shape \(4, 5\), but these pipeline stages run batches of shape \[4, 6\]"),
}
# Before a pipeline's first step, which fixes the shape of the activations its stages exchange,
# there is no stand-in shape: the ranks agree on the batch's shape first. (spoil, the message of
# each rank of the pipeline.)
FIRST_STEP_FORMS = {
    "pp2_first_step_another_shape_on_the_last_stage": (
        lambda b: {k: v[:2] for k, v in b.items()},
        [r"ValueError: the ranks of a pipeline must run batches of one \[batch, seq\] shape, .* got \[\(4, 6\), "
         r"\(2, 6\)\] \(pipeline rank 0, 1, ...\)"] * 2),
    "pp2_first_step_odd_rows_on_the_last_stage": (
        lambda b: {k: v[:3] for k, v in b.items()},
        [r"ValueError: pipeline rank 1 cannot run its first batch \(its own error says why\), so this rank's batch of "
         r"shape \(4, 6\) is not run either",
         r"ValueError: batch of 3 sequences cannot be cut into 2 micro-batches"]),
}
FORM_REFUSAL = ("TrainStep refused the batch on every rank, nothing was applied: the batch is not one the step can "
                "run (its type, keys or shape) on 1 rank, whose own error names what is wrong")
# The steps of the 2-rank batch test after its bad batches, and of the one-process run it is
# compared with: clean, every label ignored (skipped), the first half of the sequences (rank 0's
# share with dp2) ignored (taken), clean.
EMPTY_STEPS = ("clean", "all_ignored", "half_ignored", "clean")


def _step_batches() -> list[dict]:
    config = tiny_config("mixtral", **TINY)
    out = []
    for seed, kind in enumerate(EMPTY_STEPS):
        batch = tiny_batch(config, batch=4, seq=6, seed=seed)
        if kind == "all_ignored":
            batch["labels"][:] = -100
        elif kind == "half_ignored":
            batch["labels"][:2] = -100
        out.append(batch)
    return out


def _bad_batches_on_two_ranks(rank, world):
    """Per layout: the messages of RANK_BAD_BATCHES' steps (with whether the weights, optimizer
    state and gradients were left as they were), then EMPTY_STEPS' losses and skips."""
    import moe_ep
    from moe_ep.training import TrainStep

    out = {}
    for layout, kwargs in PARALLELIZE.items():
        target = moe_ep.parallelize(_model(), **kwargs)
        dp = moe_ep.parallel_context(target).meshes.dims.dp
        opt = torch.optim.AdamW(target.parameters(), lr=1e-2, weight_decay=0.1)
        step = TrainStep(target, opt, microbatches=2 if layout == "dp2" else None)
        params = list(step.params)
        share = [{k: v.chunk(dp)[rank if dp > 1 else 0] for k, v in b.items()} for b in _step_batches()]
        refused = {}
        for name, (spoil, _) in FIRST_STEP_FORMS.items():
            if name.startswith(layout):
                before = _local_state(params, opt)
                try:
                    step(spoil(share[0]) if rank == 1 else share[0])
                    message = "no error"
                except Exception as exc:  # the test asserts the type and the text
                    message = f"{type(exc).__name__}: {exc}"
                untouched = _equal(_local_state(params, opt), before) and all(p.grad is None for p in params)
                refused[name] = (message, untouched, step.steps_skipped)
        losses, skipped = [step(share[0]).item()], [step.last_step_skipped]
        for name, case in RANK_BAD_BATCHES.items():
            if case.layout != layout:
                continue
            before = _local_state(params, opt)
            batch = _spoiled(share[1], BAD_BATCHES[case.bad]) if rank in case.on else share[1]
            try:
                step(batch)
                message = "no error"
            except Exception as exc:  # the test asserts the type and the text
                message = f"{type(exc).__name__}: {exc}"
            untouched = _equal(_local_state(params, opt), before) and all(p.grad is None for p in params)
            refused[name] = (message, untouched, step.steps_skipped)
        for name, form in RANK_BAD_FORMS.items():
            if form.layout != layout:
                continue
            before = _local_state(params, opt)
            try:
                step(form.spoil(share[1]) if rank in form.on else share[1])
                message = "no error"
            except Exception as exc:  # the test asserts the type and the text
                message = f"{type(exc).__name__}: {exc}"
            untouched = _equal(_local_state(params, opt), before) and all(p.grad is None for p in params)
            refused[name] = (message, untouched, step.steps_skipped)
        for batch in share[1:]:
            before = _local_state(params, opt)
            losses.append(step(batch).item())
            skipped.append(step.last_step_skipped)
            if step.last_step_skipped:
                skipped.append(_equal(_local_state(params, opt), before))
        out[layout] = {"refused": refused, "losses": losses, "skipped": skipped}
    return out


def _two_ranks(rank, world, runs):
    return {"skips": _skips_on_two_ranks(rank, world, runs), "disagreements": _step_disagreements(rank, world),
            "batches": _bad_batches_on_two_ranks(rank, world)}


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_two_ranks, 2, SKIP_RUNS, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(STEP_DISAGREEMENTS))
def test_ranks_building_different_train_steps_stop_with_the_first_difference(two_ranks, name):
    """TrainStep's options, optimizer and learning rate, on data-parallel ranks and on two
    pipeline stages: every rank stops with the same message naming the first difference, in
    seconds (the world's collectives time out after 60 s), leaving no hook on the model. An
    optimizer built before parallelize: refused on its rank, and every other rank stops naming
    that refusal (on every rank: each names its own stage's parameters)."""
    results = [r["disagreements"][name] for r in two_ranks]
    message = STEP_DISAGREEMENTS[name].message
    if isinstance(message, str):
        assert results[0][0] == results[1][0], results
        message = (message, message)
    assert all(re.search(m, r[0]) for m, r in zip(message, results)), results
    assert max(seconds for _, seconds, _ in results) < 30
    assert all(hooks == 0 for _, _, hooks in results)


@pytest.mark.slow
def test_a_non_finite_step_on_one_rank_is_skipped_on_every_rank(two_ranks):
    """2 gloo ranks, data-parallel (fp32, bf16 compute) and as 2 pipeline stages: a NaN gradient on
    rank 0 with a finite loss, and a NaN loss on rank 1, are each skipped on both ranks, leaving
    weights and optimizer state bit-equal; the next step is bit-equal to that of a run that never
    met them; the consecutive-skip limit raises on both ranks at the same step."""
    ranks = [r["skips"] for r in two_ranks]
    for name in SKIP_RUNS:
        for result in (r[name] for r in ranks):
            assert result["skipped"] == [(True, True), (True, False)], name
            assert result["untouched"] and result["same"], name
            assert result["counts"] == (2, 0), name
            assert result["raised"] is not None and result["raised"].startswith(
                "2 steps in a row were skipped (max_consecutive_skips=2)"), name


@pytest.mark.parametrize("name", list(RANK_BAD_BATCHES))
def test_a_bad_batch_on_one_rank_stops_every_rank_with_the_same_message(two_ranks, name):
    """2 gloo ranks, data-parallel and as 2 pipeline stages: token ids or labels out of range or of
    a wrong dtype on one rank (or both) stop every rank with the same ValueError naming the tensor,
    the range and how many ranks had it (not a raw error on one rank and a gloo error on the other),
    nothing applied on any rank."""
    case = RANK_BAD_BATCHES[name]
    results = [r["batches"][case.layout]["refused"][name] for r in two_ranks]
    assert results[0] == results[1], results
    message, untouched, steps_skipped = results[0]
    assert re.search(_refusal(BAD_BATCHES[case.bad], len(case.on)), message.removeprefix("ValueError: ")), message
    assert message.startswith("ValueError: ") and untouched and steps_skipped == 0


@pytest.mark.parametrize("name", list(RANK_BAD_FORMS))
def test_a_batch_one_rank_cannot_run_stops_every_rank_not_that_rank_alone(two_ranks, name):
    """2 gloo ranks, data-parallel and as 2 pipeline stages: a batch of a type, rows or shape the
    step cannot run on one rank (which would have raised there alone, leaving the other rank in the
    step's collectives until the process group's timeout, or aborting it in gloo) is run as a
    harmless stand-in and refused on every rank at the step's read-back: the same refusal on both,
    the rank's own error after it, nothing applied."""
    form = RANK_BAD_FORMS[name]
    for rank, (message, untouched, steps_skipped) in enumerate(r["batches"][form.layout]["refused"][name]
                                                               for r in two_ranks):
        if rank in form.on:
            assert message.startswith(f"{form.error_type}: {FORM_REFUSAL} (this rank's batch: "), message
            assert re.search(form.error, message), message
        else:
            assert message == f"ValueError: {FORM_REFUSAL}", message
        assert untouched and steps_skipped == 0


@pytest.mark.parametrize("name", list(FIRST_STEP_FORMS))
def test_a_first_pipeline_step_of_batches_of_two_shapes_stops_every_rank(two_ranks, name):
    """Before the first step of 2 pipeline stages (no shape is known for a stand-in yet): a batch
    of another shape on one rank, or one it cannot run, stops both ranks with a message naming the
    shapes or the refusing rank (not a crash in the schedule's shape inference on one rank and a
    lost connection on the other); nothing applied, and the steps after run as usual (the test
    below)."""
    _, messages = FIRST_STEP_FORMS[name]
    for pattern, (message, untouched, steps_skipped) in zip(messages, (r["batches"]["pp2"]["refused"][name]
                                                                       for r in two_ranks)):
        assert re.match(pattern, message), message
        assert untouched and steps_skipped == 0


def _first_step_on_two_pipelines(rank, world):
    """pp=2 x dp_shard=2: the first batch of rank 3 (the last stage of the second pipeline) has 3
    rows, which its 2 micro-batches cannot cut; then a step of good batches."""
    import moe_ep
    from moe_ep.training import TrainStep

    target = moe_ep.parallelize(_model(), pp=2, dp_shard=2, microbatches=2)
    step = TrainStep(target, torch.optim.SGD(target.parameters(), lr=0.0))
    batch = tiny_batch(tiny_config("mixtral", **TINY), batch=8, seq=6, seed=0)
    share = {k: v.chunk(2)[target.meshes.dp_group.rank()] for k, v in batch.items()}
    try:
        step({k: v[:3] for k, v in share.items()} if rank == 3 else share)
        message = "no error"
    except ValueError as exc:
        message = str(exc)
    return message, math.isfinite(step(share).item())


@pytest.mark.slow
def test_a_first_pipeline_step_stops_the_other_data_parallel_pipelines_too():
    """The shapes are agreed within each pipeline, and whether any pipeline stopped over the
    data-parallel group: the other pipeline's ranks, whose own batches are fine, stop too rather
    than wait in the step's data-parallel collectives; the next step trains on every rank."""
    results = run_ranks(_first_step_on_two_pipelines, 4, timeout=300)
    others = "a rank of another data-parallel pipeline cannot run its first batch (its own error says why)"
    assert [message.split(", so")[0] for message, _ in results] == [
        others, "pipeline rank 1 cannot run its first batch (its own error says why)", others,
        "batch of 3 sequences cannot be cut into 2 micro-batches: microbatches=2 must divide input_ids' first "
        "dimension, got shape (3, 6)"]
    assert all(trained for _, trained in results)


@pytest.mark.parametrize("layout", list(PARALLELIZE))
def test_steps_around_bad_and_empty_batches_on_two_ranks_equal_one_process(two_ranks, layout):
    """After the refused batches, on 2 gloo ranks (data-parallel and pipeline stages): a step with
    every label ignored is skipped on both ranks with nothing applied; one where rank 0's share (the
    first half of the sequences) is all ignored is taken; every loss equals one process's on the
    whole batch, which never met the bad batches."""
    from moe_ep.training import TrainStep

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    step = TrainStep(model, opt, microbatches=4 if layout == "dp2" else 2)
    losses, skipped = [], []
    for batch in _step_batches():
        losses.append(step(batch).item())
        skipped.append(step.last_step_skipped)
        if step.last_step_skipped:
            skipped.append(True)  # the ranks also report that nothing was applied
    assert skipped == [False, True, True, False, False]
    for result in (r["batches"][layout] for r in two_ranks):
        assert result["skipped"] == skipped
        assert rel_err(torch.tensor(result["losses"]), torch.tensor(losses)) <= TOLERANCE[torch.float32], (
            result["losses"], losses)
