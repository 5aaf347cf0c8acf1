"""The chunked linear cross-entropy (moe_ep.ops.linear_cross_entropy) and TrainStep's
``chunked_loss``: the loss, z-loss and the gradients of the hidden states, head weight and bias
against a float64 reference of the full logits (fp32 and bf16 inputs, ragged and oversized
chunks, every label ignored, one token); the label shift against transformers' ForCausalLMLoss;
what it refuses; and TrainStep's losses and parameter updates over 3 steps with and without the switch,
in one process (untied and tied embeddings; also as one pipeline stage) and on 2 gloo ranks with
expert parallelism and as 2 pipeline stages (against one process without the switch)."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F

from dist_utils import run_ranks
from hf_models import tiny_batch, tiny_config, tiny_model
from numerics import TOLERANCE, rel_err

# 4 layers: ZB-V cuts 2 ranks into 4 stages.
TINY = dict(num_hidden_layers=4, num_local_experts=4, intermediate_size=24)
STEPS = 3
# Parameter updates over STEPS steps across layouts or summation orders, in float32: the rounding
# of each order, carried through 4 layers onto the router's small gradients (the losses, and every
# one-process comparison, stay within TOLERANCE). The chunked loss's own order alone moved a
# router's update by 1.5e-5 on an AMD EPYC (MKL), by less than 1e-5 on the machines before it.
UPDATE_TOLERANCE = 5e-5


class Case(NamedTuple):
    tokens: int
    vocab: int
    hidden: int
    chunk: int | None
    ignored: str  # "none", "some" (every third), "chunk" (tokens 8..15), "all"
    bias: bool = False


CASES = {
    "chunk_divides_tokens": Case(32, 50, 16, 8, "some"),
    "ragged_last_chunk": Case(37, 50, 16, 8, "some"),
    "chunk_above_tokens": Case(5, 50, 16, 64, "none"),
    "one_token": Case(1, 50, 16, None, "none"),
    "every_label_ignored": Case(12, 50, 16, 4, "all"),
    "one_chunk_all_ignored": Case(24, 50, 16, 8, "chunk"),
    "default_chunk": Case(40, 200, 16, None, "some"),
    "bias": Case(21, 50, 16, 6, "some", bias=True),
}


def _inputs(case: Case, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(case.tokens, case.hidden, generator=g).to(dtype)
    weight = (torch.randn(case.vocab, case.hidden, generator=g) * case.hidden ** -0.5).to(dtype)
    bias = torch.randn(case.vocab, generator=g).to(dtype) if case.bias else None
    target = torch.randint(0, case.vocab, (case.tokens,), generator=g)
    if case.ignored == "some":
        target[::3] = -100
    elif case.ignored == "chunk":
        target[8:16] = -100
    elif case.ignored == "all":
        target[:] = -100
    return hidden, weight, bias, target


def _reference(hidden, weight, bias, target, z_loss_coef):
    """The full logits in float64: (loss sum with z-loss, z sum, d hidden, d weight, d bias)."""
    leaves = [t.double().requires_grad_() if t is not None else None for t in (hidden, weight, bias)]
    h, w, b = leaves
    logits = h @ w.T + (b if b is not None else 0)
    valid = (target != -100).double()
    lse = torch.logsumexp(logits, dim=1)
    z = (lse.square() * valid).sum()
    loss = F.cross_entropy(logits, target, ignore_index=-100, reduction="sum") + z_loss_coef * z
    grads = torch.autograd.grad(loss, [t for t in leaves if t is not None])
    return (loss.detach(), z.detach(), *grads)


@pytest.mark.parametrize("z_loss_coef", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_loss_and_gradients_equal_the_full_logits_in_float64(name, dtype, z_loss_coef):
    from moe_ep.ops.linear_cross_entropy import linear_cross_entropy

    case = CASES[name]
    hidden, weight, bias, target = _inputs(case, dtype)
    leaves = [t.clone().requires_grad_() if t is not None else None for t in (hidden, weight, bias)]
    h, w, b = leaves
    loss, z = linear_cross_entropy(h, w, target, b, z_loss_coef=z_loss_coef, chunk_tokens=case.chunk)
    assert loss.dtype == z.dtype == torch.float32 and not z.requires_grad
    grads = torch.autograd.grad(loss * 0.5, [t for t in leaves if t is not None])
    ref = _reference(hidden, weight, bias, target, z_loss_coef)
    tol = TOLERANCE[dtype]
    assert rel_err(loss, ref[0]) <= tol and rel_err(z, ref[1]) <= tol, (loss, ref[0], z, ref[1])
    for got, leaf, want in zip(grads, [t for t in leaves if t is not None], ref[2:]):
        assert got.dtype == leaf.dtype
        assert rel_err(got, 0.5 * want) <= tol, rel_err(got, 0.5 * want)
    if case.ignored == "all":
        assert loss.item() == 0 and all(g.abs().max().item() == 0 for g in grads)


def test_float_defaults_trace_in_one_graph_under_dynamic_shapes():
    """torch.compile(dynamic=True) makes ``z_loss_coef``'s default symbolic: its check traces on
    it, with no graph break and the eager loss."""
    import torch._dynamo.testing
    from moe_ep.ops.linear_cross_entropy import linear_cross_entropy

    hidden, weight, _, target = _inputs(CASES["ragged_last_chunk"], torch.float32)
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(lambda h, w, t: linear_cross_entropy(h, w, t)[0], backend=counter, dynamic=True)
    assert torch.equal(compiled(hidden, weight, target), linear_cross_entropy(hidden, weight, target)[0])
    assert counter.frame_count == 1


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16_inputs", "fp32_under_autocast"])
def test_half_precision_logits_come_from_the_heads_own_gemm(autocast):
    """The head's GEMM runs in the compute dtype, as transformers' lm_head (float32 GEMMs of a
    bf16 model took the two-layer Mixtral step to 2.5x its time on an H200): the loss equals
    cross-entropy over the bf16 product's logits taken in float32, to float32 rounding."""
    from moe_ep.ops.linear_cross_entropy import linear_cross_entropy

    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(37, 64, generator=g)
    weight = torch.randn(300, 64, generator=g) * 0.125
    target = torch.randint(0, 300, (37,), generator=g)
    want = F.cross_entropy((hidden.bfloat16() @ weight.bfloat16().T).float(), target, reduction="sum")
    if autocast:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = linear_cross_entropy(hidden, weight, target, chunk_tokens=8)
    else:
        loss, _ = linear_cross_entropy(hidden.bfloat16(), weight.bfloat16(), target, chunk_tokens=8)
    assert rel_err(loss, want) <= 1e-6, (loss, want)


