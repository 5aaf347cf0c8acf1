"""The static cost model's view of torch's grouped GEMM (``moe_ep.kernels.cost``): one launch on
sm_90, and below sm_90 the fallback torch 2.9-2.11 runs there (pytorch#161407), a host sync and
one cuBLAS GEMM per group. Checked against the same arithmetic written out by hand."""

import math

import pytest

from moe_ep.kernels import cost

QWEN3 = cost.PROBLEMS["qwen3-30b-a3b"]


def _by_hand_loop_ms(shapes, arch):
    """One sync, then per non-empty group the longest of: whole waves of 128x128 tiles at cuBLAS's
    rate, the group's bytes at copy speed, the host's launch."""
    machine, eff = cost.MACHINES[arch], cost.EFFICIENCY[arch]
    total = cost.LOOP_SYNC_S
    for m, n, k in shapes:
        if m == 0 or n == 0 or k == 0:
            continue
        waves = math.ceil(math.ceil(m / 128) * math.ceil(n / 128) / machine.sms)
        gemm = waves * machine.sms * 2.0 * 128 * 128 * k / (machine.flops * eff.gemm)
        traffic = 2.0 * (m * k + k * n + m * n) / (machine.bandwidth * eff.copy)
        total += max(gemm, traffic, cost.LOOP_LAUNCH_S)
    return total * 1e3


def _grouped_steps(p, arch):
    return [s for s in cost.grouped_mm_sequence(p, arch) if "grouped_mm" in s["step"]]


def test_sm90_grouped_gemm_is_one_launch_without_host_sync():
    steps = _grouped_steps(QWEN3, 90)
    assert len(steps) == 6 and not any(s.get("host_syncs") for s in steps)
    assert cost.summary(cost.grouped_mm_sequence(QWEN3, 90))["host_syncs"] == 0
    gate_up = steps[0]
    N, H, I, E = QWEN3.N, QWEN3.H, QWEN3.I, QWEN3.E
    assert gate_up["flops"] == 2 * N * H * 2 * I
    assert gate_up["bytes_read"] == 2 * (N * H + E * H * 2 * I) and gate_up["bytes_written"] == 2 * N * 2 * I
    machine, eff = cost.MACHINES[90], cost.EFFICIENCY[90]
    assert gate_up["expected_ms"] == pytest.approx(
        max(gate_up["flops"] / (machine.flops * eff.gemm),
            (gate_up["bytes_read"] + gate_up["bytes_written"]) / (machine.bandwidth * eff.copy)) * 1e3)


def test_sm80_grouped_gemm_is_a_host_synced_loop_per_call():
    """Forward (gate/up, down) and both gradients of each in the backward: six loops, six syncs,
    one launch per expert each; every step at the hand-written figure and above its bound."""
    steps = _grouped_steps(QWEN3, 80)
    assert [s["host_syncs"] for s in steps] == [1] * 6 and all(s["launches"] == QWEN3.E for s in steps)
    assert cost.summary(cost.grouped_mm_sequence(QWEN3, 80))["host_syncs"] == 6
    rows, H, I = QWEN3.N // QWEN3.E, QWEN3.H, QWEN3.I
    shapes = {"fwd grouped_mm gate_up": (rows, 2 * I, H), "fwd grouped_mm down": (rows, H, I),
              "bwd grouped_mm d h": (rows, I, H), "bwd grouped_mm d down": (I, H, rows),
              "bwd grouped_mm d x": (rows, H, 2 * I), "bwd grouped_mm d gate_up": (H, 2 * I, rows)}
    for s in steps:
        m, n, k = shapes[s["step"]]
        assert s["flops"] == 2 * m * n * k * QWEN3.E
        assert s["expected_ms"] == pytest.approx(_by_hand_loop_ms([(m, n, k)] * QWEN3.E, 80), rel=1e-12)
        assert s["roofline_ms"] < s["expected_ms"]


def test_loop_of_tiny_groups_costs_its_launches_and_empty_groups_cost_nothing():
    tiny = [(1, 8, 8)] * 5 + [(0, 8, 8)] * 3
    step = cost.loop_gemm_pass("tiny", tiny, 80)
    assert step["launches"] == 5
    assert step["expected_ms"] == pytest.approx((cost.LOOP_SYNC_S + 5 * cost.LOOP_LAUNCH_S) * 1e3)


def test_loop_of_one_whole_wave_group_runs_at_cublas_rate():
    """A group of exactly one wave of tiles: no quantisation loss, only the sync on top."""
    machine, eff = cost.MACHINES[80], cost.EFFICIENCY[80]
    m, n, k = 128 * 12, 128 * machine.sms // 12, 8192
    assert (m // 128) * (n // 128) == machine.sms
    step = cost.loop_gemm_pass("one wave", [(m, n, k)], 80)
    assert step["expected_ms"] == pytest.approx((cost.LOOP_SYNC_S + 2 * m * n * k / (machine.flops * eff.gemm)) * 1e3)
    # One tile more: a second, nearly empty wave costs as much as the first.
    padded = cost.loop_gemm_pass("one wave and a tile", [(m + 1, n, k)], 80)
    assert padded["expected_ms"] - cost.LOOP_SYNC_S * 1e3 == pytest.approx(
        2 * (step["expected_ms"] - cost.LOOP_SYNC_S * 1e3))


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("name", sorted(cost.PROBLEMS))
def test_grouped_sequence_flops_are_the_expert_mlp_flops(name, arch):
    p = cost.PROBLEMS[name]
    flops = sum(s["flops"] for s in _grouped_steps(p, arch))
    assert math.isclose(flops, cost.expert_mlp_flops(p), rel_tol=1e-12)
