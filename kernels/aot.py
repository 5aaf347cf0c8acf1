"""Ahead-of-time compile check: ``python -m moe_ep.kernels.aot [--arch 80 90] [--json PATH]``.

Compiles every configuration that the kernel modules of this folder declare through
``aot_specs()`` for sm_80 (A100) and sm_90 (H100) with ``triton.compile`` on a GPU target, which
needs no GPU, and prints registers, spills, shared memory and the tensor-core instructions found
in the PTX. Exit status 1 when a configuration fails to compile, spills, needs more shared memory
than the architecture has, or is a GEMM (``uses_dot``) without mma.sync on sm_80 / wgmma on
sm_90; 2 when the Triton interpreter is switched on (it replaces ``@triton.jit`` functions, so
nothing could be compiled).

Each configuration is compiled in the specialisation Triton's JIT gives it for aligned tensors,
sizes that are multiples of 16, and top-k and expert counts that are not (see
``alignment_hints``). Registers and spills are read from
the cubin with the cuobjdump that ships with Triton: ptxas keeps spilled registers in the stack
frame, and these kernels have no local arrays, so a non-zero stack frame (or local memory) is a
spill."""

from __future__ import annotations

import argparse
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
from dataclasses import asdict, dataclass

from .runtime import interpreting

PACKAGE = "moe_ep.kernels"
FOLDER = pathlib.Path(__file__).resolve().parent
ARCHS = (80, 90)
# Largest shared memory one block may use (opt-in): A100 163 KB, H100 227 KB.
MAX_SHARED = {80: 163 * 1024, 90: 227 * 1024}
TENSOR_CORE_OP = {80: "mma.sync", 90: "wgmma"}


@dataclass
class Row:
    module: str
    kernel: str
    arch: int
    ok: bool
    registers: int | None = None
    spill_bytes: int | None = None
    shared_bytes: int | None = None
    tensor_core: str = "-"
    seconds: float = 0.0
    problem: str = ""


def kernel_modules() -> list[str]:
    """Names of the modules in this folder, which may or may not declare aot_specs."""
    return sorted(p.stem for p in FOLDER.glob("*.py") if p.stem not in ("aot", "aot_spec", "__init__"))


def discover(only: list[str] | None = None) -> tuple[list[tuple[str, object]], list[Row]]:
    """(module, spec) for every spec of every module with aot_specs (or of the modules named in
    ``only``); a module that fails to import or to list its specs becomes a failed row instead
    of hiding its kernels."""
    specs, failures = [], []
    for name in only or kernel_modules():
        try:
            module = importlib.import_module(f"{PACKAGE}.{name}")
            if not hasattr(module, "aot_specs"):
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


def alignment_hints(spec) -> dict:
    """Triton's JIT marks a pointer argument 16-byte aligned, and an integer argument a multiple
    of 16, whenever the value at launch is one, unless the kernel opts out with
    ``do_not_specialize`` (or ``do_not_specialize_on_alignment``). Freshly allocated tensors and
    production sizes (hidden and intermediate sizes, padded row counts) get that specialisation;
    top-k and expert counts usually do not (``spec.unaligned``). That is the launch compiled here."""
    params = {p.name: p for p in spec.fn.params}
    hints = {}
    for i, (name, ty) in enumerate(spec.signature.items()):
        param = params[name]
        hintable = (ty.startswith("*") or ty in ("i32", "i64", "u32", "u64")) and name not in spec.unaligned
        if hintable and not (param.do_not_specialize or param.do_not_specialize_on_alignment):
            hints[(i,)] = [["tt.divisibility", 16]]
    return hints


def compile_one(module_name: str, spec, arch: int) -> Row:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    row = Row(module_name, spec.name, arch, ok=False)
    start = time.perf_counter()
    try:
        compiled = triton.compile(
            ASTSource(fn=spec.fn, signature=spec.signature, constexprs=spec.constexprs,
                      attrs=alignment_hints(spec)),
            target=GPUTarget("cuda", arch, 32),
            options={"num_warps": spec.num_warps, "num_stages": spec.num_stages},
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
    problems = []
    if row.spill_bytes:
        problems.append(f"spills {row.spill_bytes} B")
    if row.shared_bytes > MAX_SHARED[arch]:
        problems.append(f"shared memory {row.shared_bytes} B > {MAX_SHARED[arch]} B")
    if spec.uses_dot and TENSOR_CORE_OP[arch] not in row.tensor_core:
        problems.append(f"GEMM without {TENSOR_CORE_OP[arch]}")
    row.problem = "; ".join(problems)
    row.ok = not problems
    return row


# Filled before the worker processes fork, so they find the specs without pickling jit functions.
_JOBS: list[tuple[str, object, int]] = []


def _run_job(i: int) -> Row:
    return compile_one(*_JOBS[i])


def run(archs, jobs: int, only: list[str] | None = None) -> list[Row]:
    specs, rows = discover(only)
    _JOBS[:] = [(m, s, a) for m, s in specs for a in archs if a in s.archs]
    if jobs > 1 and len(_JOBS) > 1:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            rows += pool.map(_run_job, range(len(_JOBS)), chunksize=1)
    else:
        rows += [_run_job(i) for i in range(len(_JOBS))]
    return rows


def format_table(rows: list[Row]) -> str:
    header = ("module", "kernel / config", "arch", "regs", "spill B", "smem B", "tensor core", "s", "status")
    body = [
        (
            r.module, r.kernel, f"sm_{r.arch}" if r.arch else "-",
            "-" if r.registers is None else str(r.registers),
            "-" if r.spill_bytes is None else str(r.spill_bytes),
            "-" if r.shared_bytes is None else str(r.shared_bytes),
            r.tensor_core, f"{r.seconds:.1f}", "ok" if r.ok else f"FAIL: {r.problem}",
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths[:-1]) + "  {}"
    return "\n".join(fmt.format(*line) for line in [header, *body])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_ep.kernels.aot", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", choices=ARCHS, default=list(ARCHS),
                        help="compute capabilities to compile for (default: 80 90)")
    parser.add_argument("--json", type=pathlib.Path, help="also write the rows to this JSON file")
    parser.add_argument("--module", nargs="+", choices=kernel_modules(), dest="modules",
                        help="check only these kernel modules (default: every module with aot_specs)")
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
    start = time.perf_counter()
    rows = run(args.arch, max(1, args.jobs), args.modules)
    print(format_table(rows))
    failed = [r for r in rows if not r.ok]
    print(f"\n{len(rows) - len(failed)}/{len(rows)} ok, {len(failed)} failed, "
          f"{time.perf_counter() - start:.0f} s with {args.jobs} jobs")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
