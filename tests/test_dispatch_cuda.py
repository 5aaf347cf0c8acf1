"""The expert-parallel path on CUDA tensors, flat and node-aware, the latter also with its
exchanges overlapping two chunks' experts: 4 gloo ranks sharing the one GPU (NCCL refuses two
ranks on one device, and no machine here has two GPUs), the node-aware one as 2 simulated nodes
of 2. Each rank's output and gradients (tokens, routing weights, its experts)
against the float64 single-process reference, with a rank that has no tokens and every token
routed to one node, in float32 and bfloat16 on the default CUDA backend (the Triton kernels). Then
the host syncs moe_ep itself causes in a step after warm-up: only the count exchange's one (both
stages' counts in the node-aware path, both chunks' with overlap). Gloo stages CUDA tensors through the host, so its own
syncs are not ours and are told apart by the Python frame CUDA's sync detector names.

Runs where a GPU is lent (the CPU checks of the same path are tests/test_dispatch.py's and
tests/test_dispatch_nodes.py's)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dispatch_cases import Case, reference
from dist_utils import run_ranks
from host_syncs import PACKAGE_DIRS, HostSyncRecorder
from markers import requires_cuda
from numerics import TOLERANCE, rel_err

WORLD = 4
NODE_SIZE = 2
CASES = [
    Case("odd_sizes_rank_without_tokens", T=(5, 0, 9, 3), E=12, K=3, H=12, I=10),
    Case("all_to_first_node", T=6, E=8, K=3, routing="first_half"),
    Case("k_eq_e", T=3, E=4, K=4),
]
# bfloat16 rows must be 16-byte aligned for the aligned kernels; odd sizes take the unaligned ones.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MODES = {"flat": 1, "node": 1, "node_overlap": 2}  # mode: overlap_chunks


def _case_errors(case: Case, rank: int, world: int, nodes, chunks: int, dtype: torch.dtype) -> dict:
    from moe_ep.dispatch import moe_experts_ep

    xs, idxs, ws, dys, gate_up, down = case.make(world)
    L = case.E // world
    mine = slice(rank * L, (rank + 1) * L)
    on_gpu = dict(device="cuda", dtype=dtype)
    x, gu, dn = (t.to(**on_gpu, copy=True).requires_grad_() for t in (xs[rank], gate_up[mine], down[mine]))
    w = ws[rank].to("cuda", copy=True).requires_grad_()
    y = moe_experts_ep(x, idxs[rank].cuda(), w, gu, dn, group=dist.group.WORLD, node_groups=nodes,
                       overlap_chunks=chunks)
    torch.autograd.backward(y, dys[rank].to(**on_gpu))
    y64, dx64, dw64, dgu64, ddn64 = reference(xs, idxs, ws, dys, gate_up, down)
    rows = slice(sum(case.tokens(world)[:rank]), sum(case.tokens(world)[: rank + 1]))
    return {"y": rel_err(y.cpu(), y64[rows]), "dx": rel_err(x.grad.cpu(), dx64[rows]),
            "dw": rel_err(w.grad.cpu(), dw64[rows]), "d_gate_up": rel_err(gu.grad.cpu(), dgu64[mine]),
            "d_down": rel_err(dn.grad.cpu(), ddn64[mine])}


def _in_package(filename: str) -> str | None:
    path = Path(filename)
    for package in PACKAGE_DIRS:
        if path.is_relative_to(package):
            return f"{path.relative_to(package).as_posix()}"
    return None


def _sync_audit(rank: int, world: int, nodes, chunks: int) -> dict:
    """After a warm-up forward+backward, one under the CPU recorder (the host reads it attributes
    to moe_ep) and one under CUDA's detector (the files of moe_ep's frames it warned in)."""
    from moe_ep.dispatch import moe_experts_ep

    case = Case("audit", T=64, E=8, K=2, H=64, I=32)
    xs, idxs, ws, dys, gate_up, down = case.make(world, seed=3)
    L = case.E // world
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x, gu, dn = (t.to(**bf16, copy=True).requires_grad_() for t in (xs[rank], gate_up[rank * L:(rank + 1) * L],
                                                         down[rank * L:(rank + 1) * L]))
    w = ws[rank].to("cuda", copy=True).requires_grad_()
    idx, dy = idxs[rank].cuda(), dys[rank].to(**bf16)

    def step():
        y = moe_experts_ep(x, idx, w, gu, dn, group=dist.group.WORLD, node_groups=nodes, overlap_chunks=chunks)
        torch.autograd.backward(y, dy)

    step()  # warm-up: autotuning and the backend choice time kernels (with syncs) once
    with HostSyncRecorder() as recorder:
        step()
    # Apart from the recorder: under its dispatch mode a copy to the host runs from the mode's own
    # frame, which the detector names instead of moe_ep's (seen on an H200, 2026-11-27).
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cuda_sites = [site for w in caught if "ynchroniz" in str(w.message) and (site := _in_package(w.filename))]
    return {"recorded": recorder.sites, "cuda": cuda_sites}


def _world(rank: int, world: int, mode: str) -> dict:
    from moe_ep.dispatch import split_by_node

    nodes = split_by_node([list(range(world))], NODE_SIZE) if mode.startswith("node") else None
    errors = {(case.name, name): _case_errors(case, rank, world, nodes, MODES[mode], dtype)
              for case in CASES for name, dtype in DTYPES.items()}
    return {"errors": errors, "audit": _sync_audit(rank, world, nodes, MODES[mode])}


@pytest.fixture(scope="module", params=list(MODES))
def world(request):
    return request.param, run_ranks(_world, WORLD, request.param, timeout=400, pg_timeout=300)


@requires_cuda
def test_ep_on_cuda_tensors_matches_the_float64_reference(world):
    mode, results = world
    for rank, result in enumerate(results):
        for (case, dtype), errors in result["errors"].items():
            tol = TOLERANCE[DTYPES[dtype]]
            bad = {k: v for k, v in errors.items() if not v <= tol}
            assert not bad, f"{mode}, rank {rank}, {case}, {dtype}: relative errors above {tol}: {bad}"


@requires_cuda
def test_ep_on_cuda_syncs_only_for_the_count_exchange(world):
    mode, results = world
    for rank, result in enumerate(results):
        assert result["audit"]["recorded"] == ["tolist @ dispatch/rank_exchange.py:dropless"], (mode, rank, result)
        # Python's warning registry may fold repeats of one line: at least one, all in the count read.
        assert set(result["audit"]["cuda"]) == {"dispatch/rank_exchange.py"}, (mode, rank, result["audit"])
