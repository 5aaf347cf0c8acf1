"""The expert-parallel layer with its exchanges overlapped with the experts
(``moe_experts_ep(..., overlap_chunks=n)``, moe_ep.dispatch.overlap) on 2 and 4 gloo ranks:
outputs and the gradients of the tokens, the routing weights and this rank's experts equal those
of ``overlap_chunks=1`` (within float32 rounding: the experts' GEMMs see other row counts and
their weight gradients are summed per chunk) and the float64 single-process reference; with
experts that act on each row alone, bit for bit. Cases: random routing, a rank without tokens,
every token to one rank, top-1, top-E, odd sizes, an empty chunk (one token on a rank) and three
chunks; on 4 ranks also with the node-aware dispatch over 2 simulated nodes of 2 (every token to
one node among them). A tiny Mixtral parallelized on 2 ranks trains alike with and without overlap (also under
full and selective recompute). Plus the one host sync, the argument errors (moe_experts_ep and
parallelize's configuration), and, on one rank, the order in which the collectives and the
experts really run, forward and backward: each chunk's experts run while another chunk's exchange
is in flight.

Every distributed check of one world size runs inside ONE spawned process group; pytest tests
read its results."""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from dispatch_cases import Case, reference
from dist_utils import run_ranks
from host_syncs import CPU_ONLY_CHECKS, HostSyncRecorder
from numerics import TOLERANCE, rel_err

TOL = TOLERANCE[torch.float32]
CHUNKED_TOL = 1e-6  # overlap_chunks=n against overlap_chunks=1: float32 rounding of GEMMs and weight-gradient sums


@dataclass(frozen=True)
class Scenario:
    case: Case
    chunks: int = 2
    node_aware: bool = False  # the node-aware dispatch over the world's 2 simulated nodes

    @property
    def name(self) -> str:
        return self.case.name + ("_node_aware" if self.node_aware else "")


SCENARIOS_2 = [
    Scenario(Case("random", T=7, E=8, K=2)),
    Scenario(Case("rank_without_tokens", T=(0, 6), E=4, K=2)),
    Scenario(Case("all_to_first_rank", T=6, E=8, K=2, routing="first_rank")),
    Scenario(Case("k1", T=6, E=4, K=1)),
    Scenario(Case("k_eq_e", T=3, E=4, K=4)),
    Scenario(Case("empty_chunk", T=(1, 5), E=4, K=2)),  # rank 0's chunks: 1 token and none
    Scenario(Case("three_chunks_odd_sizes", T=(7, 4), E=6, K=3, H=12, I=10), chunks=3),
    Scenario(Case("repeated_expert", T=(7, 4), E=2, K=2, routing="repeated")),
]
SCENARIOS_4 = [
    Scenario(Case("random", T=7, E=8, K=2)),
    Scenario(Case("odd_sizes_rank_without_tokens", T=(5, 0, 9, 3), E=12, K=3, H=12, I=10)),
    Scenario(Case("all_to_first_rank", T=6, E=8, K=2, routing="first_rank")),  # ranks 1-3 receive nothing
    Scenario(Case("k1", T=6, E=4, K=1)),
    Scenario(Case("k_eq_e", T=3, E=4, K=4)),
    Scenario(Case("empty_chunk", T=(1, 4, 1, 3), E=8, K=3)),
    Scenario(Case("same_rank", T=8, E=8, K=2, routing="same_rank")),
    Scenario(Case("random", T=7, E=8, K=2), node_aware=True),
    Scenario(Case("odd_sizes_rank_without_tokens", T=(5, 0, 9, 3), E=12, K=3, H=12, I=10), node_aware=True),
    Scenario(Case("all_to_first_node", T=6, E=8, K=3, routing="first_half"), node_aware=True),  # node 1: nothing
    Scenario(Case("all_to_first_rank", T=6, E=8, K=2, routing="first_rank"), node_aware=True),
    Scenario(Case("k1", T=6, E=4, K=1), node_aware=True),
    Scenario(Case("k_eq_e", T=3, E=4, K=4), node_aware=True),
    Scenario(Case("empty_chunk", T=(1, 4, 1, 3), E=8, K=3), node_aware=True),
    Scenario(Case("three_chunks_one_expert_per_rank", T=(7, 4, 5, 6), E=4, K=3), chunks=3, node_aware=True),
]
GRADS = ("y", "dx", "dw", "d_gate_up", "d_down")


