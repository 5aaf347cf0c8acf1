"""Ahead-of-time compile check: ``python -m moe_ep.kernels.aot [--arch 80 90] [--json PATH]``.

Compiles every launch that the kernel modules of this folder declare through ``aot_specs()``
for sm_80 (A100) and sm_90 (H100) with ``triton.compile`` on a GPU target, which needs no GPU,
and prints registers, spills, shared memory, warps, stages, the tensor-core instruction and the
load path found in the PTX, and for the expert GEMMs a static cost at Mixtral-8x7B shapes
(``moe_ep.kernels.cost``): FLOPs, DRAM bytes with the re-reads of the tile order, the roofline
bound (datasheet peaks: no kernel is faster) and the expected time (how far from that bound the
compiled kernel should land); then the same estimates of the whole forward and backward beside
dense cuBLAS over the same FLOPs and transformers' ``grouped_mm`` experts (on sm_80 torch's
host-synced loop of one cuBLAS GEMM per expert). Every time is an estimate.

Exit status 1 when a launch fails to compile, spills, needs more shared memory than the
architecture has, is a GEMM (``uses_dot``) without mma.sync on sm_80 / wgmma on sm_90, or is a
TMA configuration without TMA loads on sm_90; 2 when the Triton interpreter is switched on (it
replaces ``@triton.jit`` functions, so nothing could be compiled).

Each launch is specialised by Triton's own argument binder from the spec's example arguments,
exactly as the JIT specialises that launch (see ``aot_spec``). Launches whose specialisation
is identical (the same kernel, arguments, constexprs and options for the same architecture, as
the float32 tile shared by every family) are compiled once. Registers and spills are read from
the cubin with the cuobjdump that ships with Triton: ptxas keeps spilled registers in the stack
frame, and these kernels have no local arrays, so a non-zero stack frame (or local memory) is a
spill."""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import importlib
import json
import multiprocessing
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field

from . import cost
from .runtime import interpreting

PACKAGE = "moe_ep.kernels"
FOLDER = pathlib.Path(__file__).resolve().parent
ARCHS = (80, 90)
# Largest shared memory one block may use (opt-in): A100 163 KB, H100 227 KB.
MAX_SHARED = {80: 163 * 1024, 90: 227 * 1024}
TENSOR_CORE_OP = {80: "mma.sync", 90: "wgmma"}
TMA_LOAD = "cp.async.bulk.tensor"
ALL_DTYPES = ("fp32", "fp16", "bf16")


@dataclass
class Row:
    module: str
    kernel: str
    arch: int
    ok: bool
    registers: int | None = None
    spill_bytes: int | None = None
    shared_bytes: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    tensor_core: str = "-"
    load_path: str = "-"
    seconds: float = 0.0
    problem: str = ""
    # The static cost at the reference shapes, for the specs that carry one.
    cost: dict = field(default_factory=dict)


def kernel_modules() -> list[str]:
    """Names of the modules in this folder, which may or may not declare aot_specs."""
    return sorted(p.stem for p in FOLDER.glob("*.py") if p.stem not in ("aot", "aot_spec", "cost", "__init__"))


def discover(only: list[str] | None = None) -> tuple[list[tuple[str, object]], list[Row]]:
    """(module, spec) for every spec of every module with aot_specs (or of the modules named in
    ``only``); a module that fails to import or to list its specs becomes a failed row instead
    of hiding its kernels."""
    specs, failures = [], []
    for name in only or kernel_modules():
        try:
            module = importlib.import_module(f"{PACKAGE}.{name}")
            if not hasattr(module, "aot_specs"):
                if only:  # named, but it has nothing to compile: not a pass
                    failures.append(Row(name, "<module>", 0, False, problem="declares no aot_specs: nothing to compile"))
                continue
            specs.extend((name, spec) for spec in module.aot_specs())
        except Exception as exc:  # reported as a failed row, and the exit status says so
            failures.append(Row(name, "<module>", 0, False, problem=f"{type(exc).__name__}: {exc}"))
    return specs, failures


