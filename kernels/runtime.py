"""Where and how the kernels run: under Triton's interpreter (TRITON_INTERPRET=1; the launchers
then work around its bugs, the autotuner times nothing and nothing can be compiled ahead of time)
or on a CUDA device, which must be the current one at launch."""

from __future__ import annotations

import contextlib
import functools
import os

import torch


def interpreting() -> bool:
    # Read from the environment at call time, with the spellings Triton accepts, rather than
    # through triton.knobs: torch.compile traces this call and cannot trace Triton's C getenv.
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on")


def on_device(device: torch.device):
    """Triton launches on the current CUDA device: make it the tensors' one for the launches."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


# Programs a persistent grid gets under the interpreter: more than one, so that programs loop over
# several tiles, and few, so that they do.
INTERPRETER_SMS = 3


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``: the size of a persistent grid."""
    if interpreting() or device.type != "cuda":
        return INTERPRETER_SMS
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
