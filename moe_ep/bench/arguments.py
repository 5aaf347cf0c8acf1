"""argparse types of the benchmarks' flags: a value out of range is refused by argparse, which
names the flag, before any work."""

from __future__ import annotations

import argparse
import math


# The largest size a benchmark flag takes: the kernels index rows and columns with int32, and a
# larger value overflowed inside torch with a traceback.
SIZE_MAX = 2**31 - 1


def int_at_least(low: int):
    """An argparse type: an int >= ``low``, at most SIZE_MAX (argparse names the flag in its error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"must be an int >= {low}, got {text!r}")
        if value > SIZE_MAX:
            raise argparse.ArgumentTypeError(f"must be an int in [{low}, {SIZE_MAX}], got {text!r}")
        return value

    parse.__name__ = f"int >= {low}"
    return parse


# Seeds the benchmarks take: torch's generators accept them, and the dispatch benchmark's ranks
# add their rank to them.
SEED_MAX = 2**32 - 1


def int_in(low: int, high: int):
    """An argparse type: an int in ``[low, high]``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be an int in [{low}, {high}], got {text!r}")
        return value

    parse.__name__ = f"int in [{low}, {high}]"
    return parse


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value
