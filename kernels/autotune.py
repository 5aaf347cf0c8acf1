"""Which configuration each grouped-GEMM launch uses.

Each kernel has a few hand-picked configurations per architecture. A launch is keyed by (kernel,
problem shapes, dtype, GPU architecture, token-count bucket) and uses, in this order:

1. the configuration agreed for its key (``install``: the op layer agrees on them across the ranks
   of a process group, or loads them from its disk cache, see ``moe_ep.ops.selector``);
2. inside a tuning session (``tuning()``), the fastest eligible configuration timed on the real
   inputs, kept by the session, which reports every timing (the session is where host syncs are
   allowed: the first sight of a problem, never the middle of a later step);
3. the configuration agreed for the nearest bucket of the same kernel, shapes, dtype and
   architecture;
4. the first eligible configuration: the fixed default of the architecture's space.

Outside a session nothing is timed: a launch never waits for the GPU, and its choice depends on
the agreed table alone, so processes holding the same table make the same choice for every key.
``MOE_EP_AUTOTUNE=0`` makes sessions time nothing. Under the Triton interpreter a session times with
the host clock: the figures mean nothing, but the protocol runs on the CPU."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .runtime import interpreting

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


@dataclass
class Session:
    """What a tuning session timed: seconds per configuration (by its ``str``) per key, and the
    fastest of each key, which the session's launches use."""

    timings: dict[tuple, dict[str, float]] = field(default_factory=dict)
    fastest: dict[tuple, str] = field(default_factory=dict)


_AGREED: dict[tuple, str] = {}  # key -> configuration name, see install
_USED: dict[tuple, Config] = {}  # what each key last launched with (chosen_configs)
_SESSION: Session | None = None


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


def enabled() -> bool:
    """Whether tuning sessions time anything (``MOE_EP_AUTOTUNE``, default 1; set but empty is
    unset, as for ``MOE_EP_BACKEND``)."""
    value = os.environ.get(ENV_VAR) or "1"
    if value not in ("0", "1"):
        raise ValueError(f"{ENV_VAR} must be '0' or '1', got {value!r}")
    return value == "1"


@contextlib.contextmanager
def tuning():
    """A tuning session: launches of keys with no agreed configuration time every eligible one
    (host syncs) and use the fastest. Yields the ``Session`` with the timings."""
    global _SESSION
    if _SESSION is not None:
        raise RuntimeError("tuning sessions do not nest")
    _SESSION = Session()
    try:
        yield _SESSION
    finally:
        _SESSION = None


def install(choices: dict[tuple, str]) -> None:
    """Agreed configurations (by name) for keys: used by every later launch of those keys, and by
    launches of other buckets of the same kernel, shapes, dtype and architecture that have none."""
    _AGREED.update(choices)
    _nearest.cache_clear()


def _time(launch: Callable[[], object], device: torch.device) -> float:
    if interpreting() or device.type != "cuda":
        start = time.perf_counter()
        launch()
        return time.perf_counter() - start
    import triton.testing

    # host sync: timing waits for the GPU; only inside a tuning session. do_bench repeats for `rep`
    # ms: 100 gives a 12 ms launch (Mixtral's gate/up at 16384 tokens) 8 samples where 20 gave it
    # one, and the median keeps one slow sample from deciding between configurations a few percent
    # apart (the H200's sweep, 2026-11-27).
    return triton.testing.do_bench(launch, warmup=5, rep=100, return_mode="median") / 1e3


@functools.lru_cache(maxsize=None)
def _nearest(key: tuple) -> str | None:
    """The agreed configuration of the bucket nearest ``key``'s (in powers of two; the smaller
    one on a tie) among the keys of the same kernel, shapes, dtype and architecture."""
    bucket = key[-1]
    same = [(abs(math.log2(k[-1]) - math.log2(bucket)), k[-1], name) for k, name in _AGREED.items()
            if k[:-1] == key[:-1]]
    return min(same)[2] if same else None


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
    """The configuration to launch ``kernel`` with (see the module docstring); ``launch(config)``
    runs it once on the real inputs and is only called inside a tuning session."""
    if not configs:
        raise ValueError(f"no eligible configuration for kernel {kernel!r}")
    key = tuning_key(kernel, shapes, dtype, device, num_rows)
    by_name = {str(c): c for c in configs}
    name = _AGREED.get(key)
    if name not in by_name and _SESSION is not None and enabled() and len(configs) > 1:
        if key not in _SESSION.fastest:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"tuning {kernel} for {key} would time kernels inside a CUDA graph capture; run the op once "
                    f"before capturing, or set {ENV_VAR}=0"
                )
            timings = {str(c): _time(lambda c=c: launch(c), device) for c in configs}
            _SESSION.timings[key] = timings
            _SESSION.fastest[key] = min(timings, key=timings.__getitem__)
        name = _SESSION.fastest[key]
    if name not in by_name:
        name = _nearest(key)
    config = by_name.get(name, configs[0])
    _USED[key] = config
    return config


def chosen_configs() -> dict[tuple, Config]:
    """A copy of what each key of this process last launched with, keyed by ``tuning_key``."""
    return dict(_USED)


def agreed_configs() -> dict[tuple, str]:
    """A copy of the agreed configuration names, keyed by ``tuning_key``."""
    return dict(_AGREED)


def clear_cache() -> None:
    """Forget every agreed and used configuration (tests, and the GPU check between settings)."""
    _AGREED.clear()
    _USED.clear()
    _nearest.cache_clear()
