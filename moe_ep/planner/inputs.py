"""The planner's numeric inputs and the ranges it accepts, one table for the Python API and the
command line. The ranges hold every real cluster and model with room to spare and keep the search
to seconds (the layouts it enumerates grow with the divisors of the world size and of the
sequences per step)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Bound:
    kind: type  # int or float
    lo: float
    hi: float
    lo_open: bool = False  # lo itself excluded

    def describe(self) -> str:
        if self.kind is int:
            return f"an int in [{int(self.lo)}, {int(self.hi)}]"
        return f"a number in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}]"

    def check(self, name: str, value):
        """``value`` if it is of the kind and in range, else ValueError naming ``name``."""
        ok_type = (isinstance(value, int) if self.kind is int else isinstance(value, (int, float)))
        if isinstance(value, bool) or not ok_type or (self.kind is float and not math.isfinite(value)):
            raise ValueError(f"{name} must be {self.describe()}, got {value!r}")
        low_ok = value > self.lo if self.lo_open else value >= self.lo
        if not low_ok or value > self.hi:
            raise ValueError(f"{name} must be {self.describe()}, got {value!r}")
        return value


MAX_WORLD = 16384
BOUNDS = {
    "nodes": Bound(int, 1, 2048),
    "gpus_per_node": Bound(int, 1, 64),
    "gpu_memory_gib": Bound(float, 0, 4096, lo_open=True),
    "seq_len": Bound(int, 1, 2**20),
    "global_batch_tokens": Bound(int, 1, 2**30),
    "microbatch_size": Bound(int, 1, 2**20),
    "intra_node_gbps": Bound(float, 0, 1e5, lo_open=True),
    "inter_node_gbps": Bound(float, 0, 1e5, lo_open=True),
    "peak_tflops": Bound(float, 0, 1e5, lo_open=True),
    "hbm_gbps": Bound(float, 0, 1e6, lo_open=True),
    "grouped_gemm_efficiency": Bound(float, 0, 1, lo_open=True),
    "dense_gemm_efficiency": Bound(float, 0, 1, lo_open=True),
    "attention_efficiency": Bound(float, 0, 1, lo_open=True),
    "memory_efficiency": Bound(float, 0, 1, lo_open=True),
    "reserve_fraction": Bound(float, 0, 0.9),
    "imbalance": Bound(float, 1, 1024),
    "startup_imbalance": Bound(float, 1, 1024),
    "capacity_factor": Bound(float, 0, 1024, lo_open=True),
    "min_headroom": Bound(float, 0, 0.9),
    "speed_margin": Bound(float, 0, 1),
    "num_alternatives": Bound(int, 0, 100),
    "pp": Bound(int, 1, MAX_WORLD),
    "dp_replicate": Bound(int, 1, MAX_WORLD),
    "dp_shard": Bound(int, 1, MAX_WORLD),
    "ep": Bound(int, 1, MAX_WORLD),
    "virtual_stages": Bound(int, 2, 1024),
    "max_nodes": Bound(int, 1, MAX_WORLD),
    "overlap_chunks": Bound(int, 1, 64),
}


def check(name: str, value, *, label: str | None = None, optional: bool = False):
    """Check ``value`` against ``BOUNDS[name]``; the error names ``label`` (default ``name``)."""
    if value is None and optional:
        return None
    return BOUNDS[name].check(label or name, value)


def check_world(nodes: int, gpus_per_node: int) -> None:
    if nodes * gpus_per_node > MAX_WORLD:
        raise ValueError(
            f"nodes x gpus_per_node = {nodes} x {gpus_per_node} = {nodes * gpus_per_node} GPUs; the planner "
            f"takes at most {MAX_WORLD}"
        )
