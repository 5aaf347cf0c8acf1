"""Causal attention, forward and backward, through PyTorch's scaled_dot_product_attention at the
attention shapes of the models the planner plans: on the backend SDPA picks by itself (what
transformers' "sdpa" attention runs in a training step: is_causal, no mask, grouped-query heads
through ``enable_gqa``, q/k/v as transposed views of the projections' output) and on each backend
it has here (flash, cuDNN, memory-efficient, math), each alone.

The rate is counted as the planner counts it (``planner.compute``): the forward's two batched
GEMMs over the causal half of the scores, ``heads x (qk_dim + v_dim) x S^2 x B`` multiply-adds, 3.5
times for forward and backward (flash attention's backward is 2.5 forwards, its recompute
included). ``planner.calibration`` reads the default backend's rate at the model nearest the
planned one as the attention efficiency; until a GPU runs this, the planner's is an assumption."""

from __future__ import annotations

import argparse
import contextlib
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..planner.spec import ModelSpec, config_from_name
from .report import Column, Report, environment, first_line
from .timing import measure

# The anchors' models (``planner.anchors``): their attention shapes.
MODELS = ("mixtral-8x7b", "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3")
# (sequence length, sequences): the anchors' 4096 at 16k tokens on a GPU; a few short ones on the CPU.
SIZES = {"cuda": (4096, 4), "cpu": (32, 2)}
# The factor of the forward's FLOPs that forward and backward take (planner.compute's ATTENTION_PASSES).
FWD_BWD_PASSES = 3.5
DEFAULT = "default"
# SDPA's backends by the names the rows give them; "default" restricts nothing.
BACKENDS = (DEFAULT, "flash", "cudnn", "efficient", "math")
# The gate's on a GPU: the math kernel holds the whole score matrix in float32 (34 GB of DeepSeek-V3's
# at 4 x 4096 tokens), which no training run uses.
GPU_GATE_BACKENDS = (DEFAULT, "flash", "cudnn", "efficient")

COLUMNS = [
    Column("model", "model"),
    Column("shape", "heads/kv x qk,v"),
    Column("tokens", "tokens"),
    Column("variant", "variant"),
    Column("ms", "ms", "{:.3f}"),
    Column("min_ms", "min ms", "{:.3f}"),
    Column("tflops", "TFLOP/s", "{:.2f}"),
    Column("vs_default", "vs default", "{:.2f}x"),
    Column("status", "status"),
]


@dataclass(frozen=True)
class AttentionShape:
    heads: int
    kv_heads: int
    qk_dim: int
    v_dim: int

    @classmethod
    def of(cls, spec: ModelSpec) -> "AttentionShape":
        return cls(spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.value_head_dim)

    def forward_flops(self, seq_len: int, sequences: int) -> float:
        """The forward's two batched GEMMs over the causal half: ``planner.spec.attention_flops``
        per token, times the tokens."""
        return 2.0 * self.heads * (self.qk_dim + self.v_dim) * seq_len / 2 * seq_len * sequences

    def text(self) -> str:
        return f"{self.heads}/{self.kv_heads} x {self.qk_dim},{self.v_dim}"


def _backend_context(backend: str):
    """``sdpa_kernel`` restricted to ``backend``; nothing for the default."""
    if backend == DEFAULT:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
             "math": "MATH"}
    return sdpa_kernel(getattr(SDPBackend, names[backend]))


def _inputs(shape: AttentionShape, seq_len: int, sequences: int, dtype, device, seed: int):
    """q, k, v as transformers hands them to SDPA: ``[B, heads, S, dim]`` views of ``[B, S, heads,
    dim]`` projections, leaves that take a gradient; and the output's gradient."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def projection(heads: int, dim: int) -> torch.Tensor:
        x = torch.randn(sequences, seq_len, heads, dim, generator=g).to(device=device, dtype=dtype)
        return x.requires_grad_().transpose(1, 2)

    q = projection(shape.heads, shape.qk_dim)
    k = projection(shape.kv_heads, shape.qk_dim)
    v = projection(shape.kv_heads, shape.v_dim)
    dy = torch.randn(sequences, shape.heads, seq_len, shape.v_dim, generator=g).to(device=device, dtype=dtype)
    return q, k, v, dy


def fwd_bwd(q, k, v, dy) -> None:
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    torch.autograd.grad(y, (q, k, v), dy)


def bench_model(name: str, device: torch.device, args) -> list[dict]:
    shape = AttentionShape.of(ModelSpec.from_config(config_from_name(name), name))
    seq_len, sequences = SIZES[device.type]
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    q, k, v, dy = _inputs(shape, seq_len, sequences, dtype, device, args.seed)
    flops = FWD_BWD_PASSES * shape.forward_flops(seq_len, sequences)
    rows = []
    for backend in args.backends:
        row = dict(model=name, shape=shape.text(), heads=shape.heads, kv_heads=shape.kv_heads, qk_dim=shape.qk_dim,
                   v_dim=shape.v_dim, seq_len=seq_len, tokens=seq_len * sequences, kind="attention",
                   variant=f"sdpa[{backend}]", phase="fwd+bwd")
        with _backend_context(backend):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    fwd_bwd(q, k, v, dy)
                except torch.OutOfMemoryError as err:
                    rows.append(dict(row, status=f"FAIL: out of memory ({first_line(err, 160)})"))
                    continue
                except RuntimeError as err:
                    # The error says only that no kernel ran; SDPA warns each backend's reason first
                    # (head sizes, grouped-query heads, the device).
                    reasons = [str(w.message).split(" (Triggered internally")[0] for w in caught] or [str(err)]
                    rows.append(dict(row, status=f"unavailable: {(reasons[-1].splitlines() or [''])[0][:200]}"))
                    continue
            t = measure(lambda: fwd_bwd(q, k, v, dy), device=device, warmup=args.warmup, reps=args.reps,
                        name=f"{name} sdpa[{backend}]")
        rows.append(dict(row, ms=t.median_s * 1e3, min_ms=t.min_s * 1e3, tflops=flops / t.median_s / 1e12,
                         status="ok"))
    default = next((r for r in rows if r["variant"] == f"sdpa[{DEFAULT}]" and r["status"] == "ok"), None)
    for r in rows:
        if default is not None and r.get("ms"):
            r["vs_default"] = default["ms"] / r["ms"]
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS),
                        help="SDPA backends, each alone; 'default' restricts nothing (default: all)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="default bfloat16 on CUDA, float32 on the CPU")


def run(args, device: torch.device) -> Report:
    seq_len, sequences = SIZES[device.type]
    report = Report("attention", device, COLUMNS, formats=(".json", ".csv"))
    report.meta = dict(environment(device), seq_len=seq_len, sequences=sequences, warmup=args.warmup, reps=args.reps)
    for name in args.models:
        print(f"[attention] {name}: {sequences} x {seq_len} tokens", flush=True)
        report.rows += bench_model(name, device, args)
    for r in report.rows:
        if r["variant"] == f"sdpa[{DEFAULT}]" and r["status"] == "ok":
            best = max((o for o in report.rows if o["model"] == r["model"] and o["status"] == "ok"),
                       key=lambda o: o["tflops"])
            report.notes.append(f"{r['model']}: SDPA's own choice {r['tflops']:.1f} TFLOP/s forward+backward; fastest "
                                f"{best['variant']} {best['tflops']:.1f}")
    return report

