"""Kernel benchmark: the router, the routing metadata, the grouped GEMMs and the whole
``moe_experts`` forward, backward and forward+backward, against transformers' ``grouped_mm`` and
``eager`` experts on the identical routing and weights, the dense-equivalent ``torch.mm`` time
(same FLOPs, no routing) and the device's copy bandwidth.

Mixtral-8x7B shapes on CUDA (H=4096, I=14336, E=8, k=2; T = 4096, 8192, 16384); small shapes on
the CPU (H=256, I=512, E=8, k=2, T=2048) so CI exercises it.

Ratios are speedups: ``vs grouped_mm = t(grouped_mm) / t(variant)``, so > 1 is faster;
``vs dense = t(dense mm) / t(variant)`` is the fraction of the dense-equivalent speed reached.
GB/s divides a lower bound of the bytes a pass must move (weights, token rows in and out, the
weight gradients) by its time; it is the figure of merit for the memory-bound router, metadata
and copy rows and a sanity check for the compute-bound GEMM rows."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from .arguments import int_at_least
from ..kernels import autotune, library
from ..kernels.runtime import interpreting
from ..ops import selector
from ..ops.experts import moe_experts
from ..ops.experts_torch import grouped_linear, routing_order
from ..ops.routing import route_topk
from .optional import Lookup, optional_attr
from .report import Column, Report, close_figure, environment, first_line, new_figure
from .routing_cases import ROUTINGS, make_routing, max_load_share
from .timing import measure, measure_many, peak_memory_bytes, synchronize

PASSES = ("fwd", "bwd", "fwd+bwd")
FLOP_PASSES = {"fwd": 1, "bwd": 2, "fwd+bwd": 3}  # backward = dX and dW GEMMs = 2x forward
MIXTRAL_GPU = dict(hidden=4096, intermediate=14336, experts=8, top_k=2, tokens=(4096, 8192, 16384))
SMALL_CPU = dict(hidden=256, intermediate=512, experts=8, top_k=2, tokens=(2048,))
COPY_BYTES = {"cuda": 2**30, "cpu": 2**26}

REFERENCE = "hf_eager"  # err vs eager compares every variant's output and gradients with it
GROUPED_MM = "hf_grouped_mm"
DENSE = "dense_mm"

COLUMNS = [
    Column("T", "T"),
    Column("routing", "routing"),
    Column("variant", "variant"),
    Column("phase", "pass"),
    Column("ms", "ms", "{:.3f}"),
    Column("min_ms", "min ms", "{:.3f}"),
    Column("tflops", "TFLOP/s", "{:.2f}"),
    Column("gbps", "GB/s", "{:.1f}"),
    Column("peak_mib", "peak MiB", "{:.0f}"),
    Column("vs_grouped_mm", "vs grouped_mm", "{:.2f}x"),
    Column("vs_eager", "vs eager", "{:.2f}x"),
    Column("vs_dense", "vs dense", "{:.2f}"),
    Column("err_vs_eager", "err vs eager", "{:.1e}"),
    Column("status", "status"),
]


@dataclass(frozen=True)
class Problem:
    T: int
    H: int
    I: int
    E: int
    K: int
    routing: str
    dtype: torch.dtype
    device: torch.device

    @property
    def N(self) -> int:
        return self.T * self.K

    @property
    def elem(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def expert_flops(self, pass_: str) -> int:
        # GEMM 1 is 2*N*H*2I, GEMM 2 is 2*N*I*H: 6*N*H*I forward.
        return 6 * self.N * self.H * self.I * FLOP_PASSES[pass_]

    def expert_bytes(self, pass_: str) -> int:
        weights = 3 * self.E * self.H * self.I * self.elem
        rows = self.T * self.H * self.elem
        fwd = weights + 2 * rows + 8 * self.T * self.K  # read weights and x, write y; ids and weights
        bwd = 2 * weights + 3 * rows  # read weights, write their gradients; read x and dy, write dx
        return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[pass_]


@dataclass
class Inputs:
    x_TH: torch.Tensor
    idx_TK: torch.Tensor
    w_TK: torch.Tensor
    gate_up_E2IH: torch.nn.Parameter  # owned by hf_experts, so every variant differentiates the same leaves
    down_EHI: torch.nn.Parameter
    dy_TH: torch.Tensor
    router_EH: torch.Tensor
    hf_experts: torch.nn.Module

    @property
    def leaves(self) -> tuple[torch.Tensor, ...]:
        return self.x_TH, self.w_TK, self.gate_up_E2IH, self.down_EHI


def hf_mixtral_experts(p: Problem, gate_up_E2IH: torch.Tensor, down_EHI: torch.Tensor) -> torch.nn.Module:
    """A real ``MixtralExperts`` module (built from a ``MixtralConfig``) holding the given weights;
    its forward runs transformers' eager loop."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = MixtralConfig(
        hidden_size=p.H, intermediate_size=p.I, num_local_experts=p.E, num_experts_per_tok=p.K
    )
    config._experts_implementation = "eager"
    # Built on the meta device so Mixtral-sized weights are not allocated twice.
    with torch.device("meta"):
        experts = MixtralExperts(config)
    experts.gate_up_proj = torch.nn.Parameter(gate_up_E2IH)
    experts.down_proj = torch.nn.Parameter(down_EHI)
    return experts


