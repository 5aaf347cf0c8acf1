"""Numerical parity of patched transformers MoE models against the unpatched ("eager") model on
the same weights and inputs, for every supported family.

float32: the patched model against the eager model in float64 (the independent reference):
logits, loss with the auxiliary loss, the auxiliary loss, recorded router logits and every
parameter's gradient <= 1e-5.

bfloat16, at the MoE block, where ours and the reference get the same input and output gradient:
the block's output, input gradient and every parameter gradient <= 1e-2, on both backends,
against float64 with our fused router and against the eager bf16 block with the model's own
(bf16-logit) router.

bfloat16, whole model: logits, loss with the auxiliary loss, recorded router logits and every
gradient, against the eager model in float64 on the same bf16-rounded weights. Through the network
transformers' bf16 attention, norms and router put the eager bf16 model itself 0.5e-2..1.7e-2
(logits), 0.8e-2..8e-2 (all gradients together) and up to 2.5e-1 (one parameter) away from
float64, and two bf16 implementations differ by as much: transformers' own batched_mm and
grouped_mm experts are up to 2.2e-2 (2x7 tokens) and 6e-2 (1x5) away from its eager experts on one
parameter's gradient, 1.6e-2 on all gradients together (Mixtral, grouped_mm). So 1e-2 per
parameter against eager bf16 (or against float64) is met by no bf16 implementation; asserted
instead, on both backends: the loss and the auxiliary loss <= 1e-2 against float64; the logits
<= 1e-2 against eager bf16 on the torch backend (Triton's differ by up to 1.15e-2); and our error
against float64 no worse than the eager bf16 model's own times a small factor: 2 for the logits,
each layer's router logits and all gradients together (measured at most 1.32), 3 for each
parameter's gradient, against the larger of eager's error on that parameter and on all gradients
(measured at most 2.09; eager's own error on one parameter varies 3x between input batches)."""

from __future__ import annotations

import pytest
import torch

from moe_ep.hf import fused_routers, patch
from markers import requires_cuda
from numerics import TOLERANCE, rel_err
from hf_models import FAMILIES, tiny_batch, tiny_model

# The numbers, not the selector's measurement (conftest.py).
pytestmark = pytest.mark.usefixtures("no_selector_measurement")


def _run(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch, output_router_logits=True)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return out, grads


@pytest.fixture(scope="module")
def reference():
    """Per family: the float64 eager model's outputs and gradients (computed once)."""
    cache = {}

    def get(family, batch_kwargs):
        key = (family, tuple(sorted(batch_kwargs.items())))
        if key not in cache:
            model = tiny_model(family, dtype=torch.float64)
            batch = tiny_batch(model.config, **batch_kwargs)
            cache[key] = (batch, *_run(model, batch))
        return cache[key]

    return get


def _moe_layer_count(model) -> int:
    return sum(hasattr(layer.mlp, "experts") for layer in model.model.layers)


def _records_router_logits(family: str, model) -> bool:
    """Whether ``output_router_logits=True`` yields router logits: every family records them but
    DeepSeek-V3, which does from transformers 5.23 on (its ``_can_record_outputs`` says so)."""
    records = "router_logits" in model._can_record_outputs
    assert records or family == "deepseek_v3", f"{family} no longer records router logits"
    return records


