"""Time each grouped-GEMM launcher of the Triton experts op under candidate configurations, one at
a time, at Mixtral-8x7B expert shapes (T=16384, top-2, bf16): the measurements the sm_90
configuration space in ``moe_ep/kernels/grouped_gemm.py`` is ordered by (the candidates below are
Hopper's, TMA ones included; an A100 needs candidates of its own, without TMA).

    python scripts/sweep_configs.py --out sweep.json          # on a CUDA GPU, a few minutes

Each candidate replaces the architecture's space for its kernel (so the launcher runs exactly that
configuration), is checked against the first candidate's result on the slots' own rows (relative
error; a broken configuration is reported, never ranked) and timed with ``triton.testing.do_bench``
(median).
Candidates that fail to compile or run are recorded with their error. A sweep, not a gate: the
chosen configurations must still pass ``python -m moe_ep.kernels.aot`` (no spills) on the CPU."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ["MOE_EP_AUTOTUNE"] = "0"  # outside a tuning session nothing is timed: the first config runs

import torch  # noqa: E402
import triton.testing  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_ep.bench import kernels as kernel_bench  # noqa: E402
from moe_ep.kernels import autotune  # noqa: E402
from moe_ep.kernels import grouped_gemm as gg  # noqa: E402
from moe_ep.kernels.autotune import Config  # noqa: E402
from moe_ep.kernels.routing_metadata import routing_metadata  # noqa: E402

C = Config
# Candidates per launcher: (kernel space, candidates, GROUP_M values). The first candidate is the
# space's current default and the correctness reference.
CANDIDATES = {
    "weight_grad": [
        C(128, 256, 64, 8, 4, tma=True, persistent=True), C(128, 256, 64, 8, 3, tma=True, persistent=True),
        C(256, 128, 64, 8, 4, tma=True, persistent=True), C(256, 128, 32, 8, 5, tma=True, persistent=True),
        C(128, 256, 32, 8, 6, tma=True, persistent=True), C(128, 128, 64, 8, 5, tma=True, persistent=True),
    ],
    "glu_backward": [
        C(128, 128, 64, 8, 4, tma=True, persistent=True), C(128, 128, 64, 8, 5, tma=True, persistent=True),
        C(128, 128, 32, 8, 6, tma=True, persistent=True), C(128, 256, 64, 8, 3, tma=True, persistent=True),
        C(128, 128, 64, 4, 4, tma=True, persistent=True),
    ],
    "gather_glu": [
        C(128, 256, 64, 8, 4, tma=True, persistent=True), C(128, 256, 64, 8, 3, tma=True, persistent=True),
        C(128, 256, 32, 8, 6, tma=True, persistent=True), C(128, 256, 64, 8, 4, tma=True),
        C(128, 128, 64, 8, 4, tma=True, persistent=True),
    ],
    "rows_matmul": [C(128, 256, 64, 8, 4, tma=True, persistent=True)],
}
GROUP_MS = (8, 4, 16)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--kernels", nargs="+", default=list(CANDIDATES))
    parser.add_argument("--budget", type=float, default=270.0,
                        help="seconds; later candidates are skipped (default 270: a sweep stays under 5 minutes)")
    args = parser.parse_args()
    start = time.perf_counter()
    device = torch.device("cuda")
    family = gg.arch_family(device)
    p = kernel_bench.Problem(T=args.tokens, H=4096, I=14336, E=8, K=2, routing="uniform", dtype=torch.bfloat16,
                             device=device)
    inp = kernel_bench.make_inputs(p, 0)
    x_TH, dy_TH = inp.x_TH.detach(), inp.dy_TH
    gate_up, down = inp.gate_up_E2IH.detach(), inp.down_EHI.detach()
    w_N = inp.w_TK.detach().reshape(-1).float().contiguous()
    meta = routing_metadata(inp.idx_TK, p.E, gg.routing_block(p.N, p.E))
    h_PI, pre_P2I = gg.gather_glu(x_TH, gate_up, meta, p.K, "silu")
    dy_PH, x_PH = gg.gather_rows(dy_TH, meta, p.K), gg.gather_rows(x_TH, meta, p.K)
    dpre_P2I, _, hs_PI = gg.glu_backward(dy_PH, down, pre_P2I, w_N, meta, "silu")
    N, H, I = p.N, p.H, p.I
    # Row outputs are compared on the slots' own rows: padding rows and rows past the live end
    # (padded_offsets[E]) are never read, and rows_matmul does not write them.
    live = meta.sorted_slot_P >= 0
    # (space, flops, call, whether its output is rows) per launcher of the op, the furthest from its bound
    # first (the H200's gate, 2026-11-27: glu_backward 47% of its roofline, gather_glu 62%, the weight
    # gradients 70-71%).
    launchers = {
        "glu_bwd": ("glu_backward", 2 * N * H * I,
                    lambda: gg.glu_backward(dy_PH, down, pre_P2I, w_N, meta, "silu")[0], True),
        "gemm1": ("gather_glu", 4 * N * H * I, lambda: gg.gather_glu(x_TH, gate_up, meta, p.K, "silu")[0], True),
        "dw_gate_up": ("weight_grad", 4 * N * H * I, lambda: gg.weight_grad(dpre_P2I, x_PH, meta), False),
        "dw_down": ("weight_grad", 2 * N * H * I, lambda: gg.weight_grad(dy_PH, hs_PI, meta), False),
        "gemm2": ("rows_matmul", 2 * N * H * I, lambda: gg.rows_matmul(h_PI, down, meta, w_layout="nk", scale_N=w_N), True),
        "dx": ("rows_matmul", 4 * N * H * I, lambda: gg.rows_matmul(dpre_P2I, gate_up, meta, w_layout="kn"), True),
    }
    compiled = []
    run = gg._run
    gg._run = lambda *a, **k: compiled.append(run(*a, **k)) or compiled[-1]
    rows = []
    for name, (space, flops, call, by_row) in launchers.items():
        if space not in args.kernels:
            continue
        saved, saved_group = gg.CONFIGS[family][space]["half"], gg.GROUP_M
        ref = None
        trials = [(c, 8) for c in CANDIDATES[space]] + [(CANDIDATES[space][0], g) for g in GROUP_MS[1:]]
        for config, group in trials:
            if time.perf_counter() - start > args.budget:
                rows.append(dict(launcher=name, config=str(config), group_m=group, status="skipped: budget"))
                continue
            gg.CONFIGS[family][space]["half"] = [config]
            gg.GROUP_M = group
            autotune.clear_cache()
            row = dict(launcher=name, config=str(config), group_m=group)
            try:
                compiled.clear()
                out = call()
                out = out[live] if by_row else out.clone()
                row.update(regs=getattr(compiled[-1], "n_regs", None), spills=getattr(compiled[-1], "n_spills", None))
                if ref is None:
                    ref = out
                row["err_vs_first"] = rel_err(out, ref)
                if not row["err_vs_first"] <= 1e-2:
                    row["status"] = "WRONG"
                else:
                    ms = triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")
                    row.update(ms=ms, tflops=flops / ms / 1e9, status="ok")
            except Exception as err:  # a candidate that does not compile or launch is recorded
                row["status"] = f"FAIL {type(err).__name__}: {str(err).splitlines()[0][:160]}"
            finally:
                gg.CONFIGS[family][space]["half"], gg.GROUP_M = saved, saved_group
            rows.append(row)
            print(f"{name:10s} {row['config']:36s} G{group:<3d} {row.get('ms', float('nan')):8.3f} ms "
                  f"{row.get('tflops', float('nan')):6.0f} TFLOP/s spills {row.get('spills')} {row['status']}", flush=True)
    args.out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                        triton=triton.__version__, tokens=args.tokens, rows=rows), indent=1))
    print("\nbest per launcher:")
    for name in launchers:
        ok = [r for r in rows if r["launcher"] == name and r.get("status") == "ok"]
        if ok:
            best = min(ok, key=lambda r: r["ms"])
            first = ok[0]
            print(f"{name:10s} best {best['config']} G{best['group_m']} {best['ms']:.3f} ms "
                  f"({best['tflops']:.0f} TFLOP/s; first {first['ms']:.3f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
