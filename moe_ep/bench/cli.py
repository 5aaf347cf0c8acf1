"""``python -m moe_ep.bench {kernels,attention,model,dispatch,planner,gpu}``: run one benchmark mode, print
its table, save its figures (to ./bench-results/, git-ignored; the gpu gate to the committed
benchmarks/results/)."""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

from . import attention, dispatch, gpu_check, kernels, model, planner
from .arguments import SEED_MAX, int_at_least, int_in
from .report import COMMITTED_RESULTS_DIR, RESULTS_DIR, check_out_dir, format_table, save
from .timing import NoisyTimingWarning

MODES = {"kernels": kernels, "attention": attention, "model": model, "dispatch": dispatch, "planner": planner, "gpu": gpu_check}
EXIT_USAGE = 2
EXIT_FAILED = 1


def _device(name: str | None, mode: str) -> torch.device:
    """``--device``, or the mode's own default (``DEFAULT_DEVICE``: the planner check measures on
    the CPU), else CUDA where there is a GPU."""
    if name is None:
        return torch.device(getattr(MODES[mode], "DEFAULT_DEVICE", None) or
                            ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device must be cpu or cuda (cuda:N), got {name!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda (cuda:N), got {name!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device must be cpu on a machine without CUDA, got {name!r}")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"--device must name one of this machine's {torch.cuda.device_count()} GPU(s) (cuda:0 to "
                         f"cuda:{torch.cuda.device_count() - 1}), got {name!r}")
    return device


def default_out_dir(mode: str, device: torch.device) -> Path:
    """Where a mode's results go without ``--out-dir``: the GPU gate's GPU results are committed;
    everything else, the gate's CPU run of its plumbing included, goes to a git-ignored folder."""
    return COMMITTED_RESULTS_DIR if mode == "gpu" and device.type == "cuda" else RESULTS_DIR


def timed(mode: str) -> bool:
    """Whether a mode times calls (``--warmup``/``--reps``/``--seed`` apply); one that only
    counts says ``TIMED = False``."""
    return getattr(MODES[mode], "TIMED", True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m moe_ep.bench", description=__doc__)
    sub = parser.add_subparsers(dest="mode", required=True)
    for name, module in MODES.items():
        mode = sub.add_parser(name, help=module.__doc__.splitlines()[0], description=module.__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
        default_device = getattr(module, "DEFAULT_DEVICE", None) or "cuda when available"
        mode.add_argument("--device", help=f"cuda (cuda:N) or cpu (default: {default_device})")
        if timed(name):
            mode.add_argument("--warmup", type=int_at_least(0), default=2,
                              help="untimed calls before timing (default 2)")
            mode.add_argument("--reps", type=int_at_least(1), default=5,
                              help="timed calls; the median is reported (default 5)")
            mode.add_argument("--seed", type=int_in(0, SEED_MAX), default=0)
        mode.add_argument("--threads", type=int_at_least(1),
                          help="CPU threads for torch (default: torch's); on a shared machine 1 avoids "
                               "OpenMP barriers waiting on descheduled threads")
        where = (f"{COMMITTED_RESULTS_DIR}/ on a GPU, {RESULTS_DIR}/ with --device cpu" if name == "gpu"
                 else f"{RESULTS_DIR}/")
        mode.add_argument("--out-dir", type=Path, help=f"where results go (default {where})")
        mode.add_argument("--no-save", action="store_true", help="print only, write no files")
        module.add_arguments(mode)
    return parser


def console(argv: list[str] | None = None) -> int:
    """``python -m moe_ep.bench``: ``main``, a refused argument said in one line (exit status 2)
    instead of a traceback."""
    mode = next((a for a in (argv if argv is not None else sys.argv[1:]) if a in MODES), "")
    try:
        main(argv)
    except ValueError as err:
        print(f"python -m moe_ep.bench {mode}: error: {err}".replace("  ", " "), file=sys.stderr)
        return EXIT_USAGE
    except RuntimeError as err:  # torch.OutOfMemoryError on CUDA; the CPU allocator's own RuntimeError
        if not isinstance(err, torch.OutOfMemoryError) and "can't allocate memory" not in str(err):
            raise
        print(f"python -m moe_ep.bench {mode}: error: the problem does not fit in the device's memory "
              f"({str(err).splitlines()[0]}); use smaller sizes".replace("  ", " "), file=sys.stderr)
        return EXIT_FAILED
    return 0


def main(argv: list[str] | None = None):
    args = build_parser().parse_args(argv)
    device = _device(args.device, args.mode)
    if device.type == "cuda" and device.index is not None:
        # CUDA events record on the current device's stream: timing work on cuda:N needs it current.
        torch.cuda.set_device(device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    # The mode's own checks of its flags come before anything is made on disk.
    check_arguments = getattr(MODES[args.mode], "check_arguments", None)
    if check_arguments is not None:
        check_arguments(args, device)
    if args.out_dir is None:
        args.out_dir = default_out_dir(args.mode, device)
    if not args.no_save:
        check_out_dir(args.out_dir)
    calls = f"{args.warmup} warmup + {args.reps} timed calls per case; " if timed(args.mode) else ""
    print(f"[{args.mode}] on {device}: {calls}progress below, the table at the end", flush=True)
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
