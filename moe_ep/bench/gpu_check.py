"""GPU check: everything a lent GPU should prove, in one run of a few minutes (``bash
scripts/gpu_check.sh``, which finds a Python with torch and calls ``python -m moe_ep.bench gpu``).

Steps, each timed and recorded; a step that would start past ``--budget`` seconds is skipped and
says so:

1. ``compile``: the AOT check (``python -m moe_ep.kernels.aot``) for this GPU's architecture on
   every core: the real Triton's compile of every launch the kernels can make (spills, mma/wgmma,
   TMA), and a warm Triton cache, so the steps below do not compile one kernel at a time.
2. ``tests``: the CUDA test tier. ``moe_experts`` forward and every gradient (hidden states,
   routing weights, gate_up, down) on the Triton backend and on the torch backend, each against a
   float64 reference (``||out - ref|| / ||ref||``, bf16/fp16 <= 1e-2, fp32 <= 1e-5), at small
   shapes and at Mixtral-8x7B's expert shapes: uniform and skewed routing, an empty expert, all
   tokens to one expert, top-1, top-k = E, GeGLU, sizes whose rows are not 16-byte aligned, with
   autotuning on and off; two runs bitwise equal; and the local path under
   ``torch.cuda.set_sync_debug_mode("error")`` (any host sync fails it).
3. ``kernels``: the kernel benchmark at Mixtral-8x7B shapes (T=16384, uniform and skewed) against
   transformers' ``grouped_mm`` and ``eager`` experts and dense cuBLAS over the same FLOPs, each
   Triton kernel's time beside the AOT check's roofline bound and expected time; then the whole op
   at the fine-grained shapes (Qwen3-30B-A3B and OLMoE at T=16384, DeepSeek-V3 as one EP8 rank sees it:
   ``kernels.cost.PROBLEMS``).
4. ``attention``: causal attention forward+backward through SDPA at the anchors' models' attention
   shapes (4 x 4096 tokens), on SDPA's own choice of backend and on each backend alone
   (``moe_ep.bench.attention``): the rate the planner's calibration takes for attention.
5. ``model``: the two-layer Mixtral-8x7B and Qwen3-30B-A3B model benchmarks at 4096 and 16384
   tokens (forward+backward tokens/s, peak memory).
6. ``dispatch``: the dispatch benchmark at ep=4 (its ranks share the one GPU over gloo): bytes
   sent against transformers' all-to-all, and each rank's own kernels of a forward and backward
   (``local GPU ms``, rank 0's longest named); on the CPU its byte counts only.
7. ``suite``: the test suite's own CUDA tests (``pytest tests -k "cuda or on_the_gpu"``, the ones
   that skip on a CPU) in a subprocess, when pytest is installed: its counts and failures.

Each problem of steps 3 and 5 checks the budget before it starts, so the gate ends inside
``--budget`` plus the last problem's time; one that runs out of GPU memory is recorded as failed
and the next one still runs.

Writes ``gpu_check_<device>_<date>.json`` (every record, the environment, the targets beside the
estimates) and ``.png`` into ``--out-dir``. Exit status 1 when a test or the compile check fails.

``--device cpu`` runs the same plumbing at small shapes, the Triton kernels under the
interpreter (``TRITON_INTERPRET=1``), so CI exercises it."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from .arguments import positive_float
from ..kernels import autotune, cost
from ..kernels.runtime import interpreting
from ..ops import selector
from ..ops.experts import moe_experts
from ..ops.reference import moe_experts_ref, moe_experts_ref_by_expert
from . import attention as attention_bench
from . import dispatch as dispatch_bench
from . import kernels as kernel_bench
from . import model as model_bench
from .report import Column, Report, close_figure, environment, first_line, new_figure
from .routing_cases import make_routing

STEPS = ("compile", "tests", "kernels", "attention", "model", "dispatch", "suite")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
GRADS = ("hidden_states", "top_k_weights", "gate_up_proj", "down_proj")
# The AOT check's step names (kernels/grouped_gemm.py gemm_costs, kernels/aot.py whole_pass) of each
# per-kernel row of the kernel
# benchmark.
ESTIMATED_STEPS = {
    "gemm1[triton]": "fwd gemm1 (gather, gate_up, act)",
    "gemm2[triton]": "fwd gemm2 (down, routing weight)",
    "glu_bwd[triton]": "bwd dy @ down (d pre, hs, d w)",
    "dx[triton]": "bwd dx (d pre @ gate_up)",
    "dw_down[triton]": "bwd d down (dy^T hs)",
    "dw_gate_up[triton]": "bwd d gate_up (d pre^T x)",
    "combine[triton]": "fwd combine",
    "dy_rows[triton]": "bwd dy rows, padded order",
    "x_rows[triton]": "bwd x rows, padded order",
}

COLUMNS = [
    Column("check", "check"),
    Column("dtype", "dtype"),
    Column("autotune", "autotune"),
    Column("triton_err", "triton err", "{:.1e}"),
    Column("torch_err", "torch err", "{:.1e}"),
    Column("triton_vs_torch", "triton vs torch", "{:.1e}"),
    Column("tolerance", "tol", "{:.0e}"),
    Column("status", "status"),
]


@dataclass(frozen=True)
class Shape:
    T: int
    H: int
    I: int
    E: int
    K: int


@dataclass(frozen=True)
class Check:
    """One correctness case: a shape, a routing, an activation."""

    name: str
    shape: Shape
    routing: str = "uniform"  # uniform | skewed | skip_last (expert E-1 gets no token) | one_expert
    activation: str = "silu"


MIXTRAL = dict(H=4096, I=14336, E=8)


def checks_for(device: torch.device) -> list[Check]:
    """Small shapes (odd and unaligned ones included) and, on a GPU, Mixtral-8x7B's expert shapes
    at a moderate token count (the float64 reference runs expert by expert there)."""
    small = [
        Check("small uniform top-2 SwiGLU", Shape(48, 32, 48, 8, 2)),
        Check("small skewed top-2 SwiGLU", Shape(48, 32, 48, 8, 2), "skewed"),
        Check("small empty expert top-2 GeGLU", Shape(40, 32, 48, 6, 2), "skip_last", "gelu"),
        Check("small top-1 GeGLU", Shape(32, 32, 64, 4, 1), activation="gelu"),
        Check("small all tokens to one expert top-1", Shape(24, 32, 32, 4, 1), "one_expert"),
        Check("small top-k = E", Shape(16, 32, 16, 4, 4)),
        Check("small unaligned rows", Shape(37, 17, 9, 5, 2)),
        Check("small fine-grained top-8", Shape(24, 32, 16, 16, 8)),
    ]
    if device.type != "cuda":
        return small
    big = Shape(1024, K=2, **MIXTRAL)
    return small + [
        Check("mixtral uniform top-2 SwiGLU", big),
        Check("mixtral skewed top-2 SwiGLU", big, "skewed"),
        Check("mixtral empty expert top-1 GeGLU", Shape(1024, K=1, **MIXTRAL), "skip_last", "gelu"),
        Check("qwen3-30b-a3b skewed top-8 SwiGLU", Shape(2048, H=2048, I=768, E=128, K=8), "skewed"),
    ]


def make_case(check: Check, dtype: torch.dtype, device: torch.device, seed: int):
    """(x, idx, w, gate_up, down, dy) on ``device``: floats in ``dtype``, the routing weights in
    float32 as models keep them."""
    s = check.shape
    g = torch.Generator().manual_seed(seed)
    if check.routing in ("uniform", "skewed"):
        idx, w = make_routing(check.routing, s.T, s.E, s.K, seed=seed)
    else:
        if check.routing == "one_expert":
            idx = torch.full((s.T, s.K), s.E // 2, dtype=torch.long)
        else:
            idx = torch.rand(s.T, s.E - 1, generator=g).topk(s.K, dim=-1).indices
        w = torch.rand(s.T, s.K, generator=g) + 0.1
    x = torch.randn(s.T, s.H, generator=g)
    gate_up = torch.randn(s.E, 2 * s.I, s.H, generator=g) / s.H**0.5
    down = torch.randn(s.E, s.H, s.I, generator=g) / s.I**0.5
    dy = torch.randn(s.T, s.H, generator=g)
    floats = [t.to(device=device, dtype=dtype) for t in (x, gate_up, down, dy)]
    return floats[0], idx.to(device), w.to(device), floats[1], floats[2], floats[3]


def _outputs(fn, x, idx, w, gate_up, down, dy):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, gate_up, down)]
    y = fn(leaves[0], idx, leaves[1], leaves[2], leaves[3])
    grads = torch.autograd.grad(y, leaves, dy.to(y.dtype))
    return [y.detach(), *grads]


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    denom = ref.norm()
    return (out - ref).norm().item() if denom == 0 else ((out - ref).norm() / denom).item()


def _worst(outs, refs) -> float:
    """Largest relative error over the output and the four gradients; NaN compares as infinite."""
    errs = [_rel_err(o, r) for o, r in zip(outs, refs)]
    return max(float("inf") if e != e else e for e in errs)


@contextlib.contextmanager
def autotuning(on: bool):
    """MOE_EP_AUTOTUNE for the block, with the process's decisions cleared on entry and exit and a
    fresh selector cache, so each check measures (the user's cache is neither read nor written)."""
    saved = {name: os.environ.get(name) for name in (autotune.ENV_VAR, selector.CACHE_ENV_VAR)}
    with tempfile.TemporaryDirectory() as cache:
        os.environ[autotune.ENV_VAR] = "1" if on else "0"
        os.environ[selector.CACHE_ENV_VAR] = cache
        selector.clear()
        try:
            yield
        finally:
            selector.clear()
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def run_check(check: Check, dtype: torch.dtype, device: torch.device, seed: int) -> dict:
    """Triton and torch backends against float64: the worst relative error over the output and
    every gradient, and whether a second Triton run gives the same bits."""
    x, idx, w, gate_up, down, dy = make_case(check, dtype, device, seed)
    act = check.activation
    big = check.shape.H * check.shape.I >= 2**20
    reference = moe_experts_ref_by_expert if big else moe_experts_ref
    refs = _outputs(lambda *a: reference(*a, activation=act), x, idx, w, gate_up, down, dy)
    triton_fn = lambda *a: moe_experts(*a, activation=act, backend="triton")  # noqa: E731
    torch_fn = lambda *a: moe_experts(*a, activation=act, backend="torch")  # noqa: E731
    auto_fn = lambda *a: moe_experts(*a, activation=act, backend="auto")  # noqa: E731
    row = dict(check=check.name, shape=vars(check.shape), dtype=str(dtype)[6:], tolerance=TOLERANCE[dtype])
    try:
        triton_out = _outputs(triton_fn, x, idx, w, gate_up, down, dy)
        again = _outputs(triton_fn, x, idx, w, gate_up, down, dy)
    except Exception as err:  # recorded as a failed check, with its message
        return dict(row, status=f"FAIL: triton raised {type(err).__name__}: {first_line(err)}")
    row["triton_err"] = _worst(triton_out, refs)
    row["bitwise_repeatable"] = all(torch.equal(a, b) for a, b in zip(triton_out, again))
    try:
        torch_out = _outputs(torch_fn, x, idx, w, gate_up, down, dy)
        row["torch_err"] = _worst(torch_out, refs)
        row["triton_vs_torch"] = _worst(triton_out, torch_out)
    except Exception as err:  # the torch backend's own limits (a dtype grouped_mm lacks) are recorded
        row["torch_status"] = f"torch backend raised {type(err).__name__}: {first_line(err)}"
    # The selector's choice on this problem (decided by its first call, measuring both paths).
    try:
        auto_out = _outputs(auto_fn, x, idx, w, gate_up, down, dy)
        row["auto_path"] = selector.choose(x, idx, w, gate_up, down, act, pinned=None, group=None)
    except Exception as err:  # recorded as a failed check, with its message
        return dict(row, status=f"FAIL: auto raised {type(err).__name__}: {first_line(err)}")
    row["auto_err"] = _worst(auto_out, refs)
    problems = []
    if not row["auto_err"] <= TOLERANCE[dtype]:
        problems.append(f"auto err {row['auto_err']:.1e} > {TOLERANCE[dtype]:.0e}")
    if not row["triton_err"] <= TOLERANCE[dtype]:
        problems.append(f"triton err {row['triton_err']:.1e} > {TOLERANCE[dtype]:.0e}")
    if "torch_err" in row and not row["torch_err"] <= TOLERANCE[dtype]:
        problems.append(f"torch err {row['torch_err']:.1e} > {TOLERANCE[dtype]:.0e}")
    if not row["bitwise_repeatable"]:
        problems.append("two triton runs differ")
    row["status"] = "FAIL: " + "; ".join(problems) if problems else "ok"
    return row


def sync_checks(device: torch.device, dtype: torch.dtype, seed: int) -> list[dict]:
    """The router and the experts op, forward and backward, on both backends, under
    ``set_sync_debug_mode("error")`` after a first untimed run (which may tune)."""
    rows = []
    for tuned in (False, True):
        with autotuning(tuned):
            p = kernel_bench.Problem(T=256, H=256, I=512, E=8, K=2, routing="skewed", dtype=dtype, device=device)
            inp = kernel_bench.make_inputs(p, seed)
            for check in kernel_bench._sync_checks(p, inp).values():
                if check.available:
                    check.value()  # the first run of each key may time configurations (a host sync)
            for name, result in kernel_bench.check_no_host_sync(p, inp).items():
                rows.append(dict(check=f"no host sync: {name}", dtype=str(dtype)[6:], autotune=tuned,
                                 status="ok" if result == "pass" else result))
    return rows


def step_tests(device: torch.device, args) -> list[dict]:
    dtypes = (torch.bfloat16, torch.float16, torch.float32) if device.type == "cuda" else (torch.bfloat16,)
    rows = []
    for check in checks_for(device):
        for dtype in dtypes:
            if dtype == torch.float32 and check.shape.H >= MIXTRAL["H"]:
                continue  # float32 at Mixtral shapes adds minutes of IEEE FMAs and nothing new
            # Autotuning on for the skewed case (and on a GPU the unaligned one), off for the
            # others: both settings meet every kernel, and a tuned run is compared and repeated.
            tuned = check.routing == "skewed" or (device.type == "cuda" and "unaligned" in check.name)
            with autotuning(tuned):
                row = run_check(check, dtype, device, args.seed)
            row["autotune"] = tuned
            rows.append(row)
            note = f" ({row['torch_status']})" if "torch_status" in row else ""
            print(f"[gpu] test {check.name} {row['dtype']} autotune={int(tuned)}: {row['status']}{note}", flush=True)
    if device.type == "cuda":
        rows += sync_checks(device, torch.bfloat16, args.seed)
    else:
        rows.append(dict(check="no host sync", status="skipped: set_sync_debug_mode needs CUDA"))
    return rows


def step_compile(device: torch.device, args) -> dict:
    """The AOT check for this GPU's architecture, in a subprocess on every core."""
    major, minor = torch.cuda.get_device_capability(device)
    arch = 10 * major + minor
    if arch not in (80, 90):
        return dict(status=f"skipped: the AOT check compiles for sm_80 and sm_90, this GPU is sm_{arch}")
    command = [sys.executable, "-m", "moe_ep.kernels.aot", "--arch", str(arch), "--jobs", str(os.cpu_count() or 1)]
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "aot.json"
        try:
            proc = subprocess.run([*command, "--json", str(report)], env=dict(os.environ, TRITON_INTERPRET="0"),
                                  capture_output=True, text=True, timeout=args.budget)
        except subprocess.TimeoutExpired:
            return dict(status=f"FAIL: not done within {args.budget:.0f} s", arch=arch)
        data = json.loads(report.read_text()) if report.exists() else {}
    rows = data.get("rows", [])
    failed = [dict(kernel=r["kernel"], arch=r["arch"], problem=r["problem"]) for r in rows if not r["ok"]]
    return dict(status="ok" if proc.returncode == 0 else f"FAIL: exit status {proc.returncode}",
                arch=arch, triton=data.get("triton"), compiled=len(rows), failed=failed,
                estimates=data.get("estimates", {}).get(f"sm_{arch}"), stderr_tail=proc.stderr[-2000:])


def _bench_args(args, **extra) -> argparse.Namespace:
    return argparse.Namespace(warmup=args.warmup, reps=args.reps, seed=args.seed, **extra)


# The kernels step's problems, first the one whose every kernel is timed and compared with the AOT
# check's estimates: Mixtral-8x7B, then the fine-grained experts people train (kernels.cost.PROBLEMS:
# Qwen3-30B-A3B, OLMoE, DeepSeek-V3 as one EP8 rank sees it), the whole op only. On the CPU,
# small stand-ins of the two kinds.
CPU_KERNEL_PROBLEMS = {"small": cost.Problem(T=64, K=2, H=32, I=64, E=8),
                       "small-fine-grained": cost.Problem(T=32, K=4, H=32, I=16, E=16)}
# (model preset, sequence length) of the model step, in the order they run; on the CPU, tiny ones.
MODEL_RUNS = {"cuda": [("mixtral-8x7b-2layer", 4096), ("qwen3-30b-a3b-2layer", 4096),
                       ("mixtral-8x7b-2layer", 16384), ("qwen3-30b-a3b-2layer", 16384)],
              "cpu": [("tiny-mixtral", 32), ("tiny-qwen3-moe", 32)]}


def _run_part(args, result: dict, key: str, bench) -> None:
    """One problem of a step: ``bench()`` (a benchmark report) unless the gate's budget is spent;
    its rows, notes and meta added to ``result`` under ``key``, its status in ``result["parts"]``.
    A part that raises (out of GPU memory, a rank that died) or whose report failed a check is
    recorded as that part's failure, and the next part still runs: GPU time is too scarce to lose
    the other parts' results to one."""
    elapsed = time.perf_counter() - args.started
    if elapsed > args.budget:
        result["parts"][key] = f"skipped: {elapsed:.0f} s spent of a {args.budget:.0f} s budget"
        return
    try:
        report = bench()
    except torch.OutOfMemoryError as err:
        result["parts"][key] = f"FAIL: out of memory ({first_line(err)})"
        return
    except Exception as err:  # recorded as the part's failure, its traceback on stderr
        traceback.print_exc()
        result["parts"][key] = f"FAIL: {type(err).__name__}: {first_line(err)}"
        return
    result["parts"][key] = f"FAIL: {', '.join(report.failed)}" if report.failed else "done"
    result["meta"][key] = report.meta
    result["notes"] += [f"{key}: {n}" for n in report.notes]
    result["rows"] += [dict(r, problem=key) for r in report.rows]


def step_kernels(device: torch.device, args) -> dict:
    cuda = device.type == "cuda"
    problems = cost.PROBLEMS if cuda else CPU_KERNEL_PROBLEMS
    result = dict(meta={}, notes=[], rows=[], parts={})
    for i, (name, p) in enumerate(problems.items()):
        # Both routings where every kernel is timed and on the first fine-grained problem.
        routing = ["uniform", "skewed"] if i < 2 else ["uniform"]
        bench = _bench_args(args, tokens=[p.T], hidden=p.H, intermediate=p.I, experts=p.E, top_k=p.K, routing=routing,
                            dtype="bfloat16" if cuda else "float32", skip_components=i > 0)
        print(f"[gpu] kernels: {name} T={p.T} H={p.H} I={p.I} E={p.E} k={p.K}", flush=True)
        _run_part(args, result, name, lambda: kernel_bench.run(bench, device))
    return result


def step_attention(device: torch.device, args) -> dict:
    result = dict(meta={}, notes=[], rows=[], parts={})
    cuda = device.type == "cuda"
    backends = attention_bench.GPU_GATE_BACKENDS if cuda else attention_bench.BACKENDS
    bench = _bench_args(args, models=list(attention_bench.MODELS), backends=list(backends),
                        dtype="bfloat16" if cuda else "float32")
    _run_part(args, result, "sdpa", lambda: attention_bench.run(bench, device))
    return result


def step_model(device: torch.device, args) -> dict:
    batch = 1 if device.type == "cuda" else 2
    result = dict(meta={}, notes=[], rows=[], parts={})
    for name, seq in MODEL_RUNS[device.type]:
        _run_part(args, result, f"{name} seq {seq}",
                  lambda: model_bench.run(_bench_args(args, models=[name], seq=seq, batch=batch, compile_blocks=None),
                                          device))
    return result


# The expert-parallel degree of the dispatch step: ranks share the one GPU, so a few.
DISPATCH_EP = 4


def step_dispatch(device: torch.device, args) -> dict:
    result = dict(meta={}, notes=[], rows=[], parts={})
    bench = _bench_args(args, ep=[DISPATCH_EP], models=list(dispatch_bench.MODELS), routing=["uniform"],
                        tokens=None, hidden=None, dtype=None, node_size=2, no_timing=device.type != "cuda")
    print(f"[gpu] dispatch: ep={DISPATCH_EP}", flush=True)
    _run_part(args, result, f"ep{DISPATCH_EP}", lambda: dispatch_bench.run(bench, device))
    return result


# The suite's tests that need a GPU: their names say so (tests/markers.py's requires_cuda guards them).
SUITE_SELECTION = "cuda or on_the_gpu"
SUITE_TIMEOUT_S = 300.0


def suite_command() -> list[str]:
    """The pytest run of the suite's CUDA tests, from the repository root, whatever pytest.ini adds."""
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-rfE", "tests",
            "-k", SUITE_SELECTION]


