"""A static cost model of the expert MLP's kernels: FLOPs, DRAM bytes (with the re-reads implied
by the tile order), a roofline bound at an architecture's peak, and an expected time, at a
reference problem (Mixtral-8x7B by default). Every figure here is an estimate made without a GPU.

The roofline bound is the time no kernel can beat: every FLOP at the tensor cores' datasheet peak,
or every byte at the datasheet bandwidth, whichever takes longer. Dense cuBLAS gets the same bound,
so a ratio of bounds says only how much more DRAM traffic and tile padding one path has than the
other, not how fast either runs. The expected time (``expected``) says how far from the bound each
kernel should land: the rates that dense cuBLAS and a copy reach on the real card (``EFFICIENCY``),
the share of that rate our mainloop keeps on its load path (``MAINLOOP``, an assumption until the
GPU check measures it), the pipeline fill of every tile, and the epilogue, which Triton without
warp specialisation does not overlap with the next tile's mainloop.

Traffic model of a tiled GEMM: programs run in waves of as many tiles as fit on the GPU at once
(one per SM for a persistent grid, SMs times the occupancy the compiled kernel allows otherwise),
in the kernel's own tile order. Within a wave the concurrent tiles walk their reduction in step,
so an operand panel shared by several tiles of the wave comes from DRAM once and from L2 after
that; a panel needed again by a later wave is read again. Compute time counts every tile a wave
issues, padding and ragged edges included, at the tensor cores' dense peak; a kernel's roofline
time is the larger of its compute and memory times."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Machine:
    name: str
    flops: float  # dense bf16/fp16 tensor-core peak, FLOP/s
    bandwidth: float  # DRAM, B/s
    sms: int
    smem_per_sm: int  # bytes of shared memory per SM that blocks may use
    source: str
    regs_per_sm: int = 65536
    threads_per_sm: int = 2048


@dataclass(frozen=True)
class Efficiency:
    """Fractions of a machine's datasheet peaks that real code sustains."""

    gemm: float  # a large dense bf16 GEMM through cuBLAS
    copy: float  # a large device-to-device copy, bytes read plus written
    source: str


MACHINES = {
    80: Machine("A100 SXM4 80GB", 312e12, 2.039e12, 108, 164 * 1024,
                "NVIDIA A100 Tensor Core GPU datasheet: 312 TFLOP/s dense BF16, 2,039 GB/s HBM2e (80GB SXM); "
                "A100 whitepaper: 108 SMs, 164 KB shared memory per SM"),
    90: Machine("H100 SXM5 80GB", 989e12, 3.35e12, 132, 228 * 1024,
                "NVIDIA H100 Tensor Core GPU datasheet: 989 TFLOP/s dense BF16 (1,979 with sparsity), 3.35 TB/s "
                "HBM3 (SXM); Hopper whitepaper: 132 SMs, 228 KB shared memory per SM"),
}

EFFICIENCY = {
    80: Efficiency(0.85, 0.90, "assumed: no A100 was measured for this project"),
    90: Efficiency(798 / 989, 3.0 / 3.35,
                   "measured on the H100 80GB HBM3 lent to this workplace (2026-11-13, torch 2.11): "
                   "an 8192x8192x8192 bf16 matmul at 798 TFLOP/s, a device-to-device copy at 3.0 TB/s"),
}
# The share of cuBLAS's mainloop rate that our Triton mainloop keeps, by how its streamed operands
# arrive: tensor descriptors (TMA, as CUTLASS), per-thread cp.async (address arithmetic and more
# issue slots per byte), or element-wise loads (rows that are not 16-byte aligned). Assumed, not
# measured: ``python -m moe_ep.bench gpu`` measures the kernels against cuBLAS.
MAINLOOP = {"TMA": 0.95, "cp.async": 0.85, "ld.global": 0.35}


