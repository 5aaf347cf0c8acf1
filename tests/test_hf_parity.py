"""Numerical parity of patched transformers MoE models against the unpatched ("eager") model on
the same weights and inputs, for every supported family.

float32: the patched model against the eager model in float64 (the independent reference):
logits, loss with the auxiliary loss, the auxiliary loss, recorded router logits and every
parameter's gradient <= 1e-5.

bfloat16: gradients are compared at the MoE block, where ours and the reference get the same
input and output gradient: the block's output, input gradient and every parameter gradient
<= 1e-2, on both backends, against float64 with our fused router and against the eager bf16 block
with the model's own (bf16-logit) router. Through the whole network, transformers' bf16 attention,
norms and router put even the eager bf16 model 0.6e-2..5e-2 (logits) and up to 7e-1 (parameter
gradients) away from float64, and independent bf16 roundings compound in both models alike, so
the whole bf16 model is checked on its logits (against eager bf16) and its loss with the auxiliary
loss (against float64), on the torch backend."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import TOLERANCE, rel_err, requires_cuda
from tests.hf_models import FAMILIES, tiny_batch, tiny_model

pytest.importorskip("transformers")

from moe_ep.hf import fused_routers, patch  # noqa: E402

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


def _check_whole_model(family, model, reference, batch_kwargs):
    batch, ref, ref_grads = reference(family, batch_kwargs)
    out, grads = _run(model, batch)
    tol = TOLERANCE[torch.float32]
    assert rel_err(out.logits, ref.logits) <= tol
    assert rel_err(out.loss, ref.loss) <= tol
    # DeepSeek-V3 has no auxiliary loss, and before transformers 5.23 no recorded router logits.
    if getattr(ref, "aux_loss", None) is not None:
        assert out.aux_loss is not None and out.aux_loss.requires_grad
        assert rel_err(out.aux_loss, ref.aux_loss) <= tol
    if getattr(ref, "router_logits", None) is not None:
        assert len(out.router_logits) == len(ref.router_logits) > 0
        for got, want in zip(out.router_logits, ref.router_logits):
            assert got.dtype == torch.float32
            assert rel_err(got, want) <= tol
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert grad is not None, name
        assert rel_err(grad, ref_grads[name]) <= tol, name


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_model_matches_fp64_eager(family, reference):
    model = patch(tiny_model(family), backend="torch")
    moe_layers = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    assert fused_routers(model) == [f"model.layers.{i}.mlp.gate" for i in moe_layers]
    assert moe_layers == ([1] if family == "deepseek_v3" else [0, 1])
    _check_whole_model(family, model, reference, {})


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_experts_implementation_alone_matches(family, reference):
    """from_config(..., experts_implementation="moe_ep") without patch(): the model's own routers."""
    model = tiny_model(family, experts_implementation="moe_ep")
    assert fused_routers(model) == []
    _check_whole_model(family, model, reference, {})


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_model_logits_and_loss(family, reference):
    batch, ref, _ = reference(family, {})
    eager = tiny_model(family, dtype=torch.bfloat16)
    model = patch(tiny_model(family, dtype=torch.bfloat16), backend="torch")
    with torch.no_grad():
        out = model(**batch, output_router_logits=True)
        want = eager(**batch, output_router_logits=True)
    tol = TOLERANCE[torch.bfloat16]
    assert out.logits.dtype == torch.bfloat16
    assert rel_err(out.logits, want.logits) <= tol
    assert rel_err(out.loss, ref.loss) <= tol
    if getattr(ref, "aux_loss", None) is not None:
        assert rel_err(out.aux_loss, ref.aux_loss) <= tol
    for got, exp in zip(getattr(out, "router_logits", None) or (), getattr(want, "router_logits", None) or ()):
        assert got.dtype == exp.dtype


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


@pytest.mark.parametrize("family", FAMILIES)
def test_triton_experts_fp32_model(family, reference):
    model = patch(tiny_model(family), backend="triton", fused_router=False)
    _check_whole_model(family, model, reference, _TRITON_BATCH)


@pytest.mark.parametrize("family", FAMILIES)
def test_triton_experts_and_router_fp32_model(family, reference):
    model = patch(tiny_model(family), backend="triton")
    _check_whole_model(family, model, reference, _TRITON_BATCH)


@pytest.mark.parametrize("fused_router", [True, False], ids=["fused_router", "model_router"])
@pytest.mark.parametrize("family", FAMILIES)
def test_triton_bf16_moe_block(family, fused_router):
    _check_bf16_block(family, backend="triton", fused_router=fused_router, tokens=5)
