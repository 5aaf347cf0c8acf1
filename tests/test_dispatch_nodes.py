"""The node-aware dispatch (moe_ep.dispatch.nodes) on gloo ranks arranged as simulated nodes
(the node size given, ranks numbered node by node): 4 ranks as 2 nodes of 2 and 8 ranks as 4
nodes of 2, against the float64 single-process reference (outputs and the gradients of the
tokens, the routing weights and this rank's experts), with a rank that has no tokens, ranks that
receive nothing, every token to one node and odd sizes. The bytes each rank sends over each
group, forward, equal the count of ``node_wire_bytes`` exactly; with 4096 tokens per rank of
uniform routing, forward and backward, they match the planner within 2%, on those gloo ranks and
at full routing size on torch's fake process group (world 128 and 512, DeepSeek-V3's and
Qwen3-30B-A3B's routing), where a token crosses the network at most ``min(K, nodes - 1)`` times. Plus the host
sync (one for both stages' count exchanges), the choice of scheme and the argument errors.

Every distributed check of one world size runs inside ONE spawned process group; pytest tests
read its results. Loss, gradients and optimizer steps of whole models in each dispatch mode are
tests/test_parallel.py's (PARITY_4, PARITY_8)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

from dispatch_cases import Case, reference
from dist_utils import run_ranks
from host_syncs import CPU_ONLY_CHECKS, HostSyncRecorder
from numerics import TOLERANCE, rel_err
from moe_ep.dispatch import node_count_exchange_bytes, node_wire_bytes
from moe_ep.dispatch.nodes import LOCAL_WORLD_SIZE, node_size_for

TOL = TOLERANCE[torch.float32]
NODE_SIZE = 2
NETWORK_TOLERANCE = 0.02  # the planner's bytes per group against the measured ones
PLANNER_TOKENS = 4096

CASES_4 = [
    Case("random", T=7, E=8, K=2),
    Case("odd_sizes_rank_without_tokens", T=(5, 0, 9, 3), E=12, K=3, H=12, I=10),
    Case("k1", T=6, E=4, K=1),
    Case("k_eq_e", T=3, E=4, K=4),
    Case("one_expert_per_rank_k3", T=5, E=4, K=3),  # L=1: every forwarded row is single
    Case("all_to_first_rank", T=6, E=8, K=2, routing="first_rank"),  # ranks 1-3 receive nothing
    Case("all_to_first_node", T=6, E=8, K=3, routing="first_half"),  # node 1 receives nothing
    Case("same_rank", T=8, E=8, K=2, routing="same_rank"),
    Case("one_expert_gets_all", T=4, E=16, K=4, routing="one_expert"),
    Case("repeated_expert", T=5, E=4, K=3, routing="repeated"),  # one node's expert twice in a token
]
CASES_8 = [
    Case("random", T=(6, 3, 0, 5, 7, 2, 4, 6), E=16, K=4),
    Case("all_to_first_node", T=5, E=16, K=3, routing="first_half"),  # not one node of 2: nodes 0 and 1
]


def _check_case(case: Case, rank: int, world: int, nodes) -> dict:
    from moe_ep.bench.planner import CollectiveRecorder
    from moe_ep.dispatch import dispatch, moe_experts_ep

    xs, idxs, ws, dys, gate_up, down = case.make(world)
    L = case.E // world
    mine = slice(rank * L, (rank + 1) * L)
    x = xs[rank].clone().requires_grad_()
    w = ws[rank].clone().requires_grad_()
    gu = gate_up[mine].clone().requires_grad_()
    dn = down[mine].clone().requires_grad_()
    group = dist.group.WORLD
    routed = dispatch(x, idxs[rank], w, group=group, num_experts=case.E, node_groups=nodes)
    home = rank // NODE_SIZE
    result = {
        # Stage 1's rows to other nodes: one per (token, other node holding one of its experts).
        "network_rows": sum(n for node, n in enumerate(routed.layout.send_splits) if node != home),
        "network_rows_expected": sum(len(set(row.tolist()) - {home}) for row in idxs[rank] // (L * NODE_SIZE)),
        "pairs": routed.layout.num_pairs,
    }
    with CollectiveRecorder() as recorder:
        y = moe_experts_ep(x, idxs[rank], w, gu, dn, group=group, node_groups=nodes)
    counted = node_wire_bytes(idxs, L, case.H, NODE_SIZE, element_size=x.element_size())[rank]
    counts = node_count_exchange_bytes(case.E, world, case.K, NODE_SIZE)
    sent = {name: recorder.group_bytes.get(("all-to-all", pg.group_name), 0.0)
            for name, pg in (("inter", nodes.inter), ("intra", nodes.intra))}
    result["bytes"] = {"inter": (sent["inter"], counted.inter_bytes + counts[0]),
                       "intra": (sent["intra"], counted.intra_bytes + counts[1])}
    result["other_collectives"] = sorted(
        k for k in recorder.group_bytes if k[1] not in (nodes.inter.group_name, nodes.intra.group_name))
    (y * dys[rank]).sum().backward()
    y64, dx64, dw64, dgu64, ddn64 = reference(xs, idxs, ws, dys, gate_up, down)
    rows = slice(sum(case.tokens(world)[:rank]), sum(case.tokens(world)[: rank + 1]))
    result["err"] = {
        "y": rel_err(y, y64[rows]),
        "dx": rel_err(x.grad, dx64[rows]),
        "dw": rel_err(w.grad, dw64[rows]),
        "d_gate_up": rel_err(gu.grad, dgu64[mine]),
        "d_down": rel_err(dn.grad, ddn64[mine]),
    }
    return result


def _audit(rank: int, world: int, nodes) -> list[str]:
    from moe_ep.dispatch import moe_experts_ep

    case = Case("audit", T=8, E=8, K=2)
    xs, idxs, ws, dys, gate_up, down = case.make(world, seed=3)
    L = case.E // world
    x = xs[rank].clone().requires_grad_()
    w = ws[rank].clone().requires_grad_()
    gu = gate_up[rank * L:(rank + 1) * L].clone().requires_grad_()
    dn = down[rank * L:(rank + 1) * L].clone().requires_grad_()
    with HostSyncRecorder() as recorder:
        y = moe_experts_ep(x, idxs[rank], w, gu, dn, group=dist.group.WORLD, node_groups=nodes)
        torch.autograd.backward(y, dys[rank])
    return [s for s in recorder.sites if not any(check in s for check in CPU_ONLY_CHECKS)]


def _errors(rank: int, world: int, nodes) -> dict:
    from moe_ep.dispatch import NodeGroups, dispatch

    group = dist.group.WORLD
    x, idx, w = torch.randn(4, 8), torch.randint(0, 8, (4, 2)), torch.rand(4, 2)
    swapped = NodeGroups(inter=nodes.intra, intra=nodes.inter)  # right sizes, wrong ranks on ranks 1 and 2
    attempts = {
        "node_groups_type": lambda: dispatch(x, idx, w, group=group, num_experts=8, node_groups=(1, 2)),
        "node_groups_with_capacity": lambda: dispatch(x, idx, w, group=group, num_experts=8, node_groups=nodes,
                                                      capacity_factor=1.0),
        "node_groups_swapped": lambda: dispatch(x, idx, w, group=group, num_experts=8, node_groups=swapped),
        "node_groups_not_of_group": lambda: dispatch(x, idx, w, group=nodes.intra, num_experts=8, node_groups=nodes),
    }
    messages = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            messages[name] = "no error"
        except (ValueError, TypeError) as exc:
            messages[name] = f"{type(exc).__name__}: {exc}"
    return messages


def _planner_bytes(rank: int, world: int, nodes) -> dict:
    """This rank's bytes over each group for 4096 tokens of uniform routing (16 experts, top-4,
    H=8; each rank its own draw), forward and backward, and the planner's for a rank."""
    from moe_ep.bench.planner import node_dispatch_bytes, node_planner_bytes

    spec = _spec(num_experts=16, top_k=4, hidden_size=8)
    measured, _ = node_dispatch_bytes(spec, dist.group.WORLD, nodes, tokens=PLANNER_TOKENS, seed=rank, mirror=False)
    return {"measured": measured, "planner": node_planner_bytes(spec, world, NODE_SIZE, PLANNER_TOKENS)}


