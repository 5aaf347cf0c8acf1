"""The path selector of moe_experts (``backend="auto"``): one decision per problem, made at its
first call with one collective, the same on every rank whatever token counts they see; then only
lookups (no timing, no collective); pinning; MOE_EP_AUTOTUNE=0; and the disk cache, whose damaged
files are reported and left alone. On the CPU the Triton path runs under the interpreter."""

import json
import os

import pytest
import torch
import torch.distributed as dist

from moe_ep.ops import selector
from moe_ep.ops.experts import moe_experts
from moe_ep.kernels import autotune
from moe_ep.kernels import grouped_gemm as gg
from moe_ep.kernels.autotune import Config
from moe_ep.kernels.runtime import interpreting
from moe_ep.ops.reference import moe_experts_ref

from numerics import TOLERANCE, rel_err
from dist_utils import run_ranks
from moe_cases import Case, run_with_grads

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tier: the Triton path under the interpreter")

H, I, E, K = 16, 24, 4, 2
TWO = [Config(32, 16, 16, 4, 2), Config(64, 32, 16, 4, 2)]


def two_config_space():
    """Two configurations per kernel, so that configurations are timed and agreed too."""
    space = {"half": TWO, "fp32": TWO, "half_unaligned": TWO, "fp32_unaligned": TWO}
    return {k: space for k in gg.GEMM_KERNELS}


@pytest.fixture(autouse=True)
def fresh(tmp_path, monkeypatch):
    monkeypatch.setenv(selector.CACHE_ENV_VAR, str(tmp_path / "cache"))
    monkeypatch.setitem(gg.CONFIGS, "default", two_config_space())
    selector.clear()
    selector._DAMAGED.clear()
    selector._WARNED.clear()
    yield
    selector.clear()


def run(T, activation="silu", backend="auto", group=None, seed=0):
    x, idx, w, gate_up, down = Case("c", T=T, H=H, I=I, E=E, K=K).make(torch.float32, seed=seed)
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    out = run_with_grads(lambda *a: moe_experts(*a, activation=activation, backend=backend, group=group),
                         x, idx, w, gate_up, down, dy)
    ref = run_with_grads(lambda *a: moe_experts_ref(*a, activation=activation), x, idx, w, gate_up, down, dy)
    for got, want in zip([out[0], *out[1]], [ref[0], *ref[1]]):
        assert rel_err(got, want) <= TOLERANCE[torch.float32]
    return out


def mocked_config_times(monkeypatch):
    """The kernels' configurations timed by mocked figures, the larger tile faster, none launched to
    be timed (under the interpreter the host clock's figures mean nothing; the tiles still run where
    they are kept): for tests whose point is what is done with the decisions. The paths are still
    run and timed. test_first_call_decides_later_calls_look_up and the ranks' test time them for real."""
    monkeypatch.setattr(autotune, "_time", lambda launch, device: 1.0 if launch.__defaults__[0] == TWO[1] else 2.0)


def mocked_measure(monkeypatch):
    """A problem's measurement by mocked figures, nothing run (the grouped-GEMM path faster): for
    the tests of the disk cache, whose point is what is done with a decision, not how it is made."""
    monkeypatch.setattr(selector, "_measure", lambda problem, inputs, measure_torch: {
        "paths": {"triton": 2.0, "torch": 1.0}, "configs": {}})


