"""Bad input to the public ops raises ValueError/TypeError naming the argument."""

import pytest
import torch

import moe_ep

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
    ],
    ids=[
        "hidden_size", "expert_count", "odd_gate_up", "index_too_big", "index_negative", "weight_shape",
        "index_rows", "k_above_e", "mixed_dtypes", "integer_hidden", "3d_hidden", "float_index",
        "integer_weights", "not_a_tensor",
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