def test_the_head_gemms_run_in_the_autocast_dtype_the_model_ran_under(monkeypatch):
    """Under mixed precision the model's own head runs in bf16, but the chunked loss came after
    the autocast block (TrainStep) or after the forward that accelerate's autocast wraps (the
    Trainer, an accelerate loop): its head GEMMs ran in float32, at 2.5x the step's time on an
    H200. Each now runs under the autocast its forward ran under, and without one under none."""
    import functools
    import importlib

    import moe_ep
    from moe_ep.training import TrainStep

    lce = importlib.import_module("moe_ep.ops.linear_cross_entropy")  # the module, not the function
    seen = []
    real = lce._LinearCrossEntropy.apply

    def spy(*args):
        seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        return real(*args)

    monkeypatch.setattr(lce._LinearCrossEntropy, "apply", spy)
    model = tiny_model("mixtral", **TINY).train()
    batch = tiny_batch(model.config, batch=2, seq=6)
    TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), chunked_loss=True,
              autocast_dtype=torch.bfloat16)(dict(batch))
    TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), chunked_loss=True)(dict(batch))
    forward = model.forward
    model.forward = functools.wraps(forward)(torch.autocast("cpu", dtype=torch.bfloat16)(forward))  # as accelerate
    moe_ep.chunked_causal_lm_loss(model, batch["labels"], input_ids=batch["input_ids"])
    model.forward = forward
    moe_ep.chunked_causal_lm_loss(model, batch["labels"], input_ids=batch["input_ids"])
    assert seen == [torch.bfloat16, None, torch.bfloat16, None]