def _row_wise_experts(x_SH, ids_SC, w_SC, gate_up, down, activation, backend, group=None, num_routed=None):
    """Experts whose output row depends on its input row alone, so no GEMM blocking can differ
    between chunks: the dispatch and combine themselves must then give the same bits. They take
    the received rows as the dispatcher hands them over: one column per local expert a row can
    carry, id ``L`` (the local experts' count) where it carries none."""
    routed_SC = ids_SC < gate_up.shape[0]
    return torch.tanh(x_SH) * ((1 + ids_SC) * w_SC * routed_SC).sum(1, keepdim=True)


@contextmanager
def _experts_replaced_by(fn):
    import moe_ep.dispatch.expert_parallel as expert_parallel
    import moe_ep.dispatch.overlap as overlap

    saved = expert_parallel.run_experts, overlap.run_experts
    expert_parallel.run_experts = overlap.run_experts = fn
    try:
        yield
    finally:
        expert_parallel.run_experts, overlap.run_experts = saved


def _run(scenario: Scenario, rank: int, world: int, chunks: int, nodes):
    from moe_ep.dispatch import moe_experts_ep

    case = scenario.case
    xs, idxs, ws, dys, gate_up, down = case.make(world)
    L = case.E // world
    mine = slice(rank * L, (rank + 1) * L)
    x, w = xs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_()
    gu, dn = gate_up[mine].clone().requires_grad_(), down[mine].clone().requires_grad_()
    y = moe_experts_ep(x, idxs[rank], w, gu, dn, group=dist.group.WORLD, overlap_chunks=chunks,
                       node_groups=nodes if scenario.node_aware else None)
    (y * dys[rank]).sum().backward()
    zero = torch.zeros(())
    return dict(zip(GRADS, (y.detach(), x.grad, w.grad,
                            zero if gu.grad is None else gu.grad, zero if dn.grad is None else dn.grad)))


def _check(scenario: Scenario, rank: int, world: int, nodes) -> dict:
    case = scenario.case
    plain, chunked = _run(scenario, rank, world, 1, nodes), _run(scenario, rank, world, scenario.chunks, nodes)
    xs, idxs, ws, dys, gate_up, down = case.make(world)
    y64, dx64, dw64, dgu64, ddn64 = reference(xs, idxs, ws, dys, gate_up, down)
    L = case.E // world
    rows = slice(sum(case.tokens(world)[:rank]), sum(case.tokens(world)[: rank + 1]))
    ref = dict(zip(GRADS, (y64[rows], dx64[rows], dw64[rows], dgu64[rank * L:(rank + 1) * L],
                           ddn64[rank * L:(rank + 1) * L])))
    with _experts_replaced_by(_row_wise_experts):
        plain_rows = _run(scenario, rank, world, 1, nodes)
        chunked_rows = _run(scenario, rank, world, scenario.chunks, nodes)
    return {
        "tokens": case.tokens(world)[rank],
        "err_plain": {k: rel_err(plain[k], ref[k]) for k in GRADS},
        "err_chunked": {k: rel_err(chunked[k], ref[k]) for k in GRADS},
        "chunked_vs_plain": {k: rel_err(chunked[k], plain[k]) for k in GRADS},
        "row_wise_equal": {k: torch.equal(chunked_rows[k], plain_rows[k]) for k in ("y", "dx", "dw")},
    }


def _audit(rank: int, world: int, nodes=None) -> list[str]:
    from moe_ep.dispatch import moe_experts_ep

    case = Case("audit", T=8, E=8, K=2)
    xs, idxs, ws, dys, gate_up, down = case.make(world, seed=3)
    L = case.E // world
    x, w = xs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_()
    gu = gate_up[rank * L:(rank + 1) * L].clone().requires_grad_()
    dn = down[rank * L:(rank + 1) * L].clone().requires_grad_()
    with HostSyncRecorder() as recorder:
        y = moe_experts_ep(x, idxs[rank], w, gu, dn, group=dist.group.WORLD, overlap_chunks=2, node_groups=nodes)
        torch.autograd.backward(y, dys[rank])
    return [s for s in recorder.sites if not any(check in s for check in CPU_ONLY_CHECKS)]


