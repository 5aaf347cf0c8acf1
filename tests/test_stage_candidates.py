"""PyTorch's grouped GEMM as a candidate of every GEMM stage of the Triton path (gate/up and down
forward, dH, dx and the two weight gradients; the fused stages completed by element-wise passes):
offered only where it is sync-free (never on sm_80, never in float32 on a GPU), exact when chosen
for any one stage or all of them, and chosen per stage by the same timing, agreement and cache as
the Triton configurations; the selector never times the grouped-GEMM path where it would sync,
and pinning that path there warns. On the CPU the Triton kernels run under the interpreter and the
architecture is mocked."""

import warnings

import pytest
import torch

from moe_ep.bench.kernels import chosen_config_notes, decision_notes
from moe_ep.kernels import autotune
from moe_ep.kernels import grouped_gemm as gg
from moe_ep.kernels.grouped_gemm import GEMM_KERNELS
from moe_ep.kernels.library import GROUPED_MM, Library, grouped_mm_sync_free
from moe_ep.ops import experts, selector
from moe_ep.ops.experts import moe_experts
from moe_ep.ops.reference import moe_experts_ref

from numerics import TOLERANCE, rel_err
from moe_cases import CASES, Case, run_with_grads

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tier: the Triton path under the interpreter")

GRAD_NAMES = ["hidden_states", "top_k_weights", "gate_up_proj", "down_proj"]
HARD = [c for c in CASES if c.name in ("empty_expert", "one_expert", "k_eq_e", "k1", "fine_grained")]


@pytest.fixture(autouse=True)
def fresh(tmp_path, monkeypatch):
    monkeypatch.setenv(selector.CACHE_ENV_VAR, str(tmp_path / "cache"))
    selector.clear()
    yield
    selector.clear()


def test_grouped_mm_is_sync_free_only_on_hopper_and_blackwell_in_half_types():
    for arch in ("sm_90", "sm_100"):
        assert grouped_mm_sync_free(arch, torch.bfloat16) and grouped_mm_sync_free(arch, torch.float16)
        assert not grouped_mm_sync_free(arch, torch.float32)
    for arch in ("sm_80", "sm_86", "sm_89", "sm_120"):
        assert not any(grouped_mm_sync_free(arch, d) for d in (torch.bfloat16, torch.float16, torch.float32))
    assert grouped_mm_sync_free("interpreter", torch.float32)


def offered(monkeypatch, arch: str, dtype: torch.dtype) -> dict:
    """The candidates each launch of one Triton forward and backward is offered on ``arch``. The
    launchers make the candidate list whether or not a session times it: with timing off the op
    runs once (the interpreter would otherwise run every configuration of ``arch``'s space, then
    the whole op twice more, only to time them)."""
    monkeypatch.setattr(autotune, "device_arch", lambda device: arch)
    monkeypatch.setenv(autotune.ENV_VAR, "0")
    seen = {}
    choose = autotune.choose

    def spy(kernel, configs, **kw):
        seen.setdefault((kernel, kw["shapes"]), list(configs))
        return choose(kernel, configs, **kw)

    monkeypatch.setattr(autotune, "choose", spy)
    x, idx, w, gate_up, down = Case("c", T=6, H=16, I=8, E=2, K=2).make(dtype)
    dy = torch.ones(6, 16, dtype=torch.float64)
    run_with_grads(lambda *a: moe_experts(*a, backend="triton"), x, idx, w, gate_up, down, dy)
    return seen


@pytest.mark.parametrize("arch,dtype,expected", [("sm_80", torch.bfloat16, False), ("sm_90", torch.float32, False),
                                                 ("interpreter", torch.bfloat16, False),
                                                 ("sm_90", torch.bfloat16, True)], ids=str)
def test_the_candidate_is_offered_only_where_it_is_sync_free(monkeypatch, arch, dtype, expected):
    seen = offered(monkeypatch, arch, dtype)
    with_library = {key for key, configs in seen.items() if GROUPED_MM in configs}
    assert len(seen) == 6  # gate/up and down forward, dH, dx, d down, d gate_up
    assert with_library == (set(seen) if expected else set()), (arch, dtype, sorted(seen))


