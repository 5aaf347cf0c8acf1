"""moe_ep's experts under transformers' own expert parallelism.

transformers' expert-parallel routers hand an experts module the slots of experts other ranks own
as sentinel ids (``L``, this rank's expert count, weight 0): 5.24's ``AllReduceEP`` and every 5.17
expert-parallel model, which sets no ``_is_expert_parallel`` flag. moe_ep's experts skip them
(zero output, zero gradient, no effect on the other slots) and never refuse the flag alone.

One process: the sentinel rule against a float64 reference that drops those slots, with the 5.24
flag and with 5.17's marker. Two gloo ranks: transformers' ``test_fsdp2_expert_parallel_bf16_grads``
(world 2, ``experts_not_sharded``) rebuilt from its public API in float32 for Mixtral and
Qwen3-MoE loaded with ``experts_implementation="moe_ep"``, with ``ep_implementation`` transformers'
default (``"auto"``) and ``"moe_ep"``, and ``"all_reduce"`` with tensor parallelism (sentinels); on
transformers without the registry (5.17), ``DistributedConfig(tp_size=2,
enable_expert_parallel=True)`` instead. Each is compared with one process running the whole batch
in float64: the loss, and every parameter's whole gradient. The world-4 case
(``experts_sharded``) is in test_hf_loops_4_ranks.py."""

from __future__ import annotations

import contextlib

import pytest
import torch

from dist_utils import run_ranks
from hf_models import tiny_config, tiny_model
from markers import HAS_EP_REGISTRY, requires_cuda
from numerics import TOLERANCE, rel_err
from transformers_ep_cases import (
    FAMILIES,
    case_params,
    check_case,
    expected_cases,
    save_tiny_checkpoints,
    transformers_ep_vs_one_process,
)


def _local_experts(family: str, local: int, *, marker: str):
    """An experts module holding the first ``local`` experts of a tiny model, as transformers'
    expert parallelism leaves it on rank 0, marked the way ``marker`` says: ``"flag"`` (5.24:
    ``_is_expert_parallel``), ``"hooked"`` (5.17: no flag, ``_is_hooked`` on every module of a
    distributed model) or ``"none"`` (not distributed)."""
    model = tiny_model(family, experts_implementation="moe_ep")
    experts = model.model.layers[0].mlp.experts
    with torch.no_grad():
        experts.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj[:local].clone())
        experts.down_proj = torch.nn.Parameter(experts.down_proj[:local].clone())
    experts.num_experts = local
    if marker == "flag":
        experts._is_expert_parallel = True
    elif marker == "hooked":
        experts.__dict__.pop("_is_expert_parallel", None)  # 5.17 has no such flag
        experts._is_hooked = True
    return experts


def _routing(T: int, K: int, local: int, seed: int = 0):
    """Ids in [0, local] (local = the sentinel) with a row of sentinels only and a row with none;
    weights non-zero everywhere, so that a sentinel slot that were computed would show."""
    g = torch.Generator().manual_seed(seed)
    idx_TK = torch.randint(0, local + 1, (T, K), generator=g)
    idx_TK[0] = local
    idx_TK[1] = torch.arange(K) % local
    w_TK = torch.rand(T, K, generator=g) + 0.1
    return idx_TK, w_TK


@pytest.mark.slow
@pytest.mark.parametrize("marker", ["flag", "hooked"])
@pytest.mark.parametrize("family", FAMILIES)
def test_sentinel_slots_are_skipped(family, marker):
    from moe_ep.hf import moe_ep_experts_forward
    from moe_ep.ops.reference import moe_experts_ref

    L, T = 2, 9
    experts = _local_experts(family, L, marker=marker)
    K = tiny_config(family).num_experts_per_tok
    idx_TK, w_TK = _routing(T, K, L)
    sentinel_TK = idx_TK == L
    g = torch.Generator().manual_seed(1)
    x_TH = torch.randn(T, experts.gate_up_proj.shape[2], generator=g).requires_grad_()
    w_TK.requires_grad_()
    dy_TH = torch.randn(T, x_TH.shape[1], generator=g)
    y_TH = moe_ep_experts_forward(experts, x_TH, idx_TK, w_TK)
    y_TH.backward(dy_TH)

    ref_leaves = [t.detach().double().requires_grad_() for t in (x_TH, w_TK, experts.gate_up_proj, experts.down_proj)]
    x_ref, w_ref, gate_up_ref, down_ref = ref_leaves
    y_ref = moe_experts_ref(x_ref, idx_TK.masked_fill(sentinel_TK, 0), w_ref.masked_fill(sentinel_TK, 0), gate_up_ref,
                            down_ref)
    y_ref.backward(dy_TH.double())

    assert rel_err(y_TH, y_ref) <= TOLERANCE[torch.float32]
    for got, want in zip((x_TH.grad, w_TK.grad, experts.gate_up_proj.grad, experts.down_proj.grad),
                         (l.grad for l in ref_leaves)):
        assert rel_err(got, want) <= TOLERANCE[torch.float32]
    # Exactly nothing from a sentinel slot: a row of sentinels only, and their routing weights.
    assert torch.equal(y_TH[0], torch.zeros_like(y_TH[0]))
    assert torch.equal(x_TH.grad[0], torch.zeros_like(x_TH.grad[0]))
    assert torch.equal(w_TK.grad[sentinel_TK], torch.zeros(int(sentinel_TK.sum())))