def _errors(rank: int, world: int) -> dict:
    from moe_ep.dispatch import ExpertParallelDispatcher, moe_experts_ep

    x, idx, w = torch.randn(4, 8), torch.randint(0, 8, (4, 2)), torch.rand(4, 2)
    gu, dn = torch.randn(8 // world, 6, 8), torch.randn(8 // world, 8, 3)

    def call(**kwargs):
        return lambda: moe_experts_ep(x, idx, w, gu, dn, group=dist.group.WORLD, **kwargs)

    attempts = {
        "zero": call(overlap_chunks=0),
        "negative": call(overlap_chunks=-2),
        "bool": call(overlap_chunks=True),
        "float": call(overlap_chunks=2.0),
        "capacity": call(overlap_chunks=2, capacity_factor=1.0),
        "dispatcher": lambda: ExpertParallelDispatcher(dist.group.WORLD, 8, capacity_factor=1.0, overlap_chunks=2),
    }
    messages = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            messages[name] = "no error"
        except (ValueError, TypeError) as exc:
            messages[name] = f"{type(exc).__name__}: {exc}"
    return messages


MODEL_STEPS = 3
MODEL_RUNS = {  # name: (overlap_chunks, activation_checkpointing)
    "plain": (1, "none"),
    "overlap": (2, "none"),
    "overlap_full_recompute": (2, "full"),  # the recompute runs the chunks' collectives again
    "overlap_selective_recompute": (2, "selective"),
}


def _train(rank: int, world: int, overlap_chunks: int, activation_checkpointing: str) -> dict:
    """A tiny Mixtral parallelized with ep=world: the losses of a few AdamW steps and the first
    step's gradients, gathered."""
    from hf_models import tiny_batch, tiny_model
    from moe_ep.hf import binding_of, experts_modules, register
    from moe_ep.parallel import parallelize

    register()
    model = tiny_model("mixtral", experts_implementation="moe_ep").train()
    batch = tiny_batch(model.config, batch=2 * world, seq=7)
    mine = {k: v[2 * rank:2 * rank + 2] for k, v in batch.items()}
    parallelize(model, ep=world, overlap_chunks=overlap_chunks, activation_checkpointing=activation_checkpointing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], None
    for step in range(MODEL_STEPS):
        loss = model(**mine).loss
        loss.backward()
        if step == 0:
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "grads": grads,
            "dispatcher": repr(binding_of(experts_modules(model)[0][1]).dispatcher)}


def _model_parity(rank: int, world: int) -> dict:
    runs = {name: _train(rank, world, *options) for name, options in MODEL_RUNS.items()}
    plain = runs.pop("plain")
    return {name: {"loss": max(abs(a - b) / abs(b) for a, b in zip(run["losses"], plain["losses"])),
                   "grad": max(rel_err(run["grads"][n], g) for n, g in plain["grads"].items()),
                   "dispatcher": run["dispatcher"]}
            for name, run in runs.items()}