def make_inputs(p: Problem, seed: int) -> Inputs:
    g = torch.Generator(p.device).manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, device=p.device, dtype=p.dtype) * scale

    idx_TK, w_TK = make_routing(p.routing, p.T, p.E, p.K, seed=seed)
    experts = hf_mixtral_experts(p, randn(p.E, 2 * p.I, p.H, scale=p.H**-0.5), randn(p.E, p.H, p.I, scale=p.I**-0.5))
    return Inputs(
        x_TH=randn(p.T, p.H).requires_grad_(),
        idx_TK=idx_TK.to(p.device),
        w_TK=w_TK.to(p.device).requires_grad_(),
        gate_up_E2IH=experts.gate_up_proj,
        down_EHI=experts.down_proj,
        dy_TH=randn(p.T, p.H),
        router_EH=randn(p.E, p.H, scale=p.H**-0.5).requires_grad_(),
        hf_experts=experts,
    )


# ---------------------------------------------------------------- the whole experts op


def _moe_ep(backend: str, inp: Inputs) -> torch.Tensor:
    return moe_experts(inp.x_TH, inp.idx_TK, inp.w_TK, inp.gate_up_E2IH, inp.down_EHI, backend=backend)


def _hf_grouped_mm(grouped_mm_experts_forward, inp: Inputs) -> torch.Tensor:
    return grouped_mm_experts_forward(inp.hf_experts, inp.x_TH, inp.idx_TK, inp.w_TK)


def _hf_eager(inp: Inputs) -> torch.Tensor:
    return inp.hf_experts(inp.x_TH, inp.idx_TK, inp.w_TK)


def expert_variants(device: torch.device) -> dict[str, Lookup]:
    variants = {"moe_ep[torch]": Lookup(partial(_moe_ep, "torch"), None)}
    if device.type == "cuda":
        variants["moe_ep[triton]"] = Lookup(partial(_moe_ep, "triton"), None)
        # The default on CUDA: whichever of the two measured faster on its first call.
        variants["moe_ep[auto]"] = Lookup(partial(_moe_ep, "auto"), None)
    grouped = optional_attr("transformers.integrations.moe", "grouped_mm_experts_forward")
    variants[GROUPED_MM] = Lookup(partial(_hf_grouped_mm, grouped.value), None) if grouped.available else grouped
    variants[REFERENCE] = Lookup(_hf_eager, None)
    return variants


def _pass_fns(fn: Callable[[Inputs], torch.Tensor], inp: Inputs) -> dict[str, tuple[Callable, Callable | None]]:
    """(timed function, untimed setup) per pass; the backward is timed on a fresh forward's graph."""

    def grads(y):
        return torch.autograd.grad(y, inp.leaves, inp.dy_TH)

    return {
        "fwd": (lambda: fn(inp), None),
        "bwd": (grads, lambda: (fn(inp),)),
        "fwd+bwd": (lambda: grads(fn(inp)), None),
    }