def resource_usage(cubin: bytes) -> dict[str, int]:
    """REG, STACK, SHARED, LOCAL... of the one function in a cubin, as cuobjdump reports them."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name],
            check=True, capture_output=True, text=True,
        ).stdout
    usage = {}
    for line in out.splitlines():
        if "REG:" in line:
            usage.update({k: int(v) for k, v in re.findall(r"(\w+):(\d+)", line)})
    return usage


def tensor_core_ops(ptx: str) -> str:
    found = [op for op in ("wgmma", "mma.sync") if op in ptx]
    return "+".join(found) if found else "-"


def load_paths(ptx: str) -> str:
    found = ["TMA"] if TMA_LOAD in ptx else []
    # cp.async.ca / cp.async.cg: the per-thread asynchronous copies (not the bulk TMA ones).
    if re.search(r"cp\.async\.c[ag]", ptx):
        found.append("cp.async")
    return "+".join(found) if found else "ld.global"


def specialise(spec, arch: int) -> tuple[dict, dict, dict, dict]:
    """(signature, constexprs, attrs, options) of the spec's example launch as Triton's JIT
    builds them for ``arch``: its own binder and argument packing, with no GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", arch, 32))
    binder = create_function_from_signature(spec.fn.signature, spec.fn.params, backend)
    kwargs = {**spec.constexprs, "num_warps": spec.num_warps, "num_stages": spec.num_stages}
    bound, specialization, options = binder(*spec.args, **kwargs)
    options, signature, constexprs, attrs = spec.fn._pack_args(backend, kwargs, bound, specialization, options)
    return signature, constexprs, attrs, options.__dict__


def compile_key(spec, arch: int) -> tuple:
    signature, constexprs, attrs, _ = specialise(spec, arch)
    return (spec.fn.fn.__module__, spec.fn.fn.__qualname__, arch, spec.num_warps, spec.num_stages,
            repr(sorted(signature.items())), repr(sorted(constexprs.items())), repr(sorted(attrs.items())))


def compile_one(module_name: str, spec, arch: int) -> Row:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    row = Row(module_name, spec.name, arch, ok=False, num_warps=spec.num_warps, num_stages=spec.num_stages)
    start = time.perf_counter()
    try:
        signature, constexprs, attrs, options = specialise(spec, arch)
        compiled = triton.compile(
            ASTSource(fn=spec.fn, signature=signature, constexprs=constexprs, attrs=attrs),
            target=GPUTarget("cuda", arch, 32), options=options,
        )
        usage = resource_usage(compiled.asm["cubin"])
    except Exception as exc:  # a configuration that does not compile is a failed row
        row.problem = "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()[0][:300]
        row.seconds = time.perf_counter() - start
        return row
    row.seconds = time.perf_counter() - start
    row.registers = usage["REG"]
    row.spill_bytes = usage.get("STACK", 0) + usage.get("LOCAL", 0)
    row.shared_bytes = compiled.metadata.shared
    row.tensor_core = tensor_core_ops(compiled.asm["ptx"])
    row.load_path = load_paths(compiled.asm["ptx"])
    problems = []
    if row.spill_bytes:
        problems.append(f"spills {row.spill_bytes} B")
    if row.shared_bytes > MAX_SHARED[arch]:
        problems.append(f"shared memory {row.shared_bytes} B > {MAX_SHARED[arch]} B")
    if spec.uses_dot and TENSOR_CORE_OP[arch] not in row.tensor_core:
        problems.append(f"GEMM without {TENSOR_CORE_OP[arch]}")
    if spec.tma and arch >= 90 and "TMA" not in row.load_path:
        problems.append("TMA configuration without TMA loads")
    row.problem = "; ".join(problems)
    row.ok = not problems
    return row


# Filled before the worker processes fork, so they find the specs without pickling jit functions.
_JOBS: list[tuple[str, object, int]] = []


def _run_job(i: int) -> Row:
    return compile_one(*_JOBS[i])


def names_dtype(name: str, dtypes) -> bool:
    """Whether a spec named ``name`` launches one of ``dtypes`` ("bf16"...): the dtype is a word of
    the name; a name without one is a launch whose operands have no float type to choose."""
    words = set(re.split(r"[_ ]", name))
    return bool(words & set(dtypes)) or not words & set(ALL_DTYPES)


