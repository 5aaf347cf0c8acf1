"""``python -m moe_ep.bench {kernels,attention,model,dispatch,planner,gpu}``: run one benchmark mode, print
its table, save its figures (to ./bench-results/, git-ignored; the gpu gate to the committed
benchmarks/results/)."""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import torch

from . import attention, dispatch, gpu_check, kernels, model, planner
from .report import COMMITTED_RESULTS_DIR, RESULTS_DIR, format_table, save
from .timing import NoisyTimingWarning

MODES = {"kernels": kernels, "attention": attention, "model": model, "dispatch": dispatch, "planner": planner, "gpu": gpu_check}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m moe_ep.bench", description=__doc__)
    sub = parser.add_subparsers(dest="mode", required=True)
    for name, module in MODES.items():
        mode = sub.add_parser(name, help=module.__doc__.splitlines()[0], description=module.__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
        mode.add_argument("--device", help="cuda or cpu (default: cuda when available)")
        mode.add_argument("--warmup", type=int, default=2, help="untimed calls before timing (default 2)")
        mode.add_argument("--reps", type=int, default=5, help="timed calls; the median is reported (default 5)")
        mode.add_argument("--seed", type=int, default=0)
        mode.add_argument("--threads", type=int,
                          help="CPU threads for torch (default: torch's); on a shared machine 1 avoids "
                               "OpenMP barriers waiting on descheduled threads")
        out_dir = COMMITTED_RESULTS_DIR if name == "gpu" else RESULTS_DIR
        mode.add_argument("--out-dir", type=Path, default=out_dir, help=f"where results go (default {out_dir}/)")
        mode.add_argument("--no-save", action="store_true", help="print only, write no files")
        module.add_arguments(mode)
    return parser


def main(argv: list[str] | None = None):
    args = build_parser().parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device must be cpu on a machine without CUDA, got {args.device!r}")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    print(f"[{args.mode}] on {device}: {args.warmup} warmup + {args.reps} timed calls per case; "
          "progress below, the table at the end", flush=True)
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", NoisyTimingWarning)
        report = MODES[args.mode].run(args, device)
    for warning in caught:
        if issubclass(warning.category, NoisyTimingWarning):
            report.notes.append(f"noisy: {warning.message}")
        else:
            warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
    print(f"\n{args.mode} benchmark on {report.meta.get('device')} ({time.perf_counter() - start:.0f} s)")
    print(format_table(report))
    if not args.no_save:
        for path in save(report, args.out_dir):
            print(f"wrote {path}")
    if report.failed:
        raise SystemExit(f"{args.mode}: failed: {', '.join(report.failed)}")
    return report