def relative_error(out: torch.Tensor, ref: torch.Tensor, chunk_elems: int = 1 << 26) -> float:
    """||out - ref|| / ||ref|| in float64, summed over chunks of rows: a whole float64 copy of a
    weight gradient (DeepSeek-V3's gate_up: 56 GiB) does not fit beside the model."""
    out_RC, ref_RC = out.detach().reshape(out.shape[0], -1), ref.detach().reshape(ref.shape[0], -1)
    rows = max(1, chunk_elems // max(1, out_RC.shape[1]))
    diff_sq = ref_sq = 0.0
    for start in range(0, out_RC.shape[0], rows):
        o, r = out_RC[start:start + rows].double(), ref_RC[start:start + rows].double()
        diff_sq += (o - r).square().sum().item()
        ref_sq += r.square().sum().item()
    return diff_sq**0.5 if ref_sq == 0 else (diff_sq / ref_sq) ** 0.5


def _outputs(fn, inp: Inputs) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    y = fn(inp)
    return y.detach(), torch.autograd.grad(y, inp.leaves, inp.dy_TH)


def dense_passes(p: Problem, seed: int) -> dict[str, Callable]:
    """``torch.mm`` chains with exactly the experts' FLOPs and no routing: the forward's two GEMMs,
    the backward's four (dX and dW of each)."""
    g = torch.Generator(p.device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=p.device, dtype=p.dtype)

    a_NH, w1_2IH, w2_HI = randn(p.N, p.H), randn(2 * p.I, p.H), randn(p.H, p.I)
    h_NI, dy_NH, da_N2I = randn(p.N, p.I), randn(p.N, p.H), randn(p.N, 2 * p.I)

    def fwd():
        torch.mm(a_NH, w1_2IH.t())
        torch.mm(h_NI, w2_HI.t())

    def bwd():
        torch.mm(dy_NH, w2_HI)
        torch.mm(dy_NH.t(), h_NI)
        torch.mm(da_N2I, w1_2IH)
        torch.mm(da_N2I.t(), a_NH)

    def fwd_bwd():
        fwd()
        bwd()

    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd_bwd}


def bench_experts(p: Problem, inp: Inputs, args) -> list[dict]:
    """Every available variant of the experts op and the dense equivalent, each pass, timed in
    turns; peak memory and the error against transformers' eager loop per variant."""
    rows, errors, peaks, cases = [], {}, {}, {}
    variants = expert_variants(p.device)
    # The reference's outputs first, and each variant's error at once: holding every variant's
    # gradients (a copy of the experts' weights each) would not fit at DeepSeek-V3's 256 experts.
    reference = _outputs(variants[REFERENCE].value, inp)
    for name, found in variants.items():
        if not found.available:
            rows.append(dict(T=p.T, routing=p.routing, kind="op", variant=name, status=found.reason))
            continue
        try:
            y, grads = _outputs(found.value, inp)
        except RuntimeError as err:
            if name.startswith("moe_ep") or isinstance(err, torch.OutOfMemoryError):
                raise
            # A baseline's own limits (grouped_mm's 16-byte row alignment) end its row, not the run.
            rows.append(dict(T=p.T, routing=p.routing, kind="op", variant=name,
                             status=f"not available: raised {type(err).__name__}: {first_line(err, 160)}"))
            continue
        y_ref, grads_ref = reference
        errors[name] = {"fwd": relative_error(y, y_ref),
                        "grads": max(relative_error(a, b) for a, b in zip(grads, grads_ref))}
        del y, grads
        peaks[name] = peak_memory_bytes(lambda: _outputs(found.value, inp), p.device)
        for pass_, case in _pass_fns(found.value, inp).items():
            cases[name, pass_] = case
    for pass_, fn in dense_passes(p, args.seed).items():
        cases[DENSE, pass_] = (fn, None)
    label = f"[kernels] T={p.T} {p.routing}: experts op and dense"
    for (name, pass_), t in measure_many(cases, device=p.device, warmup=args.warmup, reps=args.reps,
                                         label=label).items():
        row = dict(T=p.T, routing=p.routing, kind="dense" if name == DENSE else "op", variant=name, phase=pass_,
                   ms=t.median_s * 1e3, min_ms=t.min_s * 1e3, tflops=p.expert_flops(pass_) / t.median_s / 1e12,
                   status="ok")
        if name != DENSE:
            peak = peaks[name]
            row.update(gbps=p.expert_bytes(pass_) / t.median_s / 1e9, peak_mib=None if peak is None else peak / 2**20)
        if name in errors:
            row["err_vs_eager"] = errors[name]["fwd" if pass_ == "fwd" else "grads"]
        rows.append(row)
    return rows