def _aux_and_router_logits(family, model, out, ref) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(name, ours, reference)`` for the auxiliary loss and each recorded router logits, after
    asserting that they are present wherever transformers computes them (every family but
    DeepSeek-V3, which has no auxiliary loss) and absent elsewhere."""
    pairs = []
    if family == "deepseek_v3":
        assert getattr(out, "aux_loss", None) is None and getattr(ref, "aux_loss", None) is None
    else:
        assert out.aux_loss is not None and ref.aux_loss is not None
        assert out.aux_loss.requires_grad
        pairs.append(("aux_loss", out.aux_loss, ref.aux_loss))
    if _records_router_logits(family, model):
        assert len(out.router_logits) == len(ref.router_logits) == _moe_layer_count(model)
        for i, (got, want) in enumerate(zip(out.router_logits, ref.router_logits)):
            assert got.dtype == (torch.float32 if family == "deepseek_v3" else model.dtype)
            pairs.append((f"router_logits[{i}]", got, want))
    else:
        assert getattr(out, "router_logits", None) is None
    return pairs


def _check_whole_model(family, model, reference, batch_kwargs):
    batch, ref, ref_grads = reference(family, batch_kwargs)
    out, grads = _run(model, batch)
    tol = TOLERANCE[torch.float32]
    assert rel_err(out.logits, ref.logits) <= tol
    assert rel_err(out.loss, ref.loss) <= tol
    for name, got, want in _aux_and_router_logits(family, model, out, ref):
        assert rel_err(got, want) <= tol, name
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert grad is not None, name
        assert rel_err(grad, ref_grads[name]) <= tol, name


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_model_matches_fp64_eager(family, reference):
    model = patch(tiny_model(family), backend="torch")
    moe_layers = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    assert fused_routers(model) == [f"model.layers.{i}.mlp.gate" for i in moe_layers]
    assert moe_layers == ([1] if family == "deepseek_v3" else [0, 1])
    _check_whole_model(family, model, reference, {})


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_experts_implementation_alone_matches(family, reference):
    """from_config(..., experts_implementation="moe_ep") without patch(): the model's own routers."""
    model = tiny_model(family, experts_implementation="moe_ep")
    assert fused_routers(model) == []
    _check_whole_model(family, model, reference, {})


@pytest.fixture(scope="module")
def bf16_reference():
    """Per family and batch: the eager model's outputs and gradients in bfloat16 and in float64, both
    on the same bf16-rounded weights (computed once)."""
    cache = {}

    def get(family, batch_kwargs):
        key = (family, tuple(sorted(batch_kwargs.items())))
        if key not in cache:
            eager = tiny_model(family, dtype=torch.bfloat16)
            batch = tiny_batch(eager.config, **batch_kwargs)
            fp64 = tiny_model(family, dtype=torch.bfloat16).to(torch.float64)
            cache[key] = (batch, _run(eager, batch), _run(fp64, batch))
        return cache[key]

    return get


# Our bf16 error against float64 may exceed the eager bf16 model's own by these factors (see the
# module docstring for the measured figures).
_AGGREGATE_FACTOR = 2  # logits, each layer's router logits, all gradients concatenated
_PARAMETER_FACTOR = 3  # one parameter's gradient, against max(eager's on it, eager's on all)


def _all(grads):
    return torch.cat([g.flatten() for g in grads.values()])


def _check_bf16_model(family, model, bf16_reference, batch_kwargs, *, logits_vs_eager: bool):
    """The whole bf16 model against float64 on the same weights, bounded by the eager bf16 model's
    own error (module docstring)."""
    batch, (eager, eager_grads), (ref, ref_grads) = bf16_reference(family, batch_kwargs)
    out, grads = _run(model, batch)
    tol = TOLERANCE[torch.bfloat16]
    assert out.logits.dtype == torch.bfloat16
    if logits_vs_eager:
        assert rel_err(out.logits, eager.logits) <= tol
    assert rel_err(out.logits, ref.logits) <= _AGGREGATE_FACTOR * rel_err(eager.logits, ref.logits)
    assert rel_err(out.loss, ref.loss) <= tol
    eager_pairs = _aux_and_router_logits(family, model, eager, ref)
    for (name, got, want), (_, eager_got, _) in zip(_aux_and_router_logits(family, model, out, ref), eager_pairs):
        if name == "aux_loss":
            assert rel_err(got, want) <= tol
        else:  # the eager bf16 model's own router logits are 0.4e-2..1.3e-2 away from float64
            assert rel_err(got, want) <= _AGGREGATE_FACTOR * rel_err(eager_got, want), name
    assert grads.keys() == ref_grads.keys()
    assert all(g is not None and g.dtype == torch.bfloat16 for g in grads.values())
    eager_all = rel_err(_all(eager_grads), _all(ref_grads))
    assert rel_err(_all(grads), _all(ref_grads)) <= _AGGREGATE_FACTOR * eager_all
    for name, grad in grads.items():
        eager_err = rel_err(eager_grads[name], ref_grads[name])
        assert rel_err(grad, ref_grads[name]) <= _PARAMETER_FACTOR * max(eager_err, eager_all), name