def test_the_kernel_benchmark_names_each_stage_choice(monkeypatch):
    """What the GPU gate prints after its timings: one line per GEMM stage launched, with its choice."""
    offered(monkeypatch, "sm_90", torch.bfloat16)
    notes = chosen_config_notes()
    assert {n.split()[1] for n in notes} == set(GEMM_KERNELS) and len(notes) >= 6, notes


# Every hard case in bf16; float16, whose path differs only by the dtype it hands grouped_mm, on
# the two cases where a group is empty or holds one slot per token (the interpreter runs sm_90's
# whole configuration space: seconds per case).
GROUPED_MM_CASES = [(c, torch.bfloat16) for c in HARD] + [
    (c, torch.float16) for c in HARD if c.name in ("empty_expert", "k1")]


@pytest.mark.slow
@pytest.mark.parametrize("case,dtype", GROUPED_MM_CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_stages_on_grouped_mm_match_float64_and_repeat_bitwise(monkeypatch, case, dtype):
    """A tuning session on an (emulated) H100 that times PyTorch's grouped GEMM fastest, stage by
    stage and in the whole op, puts every stage on it: the results still match the float64
    reference, and a second run gives the same bits. The session is offered sm_90's own
    configuration space; the mocked timings launch the library's candidates (so timed launches
    still run before the kept one) but not the Triton ones, whose results nothing reads and which
    the interpreter runs for seconds at sm_90's tiles, nor the whole op again."""
    monkeypatch.setattr(autotune, "device_arch", lambda device: "sm_90")
    library_calls = []
    library = gg.grouped_mm
    monkeypatch.setattr(gg, "grouped_mm", lambda *a, **k: library_calls.append(1) or library(*a, **k))

    def timed(launch, device):  # autotune.choose times `lambda c=c: launch(c)`
        if not isinstance(launch.__defaults__[0], Library):
            return 1.0
        before = len(library_calls)
        launch()
        assert len(library_calls) > before  # the candidate is PyTorch's grouped GEMM
        return 0.0

    monkeypatch.setattr(autotune, "_time", timed)

    def whole_op(fn, device, warmup):  # and the whole op too, against every stage on Triton
        session = autotune._SESSION  # None when the grouped-GEMM path is timed
        return 0.0 if session is not None and str(GROUPED_MM) in session.fastest.values() else 1.0

    monkeypatch.setattr(selector, "_timed", whole_op)

    def run():
        x, idx, w, gate_up, down = case.make(dtype)
        dy = torch.randn(case.T, case.H, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        return run_with_grads(lambda *a: moe_experts(*a, backend="auto"), x, idx, w, gate_up, down, dy), \
            run_with_grads(moe_experts_ref, x, idx, w, gate_up, down, dy)

    (y, grads), (y_ref, grads_ref) = run()
    assert rel_err(y, y_ref) <= TOLERANCE[dtype]
    for name, g, g_ref in zip(GRAD_NAMES, grads, grads_ref):
        assert rel_err(g, g_ref) <= TOLERANCE[dtype], name
    if case.T:
        chosen = {key[0]: c for key, c in autotune.chosen_configs().items() if isinstance(c, Library)}
        assert set(chosen) == set(GEMM_KERNELS), autotune.chosen_configs()
        table = next(iter(selector.decisions().values()))
        assert {(k, n) for k, _, _, n in table.configs if n == str(GROUPED_MM)} == {
            (k, "grouped_mm") for k in GEMM_KERNELS}
    (y2, grads2), _ = run()  # a lookup now: the same stages, the same bits
    assert torch.equal(y, y2) and all(torch.equal(a, b) for a, b in zip(grads, grads2))


# The six GEMM stages, told apart by their launches' (kernel, shapes) as ``grouped_gemm._tuned``
# keys them; the two weight gradients by their [F, D] ([H, I] for d down), so H != 2I below.
STAGE_NAMES = ("gate_up_fwd", "down_fwd", "dh", "dx", "dw_down", "dw_gate_up")


def _stage_of(kernel: str, shapes: tuple, case: Case) -> str:
    if kernel == "weight_grad":
        return "dw_down" if shapes[:2] == (case.H, case.I) else "dw_gate_up"
    if kernel == "rows_matmul":
        return "down_fwd" if shapes[3] == "nk" else "dx"
    return {"gather_glu": "gate_up_fwd", "glu_backward": "dh"}[kernel]


# The activation enters the two stages whose element-wise pass it is (the forward GLU, dH):
# every stage with SiLU, those two with GELU as well.
ONE_STAGE_CASES = [(stage, "silu") for stage in STAGE_NAMES] + [(stage, "gelu") for stage in ("gate_up_fwd", "dh")]


@pytest.mark.slow
@pytest.mark.parametrize("stage,activation", ONE_STAGE_CASES)
def test_any_one_stage_on_grouped_mm_matches_float64(monkeypatch, stage, activation):
    """One stage on PyTorch's grouped GEMM (its element-wise pass where the stage is fused), the
    other five on their Triton kernels: the output and the four gradients still match the float64
    reference, with an empty expert and 2I != H. With timing off the op runs once, each Triton
    stage on the first of sm_90's configurations it is offered (timing them under the interpreter
    would run every one of them, then the whole op again, and choose one by the host clock)."""
    case = Case("one_stage", T=23, H=16, I=24, E=6, K=2, routing="skip_last")
    monkeypatch.setattr(autotune, "device_arch", lambda device: "sm_90")
    monkeypatch.setenv(autotune.ENV_VAR, "0")
    choose = autotune.choose
    stages = []

    def pinned(kernel, configs, **kw):
        on_library = _stage_of(kernel, kw["shapes"], case) == stage
        stages.append((_stage_of(kernel, kw["shapes"], case), on_library))
        kept = [c for c in configs if isinstance(c, Library) == on_library]
        return choose(kernel, kept, **kw)

    monkeypatch.setattr(autotune, "choose", pinned)
    x, idx, w, gate_up, down = case.make(torch.bfloat16)
    dy = torch.randn(case.T, case.H, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y, grads = run_with_grads(lambda *a: moe_experts(*a, activation=activation, backend="triton"),
                              x, idx, w, gate_up, down, dy)
    y_ref, grads_ref = run_with_grads(lambda *a: moe_experts_ref(*a, activation=activation),
                                      x, idx, w, gate_up, down, dy)
    assert set(stages) == {(s, s == stage) for s in STAGE_NAMES}
    assert rel_err(y, y_ref) <= TOLERANCE[torch.bfloat16]
    for name, g, g_ref in zip(GRAD_NAMES, grads, grads_ref):
        assert rel_err(g, g_ref) <= TOLERANCE[torch.bfloat16], name


@pytest.mark.parametrize("arch,dtype,timed", [("sm_80", torch.bfloat16, False), ("sm_90", torch.float32, False),
                                              ("sm_90", torch.bfloat16, True)], ids=str)
def test_auto_times_the_grouped_mm_path_only_where_it_is_sync_free(monkeypatch, arch, dtype, timed):
    """On an A100 the selector never runs the host-syncing grouped-GEMM path, not even to time it on
    the first call: the decision is driven by the (mocked) architecture alone. The selector measures
    the paths for real; each kernel's configurations get mocked times, not launched (under the
    interpreter that would run the whole of ``arch``'s space at its tiles for host-clock figures)."""
    monkeypatch.setattr(autotune, "device_arch", lambda device: arch)
    monkeypatch.setattr(autotune, "_time", lambda launch, device: 1.0)
    calls = []
    measure = selector._measure
    monkeypatch.setattr(selector, "_measure", lambda *a: calls.append(a[2]) or measure(*a))
    x, idx, w, gate_up, down = Case("c", T=6, H=16, I=8, E=2, K=2).make(dtype)
    run_with_grads(lambda *a: moe_experts(*a, backend="auto"), x, idx, w, gate_up, down,
                   torch.ones(6, 16, dtype=torch.float64))
    (problem, table), = selector.decisions().items()
    assert calls == [timed] and problem.arch == arch
    if timed:  # the Triton path timed again without the library's stages where some took it
        assert {"triton", "torch"} <= set(table.times[16]) <= {"triton", "torch", selector.TRITON_FUSED}
    else:
        assert set(table.times[16]) == {"triton"}
    if not timed:
        assert table.paths[16] == "triton"


def test_pinning_the_grouped_mm_path_where_it_syncs_warns_once(monkeypatch):
    monkeypatch.setattr(autotune, "device_arch", lambda device: "sm_80")
    monkeypatch.setattr(experts, "_SYNC_WARNED", set())
    x = torch.zeros(2, 4, dtype=torch.bfloat16)
    with pytest.warns(RuntimeWarning, match=r"backend='torch' on sm_80 in torch.bfloat16: .* host sync"):
        experts._warn_if_torch_path_syncs(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        experts._warn_if_torch_path_syncs(x)  # once per architecture and dtype
    monkeypatch.setattr(autotune, "device_arch", lambda device: "sm_90")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        experts._warn_if_torch_path_syncs(x)  # sync-free there: nothing to say


@pytest.mark.parametrize("library_wins_the_op", [False, True])
def test_library_stages_stay_only_if_the_whole_op_ran_faster_with_them(monkeypatch, library_wins_the_op):
    """Every stage alone is faster on the library (mocked timings), so the tuning session gives it
    every stage; the whole op is then timed with and without those stages, and the slower choice
    is dropped: the agreed configurations, and what later calls launch, follow the whole op."""
    monkeypatch.setattr(autotune, "device_arch", lambda device: "sm_90")

    def stage_time(launch, device):  # autotune.choose times `lambda c=c: launch(c)`
        return 1.0 if isinstance(launch.__defaults__[0], Library) else 2.0

    monkeypatch.setattr(autotune, "_time", stage_time)
    whole_op = []

    def op_time(fn, device, warmup):
        fn()
        with_library = str(GROUPED_MM) in autotune._SESSION.fastest.values()
        whole_op.append(with_library)
        return (1.0 if library_wins_the_op else 3.0) if with_library else 2.0

    monkeypatch.setattr(selector, "_timed", op_time)
    case = Case("c", T=6, H=16, I=8, E=2, K=2)
    x, idx, w, gate_up, down = case.make(torch.bfloat16)
    dy = torch.ones(case.T, case.H, dtype=torch.float64)
    run_with_grads(lambda *a: moe_experts(*a, backend="triton"), x, idx, w, gate_up, down, dy)
    assert whole_op == [True, False]  # as tuned (every stage on the library), then all on Triton
    (table,) = selector.decisions().values()
    assert table.times[16][selector.TRITON_FUSED] == 2.0
    library_configs = {n for *_, n in table.configs if n == str(GROUPED_MM)}
    assert bool(library_configs) == library_wins_the_op
    (note,) = decision_notes()  # what the kernel benchmark says of it
    assert note.startswith("decided: H=16 I=8 E=2 K=2 silu bucket 16: triton ") and "triton_fused 2000.00 ms" in note
    assert note.endswith("stages on grouped_mm: " + ("gather_glu, glu_backward, rows_matmul, weight_grad"
                                                      if library_wins_the_op else "none")), note
    autotune._USED.clear()
    run_with_grads(lambda *a: moe_experts(*a, backend="triton"), x, idx, w, gate_up, down, dy)
    launched = autotune.chosen_configs().values()
    assert len(launched) == 6
    assert all(isinstance(c, Library) == library_wins_the_op for c in launched)