class Counter:
    """Counts calls of a module attribute, still calling it."""

    def __init__(self, monkeypatch, owner, name):
        self.calls = 0
        inner = getattr(owner, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return inner(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)


@pytest.mark.slow
def test_first_call_decides_later_calls_look_up(monkeypatch):
    measured = Counter(monkeypatch, selector, "_measure")
    run(40)
    (problem, table), = selector.decisions().items()
    assert problem == selector.Problem("interpreter", torch.float32, H, I, E, K, "silu", "auto")
    assert list(table.paths) == [128] and set(table.times[128]) == {"triton", "torch"}
    assert table.paths[128] == min(table.times[128], key=table.times[128].get)
    assert {c[0] for c in table.configs} == {"gather_glu", "rows_matmul", "glu_backward", "weight_grad"}
    for T in (3, 40, 100):  # other buckets: the nearest measured one, no measurement
        run(T)
    assert measured.calls == 1 and len(selector.decisions()) == 1
    run(40, activation="gelu")  # another problem
    assert measured.calls == 2 and len(selector.decisions()) == 2


def test_merge_is_the_same_from_the_same_contributions():
    def measured(bucket, triton, torch_, best):
        launch = ("gather_glu", (16, 24, 4, False, 64, 8), bucket)
        return {"measured": {bucket: {"paths": {"triton": triton, "torch": torch_},
                                      "configs": {launch: {"a": best, "b": 1.0}}}}}

    everyone = [{}, measured(128, 1.0, 2.0, 0.5), measured(128, 2.0, 0.5, 2.0), measured(1024, 1.0, None, 0.1)]
    table = selector._merge(everyone)
    # Summed over ranks: triton 3.0 < torch 2.5? no: torch 2.5 wins at 128; torch failed at 1024.
    assert table.paths == {128: "torch", 1024: "triton"}
    assert dict(((k, b), n) for k, _, b, n in table.configs) == {("gather_glu", 128): "b", ("gather_glu", 1024): "a"}
    assert table.path(16, "triton") == "torch" and table.path(8192, "torch") == "triton"
    assert table.path(362, "x") == "torch"  # 362 is nearer 128 than 1024 in powers of two
    cached = selector.Table({128: "triton"}, {128: {"triton": 1.0}}, ())
    assert selector._merge([{}, {"cached": cached.to_json()}, *everyone[1:]]).paths == {128: "triton", 1024: "triton"}
    assert selector._merge(everyone) == table


@pytest.mark.slow
def test_pinned_backends(monkeypatch):
    mocked_config_times(monkeypatch)
    measured = Counter(monkeypatch, selector, "_measure")
    run(40, backend="torch")
    assert measured.calls == 0 and selector.decisions() == {}
    monkeypatch.setenv("MOE_EP_BACKEND", "torch")
    run(40, backend=None)
    assert measured.calls == 0
    run(40, backend="triton")  # configurations are still tuned; the grouped-GEMM path is not timed
    (problem, table), = selector.decisions().items()
    assert measured.calls == 1 and set(table.times[128]) == {"triton"} and table.configs
    assert problem.paths == "triton"
    run(40, backend="auto")  # comparing the paths is a decision of its own
    assert measured.calls == 2 and len(selector.decisions()) == 2


@pytest.mark.slow
def test_the_first_call_under_saved_tensor_hooks_and_checkpointing(monkeypatch):
    """The measurement's graph is its own: a hook around the first call sees what the op saves and
    nothing more, and a checkpointed first call recomputes and differentiates correctly."""
    mocked_config_times(monkeypatch)
    x, idx, w, gate_up, down = Case("c", T=40, H=H, I=I, E=E, K=K).make(torch.float32)

    def saved_by_one_call():
        packed = []
        leaves = [t.detach().requires_grad_() for t in (x, w, gate_up, down)]
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
            moe_experts(leaves[0], idx, leaves[1], leaves[2], leaves[3], backend="auto")
        return len(packed)

    first = saved_by_one_call()
    assert len(selector.decisions()) == 1 and first == saved_by_one_call()
    selector.clear()
    leaves = [t.detach().requires_grad_() for t in (x, w, gate_up, down)]
    y = torch.utils.checkpoint.checkpoint(
        lambda a, b, c, d: moe_experts(a, idx, b, c, d, backend="auto"), *leaves, use_reentrant=False)
    grads = torch.autograd.grad(y, leaves, torch.ones_like(y))
    ref = [t.detach().double().requires_grad_() for t in (x, w, gate_up, down)]
    y_ref = moe_experts_ref(ref[0], idx, *ref[1:])
    grads_ref = torch.autograd.grad(y_ref, ref, torch.ones_like(y_ref))
    assert len(selector.decisions()) == 1
    for got, want in zip([y, *grads], [y_ref, *grads_ref]):
        assert rel_err(got.detach(), want) <= TOLERANCE[torch.float32]


def test_inference_mode_measures_nothing(monkeypatch):
    measured = Counter(monkeypatch, selector, "_measure")
    x, idx, w, gate_up, down = Case("c", T=40, H=H, I=I, E=E, K=K).make(torch.float32)
    with torch.inference_mode():
        y = moe_experts(x, idx, w, gate_up, down, backend="auto")
    assert measured.calls == 0 and selector.decisions() == {}
    assert rel_err(y, moe_experts_ref(x, idx, w, gate_up, down)) <= TOLERANCE[torch.float32]


@pytest.mark.slow
def test_autotune_off_uses_the_defaults_and_writes_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv(autotune.ENV_VAR, "0")
    measured = Counter(monkeypatch, selector, "_measure")
    run(40)
    assert measured.calls == 0 and selector.decisions() == {} and autotune.agreed_configs() == {}
    assert all(str(c) == str(TWO[0]) for c in autotune.chosen_configs().values())
    assert not (tmp_path / "cache").exists()


@pytest.mark.slow
def test_disk_cache_is_written_and_read_back(monkeypatch):
    mocked_config_times(monkeypatch)
    run(40)
    decided = selector.decisions()
    path = selector.cache_file(torch.device("cpu"))
    data = json.loads(path.read_text())
    assert data["format"] == selector.CACHE_FORMAT and data["sha256"] == selector._checksum(data["families"])
    # No temporary file left behind; the lock file of its saves stays.
    assert sorted(p.name for p in path.parent.iterdir()) == [f".{path.name}.lock", path.name]
    selector.clear()
    measured = Counter(monkeypatch, selector, "_measure")
    run(40)
    assert measured.calls == 0 and selector.decisions() == decided


def _save_one_problem(cache_dir: str, i: int, start) -> None:
    os.environ[selector.CACHE_ENV_VAR] = cache_dir
    problem = selector.Problem("sm_90", torch.bfloat16, 1024 + 64 * i, 512, 8, 2, "silu")
    table = selector.Table({128: "triton"}, {128: {"triton": 1.0, "torch": 2.0}}, ())
    start.wait()
    selector._cache_save(problem, table, torch.device("cpu"))


def test_processes_saving_at_once_keep_every_problem(tmp_path):
    """The ranks of a node or several jobs saving their problems at once: each read, merge and
    rename is done under the cache's lock, so none drops another's (the last rename won: 3
    processes lost 69 entries of 120). The processes come from dist_utils' forkserver (torch and
    moe_ep imported once), not each a fresh interpreter importing them."""
    from dist_utils import _mp_context

    ctx = _mp_context()
    for trial in range(3):
        cache_dir = tmp_path / f"cache{trial}"
        start = ctx.Barrier(3)
        procs = [ctx.Process(target=_save_one_problem, args=(str(cache_dir), i, start)) for i in range(3)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0, 0, 0]
        (cache,) = cache_dir.glob("*.json")
        assert len(json.loads(cache.read_text())["families"]) == 3, trial


def test_a_lock_held_too_long_gives_up_the_save_not_the_run(monkeypatch, tmp_path):
    """Another process that keeps the cache's lock (stopped, or on a hung network file system):
    the save waits LOCK_TIMEOUT_S, warns and leaves the file as it was, instead of stalling this
    rank while the others go on; once the lock is free, saves work again."""
    import subprocess
    import sys

    monkeypatch.setattr(selector, "LOCK_TIMEOUT_S", 0.3)
    problem = selector.Problem("sm_90", torch.bfloat16, 1024, 512, 8, 2, "silu")
    table = selector.Table({128: "triton"}, {128: {"triton": 1.0, "torch": 2.0}}, ())
    path = selector.cache_file(torch.device("cpu"))
    path.parent.mkdir(parents=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
         "fcntl.lockf(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)",
         str(path.with_name(f".{path.name}.lock"))], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.warns(RuntimeWarning, match=r"could not write the selector cache .*held by another process"):
            selector._cache_save(problem, table, torch.device("cpu"))
        assert not path.exists()
    finally:
        holder.kill()
        holder.wait()
    selector._cache_save(problem, table, torch.device("cpu"))
    assert list(json.loads(path.read_text())["families"]) == [problem.name()]


@pytest.mark.slow
def test_a_damaged_cache_is_reported_and_left_alone(monkeypatch):
    """A truncated, a flipped and a foreign cache file, one written for another GPU and one whose
    checksum holds over a bucket of 0 tokens (every call divided by its logarithm), in turn: each is
    reported, not loaded (the decision is measured again) and not overwritten by a new decision."""
    mocked_measure(monkeypatch)
    run(40)
    path = selector.cache_file(torch.device("cpu"))
    intact = path.read_text()
    measured = Counter(monkeypatch, selector, "_measure")

    def rewritten(change):
        data = json.loads(intact)
        change(data)
        return json.dumps({**data, "sha256": selector._checksum(data["families"])})

    def bucket_zero(data):
        entry = next(iter(data["families"].values()))
        entry["paths"] = {"0": p for p in entry["paths"].values()}

    for damage in ("truncated", "flipped", "foreign", "another_gpu", "bucket_zero"):
        text = {"truncated": lambda: intact[: len(intact) // 2],
                "flipped": lambda: intact.replace('"triton"', '"torch"', 1) if '"triton"' in intact
                else intact.replace('"torch"', '"triton"', 1),
                "foreign": lambda: json.dumps({"someone": "else's file"}),
                "another_gpu": lambda: rewritten(lambda data: data.update(device="selector-nvidia-a100")),
                "bucket_zero": lambda: rewritten(bucket_zero)}[damage]()
        path.write_text(text)
        selector.clear()
        selector._DAMAGED.clear()
        before = measured.calls
        with pytest.warns(RuntimeWarning, match="ignoring the damaged selector cache .* neither loaded nor overwritten"):
            run(40, activation=("silu", "gelu")[damage == "flipped"])
        assert measured.calls == before + 1, damage  # not loaded: measured again
        assert path.read_text() == text, damage  # the new decision is not saved over the damaged file


def test_without_a_home_directory_the_decisions_stay_in_memory(monkeypatch):
    """A container's user without a home directory, and no cache folder named: warned once, the
    problem decided all the same (Path.home() raised out of the op's first call)."""
    from pathlib import Path

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    mocked_measure(monkeypatch)
    for name in (selector.CACHE_ENV_VAR, "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    with pytest.warns(RuntimeWarning, match=f"no selector cache .*; set {selector.CACHE_ENV_VAR}"):
        run(40)
    assert len(selector.decisions()) == 1


@pytest.mark.slow
def test_an_unwritable_cache_warns_and_keeps_the_decision(monkeypatch, tmp_path):
    mocked_measure(monkeypatch)
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the cache folder would go")
    monkeypatch.setenv(selector.CACHE_ENV_VAR, str(blocker / "cache"))
    with pytest.warns(RuntimeWarning, match="could not write the selector cache"):
        run(40)
    assert len(selector.decisions()) == 1 and blocker.read_text().startswith("a file")


# ----------------------------------------------------------------------------------------------
# Several ranks


# Tokens per rank and step: rank 0 has none at the first call, ranks 1 and 2 measure buckets 64 and
# 256, and later steps meet buckets nobody measured (16, 128). At most 100 tokens (about 50 slots per
# expert), so that each expert's rows fit one 64-row block: the interpreter's time grows with blocks.
STEPS = {0: [0, 50, 7], 1: [24, 3, 90], 2: [100, 0, 40]}
PROBE = [16 << i for i in range(10)]


def _ranks(rank, world_size, cache_root):
    import moe_ep.kernels.grouped_gemm as gg_
    from moe_ep.ops import selector as sel

    assert interpreting()
    os.environ[sel.CACHE_ENV_VAR] = os.path.join(cache_root, f"node{rank}")  # one cache per "node"
    gg_.CONFIGS["default"] = two_config_space()
    sel.clear()
    counts = {"all_gather_object": 0, "_measure": 0, "timed": 0}

    def count(owner, name, key):
        inner = getattr(owner, name)

        def counted(*args, **kwargs):
            counts[key] += 1
            return inner(*args, **kwargs)

        setattr(owner, name, counted)

    count(dist, "all_gather_object", "all_gather_object")
    count(sel, "_measure", "_measure")
    count(autotune, "_time", "timed")
    after_first = {}
    group = dist.group.WORLD
    for step, T in enumerate(STEPS[rank]):
        for layer, activation in enumerate(("silu", "gelu")):  # two problems, like two layer types
            run(T, activation=activation, group=group, seed=10 * rank + step)
        # The layer's own collectives (the expert all-to-all) on every rank after each step.
        dist.all_reduce(torch.ones(1), group=group)
        if step == 0:
            after_first = dict(counts)
    tables = {p.name(): t.to_json() for p, t in sel.decisions().items()}
    probes = {p.name(): [t.path(b, "default") for b in PROBE] for p, t in sel.decisions().items()}
    agreed = sorted((k[0], repr(k[1]), k[4], n) for k, n in autotune.agreed_configs().items())
    return dict(tables=tables, probes=probes, agreed=agreed, counts=counts, after_first=after_first)


@pytest.mark.slow
def test_ranks_with_different_token_counts_make_one_choice_per_key(tmp_path):
    results = run_ranks(_ranks, 3, str(tmp_path), timeout=600, pg_timeout=300)
    first = results[0]
    assert len(first["tables"]) == 2
    for r in results[1:]:
        assert r["tables"] == first["tables"] and r["probes"] == first["probes"] and r["agreed"] == first["agreed"]
    # Each rank measured its own first bucket (rank 0 had no tokens); the table holds all three.
    for problem in first["tables"].values():
        assert sorted(map(int, problem["paths"])) == sorted({autotune.token_bucket(K * STEPS[r][0]) for r in (1, 2)})
    for rank, r in enumerate(results):
        # One collective and one measurement per problem, all at the first step; afterwards new
        # buckets on every rank cost no collective, no measurement and no timed launch.
        assert r["counts"] == r["after_first"], rank
        assert r["counts"]["all_gather_object"] == 2
        assert r["counts"]["_measure"] == (0 if STEPS[rank][0] == 0 else 2)
    # A second job finds every rank's cache: nothing measured, the same decisions.
    again = run_ranks(_ranks, 3, str(tmp_path), timeout=600, pg_timeout=300)
    for r in again:
        assert r["counts"]["_measure"] == 0 and r["counts"]["timed"] == 0 and r["counts"]["all_gather_object"] == 2
        assert r["tables"] == first["tables"] and r["agreed"] == first["agreed"]


def test_merge_drops_the_library_stages_where_the_whole_op_summed_faster_without_them():
    """Rank 0's stages chose the library and it timed the op again without it (triton_fused); rank
    1 chose Triton kernels everywhere, so its one time counts for both. Summed, the op without the
    library wins at bucket 128 (its launches fall back to their best Triton configuration) and
    loses at 1024 (the library's stages stay)."""
    launch = ("glu_backward", (16, 24, 4, False, 64, 8))

    def measured(bucket, triton, fused, library, best_triton):
        paths = {"triton": triton} if fused is None else {"triton": triton, selector.TRITON_FUSED: fused}
        return {bucket: {"paths": paths, "configs": {(*launch, bucket): {"grouped_mm": library, "a": best_triton,
                                                                          "b": 9.0}}}}

    rank0 = {"measured": {**measured(128, 1.0, 0.8, 0.1, 0.3), **measured(1024, 1.0, 1.5, 0.1, 0.3)}}
    rank1 = {"measured": {**measured(128, 1.0, None, 0.3, 0.2), **measured(1024, 1.0, None, 0.3, 0.2)}}
    table = selector._merge([rank0, rank1])
    assert dict(((k, b), n) for k, _, b, n in table.configs) == {("glu_backward", 128): "a",
                                                                  ("glu_backward", 1024): "grouped_mm"}
    assert table.paths == {128: "triton", 1024: "triton"}
    assert table.times[128] == {"triton": 2.0, selector.TRITON_FUSED: 1.8}
    assert selector.Table.from_json(json.loads(json.dumps(table.to_json()))) == table


def test_the_library_stages_dropped_under_expert_parallelism_are_those_the_path_was_timed_with():
    """Under expert parallelism a launch's bucket counts its kernel's slots (received rows x local
    columns), not the routed pairs the path is bucketed by: the launches timed with a path that
    ran faster without the library drop it all the same."""
    path_bucket, launch = 2048, ("rows_matmul", (4096, 14336, 8, "nk", True, 128, 8), 8192)
    measured = {path_bucket: {"paths": {"triton": 10.0, selector.TRITON_FUSED: 9.0, "torch": 12.0},
                              "configs": {launch: {"grouped_mm": 1.0, "m128n256k64w8s4_tma_persistent": 1.2}}}}
    table = selector._merge([{"measured": measured}])
    assert table.paths == {path_bucket: "triton"} and [c[-1] for c in table.configs] == ["m128n256k64w8s4_tma_persistent"]
