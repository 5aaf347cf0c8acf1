"""The expert-parallel dispatcher on 2 and 4 gloo ranks against a float64 single-process
reference (moe_experts_ref on every rank's tokens at once): outputs and the gradients of the
tokens, the routing weights and this rank's experts. Plus the capacity policy against a loop
implementation of its documented rule, the host-sync audit of both modes, the byte counts, the
transformers registry entry and the argument errors.

Every distributed check of one world size runs inside ONE spawned process group (cheap to
start); pytest tests read its results."""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dispatch_cases import Case, reference
from host_syncs import CPU_ONLY_CHECKS, HostSyncRecorder, moe_ep_site
from dist_utils import run_ranks
from markers import HAS_EP_REGISTRY, requires_cuda, requires_ep_registry
from numerics import TOLERANCE, rel_err
from routing_rules import first_slots, keep_mask_reference, remap_routing
import moe_ep
from moe_ep.bench.dispatch import count_sent_bytes
from moe_ep.dispatch import CountExchangeBytes, capacity_keep_mask, count_exchange_bytes, expert_capacity, wire_bytes
from moe_ep.ops.reference import moe_experts_ref

TOL = TOLERANCE[torch.float32]
# The ranks run transformers' expert-parallel entries only where its registry exists (markers.py).


CASES_2 = [
    Case("random", T=7, E=8, K=2),
    Case("odd_sizes", T=(5, 9), E=6, K=3, H=12, I=10),
    Case("k1", T=6, E=4, K=1),
    Case("k_eq_e", T=5, E=4, K=4),
    Case("rank1_receives_nothing", T=6, E=8, K=2, routing="first_rank"),
    Case("one_expert_gets_all_k1", T=6, E=4, K=1, routing="one_expert"),
    Case("one_expert_gets_all_k2", T=6, E=8, K=2, routing="one_expert"),
    Case("same_rank", T=8, E=8, K=2, routing="same_rank"),
    Case("rank_with_no_tokens", T=(0, 6), E=4, K=2),
    Case("capacity_1", T=12, E=4, K=2, capacity_factor=1.0),
    Case("capacity_half_ties", T=9, E=8, K=3, capacity_factor=0.5, tied_weights=True),
    Case("capacity_tight_k_eq_e", T=6, E=4, K=4, capacity_factor=0.3),
    Case("capacity_roomy", T=5, E=8, K=2, capacity_factor=4.0),
    # A token that names one expert twice: more of its slots on a rank than the rank has experts.
    Case("repeated_expert", T=7, E=4, K=3, routing="repeated"),
    Case("repeated_expert_one_per_rank", T=6, E=2, K=2, routing="repeated"),
    Case("capacity_repeated_expert", T=8, E=4, K=3, capacity_factor=0.75, routing="repeated"),
    # A repeated expert's weights summed in bf16 rounded (1e-3 off) and could drop the heavier pair.
    Case("repeated_expert_bf16_weights", T=7, E=4, K=3, routing="repeated", weights_dtype=torch.bfloat16),
    Case("capacity_repeated_expert_bf16_weights", T=8, E=4, K=3, capacity_factor=0.75, routing="repeated",
         weights_dtype=torch.bfloat16),
]
TRITON_CASES = ("odd_sizes", "k_eq_e", "rank_with_no_tokens", "capacity_half_ties", "capacity_roomy",
                "repeated_expert")
CASES_4 = [
    Case("random", T=5, E=8, K=2),
    Case("rank1_receives_nothing", T=4, E=8, K=2, routing="first_rank"),
    Case("k_eq_e", T=3, E=4, K=4),
    Case("one_expert_gets_all", T=4, E=8, K=3, routing="one_expert"),
    Case("capacity_ties", T=8, E=8, K=2, capacity_factor=0.75, tied_weights=True),
]


def _check_case(case: Case, rank: int, world: int, backend: str | None = None) -> dict:
    from moe_ep.dispatch import dispatch, moe_experts_ep

    xs, idxs, ws, dys, gate_up, down = case.make(world)
    L = case.E // world
    mine = slice(rank * L, (rank + 1) * L)
    x = xs[rank].clone().requires_grad_()
    w = ws[rank].clone().requires_grad_()
    gu = gate_up[mine].clone().requires_grad_()
    dn = down[mine].clone().requires_grad_()
    group = dist.group.WORLD
    result = {}
    kept = None
    if case.capacity_factor is not None:
        capacity = expert_capacity(case.tokens(world)[rank], case.K, case.E, case.capacity_factor)
        kept = [keep_mask_reference(i, v, case.E, capacity) for i, v in zip(idxs, ws)]
        routed = dispatch(x, idxs[rank], w, group=group, num_experts=case.E, capacity_factor=case.capacity_factor)
        # A repeated expert's later slots go nowhere: its first slot carries the pair.
        result["kept_exact"] = torch.equal(routed.layout.kept_TK, kept[rank] & first_slots(idxs[rank]))
        result["dropped"] = int((~kept[rank]).sum())
    else:
        routed = dispatch(x, idxs[rank], w, group=group, num_experts=case.E)
        # A token goes once to each rank that owns one of its experts.
        dest = idxs[rank] // L
        distinct = sum(len(set(row.tolist())) for row in dest)
        result["rows_sent"], result["rows_expected"] = sum(routed.layout.send_splits), distinct
        result["rows_received"] = sum(routed.layout.recv_splits)
    with count_sent_bytes(dist) as sent:
        y = moe_experts_ep(x, idxs[rank], w, gu, dn, group=group, capacity_factor=case.capacity_factor,
                           backend=backend)
    if case.capacity_factor is None:
        # Combine sends back other ranks' tokens, so the accounting holds for the sum over ranks.
        measured = torch.tensor([sent[0]])
        dist.all_reduce(measured)
        counted = [wire_bytes(i, L, case.H, element_size=x.element_size(), source_rank=r) for r, i in enumerate(idxs)]
        exchanged = count_exchange_bytes(case.E, world, case.K)  # per rank, the same on every rank
        result["bytes"] = {"measured": int(measured),
                           "ours": sum(c.moe_ep_bytes for c in counted) + world * exchanged.moe_ep_bytes,
                           "theirs": sum(c.transformers_bytes for c in counted) + world * exchanged.transformers_bytes,
                           "shared": any(c.moe_ep_rows < c.transformers_rows for c in counted)}
    (y * dys[rank]).sum().backward()

    y64, dx64, dw64, dgu64, ddn64 = reference(xs, idxs, ws, dys, gate_up, down, kept)
    rows = slice(sum(case.tokens(world)[:rank]), sum(case.tokens(world)[: rank + 1]))
    result["err"] = {
        "y": rel_err(y, y64[rows]),
        "dx": rel_err(x.grad, dx64[rows]),
        "dw": rel_err(w.grad, dw64[rows]),
        "d_gate_up": rel_err(gu.grad, dgu64[mine]),
        "d_down": rel_err(dn.grad, ddn64[mine]),
    }
    # The weights' gradient comes back in their dtype: its own rounding, nothing else.
    result["tolerance"] = {"dw": TOLERANCE[w.dtype]}
    return result