@pytest.mark.parametrize("marker", ["flag", "hooked"])
def test_the_flag_alone_never_refuses_or_changes_anything(marker):
    """Under transformers' all-to-all (5.24's training default) and moe_ep's own entry the experts
    get local ids only: the same bits as without the marker."""
    from moe_ep.hf import moe_ep_experts_forward

    L, T = 3, 8
    plain, marked = _local_experts("mixtral", L, marker="none"), _local_experts("mixtral", L, marker=marker)
    g = torch.Generator().manual_seed(2)
    x_TH = torch.randn(T, plain.gate_up_proj.shape[2], generator=g)
    idx_TK, w_TK = torch.randint(0, L, (T, 2), generator=g), torch.rand(T, 2, generator=g)
    assert torch.equal(moe_ep_experts_forward(marked, x_TH, idx_TK, w_TK),
                       moe_ep_experts_forward(plain, x_TH, idx_TK, w_TK))


@pytest.mark.parametrize("marker, bad_id", [("none", 2), ("flag", 3), ("flag", -1), ("hooked", 3)])
def test_ids_that_are_no_sentinel_are_refused(marker, bad_id):
    """Only ``L`` under transformers' parallelism is a sentinel: outside it ``L`` is out of range,
    and beyond ``L`` or below 0 it is out of range everywhere."""
    from moe_ep.hf import moe_ep_experts_forward

    L = 2
    experts = _local_experts("mixtral", L, marker=marker)
    x_TH = torch.randn(4, experts.gate_up_proj.shape[2])
    idx_TK = torch.zeros(4, 2, dtype=torch.long)
    idx_TK[1, 1] = bad_id
    with pytest.raises(ValueError, match=r"top_k_index must hold expert ids in \[0, 2\)"):
        moe_ep_experts_forward(experts, x_TH, idx_TK, torch.rand(4, 2))


@contextlib.contextmanager
def _host_syncs_raise():
    """CUDA's own detector: any synchronising call inside raises."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@requires_cuda
def test_sentinel_path_has_no_host_sync_on_cuda():
    from moe_ep.hf import moe_ep_experts_forward

    L = 2
    experts = _local_experts("mixtral", L, marker="flag").cuda()
    idx_TK, w_TK = _routing(64, 2, L)
    x_TH = torch.randn(64, experts.gate_up_proj.shape[2], device="cuda", requires_grad=True)
    idx_TK, w_TK = idx_TK.cuda(), w_TK.cuda()

    # Twice: the first call may autotune, which times kernels and so synchronises.
    moe_ep_experts_forward(experts, x_TH, idx_TK, w_TK).sum().backward()
    torch.cuda.synchronize()
    with _host_syncs_raise():
        moe_ep_experts_forward(experts, x_TH, idx_TK, w_TK).sum().backward()


# ---------------------------------------------------------------------------------------------
# transformers' expert-parallel FSDP2 test, world 2, float32, against one float64 process.


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    checkpoints = save_tiny_checkpoints(tmp_path_factory.mktemp("tiny_moe"))
    return run_ranks(transformers_ep_vs_one_process, 2, checkpoints, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("case", case_params(2))
def test_transformers_expert_parallel_matches_one_process(world2, case):
    check_case(world2, case)


@pytest.mark.slow
def test_the_experts_were_split_over_the_ranks(world2):
    """The runs above were expert-parallel: each rank held half of the experts."""
    for family in FAMILIES:
        E = tiny_config(family).num_local_experts if family == "mixtral" else tiny_config(family).num_experts
        for case in expected_cases(2):
            if case.startswith(family):
                assert {r[case]["local_experts"] for r in world2} == {E // 2}, case


@pytest.mark.skipif(HAS_EP_REGISTRY, reason="this transformers has the expert-parallel registry")
def test_no_registry_is_said_cleanly():
    """transformers 5.17 has no ``ep_implementation``: moe_ep registers nothing there and says so."""
    from moe_ep.hf import register_transformers_ep

    assert register_transformers_ep() is False
