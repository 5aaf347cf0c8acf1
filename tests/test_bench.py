"""The benchmarks: smoke runs of every mode at tiny shapes (files written, rows present; no timing
is asserted), the inputs every variant of the kernel benchmark sees against the float64
reference, the byte accounting of the dispatch benchmark against a per-token count, and the
helpers' error messages."""

import json
import pathlib
import subprocess
import sys

import pytest
import torch

from moe_ep.bench import dispatch, kernels
from moe_ep.bench import model as model_bench
from moe_ep.bench.cli import build_parser, main
from moe_ep.bench.optional import optional_attr, optional_import
from moe_ep.bench.report import Report, results_stem
from moe_ep.bench.routing_cases import make_routing, max_load_share
from moe_ep.bench.timing import measure
from moe_ep.ops.reference import moe_experts_ref

from markers import requires_cuda, requires_ep_registry
from numerics import TOLERANCE, rel_err

TINY = ["--warmup", "0", "--reps", "1"]


def written(tmp_path, mode):
    files = sorted(p.suffix for p in tmp_path.glob(f"{mode}_cpu_*"))
    assert files == [".csv", ".json", ".png"]
    return json.loads(next(tmp_path.glob(f"{mode}_cpu_*.json")).read_text())


@pytest.mark.slow
def test_results_are_written_without_matplotlib_and_the_missing_figure_is_said(tmp_path, capsys, monkeypatch):
    """matplotlib is in the bench and test extras only: a run in the main job's environment wrote
    its JSON and CSV, then stopped with a traceback on the figure (and the GPU gate exited 1)."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else
                        find_spec(name, *a))
    main(["kernels", "--device", "cpu", "--tokens", "8", "--hidden", "16", "--intermediate", "8",
          "--experts", "2", "--top-k", "1", "--out-dir", str(tmp_path), *TINY])
    assert sorted(p.suffix for p in tmp_path.glob("kernels_cpu_*")) == [".csv", ".json"]
    assert "no figure: matplotlib is not installed (pip install 'moe_ep[bench]')" in capsys.readouterr().err


@pytest.mark.slow
def test_kernels_mode_smoke(tmp_path):
    main(["kernels", "--device", "cpu", "--tokens", "24", "--hidden", "16", "--intermediate", "24",
          "--experts", "4", "--top-k", "2", "--out-dir", str(tmp_path), *TINY])
    payload = written(tmp_path, "kernels")
    rows = payload["rows"]
    timed = {(r["variant"], r["routing"], r["phase"]) for r in rows if r.get("ms") is not None}
    for variant in ("moe_ep[torch]", "hf_grouped_mm", "hf_eager", "dense_mm"):
        for routing in ("uniform", "skewed"):
            assert {(variant, routing, p) for p in kernels.PASSES} <= timed
    for name in ("router[torch]", "metadata[torch]", "gemm1[torch]", "gemm2[torch]", "device_copy"):
        assert any(r["variant"] == name and r["status"] == "ok" for r in rows), name
    ours = next(r for r in rows if r["variant"] == "moe_ep[torch]" and r["phase"] == "fwd+bwd")
    assert {"vs_grouped_mm", "vs_eager", "vs_dense", "err_vs_eager"} <= ours.keys()
    assert any(n.startswith("CPU target") for n in payload["notes"])
    assert payload["meta"]["device"] and payload["meta"]["date"]


@pytest.mark.parametrize("routing", ["uniform", "skewed"])
def test_every_variant_sees_identical_inputs(routing):
    """The kernel benchmark feeds each variant the same routing and weights: every output and
    gradient it compares must match the float64 reference."""
    p = kernels.Problem(T=13, H=16, I=24, E=4, K=2, routing=routing, dtype=torch.float32,
                        device=torch.device("cpu"))
    inp = kernels.make_inputs(p, seed=3)
    ref = [t.detach().double().requires_grad_() for t in inp.leaves]
    y_ref = moe_experts_ref(ref[0], inp.idx_TK, *ref[1:])
    grads_ref = torch.autograd.grad(y_ref, ref, inp.dy_TH.double())
    variants = kernels.expert_variants(p.device)
    assert {"moe_ep[torch]", "hf_grouped_mm", "hf_eager"} <= variants.keys()
    for name, found in variants.items():
        y, grads = kernels._outputs(found.value, inp)
        assert rel_err(y, y_ref) <= TOLERANCE[torch.float32], name
        for g, g_ref in zip(grads, grads_ref):
            assert rel_err(g, g_ref) <= TOLERANCE[torch.float32], name


def test_triton_launchers_run_under_the_benchmark(tmp_path):
    """The adapters of the per-kernel rows call the Triton launchers as they are today (under the
    interpreter without CUDA); timing them is for the GPU run."""
    p = kernels.Problem(T=8, H=16, I=16, E=4, K=2, routing="skewed", dtype=torch.float32, device=torch.device("cpu"))
    components = kernels.triton_components(p, kernels.make_inputs(p, seed=0))
    assert [(c.name, c.pass_) for c in components] == [("router[triton]", "fwd"), ("router[triton]", "bwd"),
                                                       *kernels.TRITON_GEMMS]
    for c in components:
        assert c.fn is not None, c.reason
        c.fn()


@requires_cuda
def test_kernels_mode_on_cuda(tmp_path):
    report = main(["kernels", "--device", "cuda", "--tokens", "512", "--hidden", "128", "--intermediate", "256",
                   "--routing", "uniform", "--out-dir", str(tmp_path), *TINY])
    assert all(r["status"] == "ok" for r in report.rows), [r for r in report.rows if r["status"] != "ok"]
    checks = report.meta["no_host_sync"]["T=512 uniform"]
    assert checks["moe_experts[triton] fwd+bwd"] == "pass" and checks["moe_experts[torch] fwd+bwd"] == "pass"


@pytest.mark.slow
def test_model_mode_smoke(tmp_path):
    """Every family's tiny model (the CPU default), each variant on the eager model's loss (the
    chunked loss too)."""
    main(["model", "--device", "cpu", "--seq", "8", "--batch", "1", "--out-dir", str(tmp_path), *TINY])
    results = written(tmp_path, "model")["rows"]
    assert {r["model"] for r in results} == set(model_bench.TINY_MODELS)
    for name in model_bench.TINY_MODELS:
        rows = {r["variant"]: r for r in results if r["model"] == name}
        assert rows["eager"]["status"] == rows["grouped_mm"]["status"] == "ok"
        assert rows["grouped_mm"]["tokens_per_s"] > 0
        for variant in ("moe_ep", "moe_ep+fused_router", "moe_ep+fused_router+chunked_loss"):
            assert rows[variant]["status"] == "ok" and rows[variant]["tokens_per_s"] > 0, (name, variant)
            assert rows[variant]["loss_diff"] <= 1e-5 * abs(rows["eager"]["loss"]), (name, variant)


def test_dispatch_mode_bytes_only(tmp_path):
    main(["dispatch", "--device", "cpu", "--no-timing", "--tokens", "64", "--hidden", "8",
          "--out-dir", str(tmp_path)])
    rows = written(tmp_path, "dispatch")["rows"]
    assert {(r["model"], r["ep"]) for r in rows} == {(m, ep) for m in ("mixtral", "fine-grained") for ep in (2, 4, 8)}
    assert all(r["status"] == "bytes only" for r in rows)
    # The node-aware rows where ep spans several simulated nodes of 2 ranks (the default).
    for model in ("mixtral", "fine-grained"):
        for ep in (2, 4, 8):
            impls = {r["impl"]: r for r in rows if (r["model"], r["ep"]) == (model, ep)}
            assert set(impls) == {"hf_all_to_all", "moe_ep"} | ({"moe_ep_node"} if ep > 2 else set()), (model, ep)
            if ep > 2:
                network = [impls[i]["network_bytes_per_token"] for i in ("moe_ep_node", "moe_ep", "hf_all_to_all")]
                assert 0 < network[0] <= network[1] <= network[2], (model, ep, network)


@pytest.mark.slow
@requires_ep_registry  # transformers' AllToAllEP is the baseline
def test_dispatch_mode_spawns_ranks(tmp_path):
    # Two nodes of one rank: the node-aware dispatch runs too, its intra-node stage empty.
    main(["dispatch", "--device", "cpu", "--ep", "2", "--node-size", "1", "--models", "mixtral", "fine-grained",
          "--tokens", "16", "--hidden", "8", "--out-dir", str(tmp_path), *TINY])
    rows = written(tmp_path, "dispatch")["rows"]
    assert {r["impl"] for r in rows} == {"hf_all_to_all", "moe_ep", "moe_ep_node"}
    for row in rows:
        assert row["status"] == "ok" and row["ms_fwd_bwd"] > 0
        # The accounting is exactly what the implementation's collectives sent.
        assert row["measured_bytes_per_token"] == row["bytes_per_token"]
        # Identity experts: both exchanges must return sum_k w_k x_t.
        assert row["max_abs_err"] <= 1e-5
    # On the wire: never more than transformers' all-to-all, strictly less once a token's experts
    # share a rank (fewer rows sent); every configuration here has such tokens.
    for model in ("mixtral", "fine-grained"):
        ours, theirs = (next(r for r in rows if (r["model"], r["impl"]) == (model, impl))
                        for impl in ("moe_ep", "hf_all_to_all"))
        assert ours["rows_per_token"] < theirs["rows_per_token"], (ours, theirs)
        assert ours["measured_bytes_per_token"] < theirs["measured_bytes_per_token"], (ours, theirs)


def _per_token_count(idx_TK, E, ep, rank):
    """(our rows, transformers' rows) sent off-rank one way, one token at a time."""
    L = E // ep
    ours = theirs = 0
    for experts in idx_TK.tolist():
        ranks = [e // L for e in experts]
        theirs += sum(r != rank for r in ranks)
        ours += len({r for r in ranks if r != rank})
    return ours, theirs


@pytest.mark.parametrize("ep", [2, 4, 8])
@pytest.mark.parametrize("routing", ["uniform", "skewed"])
def test_reported_rows_match_a_per_token_count(ep, routing):
    s = dispatch.Settings(tokens=29, hidden=8, dtype="bfloat16", models=("fine-grained",), routings=(routing,),
                          seed=1, warmup=0, reps=1, node_size=2)
    counted = dispatch.computed_bytes(s, "fine-grained", routing, ep)
    per_rank = [_per_token_count(dispatch.rank_routing(s, "fine-grained", routing, r)[0], 64, ep, r)
                for r in range(ep)]
    assert counted["moe_ep"].rows == 2 * sum(ours for ours, _ in per_rank)
    assert counted["hf_all_to_all"].rows == 2 * sum(theirs for _, theirs in per_rank)
    # transformers' bytes: rows of H bf16 values both ways, plus one int64 per expert of each peer.
    assert counted["hf_all_to_all"].bytes == counted["hf_all_to_all"].rows * 16 + ep * (ep - 1) * (64 // ep) * 8
    assert counted["moe_ep"].rows <= counted["hf_all_to_all"].rows
    # Over nodes of 2 ranks: one row per (token, other node) and per (token, other rank) both ways.
    row_bytes = 8 * 2
    network = {"moe_ep": 0, "hf_all_to_all": 0, "moe_ep_node": 0}
    for r in range(ep):
        for experts in dispatch.rank_routing(s, "fine-grained", routing, r)[0].tolist():
            away = [e // (64 // ep) for e in experts if e // (64 // ep) // 2 != r // 2]
            network["hf_all_to_all"] += 2 * len(away) * row_bytes
            network["moe_ep"] += 2 * len(set(away)) * row_bytes
            network["moe_ep_node"] += 2 * len({rank // 2 for rank in away}) * row_bytes
    assert {impl: t.network_bytes for impl, t in counted.items()} == (
        network if ep > 2 else {k: v for k, v in network.items() if k != "moe_ep_node"})


def test_routing_cases():
    idx_TK, w_TK = make_routing("skewed", 4000, 8, 2, seed=0)
    assert (idx_TK[:, 0] != idx_TK[:, 1]).all()
    torch.testing.assert_close(w_TK.sum(-1), torch.ones(4000))
    assert 0.3 < max_load_share(idx_TK, 8) < 0.5
    uniform, _ = make_routing("uniform", 4000, 8, 2, seed=0)
    assert max_load_share(uniform, 8) < 0.15
    assert make_routing("uniform", 0, 8, 2)[0].shape == (0, 2)
    with pytest.raises(ValueError, match="routing must be one of .* got 'zipf'"):
        make_routing("zipf", 4, 8, 2)
    with pytest.raises(ValueError, match=r"top_k must be in \[1, num_experts=8\], got 9"):
        make_routing("uniform", 4, 8, 9)


def test_optional_lookups(tmp_path, monkeypatch):
    missing = optional_import("moe_ep.no_such_component")
    assert not missing.available and missing.reason == "not available (moe_ep.no_such_component not found)"
    attr = optional_attr("moe_ep.bench.kernels", "no_such_function")
    assert attr.reason == "not available (moe_ep.bench.kernels.no_such_function not defined)"
    assert optional_attr("moe_ep.bench.kernels", "Problem").value is kernels.Problem
    # A component that exists but needs a package missing from the environment is a real error.
    (tmp_path / "bench_probe_pkg.py").write_text("import bench_probe_missing_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="bench_probe_missing_dependency"):
        optional_import("bench_probe_pkg")
    sys.modules.pop("bench_probe_pkg", None)


def test_argument_errors():
    with pytest.raises(ValueError, match="warmup must be >= 0 and reps >= 1, got warmup=0, reps=0"):
        measure(lambda: None, device=torch.device("cpu"), warmup=0, reps=0)
    with pytest.raises(ValueError, match=r"--ep values must divide the expert count E=8 of mixtral, got \[3\]"):
        main(["dispatch", "--device", "cpu", "--no-timing", "--no-save", "--ep", "2", "3"])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--device must be cpu on a machine without CUDA, got 'cuda'"):
            main(["kernels", "--device", "cuda", "--no-save"])
    with pytest.raises(SystemExit):
        main(["nonsense"])


def test_noisy_timings_get_more_rounds_then_a_warning(monkeypatch):
    from moe_ep.bench import timing

    clock = iter([1.0, 2.0, 2.0] * 100)  # one fast call in three: median 2 s, fastest 1 s
    monkeypatch.setattr(timing, "_time_once", lambda fn, args, device: next(clock))
    with pytest.warns(timing.NoisyTimingWarning, match=r"1 of 1 timing\(s\) noisy after 9 calls "
                      r"\(worst 'the call': median 100% above its fastest call\); other work is using"):
        t = measure(lambda: None, device=torch.device("cpu"), warmup=0, reps=3)
    assert t.reps == 9  # 3 rounds of 3: the first and both extra rounds
    steady = iter([1.0] * 100)
    monkeypatch.setattr(timing, "_time_once", lambda fn, args, device: next(steady))
    assert measure(lambda: None, device=torch.device("cpu"), warmup=0, reps=3).reps == 3
    assert measure(lambda: None, device=torch.device("cpu"), warmup=0, reps=3, extra_rounds=0).reps == 3


def test_tables_fit_120_columns_and_keep_every_value():
    from moe_ep.bench.report import Column, Report, format_table

    columns = [Column("name", "name"), Column("kind", "kind")]
    columns += [Column(f"v{i}", f"value number {i}", "{:.3f}") for i in range(12)] + [Column("status", "status")]
    reason = "not available (transformers has no grouped_mm experts in this version)"
    rows = [dict(name=f"variant-{j}", kind="op", status="ok" if j else reason, **{f"v{i}": i + j / 7 for i in range(12)})
            for j in range(3)]
    report = Report("demo", torch.device("cpu"), columns, rows=rows, notes=["x " * 100])
    text = format_table(report)
    assert max(map(len, text.splitlines())) <= 120
    blocks = text.split("\n\n")
    assert len(blocks) >= 2 and all(b.startswith("     name  kind") for b in blocks)  # the row's name repeats
    for i in range(12):
        assert f"value number {i}" in text and f"{i + 2 / 7:.3f}" in text
    assert "[1]" in text and f"[1] {reason}" in text


def test_a_problem_too_large_for_memory_is_one_line_and_exit_status_1(monkeypatch, capsys):
    """Sizes within the flags' ranges can still exceed the device: the allocator's error (CPU)
    or torch.OutOfMemoryError (CUDA) is said in one line; any other RuntimeError stays a traceback."""
    from moe_ep.bench import cli

    for err in (RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you "
                             "tried to allocate 34359738368 bytes."), torch.OutOfMemoryError("CUDA out of memory.")):
        monkeypatch.setattr(cli, "main", lambda argv, err=err: (_ for _ in ()).throw(err))
        assert cli.console(["kernels"]) == 1
        said = capsys.readouterr().err
        assert said.startswith("python -m moe_ep.bench kernels: error: the problem does not fit in the device's "
                               "memory (") and said.rstrip().endswith("use smaller sizes"), said
    monkeypatch.setattr(cli, "main", lambda argv: (_ for _ in ()).throw(RuntimeError("a kernel failed")))
    with pytest.raises(RuntimeError, match="a kernel failed"):
        cli.console(["kernels"])


def test_results_go_to_a_git_ignored_folder_by_default():
    from moe_ep.bench.cli import default_out_dir

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert str(default_out_dir("kernels", cuda)) == str(default_out_dir("gpu", cpu)) == "bench-results"
    assert str(default_out_dir("gpu", cuda)) == "benchmarks/results"  # the gate's GPU results are committed
    assert "/bench-results/" in open(".gitignore").read().split()


@pytest.mark.parametrize("argv, said", [
    (["kernels", "--reps", "0"], "argument --reps: must be an int >= 1, got '0'"),
    (["kernels", "--hidden", "0"], "argument --hidden: must be an int >= 1, got '0'"),
    (["kernels", "--tokens", "8", "-5"], "argument --tokens: must be an int >= 1, got '-5'"),
    (["dispatch", "--ep", "1"], "argument --ep: must be an int >= 2, got '1'"),
    (["model", "--seq", "1"], "argument --seq: must be an int >= 2, got '1'"),
    (["gpu", "--budget", "nan"], "argument --budget: must be a finite number > 0, got 'nan'"),
    (["attention", "--device", "foo"], "python -m moe_ep.bench attention: error: --device must be cpu or cuda"),
    (["kernels", "--seed", "99999999999999999999"], "argument --seed: must be an int in [0, 4294967295]"),
    (["kernels", "--tokens", "99999999999999999999"], "argument --tokens: must be an int in [1, 2147483647]"),
    (["kernels", "--device", "cpu", "--top-k", "9"], "--top-k must be at most the number of experts (--experts, 8 "
                                                     "here), got 9"),
    (["dispatch", "--device", "cpu", "--ep", "3", "--no-timing"], "--ep values must divide the expert count"),
    (["model", "--device", "cpu", "--compile-blocks", "nosuchbackend"],
     "--compile-blocks must name a torch.compile backend (such as "),
])
def test_a_bad_flag_is_one_line_and_exit_status_2(argv, said, tmp_path, capsys):
    """What ``python -m moe_ep.bench`` runs (``console``), in this process; the module's own entry
    point once, in a subprocess. Refused before anything is made on disk: the out-dir too."""
    from moe_ep.bench.cli import console

    try:
        code = console([*argv, "--out-dir", str(tmp_path / "results" / "today")])
    except SystemExit as exit_:  # argparse's own refusal
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and said in err, err
    assert list(tmp_path.iterdir()) == []
    if argv[0] == "attention":
        proc = subprocess.run([sys.executable, "-m", "moe_ep.bench", *argv, "--out-dir", str(tmp_path)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and said in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_mode_that_times_nothing_offers_no_timing_flags(capsys):
    with pytest.raises(SystemExit):
        main(["planner", "--reps", "3"])
    assert "unrecognized arguments: --reps 3" in capsys.readouterr().err
    assert "warmup" not in vars(build_parser().parse_args(["planner"]))


def test_an_out_dir_it_cannot_write_is_refused_before_the_run(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("the user's")
    with pytest.raises(ValueError, match=r"--out-dir .*a_file cannot hold the results"):
        main(["planner", "--out-dir", str(blocker)])
    assert blocker.read_text() == "the user's"


def test_the_planner_check_runs_on_the_cpu_by_default_on_a_machine_with_a_gpu(monkeypatch):
    from moe_ep.bench.cli import _device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _device(None, "planner") == torch.device("cpu")
    assert _device(None, "kernels") == torch.device("cuda")


def test_a_baseline_that_cannot_take_the_shapes_is_a_row_not_the_end_of_the_run(capsys):
    """transformers' grouped_mm needs 16-byte rows; H=3, I=5 in float32 has none: its row says so
    and every other variant runs (moe_ep's take any row length)."""
    from moe_ep.bench.cli import console

    assert console(["kernels", "--device", "cpu", "--threads", "1", "--tokens", "8", "--hidden", "3",
                    "--intermediate", "5", "--warmup", "0", "--reps", "1", "--routing", "uniform",
                    "--skip-components", "--no-save"]) == 0
    out = capsys.readouterr().out
    assert "not available: raised RuntimeError" in out


def _save_many(tag: str, out_dir: str, start, saved) -> None:
    from moe_ep.bench.report import Column, Report, save

    start.wait()
    for i in range(40):
        report = Report("kernels", torch.device("cpu"), [Column("x", "x", "{}")], rows=[{"who": tag, "i": i}])
        saved.put([p.name for p in save(report, pathlib.Path(out_dir))])


def test_runs_saving_at_the_same_moment_each_keep_their_own_results(tmp_path):
    """Two processes save 40 reports each into one folder at once: 80 names, each JSON with its
    own CSV; a link lying under the first name is neither followed nor replaced."""
    import multiprocessing

    (tmp_path / f"{results_stem(Report('kernels', torch.device('cpu'), []))}.json").symlink_to(tmp_path / "gone")
    ctx = multiprocessing.get_context("fork")
    start, saved = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_save_many, args=(tag, str(tmp_path), start, saved)) for tag in "AB"]
    for p in procs:
        p.start()
    names = [name for _ in range(80) for name in saved.get(timeout=120)]
    for p in procs:
        p.join(timeout=60)
    jsons = sorted(tmp_path.glob("*.json"))
    assert len([n for n in names if n.endswith(".json")]) == len(set(names) & {p.name for p in jsons}) == 80
    for path in jsons:
        if path.is_symlink():
            assert not path.exists()  # the link, untouched
            continue
        row = json.loads(path.read_text())["rows"][0]
        assert path.with_suffix(".csv").read_text().splitlines()[1] == f"{row['who']},{row['i']}"
    assert not list(tmp_path.glob(".tmp-*"))


def test_a_second_run_of_the_day_never_writes_over_the_first(tmp_path):
    from moe_ep.bench.report import Column, Report, save

    def report(value):
        r = Report("kernels", torch.device("cpu"), [Column("x", "x", "{:.1f}")])
        r.rows = [{"x": value}]
        return r

    first = save(report(1.0), tmp_path)
    second = save(report(float("nan")), tmp_path)
    assert [p.name for p in first] != [p.name for p in second] and all(p.stem.endswith("-2") for p in second)
    assert json.loads(first[0].read_text())["rows"] == [{"x": 1.0}]
    assert json.loads(second[0].read_text())["rows"] == [{"x": None}]  # strict JSON: no NaN


def test_relative_error_in_chunks_equals_the_whole_float64_norm():
    """The kernel benchmark's error check sums float64 squares over row chunks (a whole float64
    copy of DeepSeek-V3's weight gradient would not fit): the same number as the direct formula,
    for chunks that split rows unevenly, and the absolute error where the reference is zero."""
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(7, 5, 3, generator=g).to(torch.bfloat16)
    out = (ref.double() + 1e-2 * torch.randn(7, 5, 3, generator=g, dtype=torch.float64)).to(torch.bfloat16)
    direct = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    for chunk in (1, 15, 16, 1 << 26):
        assert kernels.relative_error(out, ref, chunk_elems=chunk) == pytest.approx(direct, rel=1e-12)
    zero = torch.zeros(4, 2)
    assert kernels.relative_error(zero + 3.0, zero, chunk_elems=3) == pytest.approx(3.0 * 8**0.5)


def test_model_mode_times_compiled_dense_blocks_last(tmp_path):
    """--compile-blocks (aot_eager here: inductor's C++ build takes minutes on the CPU) adds the
    patched model with its dense blocks compiled, on the eager model's loss."""
    main(["model", "--device", "cpu", "--models", "tiny-mixtral", "--seq", "8", "--batch", "1",
          "--compile-blocks", "aot_eager", "--out-dir", str(tmp_path), *TINY])
    rows = {r["variant"]: r for r in written(tmp_path, "model")["rows"]}
    assert list(rows) == list(model_bench.VARIANTS)
    compiled = rows["moe_ep+fused_router+compiled_blocks"]
    assert compiled["status"] == "ok" and compiled["tokens_per_s"] > 0
    assert compiled["loss_diff"] <= 1e-5 * abs(rows["eager"]["loss"])


def test_dispatch_mode_on_one_gpu_shares_it_and_names_the_local_kernels(monkeypatch, tmp_path):
    """With fewer GPUs than ranks the ranks share cuda:0 over gloo, transformers' exchange is not
    run, and each row carries the slowest rank's local GPU time with rank 0's longest kernels in a
    note (the ranks' results mocked: no GPU here)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert dispatch.pick_backend(torch.device("cuda"), 1)[0] == "nccl"
    backend, note = dispatch.pick_backend(torch.device("cuda"), 2)
    assert backend == dispatch.SHARED_GPU and "share cuda:0 over gloo" in note
    seen = []

    def ranks(s, ep, backend_):
        seen.append(backend_)
        return [dict(model="mixtral", routing="uniform", impl="hf_all_to_all", status="not run: ..."),
                dict(model="mixtral", routing="uniform", impl="moe_ep", measured_bytes=1.0, max_abs_err=0.0,
                     ms_fwd=1.0, ms_fwd_bwd=2.0, local_gpu_ms=0.5, status="ok",
                     local_kernels=[["index_select_kernel", 4, 0.25], ["scatter_add_kernel", 2, 0.125]])]

    monkeypatch.setattr(dispatch, "run_ranks", ranks)
    monkeypatch.setattr(dispatch, "pick_backend", lambda device, ep: (backend, note))
    main(["dispatch", "--device", "cpu", "--ep", "2", "--models", "mixtral", "--tokens", "16", "--hidden", "8",
          "--out-dir", str(tmp_path)])
    report = written(tmp_path, "dispatch")
    assert seen == [dispatch.SHARED_GPU]
    ours = next(r for r in report["rows"] if r["impl"] == "moe_ep")
    assert ours["local_gpu_ms"] == 0.5 and ours["backend"] == dispatch.SHARED_GPU
    assert any(n.startswith("local GPU kernels, mixtral ep=2 uniform moe_ep, rank 0's longest: index_select_kernel x4 "
                            "0.250 ms; scatter_add_kernel x2 0.125 ms") for n in report["notes"]), report["notes"]