def _audit(rank: int, world: int, capacity_factor) -> list[str]:
    from moe_ep.dispatch import moe_experts_ep

    case = Case("audit", T=8, E=8, K=2)
    xs, idxs, ws, dys, gate_up, down = case.make(world, seed=3)
    L = case.E // world
    x = xs[rank].clone().requires_grad_()
    w = ws[rank].clone().requires_grad_()
    gu = gate_up[rank * L:(rank + 1) * L].clone().requires_grad_()
    dn = down[rank * L:(rank + 1) * L].clone().requires_grad_()
    with HostSyncRecorder() as recorder:
        y = moe_experts_ep(x, idxs[rank], w, gu, dn, group=dist.group.WORLD, capacity_factor=capacity_factor)
        torch.autograd.backward(y, dys[rank])
    return [s for s in recorder.sites if not any(check in s for check in CPU_ONLY_CHECKS)]


def _recorder_self_test() -> list[str]:
    """The recorder must see a host read hidden in a backward pass and a tolist()."""

    class ReadsInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 2

        @staticmethod
        def backward(ctx, g):
            int(g.sum())
            return g * 2

    t = torch.ones(3, requires_grad=True)
    with HostSyncRecorder() as recorder:
        ReadsInBackward.apply(t).sum().backward()
        torch.arange(3).tolist()
        torch.arange(3)[torch.tensor([True, False, True])]
        torch.bincount(torch.arange(3))
    return recorder.sites


# ---------------------------------------------------------------------------------------------
# transformers' expert-parallel registry entry, on a transformers experts module.


def _transformers_ep(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.expert_parallel import EPImplementationInterface
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from hf_models import tiny_config
    from moe_ep.hf import register_transformers_ep

    registered = register_transformers_ep()
    config = tiny_config("mixtral", num_local_experts=4)
    config._experts_implementation = "grouped_mm"
    full = MixtralExperts(config)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        full.gate_up_proj.copy_(torch.randn(full.gate_up_proj.shape, generator=g) / 6)
        full.down_proj.copy_(torch.randn(full.down_proj.shape, generator=g) / 5)
    T, K, E = 6, 2, 4
    xs = torch.randn(world, T, config.hidden_size, generator=g)
    idx = torch.rand(world, T, E, generator=g).topk(K, -1).indices
    w = torch.rand(world, T, K, generator=g)
    L = E // world
    local = MixtralExperts(config)
    with torch.no_grad():
        local.gate_up_proj = torch.nn.Parameter(full.gate_up_proj[rank * L:(rank + 1) * L].clone())
        local.down_proj = torch.nn.Parameter(full.down_proj[rank * L:(rank + 1) * L].clone())
    local.num_experts = L
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("tp", "ep"))
    impl = EPImplementationInterface()["moe_ep"](local, mesh["ep"], mesh["tp"])
    y = impl(xs[rank], idx[rank], w[rank])
    ref = moe_experts_ref(xs.view(-1, config.hidden_size), idx.view(-1, K), w.view(-1, K), full.gate_up_proj, full.down_proj)
    return {"registered": registered, "in_registry": "moe_ep" in EPImplementationInterface(),
            "err": rel_err(y, ref.view(world, T, -1)[rank])}


