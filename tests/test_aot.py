"""`python -m moe_ep.kernels.aot` compiles every kernel configuration for sm_80 and sm_90 without a
GPU: no failure, no spill, tensor-core instructions in every GEMM. The compiles are cached in
~/.triton, so only the first run on a machine is slow."""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

from moe_ep.kernels import aot

REPO = pathlib.Path(__file__).resolve().parents[1]


def run_python(args, timeout=900):
    env = dict(os.environ, TRITON_INTERPRET="0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_every_kernel_configuration_compiles_for_sm80_and_sm90(tmp_path):
    report = tmp_path / "aot.json"
    proc = run_python(["-m", "moe_ep.kernels.aot", "--json", str(report)])
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    rows = json.loads(report.read_text())
    assert all(r["ok"] and r["spill_bytes"] == 0 for r in rows)
    specs, failures = aot.discover()
    assert not failures
    assert {m for m, _ in specs} >= {"router"}
    for module in {m for m, _ in specs}:
        names = [s.name for m, s in specs if m == module]
        assert len(names) == len(set(names)), f"{module}: spec names must be unique"
    compiled = {(r["module"], r["kernel"], r["arch"]) for r in rows}
    for module, spec in specs:
        for arch in (80, 90):
            assert (module, spec.name, arch) in compiled, f"{module} {spec.name} missing for sm_{arch}"
    gemms = [r for r in rows for m, s in specs if (m, s.name) == (r["module"], r["kernel"]) and s.uses_dot]
    assert gemms and all(aot.TENSOR_CORE_OP[r["arch"]] in r["tensor_core"] for r in gemms)
    assert "kernel / config" in proc.stdout and "sm_80" in proc.stdout and "sm_90" in proc.stdout


def test_refuses_to_run_under_the_interpreter(monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert aot.main([]) == 2
    assert "TRITON_INTERPRET" in capsys.readouterr().err


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
        from fake_gemm import not_a_gemm
        from moe_ep.kernels import aot
        from moe_ep.kernels.aot_spec import KernelSpec

        spec = KernelSpec("not_a_gemm", not_a_gemm, {"x_ptr": "*fp16", "y_ptr": "*fp16", "BLOCK": "constexpr"},
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
