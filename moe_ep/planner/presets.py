"""Named clusters and GPUs: the figures a plan needs, with where each comes from.

Peak FLOP/s, HBM size and bandwidth and NVLink are the vendors' datasheet figures; network
bandwidth is the line rate of the NICs used for training traffic, per node. Two figures are not on
any datasheet and are stated as estimates: the bus bandwidth NCCL reaches over NVLink (about two
thirds of the per-direction NVLink peak, as nccl-tests report on these systems), and the per-kernel
efficiencies (:data:`EFFICIENCIES`), which a result file of ``python -m moe_ep.bench kernels`` from
the user's own GPU replaces (``moe_ep.planner.calibration``)."""

from __future__ import annotations

from dataclasses import dataclass

GBIT = 1 / 8  # GB/s per Gb/s


@dataclass(frozen=True)
class Efficiencies:
    """Fractions of the peak each kind of kernel reaches in training (forward + backward):
    grouped GEMMs (routed experts), dense GEMMs (projections, router, dense MLPs, LM head),
    attention (flash attention's two batched GEMMs, charged with its backward's recompute) and
    memory-bound kernels (norms, rotary, SwiGLU, residuals, permutation, loss, optimizer), the
    last as a fraction of the HBM bandwidth. ``sources`` says where each figure comes from."""

    grouped_gemm: float
    dense_gemm: float
    attention: float
    memory: float
    sources: tuple[tuple[str, str], ...] = ()

    KINDS = ("grouped_gemm", "dense_gemm", "attention", "memory")

    def __post_init__(self):
        for kind in self.KINDS:
            value = getattr(self, kind)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ValueError(f"{kind} efficiency must be a number in (0, 1], got {value!r}")

    def source(self, kind: str) -> str:
        return dict(self.sources).get(kind, "given")


@dataclass(frozen=True)
class GPU:
    name: str
    family: str  # the key of EFFICIENCIES, and what a calibration file's device must name
    peak_tflops: float  # dense bf16
    memory_gib: float
    hbm_gbps: float
    nvlink_gbps: float  # NCCL bus bandwidth per GPU inside a node (estimated, see the module doc)
    source: str


A100_40GB = GPU(
    "A100-SXM4-40GB", "A100", 312.0, 40.0, 1555.0, 200.0,
    "NVIDIA A100 datasheet: 312 TFLOP/s dense BF16, 40 GB HBM2 at 1,555 GB/s, NVLink 600 GB/s (300 GB/s each way)",
)
A100_80GB = GPU(
    "A100-SXM4-80GB", "A100", 312.0, 80.0, 2039.0, 200.0,
    "NVIDIA A100 datasheet: 312 TFLOP/s dense BF16, 80 GB HBM2e at 2,039 GB/s, NVLink 600 GB/s (300 GB/s each way)",
)
H100_80GB = GPU(
    "H100-SXM5-80GB", "H100", 989.0, 80.0, 3350.0, 360.0,
    "NVIDIA H100 datasheet: 989 TFLOP/s dense BF16, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s (450 GB/s each way)",
)
H200_141GB = GPU(
    "H200-SXM-141GB", "H200", 989.0, 140.0, 4800.0, 360.0,
    "NVIDIA H200 datasheet: 989 TFLOP/s dense BF16, 141 GB HBM3e (143,771 MiB as CUDA reports it: 140 GiB) at "
    "4.8 TB/s, NVLink 900 GB/s (450 GB/s each way)",
)

_FA2 = "FlashAttention-2 (Dao, 2023)"
_GROUPED = ("estimated: 0.85 x the dense figure, the bar moe_ep's Triton grouped GEMMs are benchmarked against "
            "(python -m moe_ep.bench kernels, fwd+bwd vs dense >= 0.8)")