def _run_in_processes(jobs: int) -> list[Row]:
    """``_run_job`` of every job on ``jobs`` forked processes. A process that dies (killed for
    memory, a crash in the compiler) breaks the pool: the jobs it took down run again, each in a
    process of its own, so only the one that kills its process is a failed row, not a wait that
    never ends."""
    context = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        rows = [_result(future) for future in [pool.submit(_run_job, i) for i in range(len(_JOBS))]]
    for i, row in enumerate(rows):
        if row is None:
            with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as alone:
                rows[i] = _result(alone.submit(_run_job, i))
            if rows[i] is None:
                module, spec, arch = _JOBS[i]
                rows[i] = Row(module, spec.name, arch, False, problem="its compiler process died (killed for memory, "
                                                                        "or a crash in the compiler)")
    return rows


def _result(future) -> Row | None:
    """The job's row, None where its process pool broke."""
    try:
        return future.result()
    except concurrent.futures.BrokenExecutor:
        return None


def run(archs, jobs: int, only: list[str] | None = None, dtypes: list[str] | None = None,
        first_config: bool = False, quick: bool = False) -> tuple[list[Row], list[tuple[Row, object]]]:
    """Compile the selected specs: every row (module failures first), and each compiled row with
    its spec."""
    specs, failures = discover(only)
    if dtypes:
        specs = [(m, s) for m, s in specs if names_dtype(s.name, dtypes)]
    if first_config or quick:
        specs = [(m, s) for m, s in specs if (s.rank == 0 or s.untuned) and (s.quick or not quick)]
    wanted = [(m, s, a) for m, s in specs for a in archs if a in s.archs]
    keys = [compile_key(s, a) for _, s, a in wanted]
    index, unique = {}, []
    for job, key in zip(wanted, keys):
        if key not in index:
            index[key] = len(unique)
            unique.append(job)
    _JOBS[:] = unique
    if jobs > 1 and len(_JOBS) > 1:
        compiled = _run_in_processes(jobs)
    else:
        compiled = [_run_job(i) for i in range(len(_JOBS))]
    pairs = [(Row(**{**asdict(compiled[index[key]]), "module": m, "kernel": s.name}), s)
             for (m, s, _), key in zip(wanted, keys)]
    for row, spec in pairs:
        if spec.cost is not None and row.ok:
            row.cost = gemm_cost(row, spec)
    return failures + [r for r, _ in pairs], pairs


def gemm_cost(row: Row, spec, p: cost.Problem = cost.MIXTRAL) -> dict:
    """The static cost of a compiled GEMM launch at problem ``p`` (the sizes are not specialised,
    so one compiled launch stands for every problem of its size class)."""
    family, rank, role, persistent, gemms_of = spec.cost
    step, gemm = gemms_of(p)[role]
    machine = cost.MACHINES[row.arch]
    c = spec.constexprs
    occupancy = 1 if persistent else cost.occupancy(machine, row.registers, row.shared_bytes, row.num_warps)
    estimate = cost.estimate(gemm, p, machine, (c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]),
                             c["GROUP_M"], machine.sms * occupancy)
    return {"family": family, "rank": rank, "step": step, "programs_per_sm": occupancy, **estimate,
            **cost.expected(estimate, row.arch, row.load_path, row.num_stages)}


# The down-projection weight gradient before it read hs (issue #12): it recomputed act(gate) * up
# from pre (two [rows, BLOCK_N] panels per tile) in N-fastest tile order (GROUP_M 1), 128x128x64
# tiles at 8 warps, 233 registers (sm_90) so one program per SM.
def _down_grad_before(p: cost.Problem):
    return cost.Gemm("weight", m=p.H, n=p.I, b_panels=2), (128, 128, 64), 1


# The family whose first configuration (the one used without timing) each architecture runs.
FAMILY_OF = {90: "sm_90", 80: "sm_80"}


