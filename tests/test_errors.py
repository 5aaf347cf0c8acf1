"""Bad input to the public ops raises ValueError/TypeError naming the argument (and, for numbers,
the value and the range expected): the expert op, the router, the losses and TrainStep's options.
What the ops do not support (double backward) says so; meta tensors give the output's shape."""

import pytest
import torch

import moe_ep
from markers import requires_cuda
from moe_ep.ops.backend import BACKENDS

T, H, I, E, K = 6, 16, 8, 4, 2


def good():
    return dict(
        hidden_states=torch.randn(T, H),
        top_k_index=torch.randint(0, E, (T, K)),
        top_k_weights=torch.rand(T, K),
        gate_up_proj=torch.randn(E, 2 * I, H),
        down_proj=torch.randn(E, H, I),
    )


def call(**overrides):
    args = good()
    args.update(overrides)
    return moe_ep.moe_experts(**args)


@pytest.mark.parametrize(
    "overrides, error, pattern",
    [
        (dict(hidden_states=torch.randn(T, H + 1)), ValueError, "gate_up_proj"),
        (dict(down_proj=torch.randn(E + 1, H, I)), ValueError, "down_proj"),
        (dict(gate_up_proj=torch.randn(E, 2 * I + 1, H)), ValueError, "gate_up_proj"),
        (dict(top_k_index=torch.full((T, K), E)), ValueError, "top_k_index"),
        (dict(top_k_index=torch.full((T, K), -1)), ValueError, "top_k_index"),
        (dict(top_k_weights=torch.rand(T, K + 1)), ValueError, "top_k_weights"),
        (dict(top_k_index=torch.randint(0, E, (T + 1, K))), ValueError, "top_k_index"),
        (dict(top_k_index=torch.randint(0, E, (T, E + 1)), top_k_weights=torch.rand(T, E + 1)), ValueError, "top_k_index"),
        (dict(gate_up_proj=torch.randn(E, 2 * I, H, dtype=torch.bfloat16)), TypeError, "gate_up_proj"),
        (dict(hidden_states=torch.randint(0, 5, (T, H))), TypeError, "hidden_states"),
        (dict(hidden_states=torch.randn(2, T // 2, H)), ValueError, "hidden_states"),
        (dict(top_k_index=torch.rand(T, K)), TypeError, "top_k_index"),
        (dict(top_k_weights=torch.randint(0, 2, (T, K))), TypeError, "top_k_weights"),
        (dict(hidden_states=[[1.0] * H] * T), TypeError, "hidden_states"),
        (dict(hidden_states=torch.randn(T, H).to_sparse()), TypeError, "hidden_states must be a dense"),
    ],
    ids=[
        "hidden_size", "expert_count", "odd_gate_up", "index_too_big", "index_negative", "weight_shape",
        "index_rows", "k_above_e", "mixed_dtypes", "integer_hidden", "3d_hidden", "float_index",
        "integer_weights", "not_a_tensor", "sparse_hidden",
    ],
)
def test_moe_experts_rejects(overrides, error, pattern):
    with pytest.raises(error, match=pattern):
        call(**overrides)


def test_bad_activation_and_backend():
    with pytest.raises(ValueError, match="activation"):
        moe_ep.moe_experts(**good(), activation="relu")
    with pytest.raises(ValueError, match="backend"):
        moe_ep.moe_experts(**good(), backend="cuda")


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(router_weight=torch.randn(E, H + 1)), "router_weight"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=E + 1), "top_k"),
        (dict(score="relu"), "score"),
        (dict(n_group=3), "n_group"),
        (dict(n_group=2, topk_group=3), "topk_group"),
        (dict(correction_bias=torch.zeros(E + 1)), "correction_bias"),
        (dict(hidden_states=torch.randn(2, T // 2, H)), "hidden_states"),
    ],
)
def test_route_topk_rejects(kwargs, pattern):
    args = dict(hidden_states=torch.randn(T, H), router_weight=torch.randn(E, H), top_k=K)
    args.update(kwargs)
    with pytest.raises(ValueError, match=pattern):
        moe_ep.route_topk(**args)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(hidden_states=torch.randint(0, 5, (T, H))), "hidden_states"),
        (dict(router_weight=torch.randint(0, 5, (E, H))), "router_weight"),
        (dict(hidden_states=[[1.0] * H] * T), "hidden_states"),
    ],
    ids=["integer_hidden", "integer_router", "not_a_tensor"],
)
def test_route_topk_rejects_types(kwargs, pattern):
    args = dict(hidden_states=torch.randn(T, H), router_weight=torch.randn(E, H), top_k=K)
    args.update(kwargs)
    with pytest.raises(TypeError, match=pattern):
        moe_ep.route_topk(**args)


