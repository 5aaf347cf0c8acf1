"""Which path runs ``moe_experts``, and with which kernel configurations.

Two paths compute the op: the Triton kernels (``"triton"``: the gather, gated activation and
routing weight fused into the grouped GEMMs) and the grouped-GEMM path (``"torch"``: moe_ep's one
sort, its activation and weighted combine, the GEMMs on PyTorch's grouped GEMM, CUTLASS on sm_90).
Inside the Triton path, every GEMM stage (gate/up and down forward, dH, dx and the two weight
gradients) also times PyTorch's grouped GEMM as one more candidate configuration (the fused stages
completed by an element-wise pass), so each stage runs on whichever is faster. A stage is timed
alone, and its element-wise pass adds traffic that the whole op pays, so where any stage chose the
library the whole path is timed once more with every stage on its fastest Triton kernel, and the
library's stages stay only if the op ran faster with them. Where PyTorch's grouped GEMM is not
sync-free (sm_80, float32; ``kernels.library.grouped_mm_sync_free``) neither the path nor the
candidate is ever timed or run.
With ``backend="auto"`` (the default on CUDA) the op runs whichever measured faster for its
architecture, dtype, expert shapes, activation and token bucket, the way Inductor's max-autotune
chooses between its templates and ATen; ``backend="triton"``/``"torch"`` (or ``MOE_EP_BACKEND``)
pins one.

A problem (everything but the token count) is decided once, the first time the op meets it:

- each rank of the op's process group (``moe_experts(group=...)``, the expert-parallel group
  under ``moe_experts_ep``; no group: this process alone) either finds the problem in its disk
  cache or, with its real inputs, times the Triton kernels' configurations and both paths forward
  and backward at its own token bucket (host syncs: this first call only);
- one ``all_gather_object`` over the group brings every rank's cache entry or timings to every
  rank, which merge them the same way: the lowest rank's cache entry if any rank had one, else for
  each bucket the path and each kernel's configuration with the least time summed over the ranks
  that measured it;
- the merged table is installed and saved to the disk cache. Every later call, of any bucket, is
  a lookup in that table (an unmeasured bucket takes the nearest measured one): no timing, no
  host sync, no collective, and the same answer on every rank.

All ranks of the group meet the problem at the same call (the same layer's first call), so the
one collective pairs up, also on a rank with no tokens (it measures nothing). The measurement
runs under identity saved-tensor hooks, so activation checkpointing or offloading around the call
never sees its tensors. Under ``torch.compile``, in inference mode and on fake or meta tensors
nothing is measured: the table decided in an eager training call, else the defaults.
``MOE_EP_AUTOTUNE=0``: no measurement, no cache, no collective; the fixed per-architecture
defaults (``DEFAULT_PATH``, each space's first configuration).

The cache is one JSON file per GPU model under ``$MOE_EP_CACHE_DIR`` (default
``$XDG_CACHE_HOME/moe_ep`` or ``~/.cache/moe_ep``), keyed by problem and by torch and Triton
versions and by the sources of the kernels and paths it times (a rewritten kernel is measured
again, not taken from a table of the old one), with a SHA-256 of its contents. A file that does
not parse, is not moe_ep's, was written for another GPU or fails its checksum is reported with a
warning and neither loaded nor overwritten."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import math
import os
import re
import shutil
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..kernels import autotune
from ..kernels.library import GROUPED_MM, grouped_mm_sync_free
from ..kernels.runtime import interpreting

PATHS = ("triton", "torch")
# The Triton path timed with every stage on a Triton kernel, where the stages' own timings had given
# some to PyTorch's grouped GEMM: a time of the table, not a path.
TRITON_FUSED = "triton_fused"
# The path of each architecture without measurement (MOE_EP_AUTOTUNE=0, a bucket no rank
# measured, torch.compile before any eager call). Nothing has been measured on a GPU yet: the
# Triton kernels everywhere, until the GPU check says otherwise.
DEFAULT_PATH = {"sm_90": "triton", "sm_80": "triton"}
CACHE_ENV_VAR = "MOE_EP_CACHE_DIR"
CACHE_FORMAT = "moe_ep selector cache"
CACHE_VERSION = 1
# How long a save waits for another process's hold on the cache's lock before it gives up (the
# decisions stay in memory): a save takes milliseconds.
LOCK_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Problem:
    """What a decision is made for, less the token count: ``paths`` is "auto" when the paths are
    compared, "triton" when that path is pinned and only its kernels' configurations are chosen."""

    arch: str
    dtype: torch.dtype
    H: int
    I: int
    E: int
    K: int
    activation: str
    paths: str = "auto"

    def name(self) -> str:
        import triton

        return (f"{self.arch}/{str(self.dtype)[6:]}/H{self.H}/I{self.I}/E{self.E}/K{self.K}/{self.activation}"
                f"/{self.paths}/torch{torch.__version__}/triton{triton.__version__}/kernels{kernels_digest()}")


