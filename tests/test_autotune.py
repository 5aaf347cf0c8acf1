"""The kernels' configuration choice: nothing is timed outside a tuning session, a session times
every eligible configuration once per key, agreed configurations win, a bucket without one takes
the nearest agreed bucket's, and the rest get the architecture's default."""

import pytest
import torch

from moe_ep.kernels.runtime import interpreting
from moe_ep.ops.experts import moe_experts
from moe_ep.ops import selector
from moe_ep.kernels import autotune
from moe_ep.kernels import grouped_gemm as gg
from moe_ep.kernels.autotune import Config

from markers import requires_cuda
from moe_cases import CASES

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CONFIGS = [Config(64, 64, 32, 4, 3), Config(128, 64, 32, 8, 3)]


@pytest.fixture(autouse=True)
def _fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(selector.CACHE_ENV_VAR, str(tmp_path / "cache"))
    selector.clear()
    yield
    selector.clear()


def choose(kernel="k", shapes=(16, 8), dtype=torch.bfloat16, num_rows=100, launch=None):
    return autotune.choose(
        kernel, CONFIGS, shapes=shapes, dtype=dtype, device=DEVICE, num_rows=num_rows,
        launch=launch or (lambda c: None),
    )


def key(num_rows=100, kernel="k", shapes=(16, 8), dtype=torch.bfloat16):
    return autotune.tuning_key(kernel, shapes, dtype, DEVICE, num_rows)


def test_token_bucket():
    assert [autotune.token_bucket(n) for n in (0, 1, 16, 17, 100, 128, 129, 5000)] == [16, 16, 16, 32, 128, 128, 256, 8192]


def test_key_holds_kernel_shapes_dtype_arch_and_bucket():
    arch = autotune.device_arch(DEVICE)
    assert arch == ("interpreter" if interpreting() else "sm_%d%d" % torch.cuda.get_device_capability())
    assert key() == ("k", (16, 8), torch.bfloat16, arch, 128)


def test_nothing_is_timed_outside_a_session():
    calls = []
    assert choose(launch=calls.append) == CONFIGS[0]
    assert calls == [] and autotune.chosen_configs() == {key(): CONFIGS[0]}


def test_a_session_times_every_config_once_per_key(monkeypatch):
    monkeypatch.setenv(autotune.ENV_VAR, "1")
    calls = []
    with autotune.tuning() as session:
        best = choose(launch=calls.append)
        assert calls == CONFIGS and set(session.timings[key()]) == {str(c) for c in CONFIGS}
        assert choose(launch=calls.append, num_rows=90) == best and len(calls) == 2  # same bucket
        choose(launch=calls.append, num_rows=300)
        assert len(calls) == 4 and len(session.timings) == 2
    # What a session timed is not kept: only installed choices are.
    assert choose(launch=calls.append) == CONFIGS[0] and len(calls) == 4


def test_disabled_sessions_time_nothing(monkeypatch):
    monkeypatch.setenv(autotune.ENV_VAR, "0")
    calls = []
    with autotune.tuning() as session:
        assert choose(launch=calls.append) == CONFIGS[0]
    assert calls == [] and session.timings == {}


def test_agreed_configs_win_and_stand_in_for_the_nearest_bucket():
    autotune.install({key(100): str(CONFIGS[1])})
    assert choose(num_rows=100) == CONFIGS[1]
    assert choose(num_rows=5000) == CONFIGS[1]  # bucket 8192: the only agreed one is nearest
    assert choose(shapes=(16, 16)) == CONFIGS[0]  # other shapes: the default
    autotune.install({key(5000): str(CONFIGS[0])})
    assert choose(num_rows=2000) == CONFIGS[0] and choose(num_rows=300) == CONFIGS[1]
    # 1024 is as far from 128 as from 8192 in powers of two: the smaller bucket wins the tie.
    assert choose(num_rows=1000) == CONFIGS[1]
    with autotune.tuning():
        calls = []
        assert choose(launch=calls.append) == CONFIGS[1] and calls == []


def test_an_agreed_name_no_longer_in_the_space_falls_back_to_the_default():
    autotune.install({key(): "m16n16k16w1s1"})
    assert choose() == CONFIGS[0]


def test_bad_arguments(monkeypatch):
    with pytest.raises(ValueError, match="no eligible configuration for kernel 'k'"):
        autotune.choose("k", [], shapes=(), dtype=torch.float32, device=DEVICE, num_rows=1, launch=print)
    monkeypatch.setenv(autotune.ENV_VAR, "yes")
    with pytest.raises(ValueError, match=r"MOE_EP_AUTOTUNE must be '0' or '1', got 'yes'"):
        with autotune.tuning():
            choose()
    monkeypatch.setenv(autotune.ENV_VAR, "")  # set but empty: unset, as MOE_EP_BACKEND=""
    assert autotune.enabled()
    with autotune.tuning():
        with pytest.raises(RuntimeError, match="do not nest"):
            with autotune.tuning():
                pass


@pytest.mark.slow
def test_op_tunes_each_gemm_kernel_on_its_first_call(monkeypatch):
    if not interpreting():
        pytest.skip("swaps the interpreter's configuration space")
    two = [Config(32, 16, 16, 4, 2), Config(64, 32, 16, 4, 2)]
    space = {"half": two, "fp32": two, "half_unaligned": two, "fp32_unaligned": two}
    monkeypatch.setitem(gg.CONFIGS, "default", {k: space for k in gg.GEMM_KERNELS})
    x, idx, w, gate_up, down = CASES[0].make(torch.float32, device=DEVICE)
    leaves = [t.requires_grad_() for t in (x, w, gate_up, down)]
    y = moe_experts(leaves[0], idx, leaves[1], leaves[2], leaves[3], backend="triton")
    torch.autograd.grad(y, leaves, torch.ones_like(y))
    kernels = sorted(key[0] for key in autotune.chosen_configs())
    # rows_matmul twice (GEMM 2 and dX), weight_grad twice (down and gate_up).
    assert kernels == ["gather_glu", "glu_backward", "rows_matmul", "rows_matmul", "weight_grad", "weight_grad"]
    arch = autotune.device_arch(DEVICE)
    assert all(key[2] == torch.float32 and key[3] == arch and key[4] == 128 for key in autotune.chosen_configs())
    # Every launch got an agreed configuration at the first call, which it used.
    agreed = autotune.agreed_configs()
    assert set(agreed) == set(autotune.chosen_configs())
    assert all(str(autotune.chosen_configs()[k]) == name for k, name in agreed.items())


@requires_cuda
def test_session_times_on_the_gpu(monkeypatch):
    monkeypatch.setenv(autotune.ENV_VAR, "1")
    calls = []
    buf = torch.zeros(1 << 20, device=DEVICE)

    def launch(config):
        calls.append(config)
        buf.add_(1.0)

    with autotune.tuning() as session:
        best = choose(launch=launch)
    assert best in CONFIGS and set(calls) == set(CONFIGS) and all(t > 0 for t in session.timings[key()].values())