# ---------------------------------------------------------------------------------------------
# Numbers and options: finite and in range, named with the value (#13: a NaN correction bias
# routed every token to the same experts with finite weights).


def _route(**kwargs):
    args = dict(hidden_states=torch.randn(T, H), router_weight=torch.randn(E, H), top_k=K, score="sigmoid")
    args.update(kwargs)
    return moe_ep.route_topk(**args)


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(correction_bias=torch.tensor([0.1, NAN, 0.0, 0.2])), ValueError,
         r"^correction_bias must hold finite values, got nan at index 1 \(1 of 4 not finite\)$"),
        (dict(correction_bias=torch.full((E,), NAN)), ValueError,
         r"^correction_bias must hold finite values, got nan at index 0 \(4 of 4 not finite\)$"),
        (dict(correction_bias=torch.tensor([0.0, 0.0, -INF, INF])), ValueError,
         r"^correction_bias must hold finite values, got -inf at index 2 \(2 of 4 not finite\)$"),
        (dict(correction_bias=torch.zeros(E, dtype=torch.int64)), TypeError,
         r"^correction_bias must be a float tensor, got torch.int64$"),
        (dict(correction_bias=torch.zeros(E, device="meta")), ValueError,
         r"^all tensors must be on one device, got hidden_states on cpu, correction_bias on meta$"),
        (dict(scale=NAN), ValueError, r"^scale must be a finite number > 0, got nan$"),
        (dict(scale=INF), ValueError, r"^scale must be a finite number > 0, got inf$"),
        (dict(scale=0.0), ValueError, r"^scale must be a finite number > 0, got 0.0$"),
        (dict(scale=-2.5), ValueError, r"^scale must be a finite number > 0, got -2.5$"),
        (dict(scale="2.5"), ValueError, r"^scale must be a finite number > 0, got '2.5'$"),
        (dict(scale=True), ValueError, r"^scale must be a finite number > 0, got True$"),
        (dict(normalize="no"), TypeError, r"^normalize must be a bool, got str$"),
        (dict(n_group=True), ValueError, r"^n_group must be a positive divisor of E=4, got True$"),
        (dict(n_group=2, topk_group=True), ValueError, r"^topk_group must be an int in \[1, n_group=2\], got True$"),
        (dict(top_k=2.0), ValueError, r"^top_k must be an int in \[1, E=4\], got 2.0$"),
    ],
    ids=["bias_one_nan", "bias_all_nan", "bias_inf", "bias_int", "bias_device", "scale_nan", "scale_inf", "scale_zero",
         "scale_negative", "scale_str", "scale_bool", "normalize_str", "n_group_bool", "topk_group_bool", "top_k_float"],
)
def test_route_topk_refuses_numbers_out_of_range(backend, kwargs, error, message):
    with pytest.raises(error, match=message):
        _route(backend=backend, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_route_topk_with_a_finite_bias_matches_float64(backend):
    # The check refuses only non-finite biases: large finite ones still steer the choice.
    from moe_ep.ops.reference import route_topk_ref
    from numerics import TOLERANCE, rel_err

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(T, H, generator=g), torch.randn(E, H, generator=g)
    bias = torch.tensor([1e30, -1e30, 0.5, -0.5])
    logits, weights, idx = moe_ep.route_topk(x, w, K, score="sigmoid", correction_bias=bias, scale=2.5, backend=backend)
    ref_logits, ref_weights, ref_idx = route_topk_ref(x, w, K, score="sigmoid", correction_bias=bias, scale=2.5)
    assert torch.equal(idx, ref_idx) and (idx[:, 0] == 0).all()
    assert rel_err(weights, ref_weights) <= TOLERANCE[torch.float32]
    assert rel_err(logits, ref_logits) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: moe_ep.ops.losses.expert_counts(torch.zeros(T, K, dtype=torch.long), 0),
         r"^num_experts must be an int >= 1, got 0$"),
        (lambda: moe_ep.ops.losses.expert_counts(torch.zeros(T, K, dtype=torch.long), 4.0),
         r"^num_experts must be an int >= 1, got 4.0$"),
        (lambda: moe_ep.ops.losses.expert_counts(torch.zeros(T, K, dtype=torch.long), E, torch.ones(T + 1)),
         r"^token_mask must hold one value per token \(T=6\), got shape \(7,\)$"),
        (lambda: moe_ep.ops.losses.load_balancing_loss(torch.zeros(T, E), K, token_mask=torch.ones(2, T)),
         r"^token_mask must hold one value per token \(T=6\), got shape \(2, 6\)$"),
        (lambda: moe_ep.ops.losses.update_expert_bias_(torch.zeros(E), torch.ones(E), rate=NAN),
         r"^rate must be a finite number >= 0, got nan$"),
        (lambda: moe_ep.ops.losses.update_expert_bias_(torch.zeros(E), torch.ones(E), rate=INF),
         r"^rate must be a finite number >= 0, got inf$"),
    ],
    ids=["counts_zero_experts", "counts_float_experts", "counts_mask", "aux_mask", "bias_rate_nan", "bias_rate_inf"],
)
def test_losses_refuse_counts_and_rates_out_of_range(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_expert_bias_update_refuses_an_integer_bias():
    with pytest.raises(TypeError, match=r"^bias must be a floating-point tensor, got torch.int64$"):
        moe_ep.ops.losses.update_expert_bias_(torch.zeros(E, dtype=torch.long), torch.ones(E), rate=0.1)


def _tiny_step_model():
    from hf_models import tiny_model

    return moe_ep.patch(tiny_model("mixtral", num_hidden_layers=1, num_local_experts=4), backend="torch")


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(aux_loss_coef=NAN), r"^aux_loss_coef must be a finite number >= 0, got nan$"),
        (dict(aux_loss_coef=INF), r"^aux_loss_coef must be a finite number >= 0, got inf$"),
        (dict(z_loss_coef=NAN), r"^z_loss_coef must be a finite number >= 0, got nan$"),
        (dict(z_loss_coef=-INF), r"^z_loss_coef must be a finite number >= 0, got -inf$"),
        (dict(expert_bias_rate=INF), r"^expert_bias_rate must be a finite number >= 0, got inf$"),
        (dict(max_grad_norm=NAN), r"^max_grad_norm must be a finite number > 0 or None, got nan$"),
        (dict(max_grad_norm=INF), r"^max_grad_norm must be a finite number > 0 or None, got inf$"),
        (dict(loss_scale=INF), r"^loss_scale must be None, 'dynamic' or a finite number > 0, got inf$"),
        (dict(loss_scale=NAN), r"^loss_scale must be None, 'dynamic' or a finite number > 0, got nan$"),
        (dict(max_consecutive_skips=0), r"^max_consecutive_skips must be a positive int or None, got 0$"),
        (dict(microbatches=-1), r"^microbatches must be a positive int, got -1$"),
    ],
    ids=["aux_nan", "aux_inf", "z_nan", "z_minus_inf", "bias_rate_inf", "clip_nan", "clip_inf", "scale_inf", "scale_nan",
         "skips_zero", "microbatches_negative"],
)
def test_train_step_refuses_numbers_out_of_range(options, message):
    model = _tiny_step_model()
    with pytest.raises(ValueError, match=message):
        moe_ep.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), **options)
    assert not any(m._forward_hooks for m in model.modules())  # refused before any hook went on