def whole_pass(pairs: list[tuple[Row, object]], arch: int, p: cost.Problem = cost.MIXTRAL) -> dict | None:
    """Forward + backward of the Triton path, dense cuBLAS over the same FLOPs and grouped_mm's
    kernel sequence, at problem ``p`` on ``arch``'s machine: roofline bounds and expected times
    (estimates), from the compiled first configuration of each GEMM of ``arch``'s family."""
    machine = cost.MACHINES[arch]
    steps = {}
    for r, spec in pairs:
        if (r.arch == arch and r.ok and spec.cost is not None and spec.cost[0] == FAMILY_OF[arch]
                and spec.cost[1] == 0):
            c = gemm_cost(r, spec, p)
            steps[c["step"]] = {"step": c["step"], "kernel": r.kernel, **c}
    if len(steps) != 6:
        return None
    N, T, H, e = p.N, p.T, p.H, p.elem
    P = sum(p.expert_rows())
    triton_steps = list(steps.values()) + [
        cost.memory_pass("fwd+bwd routing metadata", N * 8 + N * 4, (P + N) * 4, arch),
        cost.memory_pass("fwd combine", N * H * e + N * 4, T * H * e, arch),
        cost.memory_pass("bwd dy rows, padded order", T * H * e + P * 4, P * H * e, arch),
        cost.memory_pass("bwd x rows, padded order", T * H * e + P * 4, P * H * e, arch),
        cost.memory_pass("bwd combine (dx)", N * H * e + N * 4, T * H * e, arch),
        cost.memory_pass("bwd d w (partial sums)", N * (p.I // 64) * 4, N * 4, arch),
    ]
    flops = cost.expert_mlp_flops(p)
    dense = [cost.gemm_pass("dense cuBLAS, same FLOPs", flops, 0, 0, arch)]
    grouped = cost.grouped_mm_sequence(p, arch)
    before_gemm, block, group_m = _down_grad_before(p)
    before = cost.estimate(before_gemm, p, machine, block, group_m, machine.sms)
    now = steps["bwd d down (dy^T hs)"]
    t, d, g = (cost.summary(x) for x in (triton_steps, dense, grouped))
    # The forward alone: the routing metadata is built in the forward; dense's forward is a third
    # of its FLOPs.
    t_fwd = cost.summary([s for s in triton_steps if s["step"].startswith("fwd")])
    g_fwd = cost.summary([s for s in grouped if s["step"].startswith("fwd")])
    d_fwd = cost.summary([cost.gemm_pass("dense cuBLAS forward", flops / 3, 0, 0, arch)])
    return {
        "machine": cost.machine_dict(arch), "problem": {**vars(p), "N": N},
        "triton": {**t, "steps": triton_steps}, "dense": {**d, "steps": dense}, "grouped_mm": {**g, "steps": grouped},
        # Time ratios: above 1, the Triton path is faster. Of roofline bounds (traffic and padding
        # only) and of expected times (the headline).
        "bound": {"dense_over_triton": d["roofline_ms"] / t["roofline_ms"],
                  "grouped_mm_over_triton": g["roofline_ms"] / t["roofline_ms"]},
        "expected": {"dense_over_triton": d["expected_ms"] / t["expected_ms"],
                     "grouped_mm_over_triton": g["expected_ms"] / t["expected_ms"]},
        "forward": {basis: {"dense_over_triton": d_fwd[f"{key}_ms"] / t_fwd[f"{key}_ms"],
                            "grouped_mm_over_triton": g_fwd[f"{key}_ms"] / t_fwd[f"{key}_ms"]}
                    for basis, key in (("bound", "roofline"), ("expected", "expected"))},
        "down_grad_bytes_today": before["bytes_read"] + before["bytes_written"],
        "down_grad_bytes_now": now["bytes_read"] + now["bytes_written"],
        "down_grad_ms_today": before["roofline_ms"],
        "activation_bytes": cost.activation_bytes(p),
    }


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f}"


def format_table(rows: list[Row]) -> str:
    header = ("module", "kernel / config", "arch", "regs", "spill B", "smem B", "warps", "stages", "tensor core",
              "loads", "GFLOP", "GB read", "GB written", "bound ms", "exp. ms", "of bound", "s", "status")
    body = []
    for r in rows:
        c = r.cost
        body.append((
            r.module, r.kernel, f"sm_{r.arch}" if r.arch else "-",
            "-" if r.registers is None else str(r.registers),
            "-" if r.spill_bytes is None else str(r.spill_bytes),
            "-" if r.shared_bytes is None else str(r.shared_bytes),
            "-" if r.num_warps is None else str(r.num_warps), "-" if r.num_stages is None else str(r.num_stages),
            r.tensor_core, r.load_path,
            f"{c['flops'] / 1e9:.0f}" if c else "", _gb(c["bytes_read"]) if c else "",
            _gb(c["bytes_written"]) if c else "", f"{c['roofline_ms']:.2f}" if c else "",
            f"{c['expected_ms']:.2f}" if c else "", f"{c['of_bound']:.0%}" if c else "",
            f"{r.seconds:.1f}", "ok" if r.ok else f"FAIL: {r.problem}",
        ))
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths[:-1]) + "  {}"
    return "\n".join(fmt.format(*line) for line in [header, *body])