@pytest.mark.slow
def test_label_shift_and_mean_equal_transformers_for_causal_lm_loss():
    """Sum over the shifted labels of each sequence (the last position predicts nothing), divided
    by the predicted tokens: transformers' ForCausalLMLoss with num_items_in_batch, in float64."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    from moe_ep.ops.linear_cross_entropy import linear_cross_entropy, shift_labels

    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 9, 16, dtype=torch.float64, generator=g)
    weight = torch.randn(40, 16, dtype=torch.float64, generator=g) * 0.25
    labels = torch.randint(0, 40, (3, 9), generator=g)
    labels[0, :4] = -100
    labels[2, -1] = -100
    predicted = (labels[:, 1:] != -100).sum()
    want = ForCausalLMLoss(hidden @ weight.T, labels, 40, num_items_in_batch=predicted)
    loss, _ = linear_cross_entropy(hidden.reshape(-1, 16).float(), weight.float(), shift_labels(labels), chunk_tokens=5)
    assert rel_err(loss / predicted, want) <= TOLERANCE[torch.float32]


def test_shift_labels_are_the_targets_as_given_as_transformers_takes_them():
    """A batch that carries ``shift_labels`` (a packing collator masking each document's first
    token: the position before it predicts nothing) is trained on those targets, as the model's
    own loss takes them; the chunked loss re-shifted ``labels`` and was 10% off. Against the
    model's own loss in float64, with and without labels beside them, with the Trainer's count or
    the batch's mean."""
    import copy

    import moe_ep

    model = tiny_model("mixtral", **TINY).train()
    reference = copy.deepcopy(model).double()
    batch = tiny_batch(model.config, batch=3, seq=8, seed=2)
    shifted = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    shifted[:, 4] = -100  # a document starts at position 5
    shifted[1, 6] = -100
    count = (shifted != -100).sum()
    for num_items in (None, count + 5):
        want = reference(input_ids=batch["input_ids"], labels=batch["labels"], shift_labels=shifted,
                         num_items_in_batch=num_items).loss
        for labels in (batch["labels"], None):
            loss, _ = moe_ep.chunked_causal_lm_loss(model, labels, shift_labels=shifted, num_items_in_batch=num_items,
                                                   input_ids=batch["input_ids"])
            assert rel_err(loss, want) <= TOLERANCE[torch.float32], (num_items, labels)
    bad = shifted.clone()
    bad[0, 0] = model.config.vocab_size
    with pytest.raises(ValueError, match=rf"shift_labels must hold token ids in \[0, {model.config.vocab_size}\)"):
        moe_ep.chunked_causal_lm_loss(model, batch["labels"], shift_labels=bad, input_ids=batch["input_ids"])
    with pytest.raises(ValueError, match="needs labels or shift_labels"):
        moe_ep.chunked_causal_lm_loss(model, None, input_ids=batch["input_ids"])


def test_refusals_name_the_argument():
    from moe_ep.ops.linear_cross_entropy import linear_cross_entropy, shift_labels

    h, w, t = torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"hidden_TH \[T, H\], weight_VH \[V, H\] and target_T \[T\] must agree"):
        linear_cross_entropy(h, torch.randn(10, 7), t)
    with pytest.raises(TypeError, match="target_T must be int64 or int32, got torch.float32"):
        linear_cross_entropy(h, w, t.float())
    with pytest.raises(ValueError, match="chunk_tokens must be an int >= 1 or None, got 0"):
        linear_cross_entropy(h, w, t, chunk_tokens=0)
    with pytest.raises(ValueError, match="z_loss_coef must be a finite number >= 0"):
        linear_cross_entropy(h, w, t, z_loss_coef=-1.0)
    for label in (10, -1):  # V, and a negative id that is not ignore_index
        bad = torch.tensor([0, 3, label, -100])
        with pytest.raises(ValueError, match=rf"target_T must hold token ids in \[0, 10\) or ignore_index=-100, "
                                             rf"got {label} at index 2"):
            linear_cross_entropy(h, w, bad)
    for weight in (torch.randn(0, 8), torch.randn(10, 0)):
        hidden = torch.randn(4, weight.shape[1])
        with pytest.raises(ValueError, match=r"weight_VH \[V, H\] must have V >= 1 and H >= 1, got shape"):
            linear_cross_entropy(hidden, weight, t)
    with pytest.raises(TypeError, match="labels must be int64 or int32, got torch.float32"):
        shift_labels(torch.zeros(2, 3))
    h.requires_grad_()
    loss, _ = linear_cross_entropy(h, w, t)
    (dh,) = torch.autograd.grad(loss, h, create_graph=True)
    with pytest.raises(RuntimeError, match="linear_cross_entropy is differentiable once"):
        dh.sum().backward()
    # A gradient penalty beside the loss: the penalty's derivative is refused, not silently 0.
    h.grad = None
    loss, _ = linear_cross_entropy(h, w, t)
    (dh,) = torch.autograd.grad(loss, h, create_graph=True)
    with pytest.raises(RuntimeError, match="linear_cross_entropy is differentiable once"):
        (loss + dh.square().sum()).backward()