def _transformers_ep_from_pretrained(rank: int, world: int, checkpoint: str, *, ep: int | None = None,
                                     routed_to_first_rank: tuple[int, ...] = (),
                                     impls: tuple[str, ...] = ("all_to_all", "moe_ep")) -> dict:
    """What a transformers user writes: from_pretrained with DistributedConfig(ep_implementation=
    "moe_ep"), FSDP over the world and ``ep`` (default: the world) expert ranks. Each rank's loss
    against a float64 single process on that rank's batch, and every gradient against
    transformers' own all-to-all on the same layout (when ``impls`` runs both).

    On the ranks in ``routed_to_first_rank`` every token's experts are rewritten to experts of
    the first rank of its expert group (``remap_routing``), so when a whole group is rewritten its
    other ranks receive no rows, and transformers' eager experts answer an empty batch with a
    tensor outside the autograd graph."""
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from hf_models import tiny_batch
    from moe_ep.hf import experts_modules

    ep = world if ep is None else ep
    routed = []

    def with_routing(model):
        if rank not in routed_to_first_rank:
            return model
        experts = experts_modules(model)
        hook = remap_routing("first_rank_only", experts[0][1].config.num_local_experts, ep)
        for _, module in experts:
            module.register_forward_pre_hook(hook)
            module.register_forward_pre_hook(lambda module, args: routed.append(args[1].detach().clone()))
        return model

    runs = {}
    for impl in impls:
        config = DistributedConfig(fsdp_size=world, ep_size=ep, ep_implementation=impl)
        model = with_routing(
            AutoModelForCausalLM.from_pretrained(checkpoint, distributed_config=config, experts_implementation="eager")
        )
        batch = tiny_batch(model.config, batch=2 * world)
        mine = {k: v[2 * rank:2 * rank + 2] for k, v in batch.items()}
        loss = model(**mine).loss
        loss.backward()
        grads = {n: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad) for n, p in model.named_parameters()}
        runs[impl] = (loss.detach(), grads)
        # transformers keeps the implementation in the closure of the forward it installs.
        installed = model.model.layers[0].mlp.experts.forward.__closure__ or ()
        runs[impl + " class"] = sorted({type(c.cell_contents).__name__ for c in installed} - {"function", "DeviceMesh"})
    reference = with_routing(
        AutoModelForCausalLM.from_pretrained(checkpoint, experts_implementation="eager", dtype=torch.float64)
    )
    with torch.no_grad():
        ref_loss = reference(**mine).loss
    loss, grads = runs["moe_ep"]
    result = {"classes": runs["moe_ep class"], "loss_err": rel_err(loss, ref_loss),
              "grads_missing": sorted(n for n, g in grads.items() if g is None)}
    if "all_to_all" in runs:
        their_grads = runs["all_to_all"][1]
        result["grads_missing"] += sorted(n for n, g in their_grads.items() if g is None)
        result["grad_err"] = max(rel_err(g, their_grads[n]) for n, g in grads.items() if g is not None)
        result["grads_compared"] = len(grads)
    if routed_to_first_rank:  # the rewritten ranks routed to the first expert rank only
        L = model.config.num_local_experts // ep
        result["only_first_rank_experts"] = bool(routed) == (rank in routed_to_first_rank) and all(
            bool((idx < L).all()) for idx in routed
        )
    return result


# ---------------------------------------------------------------------------------------------
# Argument errors that need a process group.


def _errors(rank: int, world: int) -> dict:
    from moe_ep.dispatch import combine, dispatch, moe_experts_ep

    group = dist.group.WORLD
    x, idx, w = torch.randn(4, 8), torch.randint(0, 4, (4, 2)), torch.rand(4, 2)
    attempts = {
        "num_experts_not_multiple": lambda: dispatch(x, idx, w, group=group, num_experts=3),
        "index_out_of_range": lambda: dispatch(x, idx + 4, w, group=group, num_experts=4),
        "weights_shape": lambda: dispatch(x, idx, w[:, :1], group=group, num_experts=4),
        "capacity_factor": lambda: dispatch(x, idx, w, group=group, num_experts=4, capacity_factor=0),
        "group_type": lambda: dispatch(x, idx, w, group="world", num_experts=4),
        "layout_type": lambda: combine(torch.randn(3, 8), "layout"),
        "no_local_expert": lambda: moe_experts_ep(x, idx, w, torch.zeros(0, 6, 8), torch.zeros(0, 8, 3), group=group),
    }
    messages = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            messages[name] = "no error"
        except (ValueError, TypeError) as exc:
            messages[name] = f"{type(exc).__name__}: {exc}"
    # Every rank enters the count exchange, then every rank sees a peer with another T and raises.
    T = 4 + rank
    try:
        dispatch(torch.randn(T, 8), torch.randint(0, 4, (T, 2)), torch.rand(T, 2), group=group, num_experts=4,
                 capacity_factor=1.0)
        messages["capacity_uneven_tokens"] = "no error"
    except ValueError as exc:
        messages["capacity_uneven_tokens"] = f"ValueError: {exc}"
    routed = dispatch(x, idx, w, group=group, num_experts=4)
    try:
        combine(torch.randn(routed.layout.num_pairs + 1, 8), routed.layout)
        messages["pairs_mismatch"] = "no error"
    except ValueError as exc:
        messages["pairs_mismatch"] = f"ValueError: {exc}"
    # The failed combine never reached its collective; a matching one keeps the ranks in step.
    combine(routed.hidden_states, routed.layout)
    messages["double_backward"] = _double_backward(rank, world)
    return messages