def dense_floor(ms: dict, T, routing, phase: str) -> float | None:
    """The dense reference of a pass: the same FLOPs as ``torch.mm`` chains. For fwd+bwd, the
    faster of the one timed chain and the forward's plus the backward's timings: on the H100 the
    chain of six GEMMs measured slower than its two halves timed apart (50.7 against 14.7 + 30.8
    ms, 2026-11-25), which a floor must not be; the chain runs the GPU longest at full power, where
    its clocks drop (a likely cause, not measured). Both figures are in the rows."""
    chain = ms.get((T, routing, DENSE, phase))
    if phase != "fwd+bwd":
        return chain
    halves = [ms.get((T, routing, DENSE, half)) for half in ("fwd", "bwd")]
    split = None if None in halves else sum(halves)
    return min((t for t in (chain, split) if t is not None), default=None)


def add_ratios(rows: list[dict]) -> None:
    """vs grouped_mm, vs eager, vs dense (``dense_floor``) for every timed row of the experts op,
    against the other variants of the same (T, routing, pass)."""
    ms = {(r["T"], r["routing"], r["variant"], r["phase"]): r.get("ms") for r in rows if r["kind"] in ("op", "dense") and "ms" in r}
    for row in rows:
        if row["kind"] != "op" or row.get("ms") is None:
            continue
        for col, other in (("vs_grouped_mm", GROUPED_MM), ("vs_eager", REFERENCE)):
            t_other = ms.get((row["T"], row["routing"], other, row["phase"]))
            row[col] = None if t_other is None else t_other / row["ms"]
        floor = dense_floor(ms, row["T"], row["routing"], row["phase"])
        row["vs_dense"] = None if floor is None else floor / row["ms"]


# ---------------------------------------------------------------- individual kernels


@dataclass(frozen=True)
class Component:
    name: str
    pass_: str
    flops: int
    bytes: int
    fn: Callable | None  # None: not available, see reason
    reason: str | None = None


def _router_components(p: Problem, inp: Inputs) -> list[Component]:
    """``route_topk`` on the torch backend, forward and forward+backward."""
    x_TH = inp.x_TH.detach().requires_grad_()
    flops = 2 * p.T * p.H * p.E
    bytes_ = (p.T * p.H + p.E * p.H) * p.elem + 4 * p.T * p.E + 12 * p.T * p.K

    def fwd():
        return route_topk(x_TH, inp.router_EH, p.K, backend="torch")

    def fwd_bwd():
        logits_TE, weights_TK, _ = fwd()
        return torch.autograd.grad((logits_TE, weights_TK), (x_TH, inp.router_EH),
                                   (torch.ones_like(logits_TE), torch.ones_like(weights_TK)))

    return [
        Component("router[torch]", "fwd", flops, bytes_, fwd),
        Component("router[torch]", "fwd+bwd", 3 * flops, 2 * bytes_, fwd_bwd),
    ]