def _other_optimizer_schedule(model):
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    return torch.optim.lr_scheduler.StepLR(other, step_size=1)


@pytest.mark.parametrize(
    "options, error, message",
    [
        (lambda m: dict(autocast_dtype=torch.float64), ValueError,
         r"^autocast_dtype must be torch.bfloat16, torch.float16 or None, got torch.float64$"),
        (lambda m: dict(autocast_dtype=torch.float32), ValueError,
         r"^autocast_dtype must be torch.bfloat16, torch.float16 or None, got torch.float32$"),
        (lambda m: dict(lr_scheduler="cosine"), TypeError,
         r"^lr_scheduler must be None or a learning-rate scheduler with a step\(\) method, got 'cosine'$"),
        (lambda m: dict(lr_scheduler=_other_optimizer_schedule(m)), ValueError,
         r"^lr_scheduler schedules another optimizer than the step's"),
        (lambda m: dict(aux_loss_coef=0.1, global_aux_loss="yes"), TypeError,
         r"^global_aux_loss must be a bool, got 'yes'$"),
        (lambda m: dict(aux_loss_coef=0.1, sequence_aux_loss=1), TypeError,
         r"^sequence_aux_loss must be a bool, got 1$"),
    ],
    ids=["autocast_float64", "autocast_float32", "scheduler_string", "scheduler_of_another_optimizer",
         "global_aux_not_bool", "sequence_aux_not_bool"],
)
def test_train_step_refuses_options_it_would_ignore_or_apply_half_way(options, error, message):
    """Each of these was taken and then ignored (torch.autocast only warns for a full-precision
    dtype) or failed only after the optimizer had stepped."""
    model = _tiny_step_model()
    with pytest.raises(error, match=message):
        moe_ep.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), **options(model))
    assert not any(m._forward_hooks for m in model.modules())