@pytest.mark.slow
@pytest.mark.parametrize("fused_router", [True, False], ids=["fused_router", "model_router"])
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_model(family, fused_router, bf16_reference):
    model = patch(tiny_model(family, dtype=torch.bfloat16), backend="torch", fused_router=fused_router)
    _check_bf16_model(family, model, bf16_reference, {}, logits_vs_eager=True)


def _moe_block(model):
    """The last layer's MoE block (DeepSeek-V3's first layer is dense)."""
    return model.model.layers[-1].mlp


def _check_bf16_block(family, *, backend, fused_router, tokens):
    """The bf16 MoE block (routing, experts, shared experts) against a reference on the same
    bf16-rounded weights and input. With our fused router (float32 logits) the reference is the
    block in float64; with the model's own router, whose bf16 logits are part of transformers'
    semantics (and cost Qwen3-MoE 1.4e-2 against float64 on their own), it is the eager bf16
    block."""
    model = patch(tiny_model(family, dtype=torch.bfloat16), backend=backend, fused_router=fused_router)
    ref_model = tiny_model(family, dtype=torch.bfloat16)
    ref_dtype = torch.float64 if fused_router else torch.bfloat16
    block, ref_block = _moe_block(model), _moe_block(ref_model.to(ref_dtype))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, tokens, model.config.hidden_size, generator=g).to(torch.bfloat16)
    dy = torch.randn(x.shape, generator=g).to(torch.bfloat16)
    results = []
    for blk, dtype in ((block, torch.bfloat16), (ref_block, ref_dtype)):
        xi = x.detach().to(dtype).requires_grad_()
        y = blk(xi)
        y.backward(dy.to(dtype))
        results.append((y, xi.grad, {n: p.grad for n, p in blk.named_parameters()}))
    (y, dx, grads), (y_ref, dx_ref, grads_ref) = results
    tol = TOLERANCE[torch.bfloat16]
    assert y.dtype == torch.bfloat16
    assert rel_err(y, y_ref) <= tol
    assert rel_err(dx, dx_ref) <= tol
    assert grads.keys() == grads_ref.keys()
    for name, grad in grads.items():
        assert rel_err(grad, grads_ref[name]) <= tol, name


@pytest.mark.parametrize("fused_router", [True, False], ids=["fused_router", "model_router"])
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_moe_block(family, fused_router):
    _check_bf16_block(family, backend="torch", fused_router=fused_router, tokens=17)


@pytest.mark.slow
@requires_cuda
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_default_backend_fp32_model(family, reference):
    """On CUDA the default backend is Triton for both the experts and the fused router."""
    batch, ref, ref_grads = reference(family, {})
    model = patch(tiny_model(family).cuda())
    out, grads = _run(model, {k: v.cuda() for k, v in batch.items()})
    tol = TOLERANCE[torch.float32]
    assert rel_err(out.logits.cpu(), ref.logits) <= tol
    assert rel_err(out.loss.cpu(), ref.loss) <= tol
    for name, grad in grads.items():
        assert rel_err(grad.cpu(), ref_grads[name]) <= tol, name


# --- triton backend under TRITON_INTERPRET=1 (small: the interpreter is slow) ---------------------

_TRITON_BATCH = {"batch": 1, "seq": 5}


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_triton_experts_fp32_model(family, reference):
    model = patch(tiny_model(family), backend="triton", fused_router=False)
    _check_whole_model(family, model, reference, _TRITON_BATCH)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_triton_experts_and_router_fp32_model(family, reference):
    model = patch(tiny_model(family), backend="triton")
    _check_whole_model(family, model, reference, _TRITON_BATCH)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_triton_bf16_model(family, bf16_reference):
    model = patch(tiny_model(family, dtype=torch.bfloat16), backend="triton")
    _check_bf16_model(family, model, bf16_reference, _TRITON_BATCH, logits_vs_eager=False)


@pytest.mark.slow
@pytest.mark.parametrize("fused_router", [True, False], ids=["fused_router", "model_router"])
@pytest.mark.parametrize("family", FAMILIES)
def test_triton_bf16_moe_block(family, fused_router):
    _check_bf16_block(family, backend="triton", fused_router=fused_router, tokens=5)