def suite_summary(returncode: int, output: str) -> dict:
    """pytest's outcome: its counts from the summary line, the ids of the failed and erroring tests
    (from ``-rfE``), and the output's tail."""
    import re

    lines = output.strip().splitlines()
    counts = {}
    for line in reversed(lines):
        found = re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)\b", line)
        if found and (" in " in line or line.startswith("=")):
            counts = {("error" if kind.startswith("error") else kind): int(n) for n, kind in found}
            break
    failed = [line.split(" ", 1)[1].split(" - ")[0] for line in lines if line.startswith(("FAILED ", "ERROR "))]
    ok = returncode == 0 or (returncode == 5 and not failed)  # 5: nothing selected
    return dict(status="ok" if ok else f"FAIL: pytest exit status {returncode}", counts=counts, failed=failed,
                command=" ".join(suite_command()[1:]), tail=output[-3000:])


def step_suite(device: torch.device, args) -> dict:
    """The suite's CUDA tests, in a subprocess with the kernels compiled (no interpreter)."""
    import importlib.util

    if importlib.util.find_spec("pytest") is None:
        return dict(status=f"skipped: pytest is not installed for {sys.executable}")
    repo = Path(__file__).resolve().parents[2]
    try:
        proc = subprocess.run(suite_command(), cwd=repo, env=dict(os.environ, TRITON_INTERPRET="0"),
                              capture_output=True, text=True, timeout=SUITE_TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        out = err.stdout.decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        return dict(status=f"FAIL: not done within {SUITE_TIMEOUT_S:.0f} s", tail=out[-3000:])
    result = suite_summary(proc.returncode, proc.stdout + proc.stderr)
    print(f"[gpu] suite: {result['status']} {result['counts']}", flush=True)
    return result


def estimates_beside_measurements(results: dict) -> list[dict]:
    """Each Triton kernel's measured time (T=16384, uniform) beside the AOT check's roofline bound
    and expected time for this architecture (both for the first configuration of its space; the
    autotuner may have chosen another)."""
    steps = {s["step"]: s for s in ((results.get("compile") or {}).get("estimates") or {}).get("triton", {})
             .get("steps", [])}
    rows = []
    for r in (results.get("kernels") or {}).get("rows", []):
        name = ESTIMATED_STEPS.get(r.get("variant"))
        if (name is None or r.get("problem") != "mixtral-8x7b" or r.get("routing") != "uniform" or r.get("ms") is None
                or name not in steps):
            continue
        est = steps[name]
        rows.append(dict(kernel=r["variant"], step=name, measured_ms=r["ms"], bound_ms=est["roofline_ms"],
                         expected_ms=est["expected_ms"], of_bound=est["roofline_ms"] / r["ms"],
                         of_expected=est["expected_ms"] / r["ms"]))
    return rows


def target_lines(results: dict) -> list[str]:
    """#12's targets: the measured ratios beside the AOT check's estimates for this machine."""
    lines = list((results.get("kernels") or {}).get("notes", []))
    est = (results.get("compile") or {}).get("estimates")
    if est:
        for basis in ("expected", "bound"):
            r, f = est[basis], est["forward"][basis]
            lines.append(f"estimated ({basis}, AOT cost model): fwd+bwd dense / triton {r['dense_over_triton']:.2f} "
                         f"(target >= 0.80), grouped_mm / triton {r['grouped_mm_over_triton']:.2f} (target >= 1.35), "
                         f"fwd dense / triton {f['dense_over_triton']:.2f} (target >= 0.88)")
    return lines


def plot(report: Report, path: Path) -> None:
    """Four panels: the tests' errors against their tolerances, the experts op per variant, each
    Triton kernel against its estimates, the model's tokens/s."""
    results = report.meta["results"]
    fig, axes = new_figure(2, 2, width=6.5, height=4.2)
    ax = axes[0][0]
    tests = [r for r in results.get("tests") or [] if r.get("triton_err") is not None]
    ax.bar(range(len(tests)), [max(r["triton_err"], 1e-12) for r in tests],
           color=["tab:green" if r["status"] == "ok" else "tab:red" for r in tests])
    ax.scatter(range(len(tests)), [r["tolerance"] for r in tests], marker="_", color="k", label="tolerance")
    ax.set_yscale("log")
    ax.set_xticks(range(len(tests)))
    ax.set_xticklabels([f"{r['check']} {r['dtype']}" for r in tests], rotation=90, fontsize=5)
    ax.set_title("triton vs float64: worst rel. error over y and the 4 gradients", fontsize=8)
    ax.legend(fontsize=6)
    ax = axes[0][1]
    kernel_rows = (results.get("kernels") or {}).get("rows", [])
    first = kernel_rows[0].get("problem") if kernel_rows else None
    ops = [r for r in kernel_rows if r.get("problem") == first and r.get("kind") in ("op", "dense")
           and r.get("phase") == "fwd+bwd" and r.get("ms") is not None]
    labels = [f"{r['variant']}\n{r['routing']}" for r in ops]
    ax.bar(range(len(ops)), [r["ms"] for r in ops])
    ax.set_xticks(range(len(ops)))
    ax.set_xticklabels(labels, rotation=90, fontsize=6)
    ax.set_ylabel("ms fwd+bwd (lower is better)")
    ax.set_title(f"experts op, {first}", fontsize=8)
    ax = axes[1][0]
    est = results.get("estimates_vs_measured") or []
    xs = range(len(est))
    for offset, key, label in ((-0.27, "bound_ms", "roofline bound"), (0, "expected_ms", "expected"),
                               (0.27, "measured_ms", "measured")):
        ax.bar([x + offset for x in xs], [r[key] for r in est], 0.27, label=label)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([r["kernel"] for r in est], rotation=45, fontsize=6)
    ax.set_ylabel("ms")
    ax.set_title("Triton kernels: estimates (AOT cost model) vs measured", fontsize=8)
    if est:
        ax.legend(fontsize=6)
    else:
        ax.text(0.5, 0.5, "not measured: needs sm_80 or sm_90", ha="center", transform=ax.transAxes)
    ax = axes[1][1]
    models = [r for r in (results.get("model") or {}).get("rows", []) if r.get("tokens_per_s") is not None]
    ax.bar(range(len(models)), [r["tokens_per_s"] for r in models])
    ax.set_xticks(range(len(models)))
    ax.set_xticklabels([f"{r['model']} {r['tokens']}\n{r['variant']}" for r in models], rotation=90, fontsize=5)
    ax.set_ylabel("tokens/s fwd+bwd (higher is better)")
    ax.set_title("two-layer models, fwd+bwd" if models else "model: not run", fontsize=8)
    fig.suptitle(f"moe_ep GPU check, {report.meta.get('device')}, {report.meta.get('date')}", fontsize=9)
    close_figure(fig, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS), help="default: all, in order")
    parser.add_argument("--budget", type=positive_float, default=480.0,
                        help="seconds: a step that would start later is skipped (default 480, inside 8 minutes)")