# ---------------------------------------------------------------------------------------------
# What the ops do not support says so; meta tensors propagate shapes.


@pytest.mark.parametrize("backend", BACKENDS)
def test_moe_experts_on_meta_tensors_gives_the_output_shape(backend):
    args = {k: v.to("meta") for k, v in good().items()}
    out = moe_ep.moe_experts(**args, backend=backend)
    assert out.device.type == "meta" and out.shape == (T, H) and out.dtype == torch.float32
    logits, weights, idx = moe_ep.route_topk(args["hidden_states"], torch.randn(E, H, device="meta"), K,
                                             backend=backend)
    assert [t.shape for t in (logits, weights, idx)] == [(T, E), (T, K), (T, K)]
    assert all(t.device.type == "meta" for t in (logits, weights, idx))


def _requiring_grad():
    return {k: v.requires_grad_(v.is_floating_point()) for k, v in good().items()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_double_backward_through_moe_experts_says_it_is_unsupported(backend):
    args = _requiring_grad()
    y = moe_ep.moe_experts(**args, backend=backend)
    # One backward with create_graph=True still works and gives the ordinary gradient.
    (dx,) = torch.autograd.grad(y.square().sum(), args["hidden_states"], create_graph=True)
    args2 = {k: v.detach().requires_grad_(v.is_floating_point()) for k, v in args.items()}
    (dx_plain,) = torch.autograd.grad(moe_ep.moe_experts(**args2, backend=backend).square().sum(),
                                      args2["hidden_states"])
    assert torch.equal(dx.detach(), dx_plain)
    with pytest.raises(NotImplementedError, match=r"^moe_experts is differentiable once: double backward .* is not "
                                                  r"supported$"):
        dx.sum().backward()


def test_double_backward_through_the_triton_router_says_it_is_unsupported():
    x, w = torch.randn(T, H, requires_grad=True), torch.randn(E, H, requires_grad=True)
    _, weights, _ = moe_ep.route_topk(x, w, K, backend="triton")
    (dx,) = torch.autograd.grad(weights.square().sum(), x, create_graph=True)
    with pytest.raises(NotImplementedError, match=r"^route_topk's Triton backend is differentiable once: .*; "
                                                  r"backend='torch' supports it$"):
        dx.sum().backward()


def test_double_backward_through_the_torch_router_matches_float64():
    # A Hessian-vector product of the routing weights, against the float64 reference router.
    from moe_ep.ops.reference import route_topk_ref
    from numerics import TOLERANCE, rel_err

    g = torch.Generator().manual_seed(1)
    x0, w0, v = torch.randn(T, H, generator=g), torch.randn(E, H, generator=g), torch.randn(T, H, generator=g)

    def hvp(route, dtype):
        x, w = x0.to(dtype).requires_grad_(), w0.to(dtype).requires_grad_()
        _, weights, _ = route(x, w)
        (dx,) = torch.autograd.grad(weights.square().sum(), x, create_graph=True)
        (dw,) = torch.autograd.grad((dx * v.to(dtype)).sum(), w)
        return dw

    got = hvp(lambda x, w: moe_ep.route_topk(x, w, K, backend="torch"), torch.float32)
    want = hvp(lambda x, w: route_topk_ref(x, w, K), torch.float64)
    assert rel_err(got, want) <= TOLERANCE[torch.float32]


def _nan_bias_on_cuda(rank, world) -> str:
    """In a process of its own: a failed device-side check leaves its CUDA context unusable."""
    x, w = torch.randn(T, H, device="cuda"), torch.randn(E, H, device="cuda")
    bias = torch.full((E,), NAN, device="cuda")
    try:
        _, _, idx = moe_ep.route_topk(x, w, K, score="sigmoid", correction_bias=bias)
        torch.cuda.synchronize()
        return f"no error: {idx.tolist()}"
    except RuntimeError as exc:
        return f"RuntimeError: {exc}"


@requires_cuda
def test_correction_bias_check_on_cuda_needs_no_host_sync_and_stops_a_nan():
    from dist_utils import run_ranks

    x, w = torch.randn(T, H, device="cuda"), torch.randn(E, H, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe_ep.route_topk(x, w, K, score="sigmoid", correction_bias=torch.zeros(E, device="cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert run_ranks(_nan_bias_on_cuda, 1, backend="nccl")[0].startswith("RuntimeError: ")