def _torch_components(p: Problem, inp: Inputs) -> list[Component]:
    with torch.no_grad():
        order_N, offsets_E = routing_order(inp.idx_TK, p.E)
        x_NH = inp.x_TH.detach()[order_N // p.K]
        h_NI = torch.randn(p.N, p.I, device=p.device, dtype=p.dtype)
    gate_up, down = inp.gate_up_E2IH.detach(), inp.down_EHI.detach()
    return [
        Component("metadata[torch]", "fwd", 0, 16 * p.N + 4 * p.E, lambda: routing_order(inp.idx_TK, p.E)),
        Component("gemm1[torch]", "fwd", 4 * p.N * p.H * p.I, (2 * p.E * p.I * p.H + p.N * p.H + 2 * p.N * p.I) * p.elem,
                  lambda: grouped_linear(x_NH, gate_up, offsets_E)),
        Component("gemm2[torch]", "fwd", 2 * p.N * p.H * p.I, (p.E * p.I * p.H + p.N * p.I + p.N * p.H) * p.elem,
                  lambda: grouped_linear(h_NI, down, offsets_E)),
    ]


def _triton_router_components(p: Problem, inp: Inputs) -> list[Component]:
    """The fused router kernel alone: forward (logits, top-k, weights) and backward (d logits)."""
    from ..kernels.router import router_backward, router_forward

    names = ("router[triton]", "fwd"), ("router[triton]", "bwd")
    x_TH, w_EH = inp.x_TH.detach(), inp.router_EH.detach()
    options = dict(sigmoid=False, normalize=True, scale=1.0)

    def fwd():
        return router_forward(x_TH, w_EH, p.K, bias_E=None, n_group=1, topk_group=1,
                              interpreting=interpreting(), **options)

    logits_TE, weights_TK, indices_TK = fwd()
    dweights_TK, dlogits_TE = torch.ones_like(weights_TK), torch.zeros_like(logits_TE)
    fwd_bytes = (p.T * p.H + p.E * p.H) * p.elem + 4 * p.T * p.E + 12 * p.T * p.K
    return [
        Component(*names[0], 2 * p.T * p.H * p.E, fwd_bytes, fwd),
        Component(*names[1], 0, 8 * p.T * p.E + 12 * p.T * p.K,
                  lambda: router_backward(logits_TE, indices_TK, dweights_TK, dlogits_TE, **options)),
    ]


TRITON_GEMMS = (
    ("metadata[triton]", "fwd"), ("gemm1[triton]", "fwd"), ("gemm2[triton]", "fwd"), ("combine[triton]", "fwd"),
    ("dy_rows[triton]", "bwd"), ("glu_bwd[triton]", "bwd"), ("dx[triton]", "bwd"), ("dw_down[triton]", "bwd"),
    ("x_rows[triton]", "bwd"), ("dw_gate_up[triton]", "bwd"),
)


def _triton_gemm_components(p: Problem, inp: Inputs) -> list[Component]:
    """Each launcher of the Triton experts op, forward and backward, on that op's own routing
    metadata and intermediates (computed once, untimed)."""
    from ..kernels import grouped_gemm as gg
    from ..kernels.routing_metadata import routing_metadata

    x_TH, dy_TH = inp.x_TH.detach(), inp.dy_TH
    gate_up, down = inp.gate_up_E2IH.detach(), inp.down_EHI.detach()
    w_N = inp.w_TK.detach().reshape(-1).float().contiguous()
    pad_m = gg.routing_block(p.N, p.E)
    meta = routing_metadata(inp.idx_TK, p.E, pad_m)
    h_PI, pre_P2I = gg.gather_glu(x_TH, gate_up, meta, p.K, "silu")
    out_PH = gg.rows_matmul(h_PI, down, meta, w_layout="nk", scale_N=w_N)
    dy_PH, x_PH = gg.gather_rows(dy_TH, meta, p.K), gg.gather_rows(x_TH, meta, p.K)
    dpre_P2I, _, hs_PI = gg.glu_backward(dy_PH, down, pre_P2I, w_N, meta, "silu")
    N, H, I, E, e = p.N, p.H, p.I, p.E, p.elem
    fns = {
        "metadata[triton]": (0, 16 * N + 4 * E, lambda: routing_metadata(inp.idx_TK, E, pad_m)),
        "gemm1[triton]": (4 * N * H * I, (2 * E * I * H + N * H + 3 * N * I) * e,
                          lambda: gg.gather_glu(x_TH, gate_up, meta, p.K, "silu")),
        "gemm2[triton]": (2 * N * H * I, (E * I * H + N * I + N * H) * e,
                          lambda: gg.rows_matmul(h_PI, down, meta, w_layout="nk", scale_N=w_N)),
        "combine[triton]": (0, (N * H + p.T * H) * e, lambda: gg.combine(out_PH, meta, p.T, p.K)),
        "dy_rows[triton]": (0, 2 * N * H * e, lambda: gg.gather_rows(dy_TH, meta, p.K)),
        "glu_bwd[triton]": (2 * N * H * I, (N * H + E * H * I + 5 * N * I) * e,
                            lambda: gg.glu_backward(dy_PH, down, pre_P2I, w_N, meta, "silu")),
        "dx[triton]": (4 * N * H * I, (2 * N * I + 2 * E * I * H + N * H) * e,
                       lambda: gg.rows_matmul(dpre_P2I, gate_up, meta, w_layout="kn")),
        "dw_down[triton]": (2 * N * H * I, (N * H + N * I + E * H * I) * e,
                            lambda: gg.weight_grad(dy_PH, hs_PI, meta)),
        "x_rows[triton]": (0, 2 * N * H * e, lambda: gg.gather_rows(x_TH, meta, p.K)),
        "dw_gate_up[triton]": (4 * N * H * I, (2 * N * I + N * H + 2 * E * I * H) * e,
                               lambda: gg.weight_grad(dpre_P2I, x_PH, meta)),
    }
    return [Component(name, phase, *fns[name]) for name, phase in TRITON_GEMMS]


def triton_components(p: Problem, inp: Inputs) -> list[Component]:
    return _triton_router_components(p, inp) + _triton_gemm_components(p, inp)


def bench_components(p: Problem, inp: Inputs, args) -> list[dict]:
    components = _router_components(p, inp) + _torch_components(p, inp)
    if p.device.type == "cuda":
        components += triton_components(p, inp)
    timed = [c for c in components if c.fn is not None]
    # Keyed by position too: a noise warning names the component, and no two may collide.
    times = measure_many({(i, c.name, c.pass_): (c.fn, None) for i, c in enumerate(timed)}, device=p.device,
                         warmup=args.warmup, reps=args.reps, label=f"[kernels] T={p.T} {p.routing}: components")
    rows = []
    for c in components:
        row = dict(T=p.T, routing=p.routing, kind="kernel", variant=c.name, phase=c.pass_, status=c.reason)
        if c.fn is not None:
            i = timed.index(c)
            t = times[i, c.name, c.pass_]
            row.update(ms=t.median_s * 1e3, min_ms=t.min_s * 1e3, gbps=c.bytes / t.median_s / 1e9, status="ok",
                       tflops=c.flops / t.median_s / 1e12 if c.flops else None)
        rows.append(row)
    return rows


def bench_copy(device: torch.device, args) -> dict:
    """A large device-to-device copy: the bandwidth every memory-bound pass is measured against."""
    n_bytes = COPY_BYTES[device.type]
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    print(f"[kernels] device copy of {n_bytes / 2**20:.0f} MiB", flush=True)
    t = measure(lambda: dst.copy_(src), device=device, warmup=args.warmup, reps=args.reps, name="device copy")
    return dict(kind="copy", variant="device_copy", phase="copy", ms=t.median_s * 1e3, min_ms=t.min_s * 1e3,
                gbps=2 * n_bytes / t.median_s / 1e9, status="ok")


def _sync_checks(p: Problem, inp: Inputs) -> dict[str, Lookup]:
    checks = {}
    variants = expert_variants(p.device)
    for backend in ("torch", "triton", "auto"):
        checks[f"route_topk[{backend}]"] = Lookup(partial(route_topk, inp.x_TH, inp.router_EH, p.K, backend=backend), None)
        op = variants.get(f"moe_ep[{backend}]", Lookup(None, f"not run on {p.device.type}"))
        checks[f"moe_experts[{backend}] fwd+bwd"] = Lookup(partial(_outputs, op.value, inp), None) if op.available else op
    return checks


def check_no_host_sync(p: Problem, inp: Inputs) -> dict[str, str]:
    """Runs the local path (the router and the experts op, forward and backward, per backend)
    under ``torch.cuda.set_sync_debug_mode("error")``: any host sync raises."""
    results = {}
    for name, check in _sync_checks(p, inp).items():
        if not check.available:
            results[name] = f"not checked: {check.reason}"
            continue
        synchronize(p.device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            check.value()
            results[name] = "pass"
        except RuntimeError as err:
            results[name] = f"FAIL: {first_line(err)}"
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return results


# ---------------------------------------------------------------- targets, plot, entry point


def target_notes(rows: list[dict], device: torch.device, grouped_mm_target: float = 1.35) -> list[str]:
    """The issue's targets, read off the measured rows: fwd+bwd at least ``grouped_mm_target`` times
    grouped_mm's speed (#20: 1.35 at Mixtral's shapes, 1.5 for fine-grained experts)."""
    def row(variant, pass_, T=None, routing="uniform"):
        for r in rows:
            if (r["kind"] == "op" and r["variant"] == variant and r.get("phase") == pass_ and r["routing"] == routing
                    and (T is None or r["T"] == T) and r.get("ms") is not None):
                return r
        return None

    def verdict(value, target):
        return "n/a" if value is None else f"{value:.2f} (target >= {target}: {'met' if value >= target else 'MISSED'})"

    notes = []
    if device.type == "cpu":
        for routing in sorted({r["routing"] for r in rows if r["kind"] == "op"}):
            r = row("moe_ep[torch]", "fwd+bwd", routing=routing)
            if r is not None:
                note = (f"CPU target, {routing}, T={r['T']}: torch backend fwd+bwd vs grouped_mm "
                        f"{verdict(r.get('vs_grouped_mm'), 1.0)}, vs eager {verdict(r.get('vs_eager'), 2.0)}")
                eager = row(REFERENCE, "fwd+bwd", routing=routing)
                dense = next((d for d in rows if d["kind"] == "dense" and d["routing"] == routing
                              and d.get("phase") == "fwd+bwd" and d.get("ms") is not None), None)
                if eager is not None and dense is not None:
                    # Half of eager's time is below the time the same FLOPs take as one dense GEMM chain.
                    note += (f"; 2x eager = {eager['ms'] / 2:.1f} ms against a dense-GEMM floor of "
                             f"{dense['ms']:.1f} ms for the same FLOPs")
                notes.append(note)
        return notes
    T = max((r["T"] for r in rows if r["kind"] == "op" and r.get("ms") is not None), default=None)
    fb, f = row("moe_ep[triton]", "fwd+bwd", T=T), row("moe_ep[triton]", "fwd", T=T)
    g = row(GROUPED_MM, "fwd+bwd", T=T)
    if fb is None:
        return [f"GPU target (T={T}, uniform): moe_ep[triton] not measured"]
    notes.append(f"GPU target T={T} uniform: fwd+bwd vs grouped_mm {verdict(fb.get('vs_grouped_mm'), grouped_mm_target)}"
                 f"; fwd+bwd {fb['ms']:.1f} ms, fwd {f['ms'] if f else float('nan'):.1f} ms")
    notes.append(f"GPU target T={T} uniform: fwd+bwd vs dense {verdict(fb.get('vs_dense'), 0.8)}, "
                 f"fwd vs dense {verdict(f.get('vs_dense') if f else None, 0.88)}")
    if g is not None and fb.get("peak_mib") is not None and g.get("peak_mib") is not None:
        ok = fb["peak_mib"] <= g["peak_mib"]
        notes.append(f"GPU target peak memory: {fb['peak_mib']:.0f} MiB vs grouped_mm {g['peak_mib']:.0f} MiB "
                     f"({'met' if ok else 'MISSED'})")
    for routing in ("uniform", "skewed"):
        auto = row("moe_ep[auto]", "fwd+bwd", T=T, routing=routing)
        paths = [r for r in (row(f"moe_ep[{b}]", "fwd+bwd", T=T, routing=routing) for b in ("triton", "torch"))
                 if r is not None]
        if auto is not None and paths:
            best = min(paths, key=lambda r: r["ms"])
            notes.append(f"selector T={T} {routing}: moe_ep[auto] {auto['ms']:.1f} ms, best path {best['variant']} "
                         f"{best['ms']:.1f} ms: {verdict(best['ms'] / auto['ms'], 0.97)} (never slower, within noise)")
    return notes


def plot(report: Report, path: Path) -> None:
    """Experts op time per variant: one panel per (pass, routing), grouped bars by T."""
    rows = [r for r in report.rows if r["kind"] in ("op", "dense") and r.get("ms") is not None]
    routings = sorted({r["routing"] for r in rows})
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    tokens = sorted({r["T"] for r in rows})
    fig, axes = new_figure(len(PASSES), max(1, len(routings)))
    width = 0.8 / max(1, len(variants))
    for i, pass_ in enumerate(PASSES):
        for j, routing in enumerate(routings):
            ax = axes[i][j]
            for v, variant in enumerate(variants):
                ms = {r["T"]: r["ms"] for r in rows if r["variant"] == variant and r["phase"] == pass_
                      and r["routing"] == routing}
                xs = [k + v * width for k, T in enumerate(tokens) if T in ms]
                ax.bar(xs, [ms[T] for T in tokens if T in ms], width, label=variant)
            ax.set_xticks([k + width * (len(variants) - 1) / 2 for k in range(len(tokens))])
            ax.set_xticklabels([f"T={T}" for T in tokens])
            ax.set_ylabel("ms (lower is better)")
            ax.set_title(f"{pass_}, {routing} routing")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"moe_experts, {report.meta.get('device')}, {report.meta.get('shape')}", fontsize=9)
    close_figure(fig, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int_at_least(1), nargs="+", help="T values (default: 2048 on CPU, 4096 8192 16384 on CUDA)")
    parser.add_argument("--hidden", type=int_at_least(1), help="H (default 256 on CPU, 4096 on CUDA)")
    parser.add_argument("--intermediate", type=int_at_least(1), help="I (default 512 on CPU, 14336 on CUDA)")
    parser.add_argument("--experts", type=int_at_least(1), help="E (default 8)")
    parser.add_argument("--top-k", type=int_at_least(1), help="k (default 2)")
    parser.add_argument("--routing", nargs="+", choices=ROUTINGS, default=list(ROUTINGS))
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="default float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--skip-components", action="store_true", help="time only the whole op, dense and copy")


