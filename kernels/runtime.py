"""Where and how the kernels run: under Triton's interpreter (TRITON_INTERPRET=1; the launchers
then work around its bugs, the autotuner times nothing and nothing can be compiled ahead of time)
or on a CUDA device, which must be the current one at launch."""

from __future__ import annotations

import contextlib
import os

import torch


def interpreting() -> bool:
    # Read from the environment at call time, with the spellings Triton accepts, rather than
    # through triton.knobs: torch.compile traces this call and cannot trace Triton's C getenv.
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on")


def on_device(device: torch.device):
    """Triton launches on the current CUDA device: make it the tensors' one for the launches."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