def _world(rank: int, world: int, cases: list[Case], checks: bool) -> dict:
    from moe_ep.dispatch import split_by_node

    nodes = split_by_node([list(range(world))], NODE_SIZE)
    results = {"cases": {c.name: _check_case(c, rank, world, nodes) for c in cases},
               "planner": _planner_bytes(rank, world, nodes)}
    if checks:
        results["audit"] = _audit(rank, world, nodes)
        results["errors"] = _errors(rank, world, nodes)
    return results


@pytest.fixture(scope="module")
def world4():
    return run_ranks(_world, 4, CASES_4, True, timeout=300)


@pytest.fixture(scope="module")
def world8():
    return run_ranks(_world, 8, CASES_8, False, timeout=300)


def _assert_case(results, name):
    for rank, result in enumerate(results):
        case = result["cases"][name]
        bad = {k: v for k, v in case["err"].items() if not v <= TOL}
        assert not bad, f"rank {rank}: relative errors above {TOL}: {bad}"
        assert case["network_rows"] == case["network_rows_expected"], (rank, case)
        for group, (measured, counted) in case["bytes"].items():
            assert measured == counted, f"rank {rank}: {group} bytes measured {measured}, counted {counted}"
        assert case["other_collectives"] == [], (rank, case["other_collectives"])