def check_arguments(args, device: torch.device) -> None:
    defaults = MIXTRAL_GPU if device.type == "cuda" else SMALL_CPU
    E, K = args.experts or defaults["experts"], args.top_k or defaults["top_k"]
    if K > E:
        raise ValueError(f"--top-k must be at most the number of experts (--experts, {E} here), got {K}")


def run(args, device: torch.device) -> Report:
    defaults = MIXTRAL_GPU if device.type == "cuda" else SMALL_CPU
    H, I = args.hidden or defaults["hidden"], args.intermediate or defaults["intermediate"]
    E, K = args.experts or defaults["experts"], args.top_k or defaults["top_k"]
    tokens = args.tokens or defaults["tokens"]
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if device.type == "cuda":
        # Dense, grouped_mm and ours all run without tf32, so no one gets a cheaper fp32 GEMM.
        torch.backends.cuda.matmul.allow_tf32 = False
    report = Report("kernels", device, COLUMNS, plot=plot)
    report.meta = dict(environment(device), shape=f"H={H} I={I} E={E} k={K} {str(dtype)[6:]}",
                       tokens=list(tokens), routing=list(args.routing), warmup=args.warmup, reps=args.reps)
    sync_checks = {}
    for T in tokens:
        for routing in args.routing:
            p = Problem(T, H, I, E, K, routing, dtype, device)
            inp = make_inputs(p, args.seed)
            print(f"[kernels] T={T} {routing}: busiest expert gets {max_load_share(inp.idx_TK, E):.0%} of rows",
                  flush=True)
            report.rows += bench_experts(p, inp, args)
            if not args.skip_components:
                report.rows += bench_components(p, inp, args)
            if device.type == "cuda":
                sync_checks[f"T={T} {routing}"] = check_no_host_sync(p, inp)
            del inp
    report.rows.append(dict(T=None, routing=None, **bench_copy(device, args)))
    add_ratios(report.rows)
    # Fine-grained experts (Qwen3-MoE, OLMoE, DeepSeek-V3: 64 and more) have the higher target.
    report.notes += target_notes(report.rows, device, grouped_mm_target=1.5 if E >= 64 else 1.35)
    for case, results in sync_checks.items():
        report.notes += [f"no host sync, {case}, {name}: {result}" for name, result in results.items()]
    report.meta["no_host_sync"] = sync_checks
    if device.type == "cuda":
        report.notes += decision_notes() + chosen_config_notes()
    return report