def _double_backward(rank: int, world: int) -> str:
    """A gradient penalty through the layer (every mode): the exchanges' backwards are not in the
    graph, so it must raise, not leave out every term that crosses them (it did, silently)."""
    from moe_ep.dispatch import moe_experts_ep

    xs, idxs, ws, _, gate_up, down = Case("penalty", T=4, E=4, K=2).make(world)
    mine = slice(rank * 2, (rank + 1) * 2)
    said = []
    for chunks in (1, 2):
        x = xs[rank].clone().requires_grad_()
        y = moe_experts_ep(x, idxs[rank], ws[rank], gate_up[mine], down[mine], group=dist.group.WORLD,
                           overlap_chunks=chunks)
        (dx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
        try:
            dx.square().sum().backward()
            said.append("no error")
        except RuntimeError as exc:
            said.append(f"RuntimeError: {exc}")
    return " | ".join(said)


def _idle_rank_with_plain_tensors(rank: int, world: int) -> dict:
    """Rank 0 has no tokens and passes plain empty tensors (no grad); rank 1's require grad. Both
    must run the backward exchanges (rank 0 finished without them and rank 1 waited for it in the
    exchange), and each rank's expert gradients are the float64 reference's of rank 1's tokens."""
    from moe_ep.dispatch import moe_experts_ep

    xs, idxs, ws, dys, gate_up, down = Case("idle", T=(0, 5), E=4, K=2).make(world)
    mine = slice(rank * 2, (rank + 1) * 2)
    gu, dn = gate_up[mine].clone().requires_grad_(), down[mine].clone().requires_grad_()
    x, w = (xs[0], ws[0]) if rank == 0 else (xs[1].clone().requires_grad_(), ws[1].clone().requires_grad_())
    y = moe_experts_ep(x, idxs[rank], w, gu, dn, group=dist.group.WORLD)
    (y * dys[rank]).sum().backward()
    _, _, _, dgu64, ddn64 = reference(xs, idxs, ws, dys, gate_up, down)
    return {"d_gate_up": rel_err(gu.grad, dgu64[mine]), "d_down": rel_err(dn.grad, ddn64[mine])}


def _world_2(rank: int, world: int, checkpoint: str) -> dict:
    results = {
        "idle_rank_with_plain_tensors": _idle_rank_with_plain_tensors(rank, world),
        "cases": {c.name: _check_case(c, rank, world) for c in CASES_2},
        # The experts' Triton kernels (under the interpreter) on the received rows as the dispatcher
        # hands them over: rows carrying several experts, empty columns, capacity padding, no tokens.
        "triton": {c.name: _check_case(c, rank, world, backend="triton") for c in CASES_2 if c.name in TRITON_CASES},
        "audit_capacity": _audit(rank, world, 1.0),
        "audit_dropless": _audit(rank, world, None),
        "recorder_self_test": _recorder_self_test(),
        "errors": _errors(rank, world),
    }
    if HAS_EP_REGISTRY:
        results["transformers_ep_from_pretrained"] = _transformers_ep_from_pretrained(rank, world, checkpoint)
        results["transformers_ep_rank1_gets_nothing"] = _transformers_ep_from_pretrained(
            rank, world, checkpoint, routed_to_first_rank=(0, 1))
        results["transformers_ep"] = _transformers_ep(rank, world)
    return results


def _world_4(rank: int, world: int, checkpoint: str) -> dict:
    results = {"cases": {c.name: _check_case(c, rank, world) for c in CASES_4}}
    if HAS_EP_REGISTRY:
        # Expert groups {0, 1} and {2, 3}, the expert shards FSDP-sharded over {0, 2} and {1, 3}:
        # rank 3 receives no rows while its FSDP peer rank 1 does, so rank 3's experts must still
        # produce (zero) gradients or FSDP's reduce-scatter of the shards would hang.
        results["transformers_ep_rank3_gets_nothing"] = _transformers_ep_from_pretrained(
            rank, world, checkpoint, ep=2, routed_to_first_rank=(2, 3), impls=("moe_ep",))
    return results


@pytest.fixture(scope="module")
def tiny_mixtral_checkpoint(tmp_path_factory) -> str:
    from hf_models import tiny_model

    checkpoint = tmp_path_factory.mktemp("tiny_mixtral")
    tiny_model("mixtral").save_pretrained(checkpoint)
    return str(checkpoint)


@pytest.fixture(scope="module")
def world2(tiny_mixtral_checkpoint):
    return run_ranks(_world_2, 2, tiny_mixtral_checkpoint)


@pytest.fixture(scope="module")
def world4(tiny_mixtral_checkpoint):
    return run_ranks(_world_4, 4, tiny_mixtral_checkpoint)


def _assert_case(results, name):
    for rank, result in enumerate(results):
        case = result["cases"][name]
        tolerance = {k: case.get("tolerance", {}).get(k, TOL) for k in case["err"]}
        bad = {k: v for k, v in case["err"].items() if not v <= tolerance[k]}
        assert not bad, f"rank {rank}: relative errors above {tolerance}: {bad}"
        if "kept_exact" in case:
            assert case["kept_exact"], f"rank {rank}: dropped pairs differ from the documented policy"
        else:
            assert case["rows_sent"] == case["rows_expected"], f"rank {rank}: {case}"
            # What the collectives sent is what wire_bytes says, never more than transformers', and
            # strictly less once a token has two experts on one remote rank.
            sent = case["bytes"]
            assert sent["measured"] == sent["ours"] <= sent["theirs"], f"rank {rank}: {sent}"
            if sent["shared"]:
                assert sent["ours"] < sent["theirs"], f"rank {rank}: {sent}"


@pytest.mark.slow
@pytest.mark.parametrize("name", [c.name for c in CASES_2])
def test_two_ranks_match_float64_reference(world2, name):
    _assert_case(world2, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", TRITON_CASES)
def test_two_ranks_on_the_triton_experts_match_float64_reference(world2, name):
    _assert_case([{"cases": r["triton"]} for r in world2], name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [c.name for c in CASES_4])
def test_four_ranks_match_float64_reference(world4, name):
    _assert_case(world4, name)


@pytest.mark.slow
def test_a_rank_without_tokens_passing_plain_tensors_keeps_its_peers_backward_going(world2):
    for rank, result in enumerate(world2):
        assert all(err <= TOL for err in result["idle_rank_with_plain_tensors"].values()), (rank, result)


@pytest.mark.slow
def test_hard_cases_are_what_they_claim(world2, world4):
    assert world2[1]["cases"]["rank1_receives_nothing"]["rows_received"] == 0
    assert all(r["cases"]["same_rank"]["bytes"]["shared"] for r in world2)
    assert not any(r["cases"]["k1"]["bytes"]["shared"] for r in world2)
    assert all(r["cases"]["rank1_receives_nothing"]["rows_received"] == 0 for r in world4[1:])
    # Both experts of a token on one rank: one row, not two.
    for r in world2:
        same = r["cases"]["same_rank"]
        assert same["rows_sent"] == 8
    assert all(world2[r]["cases"][n]["dropped"] > 0 for r in range(2) for n in ("capacity_1", "capacity_half_ties"))
    assert all(world2[r]["cases"]["capacity_roomy"]["dropped"] == 0 for r in range(2))


@pytest.mark.slow
def test_capacity_mode_has_no_host_sync(world2):
    for rank, result in enumerate(world2):
        assert result["audit_capacity"] == [], f"rank {rank}: host reads in capacity mode: {result['audit_capacity']}"


@pytest.mark.slow
def test_dropless_mode_has_exactly_the_count_exchange_sync(world2):
    for result in world2:
        assert result["audit_dropless"] == ["tolist @ dispatch/rank_exchange.py:dropless"]


@pytest.mark.slow
def test_host_sync_recorder_sees_reads_in_backward_and_tolist(world2):
    sites = world2[0]["recorder_self_test"]
    for read in ("_local_scalar_dense", "tolist", "index with a bool mask", "bincount"):
        assert any(s.startswith(read) for s in sites), (read, sites)
    assert all(s.endswith("@ outside moe_ep") for s in sites), sites  # all of them read in this file


def test_host_sync_sites_are_the_package_frames_whatever_the_checkout_folder_is_called():
    package = Path(moe_ep.__file__).parent
    checkout_named_moe_ep = Path("/home/user/moe_ep")
    frame = traceback.FrameSummary
    # A test file of a checkout in a folder named moe_ep is outside the package.
    assert moe_ep_site([frame(str(checkout_named_moe_ep / "tests/test_dispatch.py"), 1, "test")]) == "outside moe_ep"
    inner = frame(str(package / "dispatch/dispatcher.py"), 1, "dropless")
    outer = frame(str(package / "dispatch/expert_parallel.py"), 1, "moe_experts_ep")
    # The recorder's own frames are the innermost ones; the checkout's folder name must not matter.
    recorder = frame(str(package.parent / "tests/test_dispatch.py"), 1, "_record")
    assert moe_ep_site([outer, inner, recorder]) == "dispatch/dispatcher.py:dropless"


def test_registering_with_transformers_follows_the_registry():
    from moe_ep.hf import register_transformers_ep

    assert register_transformers_ep() is HAS_EP_REGISTRY


@pytest.mark.slow
@requires_ep_registry
def test_transformers_registry_entry(world2):
    for result in world2:
        ep = result["transformers_ep"]
        assert ep["registered"] and ep["in_registry"]
        assert ep["err"] <= TOL


@pytest.mark.slow
@requires_ep_registry
@pytest.mark.parametrize("run_name", ["transformers_ep_from_pretrained", "transformers_ep_rank1_gets_nothing"])
def test_transformers_distributed_config_runs_our_dispatcher(world2, run_name):
    for result in world2:
        run = result[run_name]
        assert "MoeEpAllToAll" in run["classes"], run
        assert run["loss_err"] <= TOL and run["grad_err"] <= TOL and run["grads_compared"] > 0, run
        assert run["grads_missing"] == [], run
        if run_name == "transformers_ep_rank1_gets_nothing":  # the case is what it claims
            assert run["only_first_rank_experts"], run


@pytest.mark.slow
@requires_ep_registry
def test_transformers_distributed_config_rank_without_rows_beside_fsdp_peer_with_rows(world4):
    # Finishing at all is the main check (a skipped collective hangs); then the loss, and a
    # gradient for every parameter on every rank.
    for rank, result in enumerate(world4):
        run = result["transformers_ep_rank3_gets_nothing"]
        assert "MoeEpAllToAll" in run["classes"], run
        assert run["loss_err"] <= TOL and run["grads_missing"] == [], (rank, run)
        assert run["only_first_rank_experts"], (rank, run)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, pattern",
    [
        ("num_experts_not_multiple", r"num_experts must be a positive int divisible by ep=2 .*, got 3"),
        ("index_out_of_range", r"top_k_index must hold expert ids in \[0, 4\)"),
        ("weights_shape", "top_k_index and top_k_weights must both have shape"),
        ("capacity_factor", "capacity_factor must be a finite number > 0 or None"),
        ("group_type", "group must be a torch.distributed.ProcessGroup, got str"),
        ("layout_type", "layout must be the DispatchLayout returned by dispatch, got str"),
        ("no_local_expert", r"gate_up_local must hold this rank's experts \(at least one\), got shape \(0, 6, 8\)"),
        ("pairs_mismatch", "expert_output must have one row per dispatched pair"),
        ("capacity_uneven_tokens", "capacity mode needs the same number of tokens on every rank .* T=4"),
        ("double_backward", r"^RuntimeError: trying to differentiate twice a function that was marked with "
                            r"@once_differentiable \| RuntimeError: trying to differentiate twice"),
    ],
)
def test_errors_name_the_argument(world2, name, pattern):
    import re

    assert re.search(pattern, world2[0]["errors"][name]), world2[0]["errors"][name]
    assert world2[1]["errors"][name] != "no error"


def _cuda_sync_audit(rank: int, world: int) -> dict:
    """CUDA's own detector (``set_sync_debug_mode("error")``) raises on any synchronising call,
    ``.cpu()`` copies included, which the CPU recorder cannot see. In bfloat16, the training
    dtype: torch's float32 grouped GEMM falls back to a loop over the groups that reads the offsets
    back (seen on an H100 with torch 2.11), so the torch path syncs there by torch's doing."""
    from moe_ep.dispatch import moe_experts_ep

    case = Case("cuda", T=64, E=8, K=2, H=32, I=16)
    xs, idxs, ws, dys, gate_up, down = case.make(1, seed=4)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    idx, dy = idxs[0].cuda(), dys[0].to(**bf16)
    outcome = {}
    for backend in ("triton", "torch"):
        for mode, capacity_factor in (("capacity", 1.0), ("dropless", None)):
            x, gu, dn = (t.to(**bf16).requires_grad_() for t in (xs[0], gate_up, down))
            w = ws[0].cuda().requires_grad_()

            def step():
                y = moe_experts_ep(x, idx, w, gu, dn, group=dist.group.WORLD, capacity_factor=capacity_factor,
                                   backend=backend)
                torch.autograd.backward(y, dy)

            step()  # warm-up: lazy initialisation (NCCL communicator, autotuning) may synchronise once
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                step()
                outcome[f"{backend} {mode}"] = "no sync"
            except RuntimeError as exc:
                outcome[f"{backend} {mode}"] = f"sync: {exc}"
            finally:
                torch.cuda.set_sync_debug_mode("default")
    return outcome


@requires_cuda
def test_capacity_mode_has_no_host_sync_on_cuda():
    outcome = run_ranks(_cuda_sync_audit, 1, backend="nccl")[0]
    for backend in ("triton", "torch"):
        assert outcome[f"{backend} capacity"] == "no sync", outcome
        assert outcome[f"{backend} dropless"].startswith("sync:"), outcome  # the count exchange, as documented


# ---------------------------------------------------------------------------------------------
# Single-process checks.


@pytest.mark.parametrize("seed", range(4))
def test_capacity_keep_mask_matches_policy_loop(seed):
    g = torch.Generator().manual_seed(seed)
    T, E, K = 23, 6, 3
    idx = torch.rand(T, E, generator=g).topk(K, -1).indices
    w = (torch.rand(T, K, generator=g) * 3).round() / 3  # many ties
    for capacity in (0, 1, 4, 11, 100):
        assert torch.equal(capacity_keep_mask(idx, w, E, capacity), keep_mask_reference(idx, w, E, capacity))


def test_expert_capacity_formula():
    assert expert_capacity(10, 2, 8, 1.0) == 3  # ceil(2.5)
    assert expert_capacity(0, 2, 8, 1.25) == 0
    assert expert_capacity(16, 2, 8, 1.0) == 4


def test_wire_bytes_fewer_when_experts_share_a_rank_and_never_more():
    H, L = 4096, 2
    shared = torch.tensor([[0, 1], [2, 3]])  # both experts of each token on one rank
    apart = torch.tensor([[0, 2], [1, 3]])
    s, a = wire_bytes(shared, L, H), wire_bytes(apart, L, H)
    assert (s.moe_ep_rows, s.transformers_rows) == (2, 4)
    # A row carrying two experts carries their routing columns (int32 id + float32 weight each).
    assert s.moe_ep_metadata == 2 * 2 * 8 and s.moe_ep_payload * 2 == s.transformers_payload
    assert s.moe_ep_bytes < s.transformers_bytes
    # No sharing: single rows carry nothing, exactly transformers' bytes.
    assert (a.moe_ep_rows, a.transformers_rows) == (4, 4) and a.moe_ep_metadata == 0
    assert a.moe_ep_bytes == a.transformers_bytes


@pytest.mark.parametrize("E, K", [(8, 1), (8, 2), (16, 4), (64, 6), (6, 6)])
def test_wire_bytes_never_more_for_any_degree(E, K):
    """Totals with the count exchange, for every ep dividing E: never more than transformers at
    the smallest row the guarantee covers (4 min(K, L) bytes); strictly fewer with any larger row
    once a token's experts share a rank."""
    g = torch.Generator().manual_seed(E * K)
    idx = torch.rand(37, E, generator=g).topk(K, -1).indices
    for ep in (d for d in range(1, E + 1) if E % d == 0):
        L = E // ep
        exchanged = count_exchange_bytes(E, ep, K)
        ours_counts, their_counts = exchanged.moe_ep_bytes, exchanged.transformers_bytes
        assert ours_counts <= their_counts
        for source in range(ep):
            smallest = wire_bytes(idx, L, min(K, L), element_size=4, source_rank=source)
            assert smallest.moe_ep_bytes + ours_counts <= smallest.transformers_bytes + their_counts
            larger = wire_bytes(idx, L, min(K, L) + 1, element_size=4, source_rank=source)
            if larger.moe_ep_rows < larger.transformers_rows:
                assert larger.moe_ep_bytes < larger.transformers_bytes


def test_wire_bytes_skips_local_rows():
    local = wire_bytes(torch.tensor([[0, 3]]), 2, 8, source_rank=0)
    assert (local.moe_ep_rows, local.transformers_rows) == (1, 1)
    assert count_exchange_bytes(8, 1, 2) == CountExchangeBytes(moe_ep_bytes=0, transformers_bytes=0)


def test_wire_bytes_errors():
    with pytest.raises(ValueError, match="experts_per_rank must be a positive int, got 0"):
        wire_bytes(torch.zeros(2, 2, dtype=torch.long), 0, 8)
    with pytest.raises(ValueError, match="ep must be a positive int, got 0"):
        count_exchange_bytes(8, 0, 2)
    with pytest.raises(TypeError, match="idx_TK must be int64 or int32"):
        wire_bytes(torch.zeros(2, 2), 1, 8)


# ---------------------------------------------------------------------------------------------
# The dispatcher's row movements, against dense float64 math.


def _row_problem(seed: int, I: int = 11, G: int = 6, C: int = 3, H: int = 5, read: int = 8):
    """``read`` of the ``I`` rows each read by a distinct (g, c) term; the rest read by none."""
    g = torch.Generator().manual_seed(seed)
    terms = torch.randperm(G * C, generator=g)[:read]
    rows = torch.randperm(I, generator=g)[:read]
    src_GC = torch.full((G * C,), I, dtype=torch.long)
    src_GC[terms] = rows
    reader_I = torch.full((I,), G * C, dtype=torch.long)
    reader_I[rows] = terms
    x = torch.randn(I, H, generator=g, dtype=torch.float64)
    scale = torch.rand(G, C, generator=g, dtype=torch.float64)
    return x, src_GC.view(G, C), reader_I, scale


@pytest.mark.parametrize("seed", range(3))
def test_sum_rows_both_orders_match_float64_and_gradients(seed):
    from moe_ep.dispatch.row_ops import _sum_by_columns, _sum_by_rows, sum_rows

    x, src_GC, reader_I, scale = _row_problem(seed)
    G, C = src_GC.shape
    dense = torch.zeros(G, C, x.shape[0], dtype=torch.float64)  # out = (scale * A) @ x
    valid = src_GC < x.shape[0]
    dense[valid.nonzero(as_tuple=True) + (src_GC[valid],)] = 1.0
    ref = ((dense * scale[:, :, None]).sum(1)) @ x
    target_I = torch.where(reader_I < G * C, reader_I // C, G)
    for got in (_sum_by_rows(x.float(), target_I, G, scale.float(), reader_I, padded=True),
                _sum_by_columns(x.float(), src_GC, scale.float())):
        assert rel_err(got, ref) <= TOL
    xs, ss = x.float().requires_grad_(), scale.float().requires_grad_()
    x64, s64 = x.clone().requires_grad_(), scale.clone().requires_grad_()
    dy = torch.randn(G, x.shape[1], dtype=torch.float64)
    (sum_rows(xs, src_GC, reader_I, ss, padded=True) * dy.float()).sum().backward()
    ((((dense * s64[:, :, None]).sum(1)) @ x64) * dy).sum().backward()
    assert rel_err(xs.grad, x64.grad) <= TOL and rel_err(ss.grad, s64.grad) <= TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", ["scaled", "unscaled", "all_to_one", "none_read", "odd"])
def test_the_triton_gather_sum_the_gpu_runs_matches_float64(dtype, case):
    """The dispatcher's sums on a GPU (``kernels.grouped_gemm.sum_rows``, run here by Triton's
    interpreter): every output row the float64 sum of its listed terms, missing terms left out, an
    output row with no term zero, in the rows' dtype."""
    from moe_ep.kernels import grouped_gemm as gg

    shapes = {"odd": dict(I=37, G=13, C=5, H=131, read=29), "all_to_one": dict(I=4, G=3, C=4, H=24, read=4),
              "none_read": dict(I=5, G=4, C=2, H=16, read=0)}
    x, src_GC, _, scale = _row_problem(7, **shapes.get(case, dict(I=23, G=9, C=3, H=40, read=19)))
    if case == "all_to_one":
        src_GC = torch.full_like(src_GC, x.shape[0])
        src_GC[1] = torch.arange(4)  # one output row reads every row; the others read none
    if case == "unscaled":
        scale = None
    valid = src_GC < x.shape[0]
    terms = x[torch.where(valid, src_GC, 0)] * valid[..., None]
    rows = x.to(dtype)
    ref = ((terms if scale is None else terms * scale[..., None]).to(torch.float64)
           if dtype == torch.float32 else
           (rows.double()[torch.where(valid, src_GC, 0)] * valid[..., None]
            * (1 if scale is None else scale.float().double()[..., None])))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    got = gg.sum_rows(rows.to(device), src_GC.to(device), None if scale is None else scale.float().to(device)).cpu()
    assert got.dtype == dtype and got.shape == (src_GC.shape[0], x.shape[1])
    assert rel_err(got, ref.sum(1)) <= {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    assert not got[~valid.any(1)].any()


def test_the_triton_gather_sum_refuses_what_it_cannot_take():
    from moe_ep.kernels import grouped_gemm as gg

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows, src = torch.randn(4, 8, device=device), torch.zeros(3, 2, dtype=torch.long, device=device)
    with pytest.raises(TypeError, match="rows_MH must be float32, float16 or bfloat16, got torch.float64"):
        gg.sum_rows(rows.double(), src)
    with pytest.raises(ValueError, match=r"src_GC must be a 2-D int32 or int64 tensor \[G, C\], got torch.float32"):
        gg.sum_rows(rows, src.float())
    with pytest.raises(ValueError, match=r"scale_GC must be a torch.float32 tensor of shape \(3, 2\)"):
        gg.sum_rows(rows, src, torch.ones(3, 3, device=device))
    assert gg.sum_rows(rows[:0], src).eq(0).all() and gg.sum_rows(rows, src[:0]).shape == (0, 8)


@requires_cuda
def test_the_dispatcher_sums_on_cuda_run_the_gather_sum_without_a_host_sync():
    """On a GPU the dispatcher's sum runs the Triton gather-sum and its gradients (the rows' and
    the scale's) the Triton scaled gather: the CPU's order within float32 rounding, with no host
    sync."""
    from moe_ep.dispatch.row_ops import sum_rows

    x, src_GC, reader_I, scale = _row_problem(3, I=41, G=17, C=4, H=96, read=33)
    dy = torch.randn(src_GC.shape[0], x.shape[1], dtype=torch.float64)
    grads = {}
    for device in ("cpu", "cuda"):
        xs = x.float().to(device).requires_grad_()
        ss = scale.float().to(device).requires_grad_()
        args = (src_GC.to(device), reader_I.to(device))
        torch.cuda.set_sync_debug_mode("error" if device == "cuda" else "default")
        try:
            out = sum_rows(xs, args[0], args[1], ss, padded=True)
            (out * dy.float().to(device)).sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        grads[device] = [t.detach().cpu() for t in (out, xs.grad, ss.grad)]
    for cpu, cuda in zip(grads["cpu"], grads["cuda"]):
        assert rel_err(cuda, cpu) <= 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", ["with_dot", "without_dot", "odd_wide", "none_read", "no_rows_to_read"])
def test_the_triton_scaled_gather_the_gpu_runs_matches_float64(dtype, case):
    """The backward of the dispatcher's scaled sums on a GPU (``kernels.grouped_gemm.scaled_gather``,
    run here by Triton's interpreter): each row its gathered gradient times its scale, zero where it
    reads none, and the gradient's float32 dot with the row, against float64."""
    from moe_ep.kernels import grouped_gemm as gg

    sizes = {"odd_wide": dict(G=7, M=19, H=300), "none_read": dict(G=5, M=6, H=16),
             "no_rows_to_read": dict(G=0, M=4, H=8)}.get(case, dict(G=9, M=23, H=40))
    g = torch.Generator().manual_seed(5)
    G, M, H = sizes["G"], sizes["M"], sizes["H"]
    grad = torch.randn(G, H, generator=g, dtype=torch.float64)
    rows = torch.randn(M, H, generator=g, dtype=torch.float64)
    index = torch.randint(0, G + 1, (M,), generator=g) if G else torch.zeros(M, dtype=torch.long)
    if case == "none_read":
        index[:] = G
    scale = torch.rand(M, generator=g, dtype=torch.float64)
    read = (index < G)[:, None]
    gathered = torch.where(read, grad[index.clamp(max=max(G - 1, 0))] if G else 0.0, 0.0)
    with_dot = case != "without_dot"
    out, dot = gg.scaled_gather(grad.to(dtype), index, scale.float(), rows.to(dtype) if with_dot else None)
    assert out.dtype == dtype and out.shape == (M, H)
    tol = TOLERANCE[dtype]
    want = gathered * scale[:, None]
    assert (rel_err(out, want) if want.norm() else out.abs().max().item()) <= tol
    assert torch.count_nonzero(out[~read[:, 0]]) == 0
    if with_dot:
        want_dot = (gathered.to(dtype).double() * rows.to(dtype).double()).sum(-1)
        assert dot.dtype == torch.float32
        assert (rel_err(dot, want_dot) if want_dot.norm() else dot.abs().max().item()) <= 1e-5
    else:
        assert dot is None


def test_the_triton_scaled_gather_refuses_what_it_cannot_take():
    from moe_ep.kernels import grouped_gemm as gg

    grad, scale = torch.zeros(3, 4), torch.zeros(2)
    with pytest.raises(ValueError, match="index_M must be a 1-D int32 or int64 tensor"):
        gg.scaled_gather(grad, torch.zeros(2, 1, dtype=torch.long), scale)
    with pytest.raises(ValueError, match="grad_GH must be 2-D"):
        gg.scaled_gather(torch.zeros(3), torch.zeros(2, dtype=torch.long), scale)
    with pytest.raises(ValueError, match="scale_M"):
        gg.scaled_gather(grad, torch.zeros(2, dtype=torch.long), torch.zeros(3))
    with pytest.raises(ValueError, match="rows_MH"):
        gg.scaled_gather(grad, torch.zeros(2, dtype=torch.long), scale, torch.zeros(2, 5))


def test_gather_rows_gradient_sums_listed_copies_only():
    from moe_ep.dispatch.row_ops import gather_rows

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, generator=g, dtype=torch.float64)
    index = torch.tensor([2, 0, 2, 1, 0])  # the last row is a padding copy nobody lists
    copies = torch.tensor([[1, 5], [3, 5], [0, 2], [5, 5]])
    dy = torch.randn(5, 3, generator=g, dtype=torch.float64)
    xs = x.float().requires_grad_()
    out = gather_rows(xs, index, copies, padded=True)
    assert torch.equal(out, x.float()[index])
    (out * dy.float()).sum().backward()
    want = torch.stack([dy[1], dy[3], dy[0] + dy[2], torch.zeros(3, dtype=torch.float64)])
    assert rel_err(xs.grad, want) <= TOL


def test_expert_parallel_layer_checks_the_expert_ids_once_per_call(monkeypatch):
    """moe_experts_ep validates its arguments at its boundary; the dispatch, the local experts and
    the combine behind it take them as validated (the expert-id range check ran twice per call
    before: at dispatch and again on the dispatched ids)."""
    import moe_ep.ops.validate as validate
    from moe_ep.dispatch import moe_experts_ep

    checked = []
    original = validate.check_indices_in_range
    monkeypatch.setattr(validate, "check_indices_in_range", lambda *args: (checked.append(args[0]), original(*args)))
    case = Case("once", T=6, E=4, K=2)
    xs, idxs, ws, _, gate_up, down = case.make(1, seed=0)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        y = moe_experts_ep(xs[0], idxs[0], ws[0], gate_up, down, group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()
    assert checked == ["top_k_index"]
    want = moe_experts_ref(xs[0], idxs[0], ws[0], gate_up, down)
    assert rel_err(y, want) <= TOL


def _mismatched_configuration(rank: int, world: int, field: str) -> str:
    """Rank 1 calls the layer with another ``field`` than rank 0: its error, or "no error"."""
    from moe_ep.dispatch import moe_experts_ep

    other = rank == 1
    L, dtype, kwargs = 2, torch.float32, {}
    if field == "experts per rank" and other:
        L = 3
    if field == "hidden_states.dtype" and other:
        dtype = torch.bfloat16
    if field == "overlap_chunks" and other:
        kwargs["overlap_chunks"] = 2
    if field == "capacity_factor" and other:
        kwargs["capacity_factor"] = 2.0
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(5, 16, generator=g).to(dtype).requires_grad_()
    idx = torch.randint(0, 4, (5, 2), generator=g)
    w = torch.rand(5, 2, generator=g)
    gu = torch.randn(L, 16, 16, generator=g).to(dtype).requires_grad_()
    dn = torch.randn(L, 16, 8, generator=g).to(dtype).requires_grad_()
    try:
        moe_experts_ep(x, idx, w, gu, dn, group=dist.group.WORLD, **kwargs)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow
@pytest.mark.parametrize("field", ["experts per rank", "hidden_states.dtype", "overlap_chunks", "capacity_factor"])
def test_ranks_called_with_different_configurations_say_which_on_every_rank(field):
    # Without the agreement the ranks exchanged counts of other sizes: gloo aborted one process
    # (SIGABRT) and the other read "Connection reset by peer".
    for rank, message in enumerate(run_ranks(_mismatched_configuration, 2, field)):
        assert "called with different configurations" in message and field in message, (rank, message)