def _world(rank: int, world: int, scenarios: list[Scenario], checks: bool) -> dict:
    from moe_ep.dispatch import split_by_node

    nodes = split_by_node([list(range(world))], world // 2) if world >= 4 else None
    results = {"cases": {s.name: _check(s, rank, world, nodes) for s in scenarios}}
    if nodes is not None:
        results["node_audit"] = _audit(rank, world, nodes)
    if checks:
        results["audit"] = _audit(rank, world)
        results["errors"] = _errors(rank, world)
        results["model"] = _model_parity(rank, world)
    return results


@pytest.fixture(scope="module")
def world2():
    return run_ranks(_world, 2, SCENARIOS_2, True, timeout=300)


@pytest.fixture(scope="module")
def world4():
    return run_ranks(_world, 4, SCENARIOS_4, False, timeout=300)


def _assert_case(results, name):
    for rank, result in enumerate(results):
        case = result["cases"][name]
        for key in ("err_plain", "err_chunked"):
            bad = {k: v for k, v in case[key].items() if not v <= TOL}
            assert not bad, f"rank {rank}: {key} relative errors above {TOL}: {bad}"
        bad = {k: v for k, v in case["chunked_vs_plain"].items() if not v <= CHUNKED_TOL}
        assert not bad, f"rank {rank}: overlap_chunks against 1 above {CHUNKED_TOL}: {bad}"
        assert all(case["row_wise_equal"].values()), f"rank {rank}: not bit for bit: {case['row_wise_equal']}"


@pytest.mark.slow
@pytest.mark.parametrize("name", [s.name for s in SCENARIOS_2])
def test_two_ranks_overlapped_equal_plain_and_float64_reference(world2, name):
    _assert_case(world2, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [s.name for s in SCENARIOS_4])
def test_four_ranks_overlapped_equal_plain_and_float64_reference(world4, name):
    _assert_case(world4, name)


@pytest.mark.slow
def test_hard_cases_are_what_they_claim(world2, world4):
    assert world2[0]["cases"]["rank_without_tokens"]["tokens"] == 0
    assert world2[0]["cases"]["empty_chunk"]["tokens"] == 1  # torch.tensor_split: chunks of 1 and 0 tokens
    assert world4[1]["cases"]["odd_sizes_rank_without_tokens"]["tokens"] == 0
    assert [world4[r]["cases"]["empty_chunk"]["tokens"] for r in range(4)] == [1, 4, 1, 3]


@pytest.mark.slow
def test_overlap_keeps_the_one_count_exchange_sync(world2, world4):
    for result in world2:
        assert result["audit"] == ["tolist @ dispatch/rank_exchange.py:dropless"]
    for result in world4:  # node-aware: both stages' counts of both chunks, one sync
        assert result["node_audit"] == ["tolist @ dispatch/rank_exchange.py:dropless"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, pattern",
    [
        ("zero", r"overlap_chunks must be a positive int .*got 0"),
        ("negative", r"overlap_chunks must be a positive int .*got -2"),
        ("bool", r"overlap_chunks must be a positive int .*got True"),
        ("float", r"overlap_chunks must be a positive int .*got 2.0"),
        ("capacity", r"overlap_chunks=2 needs the dropless dispatch, got capacity_factor=1.0"),
        ("dispatcher", r"overlap_chunks=2 needs the dropless dispatch, got capacity_factor=1.0"),
    ],
)
def test_errors_name_the_argument(world2, name, pattern):
    for result in world2:
        assert re.search(pattern, result["errors"][name]), result["errors"][name]


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in MODEL_RUNS if name != "plain"])
def test_parallelized_model_trains_alike_with_and_without_overlap(world2, name):
    for rank, result in enumerate(world2):
        run = result["model"][name]
        assert "overlap_chunks=2" in run["dispatcher"], run["dispatcher"]
        assert run["loss"] <= CHUNKED_TOL and run["grad"] <= CHUNKED_TOL, (rank, name, run)


# ---------------------------------------------------------------------------------------------
# parallelize's option, checked when its configuration is built, and the scheme "auto" picks.


@pytest.mark.parametrize(
    "arguments, pattern",
    [
        (dict(ep=2, overlap_chunks=0), r"overlap_chunks must be a positive int .*got 0"),
        (dict(ep=2, overlap_chunks="2"), r"overlap_chunks must be a positive int .*got '2'"),
        (dict(overlap_chunks=2), r"overlap_chunks=2 applies to the expert-parallel dispatcher; ep=1 has none"),
        (dict(ep=2, overlap_chunks=2, capacity_factor=1.0),
         r"overlap_chunks=2 needs the dropless dispatch, got capacity_factor=1.0"),
    ],
)
def test_parallel_config_checks_overlap_chunks(arguments, pattern):
    from moe_ep.parallel import ParallelConfig

    with pytest.raises(ValueError, match=pattern):
        ParallelConfig.from_arguments(**arguments)


def test_overlap_composes_with_either_dispatch():
    from moe_ep.parallel import ParallelConfig

    assert ParallelConfig(ep=2, overlap_chunks=2).arguments()["overlap_chunks"] == 2
    node_aware = ParallelConfig(ep=4, overlap_chunks=2, dispatch_mode="node", node_size=2).arguments()
    assert (node_aware["overlap_chunks"], node_aware["dispatch_mode"]) == (2, "node")
    assert ParallelConfig(ep=4, overlap_chunks=2, dispatch_mode="node", node_size=2).ep_node_size == 2
    assert ParallelConfig(ep=4, overlap_chunks=2, node_size=2).ep_node_size == 2  # "auto" over 2 nodes
    assert ParallelConfig(ep=4, overlap_chunks=2, dispatch_mode="flat", node_size=2).ep_node_size is None
    with pytest.raises(ValueError, match="dispatch_mode='node' needs an ep group over several whole nodes"):
        ParallelConfig(ep=4, dispatch_mode="node", node_size=4).ep_node_size


