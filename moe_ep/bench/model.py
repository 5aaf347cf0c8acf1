"""Whole-model benchmark: forward+backward tokens/s of a Hugging Face MoE model with
``experts_implementation`` "moe_ep" (and ``moe_ep.hf.patch``, which also fuses the router)
against "grouped_mm" and "eager" on the same model, weights and batch.

On the CPU a tiny model of every supported family (Mixtral, Qwen2-MoE with its shared expert,
Qwen3-MoE, OLMoE, DeepSeek-V3 with its group-limited sigmoid router); on CUDA also a 2-layer
model with Mixtral-8x7B layer shapes (H=4096, I=14336, 32 heads, 8 KV heads, E=8, k=2) in
bfloat16. The variants share one model object, switched with ``set_experts_implementation``, so
their weights are identical by construction; the patched variant runs last because patching
replaces the router's computation, and the patched model once more with the chunked loss
(``moe_ep.chunked_causal_lm_loss``: the float32 logits of the whole batch never exist). With
``--compile-blocks``, last, the patched model with its dense blocks compiled
(``moe_ep.parallelize(compile_blocks=...)``'s regions: attention, norms, the router; the experts
stay moe_ep's op), which stays compiled, so it runs after the others."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from .arguments import int_at_least
from ..hf import patch
from ..parallel.compile import compile_dense_blocks
from ..training.loss import chunked_causal_lm_loss
from .report import Column, Report, close_figure, environment, new_figure
from .timing import measure_many, peak_memory_bytes


@dataclass(frozen=True)
class ModelSetup:
    model_type: str  # transformers' name of the family
    config: dict
    batch: int
    seq: int
    dtype: torch.dtype


# The tiny models share H=256 and expert width 512, 8 experts, top-2 (DeepSeek-V3: 2 of 4 groups).
_TINY = dict(vocab_size=1024, hidden_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)  # inside the small vocabulary (OLMoE's are not)
_TINY_QWEN = dict(_TINY, intermediate_size=512, moe_intermediate_size=512, num_experts=8, num_experts_per_tok=2)


def _tiny(model_type: str, **config) -> ModelSetup:
    return ModelSetup(model_type, dict(_TINY, **config), batch=4, seq=256, dtype=torch.float32)


MODELS = {
    "tiny-mixtral": _tiny("mixtral", intermediate_size=512, num_local_experts=8, num_experts_per_tok=2),
    "tiny-qwen2-moe": _tiny("qwen2_moe", **_TINY_QWEN, shared_expert_intermediate_size=512),
    "tiny-qwen3-moe": _tiny("qwen3_moe", **_TINY_QWEN, head_dim=32, norm_topk_prob=True),
    "tiny-olmoe": _tiny("olmoe", intermediate_size=512, num_experts=8, num_experts_per_tok=2),
    "tiny-deepseek-v3": _tiny(
        "deepseek_v3", intermediate_size=512, moe_intermediate_size=512, n_routed_experts=8, num_experts_per_tok=2,
        n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=0, kv_lora_rank=64, q_lora_rank=128,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, num_key_value_heads=8,
    ),
    "mixtral-8x7b-2layer": ModelSetup(
        "mixtral",
        dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
             num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2),
        batch=1, seq=4096, dtype=torch.bfloat16,
    ),
    # Two of Qwen3-30B-A3B's 48 layers: 128 experts of width 768, top-8, its 151,936-token vocabulary.
    "qwen3-30b-a3b-2layer": ModelSetup(
        "qwen3_moe",
        dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
             num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
             num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
        batch=1, seq=4096, dtype=torch.bfloat16,
    ),
}
TINY_MODELS = tuple(name for name in MODELS if name.startswith("tiny"))
# Selected with set_experts_implementation ("moe_ep" is registered by importing moe_ep), so they can
# take turns; the patched variant, which also replaces the router's computation, is timed after them.
SWITCHABLE = ("eager", "grouped_mm", "moe_ep")
PATCHED = "moe_ep+fused_router"
CHUNKED_LOSS = "moe_ep+fused_router+chunked_loss"
COMPILED = "moe_ep+fused_router+compiled_blocks"
VARIANTS = SWITCHABLE + (PATCHED, CHUNKED_LOSS, COMPILED)

COLUMNS = [
    Column("model", "model"),
    Column("variant", "variant"),
    Column("tokens", "tokens"),
    Column("ms", "ms fwd+bwd", "{:.1f}"),
    Column("min_ms", "min ms", "{:.1f}"),
    Column("tokens_per_s", "tokens/s", "{:,.0f}"),
    Column("peak_mib", "peak MiB", "{:.0f}"),
    Column("vs_grouped_mm", "vs grouped_mm", "{:.2f}x"),
    Column("vs_eager", "vs eager", "{:.2f}x"),
    Column("loss_diff", "|loss - eager|", "{:.1e}"),
    Column("status", "status"),
]


def build_model(setup: ModelSetup, device: torch.device, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(setup.model_type, **setup.config, max_position_embeddings=max(setup.seq, 4096))
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config)
    return model.to(setup.dtype).train()


def select_variant(model, variant: str) -> None:
    if variant in (PATCHED, CHUNKED_LOSS, COMPILED):
        patch(model, fused_router=True)
    else:
        model.set_experts_implementation(variant)


def bench_model(name: str, setup: ModelSetup, device: torch.device, args) -> list[dict]:
    model = build_model(setup, device, args.seed)
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, setup.config["vocab_size"], (setup.batch, setup.seq), generator=g).to(device)
    n_tokens = setup.batch * setup.seq

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss

    def chunked_loss_step():
        loss, _ = chunked_causal_lm_loss(model, ids, input_ids=ids)
        loss.backward()
        return loss

    def fresh_grads():
        model.zero_grad(set_to_none=True)
        return ()

    def switch_to(variant):
        def setup():
            select_variant(model, variant)
            return fresh_grads()

        return setup

    def time_in_turns(cases):
        return measure_many(cases, device=device, warmup=args.warmup, reps=args.reps,
                            label=f"[model] {name}: {', '.join(cases)}")

    rows = {}

    def first_step(variant, variant_step=step):
        select_variant(model, variant)
        fresh_grads()
        loss = variant_step().item()  # host sync: once per variant, outside the timed region
        fresh_grads()
        peak = peak_memory_bytes(variant_step, device)
        # A loss that is not finite is a broken step, not a figure to compare (the table would
        # show its difference as "not measured").
        rows[variant] = dict(model=name, variant=variant, tokens=n_tokens, loss=loss,
                             peak_mib=None if peak is None else peak / 2**20,
                             status="ok" if math.isfinite(loss) else f"FAIL: loss {loss}")

    # The registry variants switch back and forth, so they are timed in turns (see measure_many);
    # the patched model comes after them, with either loss.
    for variant in SWITCHABLE:
        first_step(variant)
    timings = time_in_turns({variant: (step, switch_to(variant)) for variant in SWITCHABLE})
    first_step(PATCHED)
    first_step(CHUNKED_LOSS, chunked_loss_step)
    timings.update(time_in_turns({PATCHED: (step, fresh_grads), CHUNKED_LOSS: (chunked_loss_step, fresh_grads)}))
    if args.compile_blocks:
        compile_dense_blocks(model, {"backend": args.compile_blocks})
        first_step(COMPILED)  # compiles (the warm-up calls are not enough for that)
        timings.update(time_in_turns({COMPILED: (step, fresh_grads)}))
    for variant, t in timings.items():
        rows[variant].update(ms=t.median_s * 1e3, min_ms=t.min_s * 1e3, tokens_per_s=n_tokens / t.median_s)
    model.zero_grad(set_to_none=True)
    eager, grouped_mm = rows["eager"], rows["grouped_mm"]
    for row in rows.values():
        row.update(vs_grouped_mm=grouped_mm["ms"] / row["ms"], vs_eager=eager["ms"] / row["ms"],
                   loss_diff=abs(row["loss"] - eager["loss"]))
    return list(rows.values())


def plot(report: Report, path: Path) -> None:
    rows = [r for r in report.rows if r.get("tokens_per_s") is not None]
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = new_figure(1, max(1, len(models)))
    for ax, name in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == name]
        ax.bar([r["variant"] for r in mine], [r["tokens_per_s"] for r in mine])
        ax.set_ylabel("tokens/s, forward+backward (higher is better)")
        ax.set_title(name)
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(f"MoE model training step, {report.meta.get('device')}", fontsize=9)
    close_figure(fig, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", choices=tuple(MODELS),
                        help="default: the tiny models on CPU; those and the two-layer Mixtral-8x7B and "
                             "Qwen3-30B-A3B on CUDA")
    parser.add_argument("--seq", type=int_at_least(2),
                        help="override every model's sequence length (2 or more: a token predicts the next)")
    parser.add_argument("--batch", type=int_at_least(1), help="override every model's batch size")
    parser.add_argument("--compile-blocks", nargs="?", const="inductor", metavar="BACKEND",
                        help="also time the patched model with its dense blocks compiled by torch.compile "
                             "(default backend inductor), last")


def check_arguments(args, device: torch.device) -> None:
    if args.compile_blocks is not None:
        from torch._dynamo import list_backends

        if args.compile_blocks not in list_backends(exclude_tags=()):
            raise ValueError(f"--compile-blocks must name a torch.compile backend (such as "
                             f"{', '.join(list_backends())}), got {args.compile_blocks!r}")


def run(args, device: torch.device) -> Report:
    names = args.models or (tuple(MODELS) if device.type == "cuda" else TINY_MODELS)
    report = Report("model", device, COLUMNS, plot=plot)
    report.meta = dict(environment(device), models={}, warmup=args.warmup, reps=args.reps)
    for name in names:
        setup = MODELS[name]
        setup = ModelSetup(setup.model_type, setup.config, args.batch or setup.batch, args.seq or setup.seq,
                           setup.dtype)
        report.meta["models"][name] = dict(setup.config, model_type=setup.model_type, batch=setup.batch,
                                           seq=setup.seq, dtype=str(setup.dtype))
        print(f"[model] {name}: batch {setup.batch} x seq {setup.seq}", flush=True)
        report.rows += bench_model(name, setup, device, args)
    report.failed += [f"{r['model']} {r['variant']}: {r['status']}" for r in report.rows if r["status"] != "ok"]
    return report