@pytest.mark.slow
@pytest.mark.parametrize("name", [c.name for c in CASES_4])
def test_four_ranks_as_two_nodes_match_float64_reference_and_the_byte_count(world4, name):
    _assert_case(world4, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [c.name for c in CASES_8])
def test_eight_ranks_as_four_nodes_match_float64_reference_and_the_byte_count(world8, name):
    _assert_case(world8, name)


@pytest.mark.slow
def test_hard_cases_are_what_they_claim(world4, world8):
    assert world4[1]["cases"]["odd_sizes_rank_without_tokens"]["network_rows"] == 0  # rank 1 has no tokens
    assert all(world4[r]["cases"]["all_to_first_rank"]["pairs"] == 0 for r in (1, 2, 3))
    assert all(world4[r]["cases"]["all_to_first_node"]["pairs"] == 0 for r in (2, 3))
    assert all(world4[r]["cases"]["all_to_first_node"]["pairs"] > 0 for r in (0, 1))
    # Node 1 sends its tokens over the network once each, node 0 keeps its own on the node.
    for r in range(4):
        case = world4[r]["cases"]["all_to_first_node"]
        assert case["network_rows"] == (0 if r < 2 else 6)
    assert all(world8[r]["cases"]["all_to_first_node"]["pairs"] == 0 for r in range(4, 8))


@pytest.mark.slow
@pytest.mark.parametrize("world", ["world4", "world8"])
def test_bytes_over_each_group_match_the_planner_on_gloo(request, world):
    for rank, result in enumerate(request.getfixturevalue(world)):
        measured, planner = result["planner"]["measured"], result["planner"]["planner"]
        assert measured["other"] == []
        for group in ("ep-inter", "ep-intra"):
            ratio = measured[group] / planner[group]
            assert abs(ratio - 1) <= NETWORK_TOLERANCE, (rank, group, measured[group], planner[group])


@pytest.mark.slow
def test_node_aware_dispatch_reads_both_stages_counts_with_one_host_sync(world4):
    for result in world4:
        assert result["audit"] == ["tolist @ dispatch/rank_exchange.py:dropless"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, pattern",
    [
        ("node_groups_type", r"node_groups must be a moe_ep.dispatch.NodeGroups or None, got tuple"),
        ("node_groups_with_capacity", r"node_groups: the node-aware dispatch is dropless only, so capacity_factor "
                                      r"must be None, got 1.0"),
        ("node_groups_not_of_group", r"node_groups must split the ep group of 2 ranks into nodes x node_size, got 2 "
                                     r"nodes x 2"),
    ],
)
def test_errors_name_the_argument(world4, name, pattern):
    for result in world4:
        assert re.search(pattern, result["errors"][name]), result["errors"][name]


@pytest.mark.slow
def test_groups_that_do_not_split_the_ep_group_by_node_are_refused(world4):
    # Swapped, the groups have the right sizes; ranks 1 and 2 would sit at each other's place, and
    # ranks 0 and 3, at their own place in the wrong groups, entered the exchange alone (a hang).
    intra = {0: r"\[0, 1\], got \[0, 2\]", 1: r"\[0, 1\], got \[1, 3\]", 2: r"\[2, 3\], got \[0, 2\]",
             3: r"\[2, 3\], got \[1, 3\]"}
    for rank, result in enumerate(world4):
        message = result["errors"]["node_groups_swapped"]
        assert re.search(r"node_groups do not match the ep group: rank \d of it \(global ranks \[0, 1, 2, 3\], "
                         r"numbered node by node\) needs node_groups.intra of global ranks " + intra[rank], message), \
            message


# ---------------------------------------------------------------------------------------------
# At full routing size on torch's fake process group, against the planner.

FAKE_CASES = [  # (config, ep, node size, world size)
    ("qwen3_moe", 16, 8, 128),  # Qwen3-30B-A3B: 128 experts, top-8, 2 nodes
    ("deepseek_v3", 32, 8, 128),  # 256 experts, top-8, 4 nodes
    ("deepseek_v3", 64, 8, 512),  # EP64 over 8-GPU nodes
]


def _config(family: str):
    from transformers import AutoConfig

    return AutoConfig.for_model(family)