# ---------------------------------------------------------------------------------------------
# The order in which the exchanges and the experts really run, on one rank.


class _Recorder:
    """Records every all-to-all (issued synchronously, or asynchronously with an id, and the
    wait on that id) and each expert call's forward and backward, in the order they happen."""

    def __init__(self):
        self.events: list[tuple] = []
        self._issued = 0

    def all_to_all_single(self, real):
        recorder = self

        class Work:
            def __init__(self, work, number):
                self.work, self.number = work, number

            def wait(self):
                self.work.wait()
                recorder.events.append(("wait", self.number))

        def recorded(*args, async_op=False, **kwargs):
            work = real(*args, async_op=async_op, **kwargs)
            if not async_op:
                self.events.append(("sync",))
                return work
            self._issued += 1
            self.events.append(("issue", self._issued))
            return Work(work, self._issued)

        return recorded

    def experts(self, real):
        recorder = self

        class Mark(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, event):
                ctx.event = event
                return x.view_as(x)

            @staticmethod
            def backward(ctx, grad):
                recorder.events.append(ctx.event)
                return grad, None

        def recorded(x_QH, *args, **kwargs):
            chunk = sum(e[0] == "experts" for e in self.events) + 1
            self.events.append(("experts", chunk))
            # Backward runs the output's mark first, then the experts, then the input's mark.
            out = real(Mark.apply(x_QH, ("experts backward ends", chunk)), *args, **kwargs)
            return Mark.apply(out, ("experts backward begins", chunk))

        return recorded


def _spanning(events, begin, end) -> list[int]:
    """The exchanges issued before ``begin`` and waited for after ``end``: in flight all along."""
    at = {e: i for i, e in enumerate(events)}
    return [e[1] for e in events if e[0] == "issue" and at[e] < at[begin] and at[("wait", e[1])] > at[end]]


def _order(rank: int, world: int, node_aware: bool = False) -> dict:
    import moe_ep.dispatch.overlap as overlap
    from moe_ep.dispatch import moe_experts_ep, split_by_node

    case = Case("order", T=6, E=4, K=2)  # one rank holds all 4 experts: multi rows, so routing exchanges too
    xs, idxs, ws, dys, gate_up, down = case.make(world)
    x, w = xs[0].requires_grad_(), ws[0].requires_grad_()
    gu, dn = gate_up.requires_grad_(), down.requires_grad_()
    nodes = split_by_node([[0]], 1) if node_aware else None  # one node of one rank: both stages run
    recorder = _Recorder()
    real_a2a, real_experts = dist.all_to_all_single, overlap.run_experts
    dist.all_to_all_single = recorder.all_to_all_single(real_a2a)
    overlap.run_experts = recorder.experts(real_experts)
    try:
        y = moe_experts_ep(x, idxs[0], w, gu, dn, group=dist.group.WORLD, overlap_chunks=2, node_groups=nodes)
        forward = list(recorder.events)
        recorder.events.clear()
        torch.autograd.backward(y, dys[0])
    finally:
        dist.all_to_all_single, overlap.run_experts = real_a2a, real_experts
    backward = recorder.events
    return {
        "forward": forward,
        "backward": backward,
        "forward_spans": [_spanning(forward, ("experts", c), ("experts", c)) for c in (1, 2)],
        "backward_spans": [_spanning(backward, ("experts backward begins", c), ("experts backward ends", c))
                           for c in (1, 2)],
    }


@pytest.fixture(scope="module")
def order():
    return run_ranks(_order, 1)[0]