@functools.cache
def kernels_digest() -> str:
    """A digest of the sources behind a decision: the kernels, their configuration spaces and the
    two paths' code."""
    from ..kernels import grouped_gemm, library
    from . import experts_torch, experts_triton

    digest = hashlib.sha256()
    for module in (grouped_gemm, autotune, library, experts_triton, experts_torch):
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()[:12]


@dataclass(frozen=True)
class Table:
    """A problem's decisions: per measured token bucket the path (and the summed times behind it),
    and the agreed configuration of each Triton kernel launch, as (kernel, shapes, bucket, name)."""

    paths: dict[int, str]
    times: dict[int, dict[str, float | None]]
    configs: tuple[tuple[str, tuple, int, str], ...]

    def path(self, bucket: int, default: str) -> str:
        if not self.paths:
            return default
        nearest = min(self.paths, key=lambda b: (abs(math.log2(b) - math.log2(bucket)), b))
        return self.paths[nearest]

    def to_json(self) -> dict:
        return {"paths": {str(b): p for b, p in self.paths.items()},
                "times": {str(b): t for b, t in self.times.items()},
                "configs": [[k, list(s), b, n] for k, s, b, n in self.configs]}

    @classmethod
    def from_json(cls, data: dict) -> "Table":
        paths = {int(b): p for b, p in data["paths"].items()}
        if any(p not in PATHS for p in paths.values()):
            raise ValueError(f"unknown path in {sorted(set(paths.values()))}")
        if any(b < 1 for b in paths):  # a token bucket is a power of two: path() takes its logarithm
            raise ValueError(f"token buckets must be >= 1, got {sorted(paths)}")
        times = {int(b): {str(k): (None if v is None else float(v)) for k, v in t.items()}
                 for b, t in data["times"].items()}
        configs = tuple((str(k), tuple(s), int(b), str(n)) for k, s, b, n in data["configs"])
        return cls(paths, times, configs)


_TABLES: dict[Problem, Table] = {}
_DAMAGED: set[Path] = set()
_WARNED: set[str] = set()


def default_path(arch: str) -> str:
    return DEFAULT_PATH.get(arch, "triton")


def clear() -> None:
    """Forget every decision of this process (tests, and the GPU check between settings)."""
    _TABLES.clear()
    autotune.clear_cache()


def decisions() -> dict[Problem, Table]:
    """A copy of this process's decided problems."""
    return dict(_TABLES)


def choose(x_TH, idx_TK, w_TK, gate_up_E2IH, down_EHI, activation: str, num_routed: int | None = None, *,
           pinned: str | None, group: dist.ProcessGroup | None) -> str:
    """The path of this call: ``pinned`` ("triton"/"torch") or, for None, the table's. Decides the
    problem on its first call (a collective over ``group``), see the module docstring.
    ``num_routed``: ``run_experts``'; the bucket is that of the routed slots."""
    E, two_I, H = gate_up_E2IH.shape
    K = idx_TK.shape[1]
    problem = Problem(autotune.device_arch(x_TH.device), x_TH.dtype, H, two_I // 2, E, K, activation,
                      "auto" if pinned is None else pinned)
    default = pinned or default_path(problem.arch)
    if pinned is not None and not (_TABLES.get(problem) is None and _can_measure(x_TH)):
        # No bucket read: under torch.compile(dynamic=True) reading it specialises the token count.
        return pinned
    routed = idx_TK.numel() if num_routed is None else num_routed
    bucket = autotune.token_bucket(routed)
    table = _TABLES.get(problem)
    if table is None:
        if not _can_measure(x_TH):
            return default
        # The grouped-GEMM path is timed only where it is sync-free: on sm_80 timing it would put
        # its host syncs into the first step, and it could never be chosen anyway.
        measure_torch = pinned is None and grouped_mm_sync_free(problem.arch, problem.dtype)
        table = _decide(problem, (x_TH, idx_TK, w_TK, gate_up_E2IH, down_EHI, num_routed), routed,
                        measure_torch=measure_torch, group=group)
    return pinned or table.path(bucket, default)


