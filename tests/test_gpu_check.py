"""``bash scripts/gpu_check.sh --device cpu``: the GPU check's plumbing at small shapes (the Triton
kernels under the interpreter): every step runs or says why not, one JSON and one PNG are written,
and a failing check fails the command."""

import json
import os
import pathlib
import subprocess

import pytest
import torch

from moe_ep.bench import gpu_check
from moe_ep.bench.cli import main

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = ["--warmup", "0", "--reps", "1"]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU mode; on a GPU run the script itself")
def test_script_in_cpu_mode_writes_one_json_and_one_png(tmp_path):
    env = dict(os.environ, MOE_EP_PYTHON=str(pathlib.Path(os.sys.executable)))
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--device", "cpu", "--out-dir", str(tmp_path), *TINY],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted(tmp_path.iterdir())
    assert [p.suffix for p in files] == [".json", ".png"] and all(p.name.startswith("gpu_check_cpu_") for p in files)
    payload = json.loads(files[0].read_text())
    steps = payload["meta"]["steps"]
    assert steps["compile"]["status"].startswith("skipped: no GPU")
    assert all(steps[name]["status"] == "done" for name in ("tests", "kernels", "attention", "model", "dispatch")), steps
    assert steps["suite"]["status"].startswith("skipped: no GPU")
    dispatch = payload["meta"]["results"]["dispatch"]
    assert dispatch["parts"] == {"ep4": "done"}  # byte counts only on the CPU
    assert {"hf_all_to_all", "moe_ep"} <= {r["impl"] for r in dispatch["rows"]}
    tests = payload["meta"]["results"]["tests"]
    names = {r["check"] for r in tests}
    assert {c.name for c in gpu_check.checks_for(torch.device("cpu"))} <= names
    for r in tests:
        if r["check"] == "no host sync":
            assert r["status"].startswith("skipped")
        else:
            assert r["status"] == "ok" and r["triton_err"] <= r["tolerance"] and r["bitwise_repeatable"], r
    assert {r["autotune"] for r in tests if "autotune" in r} == {True, False}
    kernels = payload["meta"]["results"]["kernels"]["rows"]
    assert {"moe_ep[torch]", "hf_grouped_mm", "hf_eager", "dense_mm"} <= {r["variant"] for r in kernels}
    assert payload["meta"]["results"]["model"]["rows"]
    attention = payload["meta"]["results"]["attention"]["rows"]
    assert {r["model"] for r in attention if r["variant"] == "sdpa[default]" and r["status"] == "ok"} == set(
        gpu_check.attention_bench.MODELS)
    assert any(n.startswith("gpu check: ") and "0 failed" in n for n in payload["notes"])


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="what the script says on a machine without a GPU")
def test_script_help_needs_no_gpu_and_a_missing_out_dir_value_is_refused(tmp_path):
    env = dict(os.environ, MOE_EP_PYTHON=str(pathlib.Path(os.sys.executable)))

    def script(*args):
        return subprocess.run(["bash", str(REPO / "scripts/gpu_check.sh"), *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)

    shown = script("--help")
    assert shown.returncode == 0 and "usage: python -m moe_ep.bench gpu" in shown.stdout, shown.stderr
    # A flag where --out-dir's value should be is argparse's to refuse, not a folder named after it.
    refused = script("--device", "cpu", "--out-dir", "--no-save")
    assert refused.returncode == 2 and "--out-dir: expected one argument" in refused.stderr, refused.stderr
    assert list(tmp_path.iterdir()) == []


def test_what_the_budget_left_out_is_said_beside_the_counts(tmp_path):
    # A budget spent before the one step asked for: not a silent "0 failed".
    main(["gpu", "--device", "cpu", "--steps", "dispatch", "--budget", "1e-9", "--out-dir", str(tmp_path), *TINY])
    payload = json.loads(next(tmp_path.glob("gpu_check_cpu_*.json")).read_text())
    summary = next(n for n in payload["notes"] if n.startswith("gpu check: "))
    assert "0 failed; not run (budget or device): dispatch;" in summary, summary


@pytest.mark.slow
def test_a_failing_check_fails_the_command(tmp_path, monkeypatch):
    check = next(c for c in gpu_check.checks_for(torch.device("cpu")) if c.name == "small top-k = E")  # the smallest
    monkeypatch.setattr(gpu_check, "checks_for", lambda device: [check])
    monkeypatch.setitem(gpu_check.TOLERANCE, torch.bfloat16, 1e-9)
    with pytest.raises(SystemExit, match=f"gpu: failed: {check.name}"):
        main(["gpu", "--device", "cpu", "--steps", "tests", "--out-dir", str(tmp_path), *TINY])
    payload = json.loads(next(tmp_path.glob("gpu_check_cpu_*.json")).read_text())
    assert payload["meta"]["steps"]["kernels"]["status"] == "not asked for"
    status = payload["meta"]["results"]["tests"][0]["status"]
    assert status.startswith("FAIL: ") and "triton err" in status and "auto err" in status


def test_budget_skips_later_steps(tmp_path):
    main(["gpu", "--device", "cpu", "--steps", "model", "--budget", "1e-9", "--out-dir", str(tmp_path), *TINY])
    payload = json.loads(next(tmp_path.glob("gpu_check_cpu_*.json")).read_text())
    assert payload["meta"]["steps"]["model"]["status"].startswith("skipped: ")


def test_cpu_mode_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        main(["gpu", "--device", "cpu", "--no-save"])


@pytest.mark.slow
def test_reference_by_expert_matches_the_per_token_loop():
    from moe_ep.ops.reference import moe_experts_ref, moe_experts_ref_by_expert

    for check in gpu_check.checks_for(torch.device("cpu")):
        x, idx, w, gate_up, down, dy = gpu_check.make_case(check, torch.float32, torch.device("cpu"), seed=0)
        a = gpu_check._outputs(lambda *t: moe_experts_ref(*t, activation=check.activation), x, idx, w, gate_up, down, dy)
        b = gpu_check._outputs(lambda *t: moe_experts_ref_by_expert(*t, activation=check.activation),
                               x, idx, w, gate_up, down, dy)
        assert gpu_check._worst(b, a) <= 1e-12, check.name


def test_the_suite_step_runs_the_suites_cuda_tests_and_reads_their_outcome(tmp_path, monkeypatch):
    """On a GPU the gate runs ``pytest tests -k "cuda or on_the_gpu"`` (pytest.ini's options left
    out) and records its counts and failures; a failure fails the gate; on the CPU it is skipped."""
    command = gpu_check.suite_command()
    assert command[1:3] == ["-m", "pytest"] and command[-2:] == ["-k", "cuda or on_the_gpu"]
    assert "addopts=" in command and "-rfE" in command
    output = ("..F.s\n=========================== short test summary info ============================\n"
              "FAILED tests/test_dispatch.py::test_x_on_cuda - AssertionError: off\n"
              "ERROR tests/test_aot.py::test_y_cuda - RuntimeError\n"
              "1 failed, 3 passed, 1 skipped, 1790 deselected, 1 error in 98.51s (0:01:38)\n")
    summary = gpu_check.suite_summary(1, output)
    assert summary["status"] == "FAIL: pytest exit status 1"
    assert summary["counts"] == {"failed": 1, "passed": 3, "skipped": 1, "deselected": 1790, "error": 1}
    assert summary["failed"] == ["tests/test_dispatch.py::test_x_on_cuda", "tests/test_aot.py::test_y_cuda"]
    ok = gpu_check.suite_summary(0, "....\n4 passed, 1790 deselected in 9.02s\n")
    assert ok["status"] == "ok" and ok["counts"] == {"passed": 4, "deselected": 1790} and not ok["failed"]

    main(["gpu", "--device", "cpu", "--steps", "suite", "--out-dir", str(tmp_path), *TINY])
    payload = json.loads(next(tmp_path.glob("gpu_check_cpu_*.json")).read_text())
    assert payload["meta"]["steps"]["suite"]["status"].startswith("skipped: no GPU")

    # Its failure fails the gate: the step's result as a GPU run would record it.
    monkeypatch.delitem(gpu_check._NEEDS_A_GPU, "suite")
    monkeypatch.setattr(gpu_check, "step_suite", lambda device, args: summary)
    with pytest.raises(SystemExit, match="gpu: failed: suite"):
        main(["gpu", "--device", "cpu", "--steps", "suite", "--out-dir", str(tmp_path / "fail"), *TINY])


def test_a_part_that_raises_or_fails_is_the_gates_failure_and_the_other_results_are_saved(tmp_path, monkeypatch):
    """A part that raises (a rank that died) is recorded as its failure, a part whose own report
    failed a check (a model step's NaN loss) too; the other steps still run and every result is
    saved, and the command fails naming both."""
    from moe_ep.bench.report import Report

    def dying(args, device):
        raise RuntimeError("a spawned rank died")

    def nan_loss(args, device):
        report = Report("model", device, [])
        report.rows, report.failed = [dict(model="tiny", variant="eager", status="FAIL: loss nan")], ["tiny: nan"]
        return report

    monkeypatch.setattr(gpu_check.dispatch_bench, "run", dying)
    monkeypatch.setattr(gpu_check.model_bench, "run", nan_loss)
    monkeypatch.setitem(gpu_check.MODEL_RUNS, "cpu", [("tiny-mixtral", 8)])
    with pytest.raises(SystemExit, match="gpu: failed: model tiny-mixtral seq 8, dispatch ep4"):
        main(["gpu", "--device", "cpu", "--steps", "model", "dispatch", "--out-dir", str(tmp_path), *TINY])
    payload = json.loads(next(tmp_path.glob("gpu_check_cpu_*.json")).read_text())
    results = payload["meta"]["results"]
    assert results["dispatch"]["parts"] == {"ep4": "FAIL: RuntimeError: a spawned rank died"}
    assert results["model"]["parts"] == {"tiny-mixtral seq 8": "FAIL: tiny: nan"}
    assert results["model"]["rows"][0]["status"] == "FAIL: loss nan"  # the failed part's rows are kept


def test_the_dispatch_steps_kernel_times_are_in_the_notes(tmp_path, monkeypatch):
    row = dict(model="fine-grained", ep=4, impl="moe_ep", bytes_per_token=41082.6, local_gpu_ms=30.288)
    monkeypatch.setattr(gpu_check, "step_dispatch", lambda device, args: dict(rows=[row], parts={"ep4": "done"}))
    main(["gpu", "--device", "cpu", "--steps", "dispatch", "--out-dir", str(tmp_path), *TINY])
    payload = json.loads(next(tmp_path.glob("gpu_check_cpu_*.json")).read_text())
    assert ("dispatch fine-grained ep=4 moe_ep: 41,083 bytes per token sent, rank kernels 30.29 ms per "
            "forward+backward") in payload["notes"]