# The steps that run on a GPU only, and what stands in for them without one.
_NEEDS_A_GPU = {"compile": "python -m moe_ep.kernels.aot compiles for sm_80/sm_90 without one",
                "suite": "the suite's CUDA tests skip on the CPU"}


def check_arguments(args, device: torch.device) -> None:
    if device.type == "cpu" and not interpreting():
        raise ValueError("--device cpu runs the Triton kernels under the interpreter: set TRITON_INTERPRET=1 "
                         "(scripts/gpu_check.sh does)")


def run(args, device: torch.device) -> Report:
    start = time.perf_counter()
    report = Report("gpu_check", device, COLUMNS, plot=plot, formats=(".json", ".png"))
    report.meta = dict(environment(device), budget_s=args.budget, steps={}, results={})
    args.started = start
    results = report.meta["results"]
    steps = {"compile": step_compile, "tests": step_tests, "kernels": step_kernels, "attention": step_attention,
             "model": step_model, "dispatch": step_dispatch, "suite": step_suite}
    if device.type == "cuda":
        # Every path runs without tf32, so no one gets a cheaper float32 GEMM; float32 checks need IEEE.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    for name in STEPS:
        elapsed = time.perf_counter() - start
        if name not in args.steps:
            report.meta["steps"][name] = dict(status="not asked for")
            continue
        if elapsed > args.budget:
            report.meta["steps"][name] = dict(status=f"skipped: {elapsed:.0f} s spent of a {args.budget:.0f} s budget")
            continue
        if name in _NEEDS_A_GPU and device.type != "cuda":
            report.meta["steps"][name] = dict(status=f"skipped: no GPU ({_NEEDS_A_GPU[name]})")
            continue
        print(f"[gpu] step {name} at {elapsed:.0f} s", flush=True)
        try:
            results[name] = steps[name](device, args)
            status = "done"
        except Exception as err:  # the later steps still run, and every result is saved
            traceback.print_exc()
            status = f"FAIL: {type(err).__name__}: {first_line(err)}"
        report.meta["steps"][name] = dict(status=status, seconds=time.perf_counter() - start - elapsed)
    report.rows = results.get("tests") or []
    results["estimates_vs_measured"] = estimates_beside_measurements(results)
    report.notes += target_lines(results)
    for r in results["estimates_vs_measured"]:
        report.notes.append(f"{r['kernel']}: measured {r['measured_ms']:.2f} ms, expected {r['expected_ms']:.2f} ms, "
                            f"bound {r['bound_ms']:.2f} ms ({r['of_bound']:.0%} of the roofline)")
    for r in (results.get("dispatch") or {}).get("rows", []):
        if r.get("local_gpu_ms") is not None:
            report.notes.append(f"dispatch {r['model']} ep={r['ep']} {r['impl']}: {r['bytes_per_token']:,.0f} bytes per "
                                f"token sent, rank kernels {r['local_gpu_ms']:.2f} ms per forward+backward")
    statuses = [str(r.get("status", "")) for r in report.rows]
    failed = [f"{r['check']} {r.get('dtype', '')}".strip() for r, st in zip(report.rows, statuses)
              if st.startswith("FAIL")]
    for step in ("compile", "suite"):
        if (results.get(step) or {}).get("status", "").startswith("FAIL"):
            failed.append(step)
    failed += [step for step, outcome in report.meta["steps"].items() if outcome["status"].startswith("FAIL")]
    for step, outcome in results.items():
        parts = outcome.get("parts", {}) if isinstance(outcome, dict) else {}
        failed += [f"{step} {key}" for key, status in parts.items() if status.startswith("FAIL")]
    report.failed = failed
    # What the budget or the device left out, said beside the counts: a gate that ran nothing of
    # what it was asked for must not read as a clean pass.
    left_out = [step for step, outcome in report.meta["steps"].items() if outcome["status"].startswith("skipped")]
    for step, outcome in results.items():
        parts = outcome.get("parts", {}) if isinstance(outcome, dict) else {}
        left_out += [f"{step} {key}" for key, status in parts.items() if status.startswith("skipped")]
    report.notes.append(f"gpu check: {statuses.count('ok')} tests ok, "
                        f"{sum(st.startswith('skipped') for st in statuses)} skipped, {len(failed)} failed"
                        + (f" ({', '.join(failed)})" if failed else "")
                        + (f"; not run (budget or device): {', '.join(left_out)}" if left_out else "")
                        + f"; {time.perf_counter() - start:.0f} s")
    report.meta["seconds"] = time.perf_counter() - start
    return report