def format_estimates(estimates: dict) -> str:
    lines = []
    for arch, est in estimates.items():
        m = est["machine"]
        lines.append(f"\nEstimated forward+backward at Mixtral-8x7B shapes (bf16, T={est['problem']['T']}, "
                     f"k={est['problem']['K']}, H={est['problem']['H']}, I={est['problem']['I']}, "
                     f"E={est['problem']['E']}) on {m['name']}. Bound: the roofline at the datasheet peaks "
                     f"({m['flops'] / 1e12:.0f} TFLOP/s, {m['bandwidth'] / 1e12:.2f} TB/s; {m['source']}), "
                     f"which no kernel beats. Expected: cuBLAS's rate ({m['efficiency']['gemm']:.0%} of peak) "
                     f"and a copy's ({m['efficiency']['copy']:.0%}) ({m['efficiency']['source']}); our mainloop "
                     f"keeping {', '.join(f'{v:.0%} on {k}' for k, v in m['mainloop_share'].items())} of cuBLAS's "
                     f"(assumed); pipeline fill and unoverlapped epilogues counted.")
        lines.append(f"  {'':6}  {'step':<40} {'bound ms':>9} {'exp. ms':>8} {'of bound':>8}  {'GB':>6}")
        for step in est["triton"]["steps"]:
            lines.append(f"  triton  {step['step']:<40} {step['roofline_ms']:9.2f} {step['expected_ms']:8.2f} "
                         f"{step['roofline_ms'] / step['expected_ms']:8.0%}  "
                         f"{_gb(step['bytes_read'] + step['bytes_written']):>6}")
        for name in ("triton", "dense", "grouped_mm"):
            s = est[name]
            lines.append(f"  {name:<10} total: bound {s['roofline_ms']:7.2f} ms, expected {s['expected_ms']:7.2f} ms, "
                         f"{s['flops'] / 1e12:6.1f} TFLOP, {_gb(s['bytes'])} GB{_loop_note(s)}")
        for basis in ("expected", "bound"):
            r, f = est[basis], est["forward"][basis]
            lines.append(f"  {basis:<8} dense / triton = {r['dense_over_triton']:.2f}   "
                         f"grouped_mm / triton = {r['grouped_mm_over_triton']:.2f}   "
                         f"(forward alone: {f['dense_over_triton']:.2f}, {f['grouped_mm_over_triton']:.2f})")
        lines.append(f"  d down DRAM traffic: before {_gb(est['down_grad_bytes_today'])} GB "
                     f"(bound {est['down_grad_ms_today']:.2f} ms), now {_gb(est['down_grad_bytes_now'])} GB: "
                     f"{est['down_grad_bytes_today'] / est['down_grad_bytes_now']:.1f}x less")
        act = est["activation_bytes"]
        lines.append(f"  activations saved for backward: triton {_gb(act['triton'])} GB, "
                     f"grouped_mm {_gb(act['grouped_mm'])} GB")
    return "\n".join(lines)


def _loop_note(path: dict) -> str:
    """How torch's grouped GEMM runs where it is the host-synced per-group loop (sm_80)."""
    syncs = path.get("host_syncs", 0)
    return f" (per-group loop, {syncs} host syncs)" if syncs else ""


def _brief(est: dict) -> dict:
    """An estimate's totals and ratios, without its per-step rows."""
    return {"problem": est["problem"], **{k: {m: v for m, v in est[k].items() if m != "steps"}
                                          for k in ("triton", "dense", "grouped_mm")},
            "expected": est["expected"], "bound": est["bound"], "forward": est["forward"]}