def _can_measure(x_TH: torch.Tensor) -> bool:
    """False without eager execution (torch.compile), data (fake or meta tensors: shapes only),
    autograd (inference mode), or with tuning switched off."""
    from torch._subclasses.fake_tensor import is_fake

    return not (torch.compiler.is_compiling() or torch.is_inference_mode_enabled() or is_fake(x_TH)
                or x_TH.device.type == "meta" or not autotune.enabled())


def _decide(problem: Problem, inputs: tuple, routed: int, *, measure_torch: bool, group) -> Table:
    if inputs[0].device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"moe_experts would measure its paths for {problem.name()} inside a CUDA graph capture; run the op "
            f"once before capturing, or set {autotune.ENV_VAR}=0"
        )
    device = inputs[0].device
    cached = _cache_load(problem, device)
    mine: dict = {"cached": cached.to_json()} if cached is not None else {}
    if cached is None and routed > 0:
        bucket = autotune.token_bucket(routed)
        mine["measured"] = {bucket: _measure(problem, inputs, measure_torch)}
    everyone = [mine]
    if group is not None and dist.get_world_size(group) > 1:
        everyone = [None] * dist.get_world_size(group)
        # The one collective of this problem, on every rank at the same call.
        dist.all_gather_object(everyone, mine, group=group)
    table = _merge(everyone)
    autotune.install({(k, s, problem.dtype, problem.arch, b): n for k, s, b, n in table.configs})
    _TABLES[problem] = table
    if any("measured" in c for c in everyone) and table.paths:
        _cache_save(problem, table, device)
    return table


def _timed(fn, device: torch.device, warmup: bool) -> float:
    """Median seconds of ``fn()`` (CUDA events on a GPU), after a warm-up call if ``warmup``. Under
    the interpreter one call: the figure means nothing there, only the protocol runs."""
    if warmup:
        fn()
    times = []
    for _ in range(1 if interpreting() else 3):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            # host sync: reading the time; only on a problem's first call.
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _measure(problem: Problem, inputs: tuple, measure_torch: bool) -> dict:
    """This rank's timings at its own bucket: each Triton kernel's configurations (a tuning
    session over one forward and backward), then each path's forward and backward."""
    from .experts_torch import experts_torch_fwd
    from .experts_triton import experts_triton

    x_TH, idx_TK, w_TK, gate_up_E2IH, down_EHI, num_routed = inputs
    leaves = [t.detach().requires_grad_() for t in (x_TH, w_TK, gate_up_E2IH, down_EHI)]
    dy_TH = torch.ones_like(x_TH)

    def step(forward):
        def run():
            y = forward(leaves[0], idx_TK, leaves[1], leaves[2], leaves[3], problem.activation, num_routed)
            return torch.autograd.grad(y, leaves, dy_TH)
        return run

    paths = {"triton": step(experts_triton), "torch": step(lambda *a: experts_torch_fwd(*a)[0])}
    times: dict[str, float | None] = {}
    # The measurement's own graph keeps its tensors as they are: the caller's saved-tensor hooks
    # (activation checkpointing, offloading, a memory probe) must not see them.
    hooks = (torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
             if torch._C._autograd._saved_tensors_hooks_is_enabled() else contextlib.nullcontext())
    with torch.enable_grad(), hooks:
        with autotune.tuning() as session:
            paths["triton"]()  # tunes each kernel, and warms the path up
            times["triton"] = _timed(paths["triton"], x_TH.device, warmup=False)
        fused = _without_library(session.timings)
        if fused != session.fastest:
            # Each stage was timed alone; the library's GEMM wins a stage with an element-wise pass
            # beside it, whose traffic the whole op pays too: the path once more with every stage on
            # its fastest Triton kernel decides whether the library's stages stay.
            with autotune.tuning() as again:
                again.fastest.update(fused)
                times[TRITON_FUSED] = _timed(paths["triton"], x_TH.device, warmup=True)
        if measure_torch:
            try:
                times["torch"] = _timed(paths["torch"], x_TH.device, warmup=not interpreting())
            except (RuntimeError, NotImplementedError) as err:  # grouped GEMM lacks this dtype or GPU
                times["torch"] = None
                _warn_once(f"grouped-GEMM path unavailable for {problem.name()}: {str(err).splitlines()[0]}")
    configs = {(k[0], k[1], k[4]): t for k, t in session.timings.items()}
    return {"paths": times, "configs": configs}


