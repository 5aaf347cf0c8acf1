import pytest
import torch

from moe_ep.kernels.runtime import interpreting
from moe_ep.ops.experts import moe_experts
from moe_ep.kernels import autotune
from moe_ep.kernels.autotune import Config

from markers import requires_cuda
from moe_cases import CASES

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CONFIGS = [Config(64, 64, 32, 4, 3), Config(128, 64, 32, 8, 3)]


@pytest.fixture(autouse=True)
def _fresh_cache():
    autotune.clear_cache()
    yield
    autotune.clear_cache()


def choose(kernel="k", shapes=(16, 8), dtype=torch.bfloat16, num_rows=100, launch=None):
    return autotune.choose(
        kernel, CONFIGS, shapes=shapes, dtype=dtype, device=DEVICE, num_rows=num_rows,
        launch=launch or (lambda c: None),
    )


def test_token_bucket():
    assert [autotune.token_bucket(n) for n in (0, 1, 16, 17, 100, 128, 129, 5000)] == [16, 16, 16, 32, 128, 128, 256, 8192]


def test_key_holds_kernel_shapes_dtype_arch_and_bucket():
    arch = autotune.device_arch(DEVICE)
    assert arch == ("interpreter" if interpreting() else "sm_%d%d" % torch.cuda.get_device_capability())
    key = autotune.tuning_key("k", (16, 8), torch.bfloat16, DEVICE, 100)
    assert key == ("k", (16, 8), torch.bfloat16, arch, 128)


def test_results_are_cached_per_key(monkeypatch):
    monkeypatch.setenv(autotune.ENV_VAR, "0")
    choose(num_rows=100)
    choose(num_rows=120)  # same bucket: no new entry
    assert len(autotune.chosen_configs()) == 1
    choose(num_rows=300)
    choose(dtype=torch.float16)
    choose(shapes=(16, 16))
    choose(kernel="other")
    assert len(autotune.chosen_configs()) == 5


def test_no_timing_under_interpreter_or_when_disabled(monkeypatch):
    if not interpreting():
        monkeypatch.setenv(autotune.ENV_VAR, "0")
    calls = []
    assert choose(launch=calls.append) == CONFIGS[0]
    assert calls == []


def test_bad_arguments(monkeypatch):
    with pytest.raises(ValueError, match="no eligible configuration for kernel 'k'"):
        autotune.choose("k", [], shapes=(), dtype=torch.float32, device=DEVICE, num_rows=1, launch=print)
    monkeypatch.setenv(autotune.ENV_VAR, "yes")
    with pytest.raises(ValueError, match=r"MOE_EP_AUTOTUNE must be '0' or '1', got 'yes'"):
        choose()


def test_op_records_one_choice_per_gemm_kernel():
    x, idx, w, gate_up, down = CASES[0].make(torch.float32, device=DEVICE)
    leaves = [t.requires_grad_() for t in (x, w, gate_up, down)]
    y = moe_experts(leaves[0], idx, leaves[1], leaves[2], leaves[3], backend="triton")
    torch.autograd.grad(y, leaves, torch.ones_like(y))
    kernels = sorted(key[0] for key in autotune.chosen_configs())
    # rows_matmul twice (GEMM 2 and dX), weight_grad twice (down and gate_up).
    assert kernels == ["gather_glu", "glu_backward", "rows_matmul", "rows_matmul", "weight_grad", "weight_grad"]
    arch = autotune.device_arch(DEVICE)
    assert all(key[2] == torch.float32 and key[3] == arch and key[4] == 128 for key in autotune.chosen_configs())


@requires_cuda
def test_times_every_config_once_per_key(monkeypatch):
    monkeypatch.setenv(autotune.ENV_VAR, "1")
    calls = []
    buf = torch.zeros(1 << 20, device=DEVICE)

    def launch(config):
        calls.append(config)
        buf.add_(1.0)

    best = choose(launch=launch)
    assert best in CONFIGS and set(calls) == set(CONFIGS)
    calls.clear()
    assert choose(launch=launch, num_rows=90) == best and calls == []
