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

from moe_ep.kernels import aot

REPO = pathlib.Path(__file__).resolve().parents[1]


def run_python(args, timeout=900):
    env = dict(os.environ, TRITON_INTERPRET="0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_first_configurations_compile_for_sm80_and_sm90(tmp_path):
    """Every kernel's first configuration (the one launched without timing) in every family, in
    bfloat16 and float32, with every specialisation: the full sweep over every configuration and
    dtype is ``python -m moe_ep.kernels.aot`` (committed under benchmarks/results/)."""
    report = tmp_path / "aot.json"
    proc = run_python(["-m", "moe_ep.kernels.aot", "--first-config", "--dtype", "bf16", "fp32",
                       "--json", str(report)])
    data = json.loads(report.read_text())
    rows = [r for r in data["rows"] if "unaligned" not in r["kernel"]]
    bad = [(r["kernel"], r["arch"], r["problem"]) for r in rows if not r["ok"]]
    assert not bad, bad
    specs, failures = aot.discover()
    assert not failures
    assert {m for m, _ in specs} >= {"router", "grouped_gemm", "routing_metadata"}
    for module in {m for m, _ in specs}:
        names = [s.name for m, s in specs if m == module]
        assert len(names) == len(set(names)), f"{module}: spec names must be unique"
    compiled = {(r["module"], r["kernel"], r["arch"]) for r in data["rows"]}
    for module, spec in specs:
        if spec.rank == 0 and any(f"_{d}_" in f"_{spec.name}_" for d in ("bf16", "fp32")):
            for arch in spec.archs:
                assert (module, spec.name, arch) in compiled, f"{module} {spec.name} missing for sm_{arch}"
    by_name = {(m, s.name): s for m, s in specs}
    gemms = [r for r in rows if by_name[(r["module"], r["kernel"])].uses_dot]
    assert gemms and all(aot.TENSOR_CORE_OP[r["arch"]] in r["tensor_core"] for r in gemms)
    tma = [r for r in rows if by_name[(r["module"], r["kernel"])].tma]
    assert tma and all(r["arch"] == 90 and "TMA" in r["load_path"] for r in tma)
    for arch in ("sm_80", "sm_90"):
        est = data["estimates"][arch]
        assert est["triton"]["ms"] > 0 and est["dense"]["ms"] > 0 and est["grouped_mm"]["ms"] > 0
    assert "kernel / config" in proc.stdout and "sm_80" in proc.stdout and "sm_90" in proc.stdout
    assert "dense / triton" in proc.stdout


def test_jit_specialisation_of_integer_arguments(tmp_path):
    """top_k = 1 becomes a constant and other small counts get no divisibility hint, as in the JIT
    (in a process without the interpreter, which replaces the jit functions)."""
    (tmp_path / "check.py").write_text(textwrap.dedent('''
        from moe_ep.kernels import aot
        from moe_ep.kernels import grouped_gemm as gg

        specs = {s.name: s for s in gg.aot_specs()}
        params = [p.name for p in gg._gather_glu_kernel.params]
        for top_k, expect in ((1, "constexpr"), (2, "i32")):
            spec = next(s for n, s in specs.items()
                        if n.startswith("gather_glu_bf16_sm_90") and n.endswith(f"_aligned_{top_k}_silu"))
            signature, constexprs, attrs, _ = aot.specialise(spec, 90)
            assert signature["top_k"] == expect, signature
            assert attrs[(params.index("H"),)] == [["tt.divisibility", 16]], attrs
            assert not attrs.get((params.index("num_experts"),)), attrs
        print("ok")
    '''))
    proc = run_python([str(tmp_path / "check.py")], timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


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