def test_forward_issues_both_dispatches_then_pipelines_experts_and_combines(order):
    assert order["forward"] == [
        ("sync",),  # the count exchange of both chunks, the one host sync
        ("issue", 1), ("issue", 2),  # chunk 1's rows and routing columns
        ("issue", 3), ("issue", 4),  # chunk 2's
        ("wait", 1), ("wait", 2), ("experts", 1), ("issue", 5),  # chunk 1's combine
        ("wait", 3), ("wait", 4), ("experts", 2), ("issue", 6),  # chunk 2's combine
        ("wait", 5), ("wait", 6),
    ]
    # While chunk 1's experts run, chunk 2's dispatch is in flight; while chunk 2's, chunk 1's combine.
    assert order["forward_spans"] == [[3, 4], [5]]


def test_backward_exchanges_are_asynchronous_and_overlap_the_other_chunks_experts(order):
    # Numbered on from the forward's six: each backward exchange is issued by its wait's backward
    # and waited for by its issue's backward.
    assert order["backward"] == [
        ("issue", 7), ("issue", 8),  # the combines' gradients, chunk 2's then chunk 1's
        ("wait", 7), ("experts backward begins", 2), ("experts backward ends", 2),
        ("issue", 9), ("issue", 10),  # chunk 2's dispatch gradients (rows, routing weights)
        ("wait", 8), ("experts backward begins", 1), ("experts backward ends", 1),
        ("issue", 11), ("issue", 12),  # chunk 1's
        ("wait", 9), ("wait", 10), ("wait", 11), ("wait", 12),
    ]
    # Chunk 1's experts' backward runs while chunk 2's dispatch gradients travel; chunk 2's while
    # chunk 1's combine gradient does.
    assert order["backward_spans"] == [[9, 10], [8]]


@pytest.fixture(scope="module")
def node_order():
    return run_ranks(_order, 1, True)[0]


def test_node_aware_forward_hides_a_network_exchange_behind_each_chunks_experts(node_order):
    # One node of one rank, so both stages run: S1 over the inter-node group, S2 inside the node;
    # the combine's C2 inside the node, then C1 back over the network.
    assert node_order["forward"] == [
        ("sync",), ("sync",),  # both stages' counts of both chunks: one collective per group, one host sync
        ("issue", 1), ("issue", 2), ("issue", 3), ("issue", 4),  # S1 of chunks 1 and 2 (rows, routing columns)
        ("wait", 1), ("wait", 2), ("issue", 5), ("issue", 6), ("wait", 5), ("wait", 6),  # chunk 1: S1 -> S2
        ("experts", 1), ("issue", 7),  # chunk 1's C2
        ("wait", 3), ("wait", 4), ("issue", 8), ("issue", 9), ("wait", 8), ("wait", 9),  # chunk 2: S1 -> S2
        ("wait", 7), ("issue", 10),  # chunk 1's C1, over the network during chunk 2's experts
        ("experts", 2), ("issue", 11), ("wait", 11), ("issue", 12),  # chunk 2's C2, then its C1
        ("wait", 10), ("wait", 12),
    ]
    # Chunk 1's experts run while chunk 2's S1 crosses the network; chunk 2's while chunk 1's C1 does.
    assert node_order["forward_spans"] == [[3, 4], [10]]


def test_node_aware_backward_hides_a_network_exchange_behind_each_chunks_experts(node_order):
    # Numbered on from the forward's twelve.
    assert node_order["backward"] == [
        ("issue", 13), ("issue", 14),  # the C1 gradients, chunk 2's then chunk 1's
        ("wait", 13), ("issue", 15), ("wait", 15),  # chunk 2's C2 gradient
        ("experts backward begins", 2), ("experts backward ends", 2),
        ("wait", 14), ("issue", 16),  # chunk 1's C2 gradient
        ("issue", 17), ("issue", 18), ("wait", 17), ("wait", 18),  # chunk 2's S2 gradients
        ("issue", 19), ("issue", 20),  # chunk 2's S1 gradients, over the network
        ("wait", 16), ("experts backward begins", 1), ("experts backward ends", 1),
        ("issue", 21), ("issue", 22), ("wait", 21), ("wait", 22),  # chunk 1's S2 gradients
        ("issue", 23), ("issue", 24),  # chunk 1's S1 gradients
        ("wait", 19), ("wait", 20), ("wait", 23), ("wait", 24),
    ]
    # Chunk 2's experts' backward runs while chunk 1's C1 gradient travels; chunk 1's while chunk
    # 2's S1 gradients do.
    assert node_order["backward_spans"] == [[19, 20], [14]]
