"""Whether Triton runs kernels under its interpreter (TRITON_INTERPRET=1): the launchers then work
around the interpreter's bugs, the autotuner times nothing, and nothing can be compiled ahead of
time."""

from __future__ import annotations

import os


def interpreting() -> bool:
    # Read from the environment at call time, with the spellings Triton accepts, rather than
    # through triton.knobs: torch.compile traces this call and cannot trace Triton's C getenv.
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on")
