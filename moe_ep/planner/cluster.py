"""The hardware the planner lays a model out on, and which links a process group's traffic uses."""

from __future__ import annotations

from dataclasses import dataclass

GiB = 2**30
GB = 1e9


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``gpus_per_node`` GPUs of ``gpu_memory_gib`` each.

    Bandwidths are effective bus bandwidths per GPU in GB/s, as NCCL's tests report them:
    ``intra_node_gbps`` for traffic that stays on NVLink, ``inter_node_gbps`` for traffic that
    crosses the network (one NIC per GPU). Defaults: A100 SXM with NVLink3 (about 200 GB/s
    achieved) and one 200 Gb/s HDR InfiniBand NIC per GPU (25 GB/s). ``peak_tflops``: dense bf16
    peak (A100: 312); ``efficiency``: the fraction of it the GEMMs reach. ``reserve_fraction``:
    memory kept back for the CUDA context, NCCL and allocator fragmentation.
    ``latency_us``: fixed cost of one all-to-all."""

    nodes: int
    gpus_per_node: int
    gpu_memory_gib: float
    intra_node_gbps: float = 200.0
    inter_node_gbps: float = 25.0
    peak_tflops: float = 312.0
    efficiency: float = 0.40
    reserve_fraction: float = 0.10
    latency_us: float = 30.0

    def __post_init__(self):
        for name in ("nodes", "gpus_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("gpu_memory_gib", "intra_node_gbps", "inter_node_gbps", "peak_tflops"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"efficiency must lie in (0, 1], got {self.efficiency!r}")
        if not 0 <= self.reserve_fraction < 1:
            raise ValueError(f"reserve_fraction must lie in [0, 1), got {self.reserve_fraction!r}")
        if self.latency_us < 0:
            raise ValueError(f"latency_us must be >= 0, got {self.latency_us!r}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def memory_bytes(self) -> float:
        return self.gpu_memory_gib * GiB

    @property
    def reserved_bytes(self) -> float:
        return self.reserve_fraction * self.memory_bytes

    @property
    def flops_per_s(self) -> float:
        return self.peak_tflops * 1e12 * self.efficiency

    def intra_node(self, size: int, stride: int) -> bool:
        """Whether a group of ``size`` ranks spaced ``stride`` apart (ranks numbered node by
        node) stays inside one node."""
        span = size * stride
        return span <= self.gpus_per_node and self.gpus_per_node % span == 0

    def bandwidth(self, size: int, stride: int) -> float:
        """Bytes per second of a collective over that group."""
        return (self.intra_node_gbps if self.intra_node(size, stride) else self.inter_node_gbps) * GB
