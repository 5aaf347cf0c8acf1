"""Node-limited routing (DeepSeek-V3's: every token to experts on at most ``max_nodes`` nodes,
the nodes holding equal consecutive blocks of experts as expert parallelism lays them out):
``route_topk(nodes=, max_nodes=)`` against a float64 reference of the rule on both backends (no
token reaches more nodes than allowed; the choice within the allowed nodes is the plain top-k),
how it combines with a model's own expert groups, the refusals, and
``moe_ep.hf.limit_routing_to_nodes`` on patched models (Mixtral without groups, DeepSeek-V3 whose
groups are the nodes) against their own routing where the limit does not bind."""

from __future__ import annotations

import pytest
import torch

from moe_ep.ops.routing import node_limited_groups, route_topk

from hf_models import tiny_batch, tiny_model

BACKENDS = ("torch", "triton")


def _reference(x, w, top_k, nodes, max_nodes, score="softmax", bias=None):
    """The rule in float64, written out: nodes ranked by the sum of their two best (biased)
    scores, the best ``max_nodes`` kept, top-k among their experts."""
    logits = x.double() @ w.double().T
    probs = logits.softmax(-1) if score == "softmax" else logits.sigmoid()
    choice = probs if bias is None else probs + bias.double()
    T, E = choice.shape
    per_node = choice.view(T, nodes, E // nodes)
    node_score = per_node.topk(min(2, E // nodes), dim=-1).values.sum(-1)
    allowed = torch.zeros(T, nodes, dtype=torch.bool).scatter_(1, node_score.topk(max_nodes, -1).indices, True)
    masked = choice.masked_fill(~allowed.repeat_interleave(E // nodes, 1), float("-inf"))
    return masked.topk(top_k, -1).indices


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("E,K,nodes,max_nodes", [(16, 4, 4, 2), (16, 4, 4, 1), (32, 8, 8, 4), (12, 3, 3, 3),
                                                 (8, 1, 2, 1), (8, 8, 2, 2)])
def test_tokens_reach_at_most_max_nodes_and_take_the_top_k_there(backend, E, K, nodes, max_nodes):
    g = torch.Generator().manual_seed(E * 100 + K)
    x, w = torch.randn(57, 24, generator=g), torch.randn(E, 24, generator=g)
    _, weights, idx = route_topk(x, w, K, nodes=nodes, max_nodes=max_nodes, backend=backend)
    want = _reference(x, w, K, nodes, max_nodes)
    assert torch.equal(idx.sort(-1).values, want.sort(-1).values)
    assert int((torch.nn.functional.one_hot(idx // (E // nodes), nodes).sum(1) > 0).sum(-1).max()) <= max_nodes
    torch.testing.assert_close(weights.sum(-1), torch.ones(57))
    # max_nodes = nodes limits nothing: the plain top-k.
    assert torch.equal(route_topk(x, w, K, nodes=nodes, max_nodes=nodes, backend=backend)[2], route_topk(x, w, K)[2])


def test_a_model_whose_groups_are_the_nodes_keeps_them():
    assert node_limited_groups(256, 8, 4, nodes=8, max_nodes=4) == (8, 4)  # DeepSeek-V3 on 8 nodes
    assert node_limited_groups(256, 8, 4, nodes=8, max_nodes=2) == (8, 2)
    assert node_limited_groups(256, 8, 4, nodes=8, max_nodes=6) == (8, 4)  # topk_group binds already
    assert node_limited_groups(64, 1, 1, nodes=4, max_nodes=2) == (4, 2)  # no groups: the nodes are
    assert node_limited_groups(64, 1, 1, nodes=4, max_nodes=None) == (1, 1)
    g = torch.Generator().manual_seed(0)
    x, w, bias = torch.randn(40, 16, generator=g), torch.randn(32, 16, generator=g), torch.randn(32, generator=g)
    _, _, idx = route_topk(x, w, 8, score="sigmoid", correction_bias=bias, n_group=4, topk_group=3, nodes=4,
                           max_nodes=2)
    assert torch.equal(idx.sort(-1).values, _reference(x, w, 8, 4, 2, "sigmoid", bias).sort(-1).values)


def test_refusals_name_the_argument():
    x, w = torch.randn(4, 8), torch.randn(12, 8)
    with pytest.raises(ValueError, match=r"nodes must be a positive divisor of E=12, got 5"):
        route_topk(x, w, 2, nodes=5, max_nodes=1)
    with pytest.raises(ValueError, match=r"max_nodes must be an int in \[1, nodes=3\] or None, got 4"):
        route_topk(x, w, 2, nodes=3, max_nodes=4)
    with pytest.raises(ValueError, match=r"top_k=5 exceeds the 4 experts left by topk_group=1 of n_group=3"):
        route_topk(x, w, 5, nodes=3, max_nodes=1)
    with pytest.raises(ValueError, match=r"max_nodes needs the router's expert groups to be the nodes: n_group=2 "
                                         r"groups over nodes=3"):
        node_limited_groups(12, 2, 1, nodes=3, max_nodes=1)


@pytest.mark.parametrize("family,nodes,max_nodes", [("mixtral", 2, 1), ("deepseek_v3", 4, 2)])
def test_limit_routing_to_nodes_on_a_patched_model(family, nodes, max_nodes):
    """Mixtral (8 experts, top-2, no groups) on 2 nodes limited to 1; the tiny DeepSeek-V3 (8
    experts in 4 groups, top-3 in the 2 best groups) whose groups are 4 nodes, limited to 2: its
    own topk_group binds already, so its outputs do not change."""
    import moe_ep
    from moe_ep.hf import binding_of, limit_routing_to_nodes

    model = moe_ep.patch(tiny_model(family, experts_implementation="moe_ep"), backend="torch")
    batch = tiny_batch(model.config, batch=2, seq=9)
    routers = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]
    E = routers[0].weight.shape[0]
    hidden = model.model.embed_tokens(batch["input_ids"]).reshape(-1, model.config.hidden_size)
    with torch.no_grad():
        free = model(**batch).logits
        limit_routing_to_nodes(model, nodes, nodes)  # no limit in effect: the same model
        torch.testing.assert_close(model(**batch).logits, free, rtol=0, atol=0)
        limit_routing_to_nodes(model, nodes, max_nodes)
        assert all(binding_of(r).node_limit == (nodes, max_nodes) for r in routers)
        for router in routers:
            node_TK = router(hidden)[2] // (E // nodes)
            reached = torch.nn.functional.one_hot(node_TK, nodes).sum(1).gt(0).sum(-1)
            assert int(reached.max()) <= max_nodes
        limited = model(**batch).logits
        if family == "deepseek_v3":
            torch.testing.assert_close(limited, free, rtol=0, atol=0)
        else:
            assert not torch.equal(limited, free)  # the limit binds for some tokens
        limit_routing_to_nodes(model, nodes, None)
        assert all(binding_of(r).node_limit is None for r in routers)
        torch.testing.assert_close(model(**batch).logits, free, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"top_k=\d experts do not fit on max_nodes=1 nodes"):
        limit_routing_to_nodes(model, nodes, 1) if family == "deepseek_v3" else limit_routing_to_nodes(model, E, 1)
    with pytest.raises(ValueError, match=rf"mlp.gate: nodes must be a positive divisor of E={E}, got {E + 1}"):
        limit_routing_to_nodes(model, E + 1, 1)
    unfused = moe_ep.patch(tiny_model(family, experts_implementation="moe_ep"), fused_router=False)
    with pytest.raises(ValueError, match=r"node-limited routing runs in moe_ep's fused routers, but the router of "
                                         r".*: call moe_ep.patch\(model\) \(fused_router=True\) first"):
        limit_routing_to_nodes(unfused, nodes, 1)
