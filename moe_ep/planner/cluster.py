"""The hardware the planner lays a model out on, and which links a process group's traffic uses."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .presets import A100_80GB, EFFICIENCIES, ClusterPreset, Efficiencies, efficiencies_for

GiB = 2**30
GB = 1e9


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``gpus_per_node`` GPUs of ``gpu_memory_gib`` each.

    ``peak_tflops``: dense bf16 peak of one GPU; ``hbm_gbps``: its memory bandwidth;
    ``efficiencies``: the fractions of those peaks each kind of kernel reaches
    (``moe_ep.planner.presets.Efficiencies``). Bandwidths are per GPU in GB/s:
    ``intra_node_gbps`` the bus bandwidth NCCL reaches over NVLink, ``inter_node_gbps`` one GPU's
    share of its node's network (the node's NICs' line rate over its GPUs). A collective over a
    group that stays in a node runs at the NVLink figure; one that crosses nodes at the network
    share of the group's GPUs on each node (every GPU of a node runs a collective of the same kind
    at once, so a group with k GPUs per node has k shares: a group spanning whole nodes gets the
    node's whole network), at most the NVLink figure. ``reserve_fraction``: memory kept back for
    the CUDA context, NCCL and allocator fragmentation. ``latency_us``: fixed cost of one
    all-to-all. Defaults: a DGX A100 80 GB (``moe_ep.planner.presets``); ``gpu`` and ``preset``
    name what the figures describe."""

    nodes: int
    gpus_per_node: int
    gpu_memory_gib: float
    intra_node_gbps: float = A100_80GB.nvlink_gbps
    inter_node_gbps: float = 25.0
    peak_tflops: float = A100_80GB.peak_tflops
    hbm_gbps: float = A100_80GB.hbm_gbps
    efficiencies: Efficiencies = EFFICIENCIES["A100"]
    reserve_fraction: float = 0.10
    latency_us: float = 30.0
    gpu: str = A100_80GB.name
    preset: str | None = None

    def __post_init__(self):
        for name in ("nodes", "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("gpu_memory_gib", "intra_node_gbps", "inter_node_gbps", "peak_tflops", "hbm_gbps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")
        if not isinstance(self.efficiencies, Efficiencies):
            raise TypeError(f"efficiencies must be an Efficiencies, got {type(self.efficiencies).__name__}")
        if isinstance(self.reserve_fraction, bool) or not 0 <= self.reserve_fraction < 1:
            raise ValueError(f"reserve_fraction must lie in [0, 1), got {self.reserve_fraction!r}")
        if isinstance(self.latency_us, bool) or not 0 <= self.latency_us < math.inf:
            raise ValueError(f"latency_us must be a finite number >= 0, got {self.latency_us!r}")

    @classmethod
    def from_preset(cls, preset: ClusterPreset, nodes: int, **overrides) -> "Cluster":
        """``nodes`` nodes of ``preset``; any field of the cluster may be overridden."""
        gpu = preset.gpu
        fields = dict(
            gpus_per_node=preset.gpus_per_node, gpu_memory_gib=gpu.memory_gib, intra_node_gbps=gpu.nvlink_gbps,
            inter_node_gbps=preset.network_gbps_per_gpu, peak_tflops=gpu.peak_tflops, hbm_gbps=gpu.hbm_gbps,
            efficiencies=efficiencies_for(gpu.family), gpu=gpu.name, preset=preset.name,
        )
        fields.update(overrides)
        return cls(nodes=nodes, **fields)

    def replace(self, **changes) -> "Cluster":
        return dataclasses.replace(self, **changes)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def node_network_gbps(self) -> float:
        return self.inter_node_gbps * self.gpus_per_node

    @property
    def memory_bytes(self) -> float:
        return self.gpu_memory_gib * GiB

    @property
    def reserved_bytes(self) -> float:
        return self.reserve_fraction * self.memory_bytes

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_gbps * GB

    def intra_node(self, size: int, stride: int) -> bool:
        """Whether a group of ``size`` ranks spaced ``stride`` apart (ranks numbered node by
        node) stays inside one node."""
        span = size * stride
        return span <= self.gpus_per_node and self.gpus_per_node % span == 0

    def per_node(self, size: int, stride: int) -> int:
        """GPUs of such a group on one node."""
        return max(1, min(size, self.gpus_per_node // stride))

    def bandwidth(self, size: int, stride: int) -> float:
        """Bus bandwidth in bytes per second of a collective over that group."""
        if self.intra_node(size, stride):
            return self.intra_node_gbps * GB
        return min(self.intra_node_gbps, self.per_node(size, stride) * self.inter_node_gbps) * GB

    def all_to_all_seconds(self, bytes_to_others: float, size: int, stride: int) -> float:
        """One all-to-all in which a rank sends ``bytes_to_others`` spread evenly over the other
        ``size - 1`` ranks: the peers on its node over NVLink, the others over its network share,
        both at once (every GPU of the node runs its own all-to-all at the same time)."""
        if size == 1 or not bytes_to_others:
            return 0.0
        local = self.per_node(size, stride) - 1 if not self.intra_node(size, stride) else size - 1
        share = local / (size - 1)
        return max(share * bytes_to_others / (self.intra_node_gbps * GB),
                   (1 - share) * bytes_to_others / (self.inter_node_gbps * GB)) + self.latency_us * 1e-6

    def p2p_bandwidth(self, size: int, stride: int) -> float:
        """Bytes per second between neighbours of a pipeline group of ``size`` ranks ``stride``
        apart: NVLink when the whole group is in a node, else the slowest neighbours cross nodes,
        each at its GPU's network share."""
        return (self.intra_node_gbps if self.intra_node(size, stride) else self.inter_node_gbps) * GB
