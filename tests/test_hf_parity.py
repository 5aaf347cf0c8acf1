"""Numerical parity of patched transformers MoE models against the unpatched ("eager") model on
the same weights and inputs, for every supported family.

float32: the patched model against the eager model in float64 (the independent reference):
logits, loss with the auxiliary loss, the auxiliary loss, recorded router logits and every
parameter's gradient <= 1e-5.

bfloat16: transformers' own bf16 semantics (router logits in bf16, Qwen routing weights rounded
to bf16, bf16 attention and norms) put even the eager bf16 model 1e-2 (MoE block) to 6e-1 (whole
model, parameter gradients) away from float64, so for bf16 the reference is the eager bf16 model,
as the issue asks. Gradients are compared at the MoE block, where both get the same input and
output gradient: the block's output, input gradient and every parameter gradient <= 1e-2. Through
the whole network, independent bf16 roundings compound to 1e-2..5e-2 in parameter gradients in
both directions, so the whole bf16 model is checked on its logits (against eager bf16) and its
loss with the auxiliary loss (against float64)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.conftest import TOLERANCE, rel_err, requires_cuda
from tests.hf_models import FAMILIES, tiny_batch, tiny_model

pytest.importorskip("transformers")

from moe_ep.hf import fused_routers, patch  # noqa: E402

_MISSING_TRITON = [m for m in ("moe_ep.experts_triton",) if importlib.util.find_spec(m) is None]
_MISSING_ROUTER_TRITON = [m for m in ("moe_ep.routing_triton",) if importlib.util.find_spec(m) is None]


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
    ref_model = tiny_model(family, dtype=torch.bfloat16)
    model = patch(tiny_model(family, dtype=torch.bfloat16), backend=backend, fused_router=fused_router)
    block, ref_block = _moe_block(model), _moe_block(ref_model)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, tokens, model.config.hidden_size, generator=g)
    dy = torch.randn(x.shape, generator=g)
    results = []
    for blk in (block, ref_block):
        xi = x.to(torch.bfloat16).requires_grad_()
        y = blk(xi)
        y.backward(dy.to(torch.bfloat16))
        results.append((y, xi.grad, {n: p.grad for n, p in blk.named_parameters()}))
    (y, dx, grads), (y_ref, dx_ref, grads_ref) = results
    tol = TOLERANCE[torch.bfloat16]
    assert y.dtype == torch.bfloat16
    assert rel_err(y, y_ref) <= tol
    assert rel_err(dx, dx_ref) <= tol
    assert grads.keys() == grads_ref.keys()
    for name, grad in grads.items():
        assert rel_err(grad, grads_ref[name]) <= tol, name


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_moe_block_matches_eager(family):
    _check_bf16_block(family, backend="torch", fused_router=True, tokens=17)


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


@pytest.mark.skipif(bool(_MISSING_TRITON), reason=f"Triton experts backend not written yet: {_MISSING_TRITON}")
@pytest.mark.parametrize("family", FAMILIES)
def test_triton_experts_fp32_model(family, reference):
    model = patch(tiny_model(family), backend="triton", fused_router=False)
    _check_whole_model(family, model, reference, _TRITON_BATCH)


@pytest.mark.skipif(
    bool(_MISSING_TRITON + _MISSING_ROUTER_TRITON),
    reason=f"Triton backends not written yet: {_MISSING_TRITON + _MISSING_ROUTER_TRITON}",
)
@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_triton_experts_and_router_fp32_model(family, reference):
    model = patch(tiny_model(family), backend="triton")
    _check_whole_model(family, model, reference, _TRITON_BATCH)


@pytest.mark.skipif(bool(_MISSING_TRITON), reason=f"Triton experts backend not written yet: {_MISSING_TRITON}")
@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_triton_bf16_moe_block_matches_eager(family):
    _check_bf16_block(family, backend="triton", fused_router=False, tokens=5)