@dataclass(frozen=True)
class Problem:
    """One MoE layer's experts, every expert receiving the same number of rows."""

    T: int = 16384
    K: int = 2
    H: int = 4096
    I: int = 14336
    E: int = 8
    elem: int = 2  # bytes per element (bf16)
    pad_m: int = 128

    @property
    def N(self) -> int:
        return self.T * self.K

    def expert_counts(self) -> list[int]:
        """Rows per expert, unpadded."""
        base, extra = divmod(self.N, self.E)
        return [base + (e < extra) for e in range(self.E)]

    def expert_rows(self) -> list[int]:
        """Padded rows per expert."""
        return [-(-c // self.pad_m) * self.pad_m for c in self.expert_counts()]


MIXTRAL = Problem()
# The expert shapes of the fine-grained models people train (their configs' hidden_size,
# moe_intermediate_size, num_experts, num_experts_per_tok). DeepSeek-V3 as one rank of EP8 sees it:
# 32 of its 256 experts, and 4096 tokens a rank each routing 8 ways, about 1024 rows per expert. (All
# 256 experts in one process do not fit beside their float64 checks: weights and gradients alone
# take 45 GB, and no one trains them that way.) pad_m as routing_block gives it.
PROBLEMS = {
    "mixtral-8x7b": MIXTRAL,
    "qwen3-30b-a3b": Problem(T=16384, K=8, H=2048, I=768, E=128),
    "olmoe-1b-7b": Problem(T=16384, K=8, H=2048, I=1024, E=64),
    "deepseek-v3-ep8": Problem(T=4096, K=8, H=7168, I=2048, E=32),
}


@dataclass(frozen=True)
class Gemm:
    """One grouped-GEMM launch as the model sees it.

    kind "rows": the output has one row per padded row (an expert's rows times its weight); n
    output columns, a reduction of length k; each tile reads a [BLOCK_M, k] row panel and
    ``b_panels`` [k, BLOCK_N] panels of its expert's weight. ``epilogue_read`` and
    ``epilogue_write`` are elements read and written per output element besides the operands.
    kind "weight": the output is each expert's [m, n] weight gradient, a reduction over the
    expert's rows; each tile reads a [rows, BLOCK_M] panel and ``b_panels`` [rows, BLOCK_N]
    panels."""

    kind: str
    n: int
    k: int = 0  # rows: reduction length
    m: int = 0  # weight: rows of the weight
    b_panels: int = 1
    dots: int = 1  # rows: products per tile (gate and up: 2)
    epilogue_read: int = 0
    epilogue_write: int = 1


def _tile_order(num_pid_m: int, num_pid_n: int, group_m: int):
    """The kernels' grouped tile order (``_tile`` in grouped_gemm)."""
    per_group = group_m * num_pid_n
    for t in range(num_pid_m * num_pid_n):
        first_m = (t // per_group) * group_m
        rows = min(num_pid_m - first_m, group_m)
        yield first_m + (t % per_group) % rows, (t % per_group) // rows


def occupancy(machine: Machine, registers: int, shared: int, warps: int) -> int:
    threads = warps * 32
    by_regs = machine.regs_per_sm // max(1, registers * threads)
    by_smem = machine.smem_per_sm // max(1, shared)
    return max(1, min(by_regs, by_smem, machine.threads_per_sm // threads))


def estimate(g: Gemm, p: Problem, machine: Machine, block: tuple, group_m: int, concurrent: int) -> dict:
    """FLOPs (useful and issued), DRAM bytes read and written (and the epilogue's share), reduction
    steps per tile, and the compute, memory and roofline times of one launch."""
    bm, bn, bk = block
    e = p.elem
    rows = p.expert_rows()
    waves_a, waves_b, tile_flops = [], [], []
    if g.kind == "rows":
        owner = [ex for ex, r in enumerate(rows) for _ in range(r // bm)]
        nn = math.ceil(g.n / bn)
        for pid_m, pid_n in _tile_order(len(owner), nn, group_m):
            waves_a.append((pid_m,))
            waves_b.append((owner[pid_m], pid_n))
            tile_flops.append(2 * bm * bn * g.k * g.dots)
        a_bytes = lambda key: bm * g.k * e  # noqa: E731
        b_bytes = lambda key: g.b_panels * g.k * bn * e  # noqa: E731
        useful = 2 * p.N * g.n * g.k * g.dots
        written = (g.epilogue_write * sum(rows) * g.n) * e
        extra_read = g.epilogue_read * sum(rows) * g.n * e
        k_steps = g.k / bk
    else:
        nm, nn = math.ceil(g.m / bm), math.ceil(g.n / bn)
        for ex, r in enumerate(rows):
            for pid_m, pid_n in _tile_order(nm, nn, group_m):
                waves_a.append((ex, pid_m))
                waves_b.append((ex, pid_n))
                tile_flops.append(2 * bm * bn * r)
        a_bytes = lambda key: rows[key[0]] * bm * e  # noqa: E731
        b_bytes = lambda key: g.b_panels * rows[key[0]] * bn * e  # noqa: E731
        useful = 2 * p.N * g.m * g.n
        written = p.E * g.m * g.n * e
        extra_read = 0
        k_steps = sum(rows) / p.E / bk
    read = extra_read
    compute = 0.0
    for start in range(0, len(tile_flops), concurrent):
        stop = start + concurrent
        read += sum(a_bytes(k) for k in set(waves_a[start:stop])) + sum(b_bytes(k) for k in set(waves_b[start:stop]))
        wave = tile_flops[start:stop]
        compute += math.ceil(len(wave) / machine.sms) * max(wave) * machine.sms / machine.flops
    memory = (read + written) / machine.bandwidth
    return {
        "flops": useful, "flops_issued": sum(tile_flops), "bytes_read": read, "bytes_written": written,
        "epilogue_bytes": extra_read + written, "k_steps": k_steps,
        "compute_ms": compute * 1e3, "memory_ms": memory * 1e3, "roofline_ms": max(compute, memory) * 1e3,
    }


def expected(est: dict, arch: int, load_path: str, num_stages: int) -> dict:
    """How far from its roofline bound a compiled launch should land (see the module docstring):
    the mainloop at cuBLAS's measured rate times the share its load path keeps (the slowest path of
    its operands), plus the pipeline fill of each tile ((stages - 1) of its reduction steps), plus
    the epilogue's traffic at copy speed, serialised; never faster than all its traffic at copy
    speed."""
    machine, eff = MACHINES[arch], EFFICIENCY[arch]
    share = min(MAINLOOP[path] for path in load_path.split("+"))
    fill = (num_stages - 1) / max(est["k_steps"], 1.0)
    mainloop = est["compute_ms"] * (1 + fill) / (eff.gemm * share)
    epilogue = est["epilogue_bytes"] / (machine.bandwidth * eff.copy) * 1e3
    ms = max(mainloop + epilogue, est["memory_ms"] / eff.copy)
    return {"expected_ms": ms, "of_bound": est["roofline_ms"] / ms}


def memory_pass(name: str, read: float, written: float, arch: int) -> dict:
    """A bandwidth-bound pass (permutation, activation, combine...): bound at the datasheet
    bandwidth, expected at copy speed."""
    machine, eff = MACHINES[arch], EFFICIENCY[arch]
    t = (read + written) / machine.bandwidth * 1e3
    return {"step": name, "flops": 0, "bytes_read": read, "bytes_written": written,
            "roofline_ms": t, "expected_ms": t / eff.copy}


def gemm_pass(name: str, flops: float, read: float, written: float, arch: int) -> dict:
    """A library GEMM (cuBLAS, or CUTLASS under grouped_mm, taken as fast): bound at the tensor
    cores' peak or the bandwidth, whichever binds; expected at cuBLAS's measured rates."""
    machine, eff = MACHINES[arch], EFFICIENCY[arch]
    compute, memory = flops / machine.flops * 1e3, (read + written) / machine.bandwidth * 1e3
    return {"step": name, "flops": flops, "bytes_read": read, "bytes_written": written,
            "roofline_ms": max(compute, memory), "expected_ms": max(compute / eff.gemm, memory / eff.copy)}


# torch's grouped GEMM below sm_90 (torch 2.9-2.11 build no grouped kernel for sm_80:
# pytorch#161407): ``_grouped_mm_fallback`` copies ``offs`` to the host, a sync that drains the
# stream, then issues one cuBLAS matmul per group from the host. Assumed, not measured (no A100 was
# lent): the host time to issue one of those matmuls (ATen's dispatch, the narrowed views, the
# cuBLAS launch), which the GPU waits out whenever a group's GEMM is shorter; and what one sync
# costs (the copy's round trip, then the empty queue until the next launch arrives).
LOOP_LAUNCH_S = 6e-6
LOOP_SYNC_S = 15e-6
# The output tile cuBLAS is taken to run each group's GEMM in: a group that fills less than whole
# waves of them leaves SMs idle for the rest of the wave.
LOOP_TILE = 128


def grouped_mm_loops(arch: int) -> bool:
    """Whether torch's grouped GEMM runs as the host-synced per-group loop on ``arch``."""
    return arch < 90


def loop_gemm_pass(name: str, shapes: list[tuple[int, int, int]], arch: int, elem: int = 2) -> dict:
    """The per-group loop of torch's grouped-GEMM fallback: one host sync, then one cuBLAS GEMM per
    non-empty group of ``shapes`` ([m, n] output, reduction k), each taking the longer of its GPU
    time (whole waves of LOOP_TILE tiles at cuBLAS's rate, or its traffic at copy speed) and the
    host's time to issue it. The bound is the hardware's, as for one launch."""
    machine, eff = MACHINES[arch], EFFICIENCY[arch]
    flops = read = written = 0.0
    ms = LOOP_SYNC_S
    for m, n, k in shapes:
        if not m * n * k:
            continue
        tiles = math.ceil(m / LOOP_TILE) * math.ceil(n / LOOP_TILE)
        waves = math.ceil(tiles / machine.sms)
        compute = waves * machine.sms * 2 * LOOP_TILE * LOOP_TILE * k / machine.flops / eff.gemm
        bytes_ = (m * k + k * n + m * n) * elem
        ms += max(compute, bytes_ / (machine.bandwidth * eff.copy), LOOP_LAUNCH_S)
        flops, read, written = flops + 2 * m * n * k, read + (m * k + k * n) * elem, written + m * n * elem
    bound = max(flops / machine.flops, (read + written) / machine.bandwidth)
    return {"step": name, "flops": flops, "bytes_read": read, "bytes_written": written,
            "roofline_ms": bound * 1e3, "expected_ms": ms * 1e3, "host_syncs": 1,
            "launches": sum(1 for s in shapes if s[0] * s[1] * s[2])}


def grouped_gemm_pass(name: str, shapes: list[tuple[int, int, int]], arch: int, elem: int = 2) -> dict:
    """torch's grouped GEMM over ``shapes`` (per group: [m, n] output, reduction k): one launch
    taken as fast as cuBLAS on sm_90 and later, the per-group loop below."""
    if grouped_mm_loops(arch):
        return loop_gemm_pass(name, shapes, arch, elem)
    flops = sum(2 * m * n * k for m, n, k in shapes)
    read = sum((m * k + k * n) * elem for m, n, k in shapes)
    return gemm_pass(name, flops, read, sum(m * n * elem for m, n, k in shapes), arch)


def expert_mlp_flops(p: Problem) -> float:
    """Forward and backward of the expert MLP: forward 2N(2I)H + 2NIH, backward twice that."""
    forward = 2 * p.N * 2 * p.I * p.H + 2 * p.N * p.I * p.H
    return 3 * forward


def grouped_mm_sequence(p: Problem, arch: int) -> list[dict]:
    """transformers' ``grouped_mm`` experts (integrations/moe.py), forward and autograd backward:
    a sort and a gather of the token rows, two grouped GEMMs (:func:`grouped_gemm_pass`: one
    CUTLASS launch on sm_90, taken as fast as cuBLAS; the host-synced per-group loop below), the
    gated activation as separate elementwise passes, the routing weight, the inverse permutation
    and the per-token sum; each a pass over DRAM. The backward of a grouped GEMM is two grouped
    GEMMs (the input's and the weight's gradient), each its own loop and sync below sm_90."""
    N, T, H, I, e = p.N, p.T, p.H, p.I, p.elem
    rows_h, rows_i = N * H * e, N * I * e
    counts = p.expert_counts()
    mp = lambda *a: memory_pass(*a, arch)  # noqa: E731
    gp = lambda name, shape: grouped_gemm_pass(name, [shape(c) for c in counts], arch, e)  # noqa: E731
    return [
        mp("fwd sort + gather x[perm]", N * 8 * 3 + rows_h, rows_h + N * 8),
        gp("fwd grouped_mm gate_up", lambda c: (c, 2 * I, H)),
        mp("fwd act(gate)", rows_i, rows_i),
        mp("fwd act * up", 2 * rows_i, rows_i),
        gp("fwd grouped_mm down", lambda c: (c, H, I)),
        mp("fwd * routing weight", rows_h + N * 4, rows_h),
        mp("fwd inverse permutation", rows_h, rows_h),
        mp("fwd sum over top-k", rows_h, T * H * e),
        mp("bwd expand + inverse permutation (zero, scatter)", rows_h, 2 * rows_h),
        mp("bwd * routing weight, d weight", 3 * rows_h, rows_h + N * 4),
        gp("bwd grouped_mm d h", lambda c: (c, I, H)),
        gp("bwd grouped_mm d down", lambda c: (I, H, c)),
        mp("bwd act * up", 3 * rows_i, 2 * rows_i),
        mp("bwd act(gate)", 2 * rows_i, rows_i),
        mp("bwd cat(d gate, d up)", 2 * rows_i, 2 * rows_i),
        gp("bwd grouped_mm d x", lambda c: (c, H, 2 * I)),
        gp("bwd grouped_mm d gate_up", lambda c: (H, 2 * I, c)),
        mp("bwd gather backward (index_add)", rows_h + 2 * T * H * e, T * H * e * 2),
    ]


def activation_bytes(p: Problem) -> dict:
    """Bytes each path saves from forward for backward, besides x, the weights and the routing."""
    N, H, I, e = p.N, p.H, p.I, p.elem
    P = sum(p.expert_rows()) + p.E * p.pad_m  # the static bound the metadata allocates
    return {
        # pre (P x 2I) and the int32 metadata.
        "triton": P * 2 * I * e + (P + N) * 4,
        # x[perm] (N x H), the gate_up output (N x 2I), act(gate) (N x I), h (N x I), the down
        # output (N x H, for d weight).
        "grouped_mm": N * (2 * H + 4 * I) * e,
    }


def summary(steps: list[dict]) -> dict:
    return {
        "flops": sum(s["flops"] for s in steps),
        "bytes": sum(s["bytes_read"] + s["bytes_written"] for s in steps),
        "roofline_ms": sum(s["roofline_ms"] for s in steps),
        "expected_ms": sum(s["expected_ms"] for s in steps),
        "host_syncs": sum(s.get("host_syncs", 0) for s in steps),
    }


def machine_dict(arch: int) -> dict:
    return {**asdict(MACHINES[arch]), "efficiency": asdict(EFFICIENCY[arch]), "mainloop_share": MAINLOOP}
