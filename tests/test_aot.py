"""`python -m moe_ep.kernels.aot` compiles the kernels' launches for sm_80 and sm_90 without a GPU:
no failure, no spill, tensor-core instructions in every GEMM, TMA loads in the sm_90 TMA
configurations, and the static estimates. The compiles are cached in ~/.triton, so only the
first run on a machine is slow."""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

from moe_ep.kernels import aot
from moe_ep.kernels import grouped_gemm as gg

REPO = pathlib.Path(__file__).resolve().parents[1]


def run_python(args, timeout=900):
    env = dict(os.environ, TRITON_INTERPRET="0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_quick_check_compiles_every_kernel_for_sm80_and_sm90(tmp_path):
    """The quick check: every kernel's configurations launched without timing (each space's first,
    and the first dividing the 64-row padding of small batches) in
    every family, for aligned and unaligned rows, in bfloat16 and float32, top-2 SwiGLU and top-1
    GeGLU: TMA on sm_90, cp.async on sm_80, element-wise loads for unaligned rows; the routers and
    the routing metadata. The full sweep over every configuration, dtype and specialisation is
    ``python -m moe_ep.kernels.aot`` (committed under benchmarks/results/)."""
    report = tmp_path / "aot.json"
    proc = run_python(["-m", "moe_ep.kernels.aot", "--quick", "--dtype", "bf16", "fp32", "--json", str(report)])
    data = json.loads(report.read_text())
    rows = data["rows"]
    bad = [(r["kernel"], r["arch"], r["problem"]) for r in rows if not r["ok"]]
    assert not bad, bad
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Each launch's role and the configuration space it draws from.
    spaces = {"gather_glu": "gather_glu", "rows_matmul_nk_scaled": "rows_matmul", "rows_matmul_kn": "rows_matmul",
              "glu_backward": "glu_backward", "weight_grad_down": "weight_grad", "weight_grad_gate_up": "weight_grad"}
    for kernel, space in spaces.items():
        for ty in ("bf16", "fp32"):
            for arch in (80, 90):
                mine = [r for r in rows if r["kernel"].startswith(f"{kernel}_{ty}_") and r["arch"] == arch]
                assert any("_aligned" in r["kernel"] for r in mine), (kernel, ty, arch)
                unaligned = [r for r in mine if "_unaligned" in r["kernel"]]
                assert unaligned and all(r["load_path"] in ("ld.global", "cp.async") for r in unaligned), unaligned
            if ty == "bf16":
                # TMA exactly where the sm_90 configurations launched untimed ask for it (the
                # space's first; the first dividing the 64-row padding of small batches);
                # gather_glu's gathered token rows stay on cp.async beside it.
                for config in {gg.configs_for(space, torch.bfloat16, "sm_90", pad_m=pad)[0] for pad in (None, 64)}:
                    first = [r for r in rows if r["kernel"].startswith(f"{kernel}_bf16_sm_90_{config}_")
                             and "_aligned" in r["kernel"]]
                    assert first and all(r["load_path"].startswith("TMA") == config.tma for r in first), (kernel, first)
                    if space in ("glu_backward", "weight_grad") and config.tma:
                        # Both operands in the padded layout: every load of the mainloop through TMA.
                        assert all(r["load_path"] == "TMA" for r in first), (kernel, first)
    specs, failures = aot.discover()
    assert not failures
    assert {m for m, _ in specs} >= {"router", "grouped_gemm", "routing_metadata"}
    assert {r["module"] for r in rows} == {m for m, _ in specs}
    for module in {m for m, _ in specs}:
        names = [s.name for m, s in specs if m == module]
        assert len(names) == len(set(names)), f"{module}: spec names must be unique"
    compiled = {(r["module"], r["kernel"], r["arch"]) for r in data["rows"]}
    for module, spec in specs:
        if (spec.rank == 0 or spec.untuned) and spec.quick and aot.names_dtype(spec.name, ("bf16", "fp32")):
            for arch in spec.archs:
                assert (module, spec.name, arch) in compiled, f"{module} {spec.name} missing for sm_{arch}"
    by_name = {(m, s.name): s for m, s in specs}
    gemms = [r for r in rows if by_name[(r["module"], r["kernel"])].uses_dot]
    assert gemms and all(aot.TENSOR_CORE_OP[r["arch"]] in r["tensor_core"] for r in gemms)
    tma = [r for r in rows if by_name[(r["module"], r["kernel"])].tma]
    assert tma and all(r["arch"] == 90 and "TMA" in r["load_path"] for r in tma)
    for arch in ("sm_80", "sm_90"):
        est = data["estimates"][arch]
        for path in ("triton", "dense", "grouped_mm"):
            # The expected time is never below the roofline bound.
            assert 0 < est[path]["roofline_ms"] <= est[path]["expected_ms"], (arch, path, est[path])
        for step in est["triton"]["steps"]:
            assert step["roofline_ms"] <= step["expected_ms"], step
    assert "kernel / config" in proc.stdout and "sm_80" in proc.stdout and "sm_90" in proc.stdout
    assert "expected dense / triton" in proc.stdout and "bound    dense / triton" in proc.stdout


@pytest.mark.slow
def test_jit_specialisation_is_what_the_aot_check_compiles(tmp_path):
    """Sizes and counts are not specialised (one variant per size class, chosen by ALIGN), top_k = 1
    is a constant: launches at any other sizes of a class bind to the very compile key of the
    spec the check compiles (in a process without the interpreter, which replaces jit functions)."""
    (tmp_path / "check.py").write_text(textwrap.dedent('''
        import dataclasses
        import torch
        from moe_ep.kernels import aot
        from moe_ep.kernels import grouped_gemm as gg

        specs = {s.name: s for s in gg.aot_specs()}
        params = [p.name for p in gg._gather_glu_kernel.params]
        for top_k, expect in ((1, "constexpr"), (2, "i32")):
            spec = specs[f"gather_glu_bf16_sm_90_{gg.configs_for('gather_glu', torch.bfloat16, 'sm_90')[0]}"
                         f"_aligned_{top_k}_silu"]
            signature, constexprs, attrs, _ = aot.specialise(spec, 90)
            assert signature["top_k"] == expect, signature
            assert constexprs[(params.index("ALIGN"),)] == 8, constexprs
            for name in ("H", "I", "num_experts", "num_rows", "pad_m"):
                assert signature[name] == "i32" and not attrs.get((params.index(name),)), (name, attrs)
        # Other sizes of each class, other expert counts and padding: the same compile key as the
        # spec (16 and 1 are sizes the JIT would otherwise specialise).
        dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
        for kind, sizes in (("aligned", [(16, 8), (4096 + 16, 1024 + 8), (8, 16)]),
                            ("unaligned", [(1, 1), (17, 33), (4096, 14337)])):
            H0, I0 = gg._SIZES[kind]
            for H, I in sizes:
                swap = {H0: H, I0: I, 2 * I0: 2 * I, gg.MIXTRAL.E: 64, 128: 64}
                for name, spec in specs.items():
                    if not name.endswith((f"_{kind}_2_silu", f"_{kind}_2", f"_{kind}_0")) or "_sm_80_" not in name:
                        continue
                    dtype = next(d for t, d in dtypes.items() if f"_{t}_" in name)
                    if gg.row_align(dtype, H, I) != spec.constexprs["ALIGN"]:
                        continue  # e.g. (8, 16) is unaligned in float32
                    args = tuple(swap.get(a, a) if isinstance(a, int) else a for a in spec.args)
                    assert args != spec.args
                    other = dataclasses.replace(spec, args=args)
                    assert aot.compile_key(other, 80) == aot.compile_key(spec, 80), (name, H, I)
        print("ok")
    '''))
    proc = run_python([str(tmp_path / "check.py")], timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_the_quick_check_takes_the_configurations_small_batches_launch_untimed():
    """Experts with few rows pad to 64 and, untimed, launch the first configuration whose tile
    divides 64: on sm_90 that is not the space's first for every kernel, and the quick check (what
    CI compiles) compiles it too."""
    specs, _ = aot.discover(["grouped_gemm"])
    for kernel in ("gather_glu", "rows_matmul", "glu_backward", "weight_grad"):
        small = gg.configs_for(kernel, torch.bfloat16, "sm_90", pad_m=64)[0]
        marked = [s for _, s in specs if s.untuned and f"_bf16_sm_90_{small}_" in s.name]
        assert marked, kernel
    assert any(s.untuned and s.rank > 0 for _, s in specs)


def test_a_selection_that_compiles_nothing_or_cannot_write_its_report_is_not_a_pass(tmp_path, monkeypatch, capsys):
    proc = run_python(["-m", "moe_ep.kernels.aot", "--arch", "90", "--module", "autotune"], timeout=300)
    assert proc.returncode == 1 and "declares no aot_specs: nothing to compile" in proc.stdout, proc.stdout[-2000:]
    # The unwritable report through main() in this process (the status the command exits with, as
    # above): refused before anything would compile, which the interpreter here would forbid.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    code = aot.main(["--arch", "90", "--module", "routing_metadata", "--json", str(tmp_path / "missing" / "aot.json")])
    captured = capsys.readouterr()
    assert code == 2 and "cannot be written" in captured.err and "kernel / config" not in captured.out
    # Nor over a user's file, a folder or a link: only an earlier report of the command is replaced.
    (tmp_path / "mine.json").write_text('{"my": "results"}')
    (tmp_path / "link.json").symlink_to(tmp_path / "mine.json")
    for target, said in (("mine.json", "holds a file that is not an earlier report of this command"),
                         ("link.json", "is a link"), (".", "is a folder")):
        code = aot.main(["--arch", "90", "--module", "routing_metadata", "--json", str(tmp_path / target)])
        captured = capsys.readouterr()
        assert code == 2 and said in captured.err and "kernel / config" not in captured.out, captured.err
    assert (tmp_path / "mine.json").read_text() == '{"my": "results"}'


@pytest.mark.slow
def test_a_compiler_process_that_dies_fails_its_launch_alone(tmp_path):
    """A compiler process killed (for memory) broke the process pool and the check waited for ever:
    its launch is a failed row, the others compile in processes of their own."""
    (tmp_path / "dying.py").write_text(textwrap.dedent('''
        import os, signal, sys
        from moe_ep.kernels import aot

        real = aot.compile_one

        def dying(module, spec, arch):
            if spec.name == "routing_scan":
                os.kill(os.getpid(), signal.SIGKILL)  # the out-of-memory killer
            return real(module, spec, arch)

        aot.compile_one = dying
        sys.exit(aot.main(["--arch", "90", "--module", "routing_metadata", "--jobs", "2"]))
    '''))
    proc = run_python([str(tmp_path / "dying.py")], timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "routing_scan" in proc.stdout and "its compiler process died" in proc.stdout
    assert "4/5 ok, 1 failed" in proc.stdout, proc.stdout[-2000:]


def test_refuses_to_run_under_the_interpreter(monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert aot.main([]) == 2
    assert "TRITON_INTERPRET" in capsys.readouterr().err


@pytest.mark.slow
def test_a_gemm_without_tensor_cores_fails_the_check(tmp_path):
    """A kernel declared uses_dot whose product is elementwise must be reported and fail. It runs
    in a fresh process without the interpreter: Triton modules imported while this process has it
    on refuse to compile (and a warm ~/.triton cache would hide that)."""
    (tmp_path / "fake_gemm.py").write_text(textwrap.dedent('''
        import triton
        import triton.language as tl

        @triton.jit
        def not_a_gemm(x_ptr, y_ptr, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            tl.store(y_ptr + offs, tl.load(x_ptr + offs) * 2.0)
    '''))
    (tmp_path / "check.py").write_text(textwrap.dedent('''
        import dataclasses, json
        import torch
        from fake_gemm import not_a_gemm
        from moe_ep.kernels import aot
        from moe_ep.kernels.aot_spec import KernelSpec, pointer

        spec = KernelSpec("not_a_gemm", not_a_gemm, (pointer(torch.float16), pointer(torch.float16)),
                          {"BLOCK": 128}, uses_dot=True)
        row = aot.compile_one("fake", spec, 80)
        print(json.dumps({"row": dataclasses.asdict(row), "table": aot.format_table([row])}))
    '''))
    proc = run_python([str(tmp_path / "check.py")], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    row = result["row"]
    assert not row["ok"] and row["registers"] and row["spill_bytes"] == 0, row
    assert "FAIL: GEMM without mma.sync" in result["table"]