def format_other_problems(others: dict) -> str:
    """One line per (problem, architecture): the whole pass's estimates at the other reference
    problems (fine-grained experts), from the same compiled launches."""
    lines = ["\nEstimated forward+backward at the other reference problems (bf16; same machines and rates):"]
    for name, by_arch in others.items():
        for arch, est in by_arch.items():
            p, t, d, g = est["problem"], est["triton"], est["dense"], est["grouped_mm"]
            lines.append(f"  {name:<14} T={p['T']:<6} k={p['K']} H={p['H']} I={p['I']} E={p['E']:<4} sm_{arch}: "
                         f"triton {t['expected_ms']:7.2f} ms, dense {d['expected_ms']:7.2f}, grouped_mm "
                         f"{g['expected_ms']:7.2f}{_loop_note(g)}; grouped_mm / triton "
                         f"{est['expected']['grouped_mm_over_triton']:.2f}, "
                         f"dense / triton {est['expected']['dense_over_triton']:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_ep.kernels.aot", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", choices=ARCHS, default=list(ARCHS),
                        help="compute capabilities to compile for (default: 80 90)")
    parser.add_argument("--json", type=pathlib.Path, help="also write the rows and estimates to this JSON file")
    parser.add_argument("--module", nargs="+", choices=kernel_modules(), dest="modules",
                        help="check only these kernel modules (default: every module with aot_specs)")
    parser.add_argument("--dtype", nargs="+", choices=ALL_DTYPES, dest="dtypes",
                        help="check only the launches of these element types (default: all)")
    parser.add_argument("--first-config", action="store_true",
                        help="check only the configurations launched without timing: each space's first, and the "
                             "first that divides the 64-row padding of experts with few rows")
    parser.add_argument("--quick", action="store_true",
                        help="--first-config, and of the expert GEMMs' specialisations per size class only top-2 "
                             "SwiGLU and top-1 GeGLU (what CI compiles)")
    parser.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)),
                        help="parallel compiler processes (default: all cores)")
    args = parser.parse_args(argv)
    if interpreting():
        print(
            "moe_ep.kernels.aot: TRITON_INTERPRET is set, which turns every @triton.jit function into "
            "an interpreted one that cannot be compiled. Run with TRITON_INTERPRET=0.",
            file=sys.stderr,
        )
        return 2
    if args.json is not None and (problem := _report_target_problem(args.json)):
        print(f"moe_ep.kernels.aot: --json {args.json} {problem}; checked before compiling", file=sys.stderr)
        return 2
    import triton

    start = time.perf_counter()
    rows, pairs = run(args.arch, max(1, args.jobs), args.modules, args.dtypes, args.first_config, args.quick)
    estimates = {a: e for a in args.arch if (e := whole_pass(pairs, a)) is not None}
    others = {name: {a: e for a in args.arch if (e := whole_pass(pairs, a, p)) is not None}
              for name, p in cost.PROBLEMS.items() if p != cost.MIXTRAL}
    print(f"Triton {triton.__version__}")
    print(format_table(rows))
    print(format_estimates(estimates))
    print(format_other_problems(others))
    failed = [r for r in rows if not r.ok]
    print(f"\n{len(rows) - len(failed)}/{len(rows)} ok, {len(failed)} failed, "
          f"{time.perf_counter() - start:.0f} s with {args.jobs} jobs")
    if not rows:
        print("moe_ep.kernels.aot: the selection compiled nothing: not a pass", file=sys.stderr)
    if args.json:
        report = {"triton": triton.__version__, "date": datetime.date.today().isoformat(),
                  "note": "costs and times are static estimates made without a GPU",
                  "rows": [asdict(r) for r in rows], "estimates": {f"sm_{a}": e for a, e in estimates.items()},
                  "other_problems": {name: {f"sm_{a}": _brief(e) for a, e in by_arch.items()}
                                     for name, by_arch in others.items()}}
        # Written beside it, then renamed over it: an interrupted write leaves the earlier report whole.
        partial = args.json.with_name(f".{args.json.name}.partial-{os.getpid()}")
        partial.write_text(json.dumps(report, indent=1))
        os.replace(partial, args.json)
    return 1 if failed or not rows else 0


_REPORT_KEYS = {"triton", "date", "note", "rows", "estimates"}  # what every report has held


def _report_target_problem(path: pathlib.Path) -> str | None:
    """Why the report cannot go to ``path``, or None: its folder must exist and take files, and
    what is there already must be an earlier report of this command (replaced), never a user's
    file, a folder or a link."""
    if path.is_symlink():
        return "is a link: the report is never written through one"
    if path.is_dir():
        return "is a folder: give the report's file name"
    if not path.parent.is_dir() or not os.access(path.parent, os.W_OK):
        return "cannot be written (its folder must exist and take files)"
    if path.exists():
        try:
            earlier = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            earlier = None
        if not (isinstance(earlier, dict) and _REPORT_KEYS <= earlier.keys()):
            return "holds a file that is not an earlier report of this command: not overwritten, choose another path"
    return None


if __name__ == "__main__":
    sys.exit(main())