def decision_notes() -> list[str]:
    """The whole-op times behind each decision of the selector (``moe_experts(backend="auto")``),
    per problem and token bucket: the Triton path with the stages the library won, the same path
    with every stage on a Triton kernel where it was timed, the grouped-GEMM path; and the choice."""
    notes = []
    for problem, table in sorted(selector.decisions().items(), key=str):
        for bucket, times in table.times.items():
            timed = ", ".join(f"{path} {t * 1e3:.2f} ms" if t is not None else f"{path} failed"
                              for path, t in times.items())
            on_library = sorted({k for k, _, b, n in table.configs if b == bucket and n == str(library.GROUPED_MM)})
            shapes = f"H={problem.H} I={problem.I} E={problem.E} K={problem.K} {problem.activation}"
            notes.append(f"decided: {shapes} bucket {bucket}: {timed}; runs {table.paths[bucket]}, "
                         f"stages on grouped_mm: {', '.join(on_library) or 'none'}")
    return notes


def chosen_config_notes() -> list[str]:
    """What each GEMM stage of the Triton path launched with, per shapes and token bucket: the tile
    configuration, or grouped_mm, that timing chose (or the default where nothing was timed)."""
    return [f"chosen: {kernel} {shapes} bucket {bucket}: {config}"
            for (kernel, shapes, _, _, bucket), config in sorted(autotune.chosen_configs().items(), key=str)]