def test_an_ignored_token_leaves_the_loss_whatever_its_hidden_state():
    """A NaN hidden state at an ignored position (padding a model never normalised) is left out
    of the sum, as F.cross_entropy leaves it out: the loss is the float64 one of the others."""
    from moe_ep.ops.linear_cross_entropy import linear_cross_entropy

    g = torch.Generator().manual_seed(4)
    h, w = torch.randn(9, 8, generator=g), torch.randn(20, 8, generator=g)
    t = torch.randint(0, 20, (9,), generator=g)
    t[[2, 7]] = -100
    want = F.cross_entropy(h.double() @ w.double().T, t, reduction="sum")
    h[[2, 7]] = torch.tensor([float("nan"), float("inf")])[:, None]
    for z_loss_coef in (0.0, 1e-3):
        loss, z_sum = linear_cross_entropy(h, w, t, z_loss_coef=z_loss_coef, chunk_tokens=4)
        assert torch.isfinite(loss) and torch.isfinite(z_sum)
    loss, _ = linear_cross_entropy(h, w, t, chunk_tokens=4)
    assert rel_err(loss, want) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_no_gradient_work_where_grad_mode_is_off(mode):
    """Evaluation (inputs that require grad, grad mode off) runs one GEMM per chunk, the logits',
    as on detached inputs; with grad mode on each chunk also runs the two gradient GEMMs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from moe_ep.ops.linear_cross_entropy import linear_cross_entropy

    class CountMatmuls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # inference_mode dispatches matmul itself, not the mm it decomposes into.
            self.count += func.overloadpacket.__name__ in ("mm", "matmul", "addmm_")
            return func(*args, **(kwargs or {}))

    h, w = torch.randn(12, 8, requires_grad=True), torch.randn(10, 8, requires_grad=True)
    t = torch.randint(0, 10, (12,))
    want, _ = linear_cross_entropy(h.detach(), w.detach(), t, chunk_tokens=4)
    with getattr(torch, mode)(), CountMatmuls() as counted:
        loss, _ = linear_cross_entropy(h, w, t, chunk_tokens=4)
    assert counted.count == 3 and not loss.requires_grad and torch.equal(loss, want)
    with CountMatmuls() as counted:
        linear_cross_entropy(h, w, t, chunk_tokens=4)
    assert counted.count == 9


@pytest.mark.slow
def test_train_step_refuses_a_model_that_transforms_its_logits():
    from moe_ep.training import TrainStep

    model = tiny_model("mixtral", **TINY, final_logit_softcapping=30.0).train()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match=r"config has final_logit_softcapping=30.0 \(expected None\)"):
        TrainStep(model, opt, chunked_loss=True)
    with pytest.raises(TypeError, match="chunked_loss must be a bool, got 'yes'"):
        TrainStep(model, opt, chunked_loss="yes")


@pytest.mark.slow
def test_a_model_whose_forward_changes_its_head_logits_is_refused_at_its_first_step():
    """A family whose forward transforms its logits in a way no config field names (here: a hook
    scaling the head's output, as Inkling scales the hidden states before its head) is found out
    on the first forward, by comparing the last position's logits with the head's linear map."""
    import moe_ep
    from moe_ep.training import TrainStep

    message = "InklingLike's forward returns other logits"
    config = tiny_config("mixtral", **TINY)
    batch = tiny_batch(config, batch=2, seq=6)
    plain = tiny_model("mixtral", **TINY).train()
    loss, outputs = moe_ep.chunked_causal_lm_loss(plain, batch["labels"], input_ids=batch["input_ids"])
    assert rel_err(loss, plain(**batch).loss) <= TOLERANCE[torch.float32] and outputs.logits.numel() == 0
    with pytest.raises(ValueError, match=r"labels must be \[batch, seq\] = \(2, 6\) as the hidden states, got shape"):
        moe_ep.chunked_causal_lm_loss(plain, batch["labels"][:, :5], input_ids=batch["input_ids"])
    labels = batch["labels"].clone()
    labels[1, 3] = config.vocab_size
    with pytest.raises(ValueError, match=rf"labels\[:, 1:\] must hold token ids in \[0, {config.vocab_size}\)"):
        moe_ep.chunked_causal_lm_loss(plain, labels, input_ids=batch["input_ids"])

    # A first forward that is not finite checks nothing (its step is skipped, as without the
    # chunked loss); the next one does.
    broken = tiny_model("mixtral", **TINY).train()
    step = TrainStep(broken, torch.optim.SGD(broken.parameters(), lr=0.1), chunked_loss=True)
    with torch.no_grad():
        broken.model.norm.weight[0] = float("nan")
    step(batch)
    assert step.last_step_skipped
    with torch.no_grad():
        broken.model.norm.weight[0] = 1.0
    broken.lm_head.register_forward_hook(lambda module, args, out: out / 4.0)
    with pytest.raises(ValueError, match=message.replace("InklingLike", type(broken).__name__)):
        step(batch)

    for chunked in ("loop", "step"):
        model = tiny_model("mixtral", **TINY).train()
        model.__class__ = type("InklingLike", (type(model),), {})
        model.lm_head.register_forward_hook(lambda module, args, out: out / 4.0)
        with pytest.raises(ValueError, match=message):
            if chunked == "loop":
                moe_ep.chunked_causal_lm_loss(model, batch["labels"], input_ids=batch["input_ids"])
            else:
                TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), chunked_loss=True)(batch)
        assert all(p.grad is None for p in model.parameters())


@pytest.mark.slow
def test_pipeline_stages_with_the_chunked_loss_equal_the_full_logits_in_one_process():
    """A one-stage pipeline (GPipe, 2 micro-batches) on a one-rank gloo group: its last stage
    returns the hidden states and the loss applies the head; 3 steps give the losses and updates
    of the full-logits stages. The stages' loss input is fixed by their first TrainStep: one with
    the other switch on the same stages is refused at its first step."""
    import torch.distributed as dist

    from moe_ep.parallel.pipeline import build_pipeline
    from moe_ep.training import TrainStep

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        losses, updates = [], []
        for chunked in (False, True):
            stages = build_pipeline(_model(False), dist.group.WORLD, schedule="gpipe", microbatches=2, split_points=[])
            before = {k: p.detach().clone() for k, p in stages.named_parameters()}
            losses.append(_run(stages, _batches(), chunked_loss=chunked, microbatches=None))
            updates.append({k: p.detach() - before[k] for k, p in stages.named_parameters()})
        other = TrainStep(stages, torch.optim.SGD(stages.parameters(), lr=0.1), chunked_loss=False)
        with pytest.raises(ValueError, match="computes the loss from their hidden .* not their logits"):
            other(_batches()[0])
    finally:
        dist.destroy_process_group()
    assert rel_err(torch.tensor(losses[1]), torch.tensor(losses[0])) <= TOLERANCE[torch.float32], losses
    for name, want in updates[0].items():
        assert rel_err(updates[1][name], want) <= UPDATE_TOLERANCE, name


def _model(tied: bool):
    from moe_ep.hf import patch

    return patch(tiny_model("mixtral", **TINY, tie_word_embeddings=tied), fused_router=True).train()


def _batches():
    config = tiny_config("mixtral", **TINY)
    batches = [tiny_batch(config, batch=4, seq=6, seed=s) for s in range(STEPS)]
    batches[1]["labels"][0, 2:] = -100  # a micro-batch with fewer predicted tokens
    return batches


def _run(model, batches, *, chunked_loss, microbatches=2):
    from moe_ep.training import TrainStep

    # SGD: its update is linear in the gradient, so comparing updates compares gradients. Adam's
    # m / sqrt(v) would amplify the float32 rounding of near-zero gradients (embedding rows of
    # rare tokens) that FSDP's different summation order alone gives, with or without the switch.
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), microbatches=microbatches,
                     chunked_loss=chunked_loss, aux_loss_coef=0.01)
    return [step(b).item() for b in batches]


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_train_step_with_the_chunked_loss_equals_the_full_logits_in_one_process(tied):
    """3 SGD steps of a tiny Mixtral (2 micro-batches, aux loss on): the same losses and
    parameter updates with and without the switch; tied, the one embedding parameter gets the
    head's gradient too (it moves as the full-logits run moves it)."""
    losses, updates = [], []
    for chunked in (False, True):
        model = _model(tied)
        if tied:
            assert model.lm_head.weight is model.model.embed_tokens.weight
        before = {k: v.clone() for k, v in model.state_dict().items()}
        losses.append(_run(model, _batches(), chunked_loss=chunked))
        updates.append({k: v - before[k] for k, v in model.state_dict().items()})
    assert rel_err(torch.tensor(losses[1]), torch.tensor(losses[0])) <= TOLERANCE[torch.float32], losses
    for name, want in updates[0].items():
        assert rel_err(updates[1][name], want) <= UPDATE_TOLERANCE, name


class Layout(NamedTuple):
    """A 2-rank layout: parallelize(ep=2) (dp_shard=2 over both ranks), or 2 pipeline ranks under
    ``schedule`` (each rank the whole batch); embeddings tied or not."""

    tied: bool
    pp: int = 1
    schedule: str | None = None


LAYOUTS = {
    "ep2": Layout(tied=False),
    "ep2_tied": Layout(tied=True),
    "pp2_1f1b": Layout(tied=False, pp=2, schedule="1f1b"),
    # ZB-V: the first and the last stage on rank 0, the tied head one parameter; its backward is
    # split into an input pass and a weight pass.
    "pp2_zbv_tied": Layout(tied=True, pp=2, schedule="zbv"),
}


def _chunked_on_two_ranks(rank, world, layouts):
    """Each layout, with and without the switch: the losses, and the parameter updates of this
    rank (all of them with ep=2, its stages' with pp=2); one process's losses on the whole batch
    with the full logits. Compared on the rank (tensors do not travel back)."""
    import moe_ep
    from torch.distributed.tensor import DTensor

    batches = _batches()
    out = {}
    for name, layout in layouts.items():
        # The same micro-batches as the layout's (the aux loss is a mean over micro-batches): each
        # ep rank cuts its 2 sequences in 2, the pipeline cuts the 4 sequences in 2.
        ref_losses = _run(_model(layout.tied), batches, chunked_loss=False, microbatches=4 if layout.pp == 1 else 2)
        runs = {}
        for chunked in (False, True):
            model = _model(layout.tied)
            before = {k: v.clone() for k, v in model.state_dict().items()}
            if layout.pp == 1:
                target = moe_ep.parallelize(model, ep=2)
                share = [{k: v.chunk(world)[rank] for k, v in b.items()} for b in batches]
                losses = _run(target, share, chunked_loss=chunked)
                state = moe_ep.full_state_dict(target, cpu_offload=False)
            else:
                target = moe_ep.parallelize(model, pp=2, schedule=layout.schedule, microbatches=2)
                losses = _run(target, batches, chunked_loss=chunked, microbatches=None)
                state = {k: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
                         for k, p in target.named_parameters()}
            runs[chunked] = losses, {k: v - before[k] for k, v in state.items()}
        (full_losses, full_updates), (losses, updates) = runs[False], runs[True]
        errors = [rel_err(updates[k], want) for k, want in full_updates.items()]
        out[name] = (losses, full_losses, ref_losses, max(errors), bool(errors) and set(updates) == set(full_updates))
    return out


@pytest.mark.slow
def test_chunked_loss_on_two_ranks_equals_one_process():
    """2 gloo ranks, ep=2 with FSDP2 over both (the root holds the head; tied, the embedding): the
    chunked loss reads the gathered head weight after the model's forward and its gradient is
    reduced like any other; as 2 pipeline ranks (1F1B, and ZB-V with a tied head) the last stage
    returns hidden states. Over 3 steps: the losses equal one process's full-logits run on the
    whole batch, and the parameter updates (of this rank's stages) the same layout's without the
    switch, to ``UPDATE_TOLERANCE``. (Against one process the updates of this 4-layer model
    already differ by up to 2e-5 without the switch: FSDP's and the all-to-all's summation order
    alone, amplified through the layers onto the small router gradients; the head's chunking is
    one more summation order: 2.5e-5 on layer 0's router with ep=2 and chunks of two thirds of H.)"""
    for result in run_ranks(_chunked_on_two_ranks, 2, LAYOUTS, timeout=300):
        for name, (losses, full_losses, ref_losses, max_error, complete) in result.items():
            for got in (losses, full_losses):
                assert rel_err(torch.tensor(got), torch.tensor(ref_losses)) <= TOLERANCE[torch.float32], (
                    name, got, ref_losses)
            assert complete and max_error <= UPDATE_TOLERANCE, (name, max_error)