def _spec(**changes):
    """The planner's description of Qwen3-30B-A3B with ``changes`` (routing and width)."""
    import dataclasses

    from moe_ep.planner.spec import ModelSpec

    return dataclasses.replace(ModelSpec.resolve(_config("qwen3_moe")), **changes)


@pytest.mark.slow
@pytest.mark.parametrize("family, ep, node_size, world", FAKE_CASES)
def test_bytes_over_each_group_match_the_planner_on_the_fake_group(family, ep, node_size, world):
    from moe_ep.bench.planner import node_dispatcher_checks

    config = _config(family)
    nodes = ep // node_size
    checks, copies = node_dispatcher_checks(config, ep, node_size, world_size=world, tokens=4096, hidden_size=64)
    assert {c.check.split(" over ")[1].split(",")[0] for c in checks} == {"ep-inter", "ep-intra"}
    for c in checks:
        assert abs(c.ratio - 1) <= NETWORK_TOLERANCE, f"{c.case}: {c.check}: {c.measured} against {c.modelled}"
    assert copies["other collectives"] == []
    # Copies of a token over the network: at most one per other node, fewer than the single-stage
    # dispatch's one per rank on another node.
    assert copies["node-aware"] <= min(config.num_experts_per_tok, nodes - 1)
    assert copies["node-aware"] < copies["single-stage"]


# ---------------------------------------------------------------------------------------------
# Single-process checks.


def test_auto_splits_a_dropless_ep_group_that_spans_whole_nodes(monkeypatch):
    monkeypatch.delenv(LOCAL_WORLD_SIZE, raising=False)
    assert node_size_for("auto", 16, None, None) is None  # the node size is unknown: one node
    assert node_size_for("auto", 16, 8, None) == 8
    assert node_size_for("auto", 8, 8, None) is None  # one node
    assert node_size_for("auto", 12, 8, None) is None  # not whole nodes
    assert node_size_for("auto", 16, 8, 1.0) is None  # capacity mode: single-stage
    assert node_size_for("flat", 16, 8, None) is None
    assert node_size_for("node", 16, 8, None) == 8
    monkeypatch.setenv(LOCAL_WORLD_SIZE, "4")
    assert node_size_for("auto", 16, None, None) == 4
    assert node_size_for("auto", 16, 8, None) == 8  # given beats the launcher's


@pytest.mark.parametrize(
    "mode, ep, node_size, capacity_factor, env, pattern",
    [
        ("nodes", 16, 8, None, None, r"dispatch_mode must be one of \('auto', 'flat', 'node'\), got 'nodes'"),
        ("node", 16, 8, 1.0, None, r"dispatch_mode='node' is dropless only, so capacity_factor must be None, got 1.0"),
        ("node", 16, None, None, None, r"dispatch_mode='node' needs the node size: pass node_size or launch with"),
        ("node", 8, 8, None, None, r"needs an ep group over several whole nodes: ep=8 must be a multiple of "
                                   r"node_size=8 larger than it"),
        ("node", 12, 8, None, None, r"ep=12 must be a multiple of node_size=8"),
        ("auto", 16, 0, None, None, r"node_size must be a positive int or None .*, got 0"),
        ("auto", 16, None, None, "eight", r"LOCAL_WORLD_SIZE must be a positive int, got 'eight'"),
    ],
)
def test_dispatch_mode_errors(monkeypatch, mode, ep, node_size, capacity_factor, env, pattern):
    if env is None:
        monkeypatch.delenv(LOCAL_WORLD_SIZE, raising=False)
    else:
        monkeypatch.setenv(LOCAL_WORLD_SIZE, env)
    with pytest.raises(ValueError, match=pattern):
        node_size_for(mode, ep, node_size, capacity_factor)


@pytest.mark.parametrize(
    "ep_groups, node_size, pattern",
    [
        ([list(range(6))], 4, r"an ep group of 6 ranks does not split into nodes of node_size=4"),
        ([[1, 2, 3, 4]], 2, r"ranks \[1, 2\] of the ep group \[1, 2, 3, 4\] should share a node of 2 and do not"),
        ([[4, 5, 6, 7]], 2, r"rank 0 is in none of the ep groups \[\[4, 5, 6, 7\]\]"),
        ([list(range(8))], None, r"node_size must be a positive int, got None"),
    ],
)
def test_split_by_node_refuses_groups_that_do_not_split_into_nodes(ep_groups, node_size, pattern):
    from moe_ep.bench.planner import fake_rank
    from moe_ep.dispatch import split_by_node

    with fake_rank(0, 8), pytest.raises(ValueError, match=pattern):
        split_by_node(ep_groups, node_size)