def _without_library(timings: dict) -> dict:
    """The fastest configuration of each key among the Triton kernels alone."""
    return {key: min((n for n in t if n != str(GROUPED_MM)), key=t.__getitem__) for key, t in timings.items()}


def _merge(everyone: list[dict]) -> Table:
    """The same table from the same contributions on every rank: the lowest rank's cache entry
    (its measured buckets added where it has none), else per bucket and per launch the least time
    summed over the ranks that measured it; a path that failed on any rank is out."""
    cached = next((Table.from_json(c["cached"]) for c in everyone if "cached" in c), None)
    path_times: dict[int, dict[str, float | None]] = {}
    config_times: dict[tuple, dict[str, float]] = {}
    # The path buckets each launch was timed under: a launch's own bucket counts its kernel's
    # rows, which under expert parallelism (received rows of several columns) is not the path's.
    timed_under: dict[tuple, set[int]] = {}
    fused_buckets = {b for c in everyone for b, m in c.get("measured", {}).items() if TRITON_FUSED in m["paths"]}
    for c in everyone:
        for bucket, m in sorted(c.get("measured", {}).items()):
            summed = path_times.setdefault(bucket, {})
            # A rank whose stages all chose Triton kernels timed that path once, as "triton".
            mine = {**m["paths"], TRITON_FUSED: m["paths"].get(TRITON_FUSED, m["paths"]["triton"])} \
                if bucket in fused_buckets else m["paths"]
            for path, t in mine.items():
                summed[path] = None if t is None or (path in summed and summed[path] is None) else summed.get(path, 0) + t
            for launch, timings in m["configs"].items():
                timed_under.setdefault(launch, set()).add(bucket)
                for name, t in timings.items():
                    config_times.setdefault(launch, {})[name] = config_times.get(launch, {}).get(name, 0.0) + t
    paths = dict(cached.paths) if cached else {}
    times = dict(cached.times) if cached else {}
    configs = {(k, s, b): n for k, s, b, n in cached.configs} if cached else {}
    library_out = set()  # buckets whose whole op ran faster without the library's stages
    for bucket, summed in path_times.items():
        if bucket in paths:
            continue
        usable = {p: t for p, t in summed.items() if t is not None}
        if TRITON_FUSED in usable:
            fused = usable.pop(TRITON_FUSED)
            if fused <= usable["triton"]:
                library_out.add(bucket)
                usable["triton"] = fused
        paths[bucket] = min(sorted(usable), key=usable.__getitem__) if usable else "triton"
        times[bucket] = summed
    for launch, timings in config_times.items():
        if timed_under[launch] & library_out:
            timings = {n: t for n, t in timings.items() if n != str(GROUPED_MM)}
        configs.setdefault(launch, min(sorted(timings), key=timings.__getitem__))
    return Table(dict(sorted(paths.items())), dict(sorted(times.items())),
                 tuple(sorted((k, s, b, n) for (k, s, b), n in configs.items())))


