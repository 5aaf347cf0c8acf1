"""A small autotuner for the grouped-GEMM kernels.

Each kernel has a few hand-picked configurations. The first time a launcher meets a key
(kernel, problem shapes, dtype, GPU architecture, token-count bucket) it times every eligible
configuration on the real inputs and keeps the fastest for the rest of the process. The kernels
only write their outputs, so running one several times while timing is harmless.

Under the Triton interpreter nothing is timed: the first eligible configuration is used. The same
happens on a GPU with ``MOE_EP_AUTOTUNE=0``, which makes the choice (and so the floating-point
summation order) identical from one process to the next."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from moe_ep.kernels.runtime import interpreting

ENV_VAR = "MOE_EP_AUTOTUNE"


@dataclass(frozen=True)
class Config:
    """Tile sizes of one grouped GEMM (M: rows of the output tile, N: its columns, K: the reduction
    step), Triton's launch options, whether the operands that are not gathered are loaded through
    TMA tensor descriptors (sm_90), and whether the grid is persistent (one program per SM, each
    looping over tiles) rather than one program per tile."""

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    num_warps: int
    num_stages: int
    tma: bool = False
    persistent: bool = False

    def constexprs(self) -> dict:
        return {"BLOCK_M": self.BLOCK_M, "BLOCK_N": self.BLOCK_N, "BLOCK_K": self.BLOCK_K, "TMA": self.tma}

    def launch_options(self) -> dict:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}

    def __str__(self) -> str:
        tags = ("_tma" if self.tma else "") + ("_persistent" if self.persistent else "")
        return f"m{self.BLOCK_M}n{self.BLOCK_N}k{self.BLOCK_K}w{self.num_warps}s{self.num_stages}{tags}"


_CHOSEN: dict[tuple, Config] = {}


def token_bucket(num_rows: int) -> int:
    """Row counts that share a tuning result: the next power of two, at least 16."""
    return max(16, 1 << max(0, num_rows - 1).bit_length())


@functools.lru_cache(maxsize=None)
def _cuda_arch(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}"


def device_arch(device: torch.device) -> str:
    if interpreting():
        return "interpreter"
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device unless TRITON_INTERPRET=1, got {device}")
    return _cuda_arch(device.index if device.index is not None else torch.cuda.current_device())


def tuning_key(kernel: str, shapes: tuple, dtype: torch.dtype, device: torch.device, num_rows: int) -> tuple:
    return (kernel, tuple(shapes), dtype, device_arch(device), token_bucket(num_rows))


def _timing_enabled() -> bool:
    value = os.environ.get(ENV_VAR, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV_VAR} must be '0' or '1', got {value!r}")
    return value == "1" and not interpreting()


def choose(
    kernel: str,
    configs: Sequence[Config],
    *,
    shapes: tuple,
    dtype: torch.dtype,
    device: torch.device,
    num_rows: int,
    launch: Callable[[Config], object],
) -> Config:
    """The configuration to launch ``kernel`` with; ``launch(config)`` runs it once on the real
    inputs and is only called while timing."""
    if not configs:
        raise ValueError(f"no eligible configuration for kernel {kernel!r}")
    key = tuning_key(kernel, shapes, dtype, device, num_rows)
    if key in _CHOSEN:
        return _CHOSEN[key]
    if len(configs) == 1 or not _timing_enabled():
        best = configs[0]
    else:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"autotuning {kernel} for {key} would time kernels inside a CUDA graph capture; "
                f"run the op once before capturing, or set {ENV_VAR}=0"
            )
        import triton.testing

        # host sync: timing needs the GPU to finish; it happens once per key and process.
        timings = [triton.testing.do_bench(lambda c=c: launch(c), warmup=5, rep=20) for c in configs]
        best = configs[min(range(len(configs)), key=timings.__getitem__)]
    _CHOSEN[key] = best
    return best


def chosen_configs() -> dict[tuple, Config]:
    """A copy of this process's choices, keyed by ``tuning_key``."""
    return dict(_CHOSEN)


def clear_cache() -> None:
    _CHOSEN.clear()