def test_split_by_node_refuses_what_is_not_lists_of_ranks():
    from moe_ep.bench.planner import fake_rank
    from moe_ep.dispatch import split_by_node

    for ep_groups in (object(), [0, 1, 2, 3], [[0, 1.0]], "0123"):
        with fake_rank(0, 4), pytest.raises(TypeError, match=r"ep_groups must be a list of every ep group's global "
                                                             r"ranks \(lists of ints, in ep order\), got "):
            split_by_node(ep_groups, 2)


def test_node_wire_bytes_counts_one_row_per_node_and_per_rank():
    # 4 ranks as 2 nodes of 2, one expert per rank, H=4 in float32: a row is 16 bytes.
    idx = [torch.tensor([[2, 3]]), torch.empty(0, 2, dtype=torch.long), torch.tensor([[0, 2]]),
           torch.empty(0, 2, dtype=torch.long)]
    counted = node_wire_bytes(idx, 1, 4, 2, element_size=4)
    # Rank 0's token: one row to node 1 (rank 2) carrying both of its experts there (2 routing
    # columns), which rank 2 forwards to rank 3 and returns combined. Rank 2's token: one row to
    # node 0 (rank 0, expert 0 there) and its own node's row, which stays on rank 2 (expert 2).
    assert [(c.inter_rows, c.inter_metadata, c.intra_rows, c.intra_metadata) for c in counted] == [
        (1 + 1, 2 * 8, 0, 0), (0, 0, 0, 0), (1 + 1, 0, 1, 0), (0, 0, 1, 0)]
    assert counted[0].inter_bytes == 2 * 16 + 16
    # To the other node: its 4 experts' counts (+ multi rows and pairs), and the stage-2 counts of
    # its 2 ranks (2 experts each, + multi rows and pairs); inside the node: one rank's.
    assert node_count_exchange_bytes(8, 4, 2, 2) == (4 * (4 + 2) + 4 * 2 * (2 + 2), 4 * (2 + 2))
    with pytest.raises(ValueError, match="node_size=3 must divide the 4 ranks of idx_by_rank"):
        node_wire_bytes(idx, 1, 4, 3)
    with pytest.raises(ValueError, match="node_size must be a positive int, got 0"):
        node_count_exchange_bytes(8, 4, 2, 0)


@pytest.mark.slow  # transformers' DeepSeek-V3 config: seconds to import
def test_planner_sends_fewer_network_bytes_node_aware():
    # DeepSeek-V3 at EP64 over 8-GPU nodes: the network carries one copy per token and other
    # node (about 4.6) instead of one per rank on another node (about 6.6).
    from moe_ep.planner.comm import all_to_all_collective, node_all_to_all_collectives
    from moe_ep.planner.layout import Layout
    from moe_ep.planner.presets import cluster_preset
    from moe_ep.planner.spec import ModelSpec

    spec = ModelSpec.resolve(_config("deepseek_v3"))
    layout = Layout(1, 1, 64, 64, 1, 1, "none", False)
    flat = all_to_all_collective(spec, layout, 4096, 1)
    inter, intra = node_all_to_all_collectives(spec, layout, 4096, 1, 8)
    assert (inter.group, inter.size, inter.stride, intra.group, intra.size, intra.stride) == (
        "ep-inter", 8, 8, "ep-intra", 8, 1)
    network_flat = flat.bytes * 56 / 63  # the share of the single-stage bytes to other nodes
    assert 0.6 < inter.bytes / network_flat < 0.75
    # The search costs what parallelize's "auto" runs on the cluster: node-aware over 8-GPU nodes,
    # single-stage in capacity mode; the node-aware layer's all-to-all takes less time.
    from moe_ep.planner import Cluster
    from moe_ep.planner.memory import unit_seconds
    from moe_ep.planner.search import Assumptions, _units

    cluster = Cluster.from_preset(cluster_preset("dgx-h100"), nodes=8)
    moe = [u for u in _units(spec, layout, 4096, Assumptions(), cluster) if u.moe][0]
    assert [c.group for c in moe.a2a] == ["ep-inter", "ep-intra"]
    dropping = [u for u in _units(spec, layout, 4096, Assumptions(capacity_factor=1.0), cluster) if u.moe][0]
    assert [c.group for c in dropping.a2a] == ["ep"]
    # The single-stage all-to-all of the busiest rank, as the units count theirs.
    loaded = all_to_all_collective(spec, layout, 4096, 1, Assumptions().imbalance)
    assert sum(c.seconds(cluster) for c in moe.a2a) < 0.9 * loaded.seconds(cluster)
    assert unit_seconds(moe, cluster) > 0