_MEMORY = "estimated: elementwise kernels and copies move about 80% of the HBM peak"
EFFICIENCIES = {
    "A100": Efficiencies(
        grouped_gemm=0.64, dense_gemm=0.75, attention=0.60, memory=0.80,
        sources=(
            ("dense_gemm", "estimated: cuBLAS BF16 GEMMs of Mixtral's sizes reach about 230-250 of 312 TFLOP/s "
                           "in public A100 benchmarks"),
            ("grouped_gemm", _GROUPED),
            ("attention", f"estimated: {_FA2}, fig. 4: causal, head dim 128, 4k tokens, forward+backward "
                          "about 190 TFLOP/s on A100-80GB"),
            ("memory", _MEMORY),
        ),
    ),
    "H100": Efficiencies(
        grouped_gemm=0.56, dense_gemm=0.66, attention=0.35, memory=0.80,
        sources=(
            ("dense_gemm", "estimated: cuBLAS BF16 GEMMs of Mixtral's sizes reach about 600-700 of 989 TFLOP/s "
                           "in public H100 benchmarks"),
            ("grouped_gemm", _GROUPED),
            ("attention", f"estimated: {_FA2} as PyTorch's SDPA runs it, measured at about 350 TFLOP/s "
                          "forward+backward on H100 SXM5 in FlashAttention-3 (Shah et al., 2024)"),
            ("memory", _MEMORY),
        ),
    ),
}
# The H200 is the H100's GH100 chip (the same SMs and clocks) with faster, larger HBM: its
# compute-bound kernels run at the H100's rates (the gates of 2026-11-25 and 2026-11-28 measured
# the same dense cuBLAS chain at 684 and 691 TFLOP/s), so the H100's compute estimates stand.
EFFICIENCIES["H200"] = Efficiencies(
    grouped_gemm=EFFICIENCIES["H100"].grouped_gemm, dense_gemm=EFFICIENCIES["H100"].dense_gemm,
    attention=EFFICIENCIES["H100"].attention, memory=EFFICIENCIES["H100"].memory,
    sources=tuple((kind, f"the H100's (the same GH100 compute): {text}") if kind != "memory" else (kind, text)
                  for kind, text in EFFICIENCIES["H100"].sources),
)


@dataclass(frozen=True)
class ClusterPreset:
    name: str
    description: str
    gpu: GPU
    gpus_per_node: int
    network_gbps: float  # GB/s per node for training traffic, all NICs together
    network: str
    source: str

    @property
    def network_gbps_per_gpu(self) -> float:
        return self.network_gbps / self.gpus_per_node


CLUSTERS = {
    p.name: p
    for p in (
        ClusterPreset(
            "dgx-a100-40gb", "NVIDIA DGX A100 (40 GB)", A100_40GB, 8, 8 * 200 * GBIT,
            "8 x 200 Gb/s HDR InfiniBand", "NVIDIA DGX A100 datasheet: 8 single-port ConnectX-6 for compute traffic",
        ),
        ClusterPreset(
            "dgx-a100-80gb", "NVIDIA DGX A100 (80 GB)", A100_80GB, 8, 8 * 200 * GBIT,
            "8 x 200 Gb/s HDR InfiniBand", "NVIDIA DGX A100 datasheet: 8 single-port ConnectX-6 for compute traffic",
        ),
        ClusterPreset(
            "p4d", "AWS p4d.24xlarge", A100_40GB, 8, 400 * GBIT, "400 Gb/s EFA (4 x 100 Gb/s)",
            "AWS EC2 P4 instances: 8 A100 40 GB, NVSwitch 600 GB/s, 400 Gbps EFA",
        ),
        ClusterPreset(
            "p4de", "AWS p4de.24xlarge", A100_80GB, 8, 400 * GBIT, "400 Gb/s EFA (4 x 100 Gb/s)",
            "AWS EC2 P4 instances: 8 A100 80 GB, NVSwitch 600 GB/s, 400 Gbps EFA",
        ),
        ClusterPreset(
            "dgx-h100", "NVIDIA DGX H100", H100_80GB, 8, 8 * 400 * GBIT, "8 x 400 Gb/s NDR InfiniBand",
            "NVIDIA DGX H100 datasheet: 8 ConnectX-7 (400 Gb/s each) for compute traffic",
        ),
        ClusterPreset(
            "p5", "AWS p5.48xlarge", H100_80GB, 8, 3200 * GBIT, "3,200 Gb/s EFAv2 (32 x 100 Gb/s)",
            "AWS EC2 P5 instances: 8 H100 80 GB, NVSwitch 900 GB/s, 3,200 Gbps EFAv2",
        ),
        ClusterPreset(
            "dgx-h200", "NVIDIA DGX H200", H200_141GB, 8, 8 * 400 * GBIT, "8 x 400 Gb/s NDR InfiniBand",
            "NVIDIA DGX H200 datasheet: 8 ConnectX-7 (400 Gb/s each) for compute traffic",
        ),
        ClusterPreset(
            "p5e", "AWS p5e.48xlarge", H200_141GB, 8, 3200 * GBIT, "3,200 Gb/s EFA (32 x 100 Gb/s)",
            "AWS EC2 P5e instances: 8 H200 141 GB, NVSwitch 900 GB/s, 3,200 Gbps EFA",
        ),
    )
}
DEFAULT_CLUSTER = "dgx-a100-80gb"


def cluster_preset(name: str) -> ClusterPreset:
    if name not in CLUSTERS:
        raise ValueError(f"cluster must be one of {tuple(CLUSTERS)}, got {name!r}")
    return CLUSTERS[name]


def efficiencies_for(family: str) -> Efficiencies:
    """The default efficiencies of a GPU family; other GPUs get the A100's, which the report says."""
    return EFFICIENCIES.get(family, EFFICIENCIES["A100"])