# ----------------------------------------------------------------------------------------------
# Disk cache


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def cache_file(device: torch.device) -> Path:
    """This GPU model's cache file (``interpreter`` under the Triton interpreter)."""
    root = os.environ.get(CACHE_ENV_VAR) or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moe_ep"
    model = "interpreter" if interpreting() else torch.cuda.get_device_name(device)
    return Path(root) / f"selector-{re.sub(r'[^A-Za-z0-9]+', '-', model).strip('-').lower()}.json"


def _cache_path(device: torch.device) -> Path | None:
    """``cache_file``, or None (warned once) where there is no home directory to put it under (a
    container's user without one) and no $MOE_EP_CACHE_DIR: the decisions then stay in memory."""
    try:
        return cache_file(device)
    except RuntimeError as err:
        _warn_once(f"moe_ep: no selector cache ({err}); set {CACHE_ENV_VAR} to keep decisions across runs")
        return None


def _checksum(families: dict) -> str:
    return hashlib.sha256(json.dumps(families, sort_keys=True).encode()).hexdigest()


def _read(path: Path) -> dict | None:
    """The cache's families, {} when there is no file, None when the file is damaged (warned)."""
    if path in _DAMAGED:
        return None
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT:
            raise ValueError("not a moe_ep selector cache")
        if data.get("version") != CACHE_VERSION:
            raise ValueError(f"version {data.get('version')!r}, expected {CACHE_VERSION}")
        families = data["families"]
        if data.get("sha256") != _checksum(families):
            raise ValueError("checksum mismatch")
        if data.get("device") != path.stem:
            raise ValueError(f"written for {data.get('device')!r}, not {path.stem!r}")
        for entry in families.values():
            Table.from_json(entry)
        return families
    except (FileNotFoundError, NotADirectoryError):
        return {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        _DAMAGED.add(path)
        _warn_once(f"moe_ep: ignoring the damaged selector cache {path} ({type(err).__name__}: {err}); it is "
                   f"neither loaded nor overwritten: delete it to let moe_ep write a new one")
        return None


def _cache_load(problem: Problem, device: torch.device) -> Table | None:
    path = _cache_path(device)
    families = None if path is None else _read(path)
    entry = (families or {}).get(problem.name())
    return None if entry is None else Table.from_json(entry)


@contextlib.contextmanager
def _cache_lock(path: Path):
    """An exclusive lock on ``path``'s lock file beside it, for one read, merge and rename: without
    it, processes saving at once (the ranks of a node, several jobs) each renamed their own copy
    over the file and the last one dropped the others' problems (3 processes lost 69 of 120).
    A holder that keeps it past ``LOCK_TIMEOUT_S`` (a stopped process, a hung network file system)
    raises OSError instead of stalling this rank while the others go on to their next collective."""
    fd = os.open(path.with_name(f".{path.name}.lock"), os.O_RDWR | os.O_CREAT, 0o666)  # the umask decides
    try:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except (BlockingIOError, PermissionError):  # held by another process (EAGAIN or EACCES)
                if time.monotonic() >= deadline:
                    raise OSError(f"its lock was held by another process for {LOCK_TIMEOUT_S:g} s") from None
                time.sleep(0.05)
            except OSError:  # a file system without locks: unguarded, as before
                break
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _cache_save(problem: Problem, table: Table, device: torch.device) -> None:
    """Add ``problem`` to the cache file, under its lock: written whole to a temporary file
    beside it, then renamed over it, so a crash leaves the old file or the new one, never half of
    one."""
    path = _cache_path(device)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with _cache_lock(path):
            families = _read(path)
            if families is None:
                return
            families[problem.name()] = table.to_json()
            text = json.dumps({"format": CACHE_FORMAT, "version": CACHE_VERSION, "device": path.stem,
                               "families": families, "sha256": _checksum(families)}, indent=1, sort_keys=True)
            if shutil.disk_usage(path.parent).free < 2 * len(text) + 2**20:
                raise OSError(f"less than {2 * len(text) + 2**20} bytes free")
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(text)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
    except OSError as err:
        _warn_once(f"moe_ep: could not write the selector cache {path} ({err}); decisions stay in memory (set "
                   f"{CACHE_ENV_VAR} to a writable folder to keep them)")
