"""Command-line flags of train.py and the checks that run on them before any process group, model
or data exists: a wrong flag costs the user seconds, not a queue slot on a cluster."""

from __future__ import annotations

import argparse
import importlib.util
import math
import signal
from pathlib import Path

from moe_ep.runs import StartupWatchdog, UsageError, parse_signal


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Expert-parallel training of Mixtral-style models; launch with `accelerate launch` or `torchrun`.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    m = p.add_argument_group("model")
    m.add_argument("--model", default="tiny",
                   help="a named config initialised at random (tiny, mixtral-8x7b, mixtral-8x22b), or a Hugging Face id / local "
                        "folder with config.json and safetensors weights")
    m.add_argument("--init", default="auto", choices=["auto", "full", "meta"],
                   help="random init of named configs: full (whole model on every rank, then sharded) or meta "
                        "(delayed: each rank initialises only its shards); auto: full for tiny, meta for mixtral-8x7b")
    m.add_argument("--tokenizer", default="auto", choices=["auto", "byte"],
                   help="auto: bytes for named configs, the model's own tokenizer for pretrained ones; byte: always "
                        "bytes (e.g. to continue training a model this example exported)")
    m.add_argument("--experts-implementation", default="moe_ep", choices=["moe_ep", "eager", "grouped_mm"],
                   help="expert kernels: moe_ep (needs moe_ep.hf) or one of transformers' own")
    m.add_argument("--backend", default=None, choices=["triton", "torch"],
                   help="moe_ep kernel backend (default: triton on CUDA, torch elsewhere)")
    m.add_argument("--compile-blocks", action="store_true",
                   help="torch.compile the dense parts of each decoder layer (attention, norms, router; "
                        "moe_ep.parallelize(compile_blocks=True)); needs a launcher, even for one process")

    lay = p.add_argument_group("parallel layout (world size = pp * dp_replicate * dp_shard; ep divides dp_shard)")
    lay.add_argument("--ep", type=int, default=1, help="expert-parallel degree")
    lay.add_argument("--dp-shard", type=int, default=None, help="sharded data-parallel degree (default: what is left)")
    lay.add_argument("--dp-replicate", type=int, default=1, help="replicated data-parallel degree (HSDP)")
    lay.add_argument("--pp", type=int, default=1, help="pipeline stages")
    lay.add_argument("--microbatches", type=int, default=None,
                     help="pipeline micro-batches per step, each of --micro-batch-size sequences (default: 2 * pp)")
    lay.add_argument("--schedule", default=None,
                     help="pipeline schedule: gpipe, 1f1b, interleaved-1f1b, interleaved-1f1b-overlap, zbv or "
                          "dualpipev (default with --pp > 1: 1f1b)")
    lay.add_argument("--plan", action="store_true",
                     help="take ep/dp/pp, micro-batches, schedule and the recompute policy from moe_ep.plan")
    lay.add_argument("--gpu-memory-gib", type=float, default=None, help="for --plan: memory per GPU (default: queried)")
    lay.add_argument("--global-batch-tokens", type=int, default=None,
                     help="for --plan: tokens per optimizer step over all ranks (default: the planner's)")
    lay.add_argument("--overlap-chunks", type=int, default=1, metavar="N",
                     help="cut each MoE layer's tokens into N chunks whose all-to-alls overlap the other chunks' "
                          "experts (moe_ep.parallelize(overlap_chunks=N); needs --ep > 1); default 1: no overlap")
    lay.add_argument("--dispatch-mode", default="auto", choices=("auto", "flat", "node"),
                     help="the expert-parallel dispatch: node-aware (each token once per destination node) when ep "
                          "spans several whole nodes (auto, the default), pinned (node), or one copy per rank (flat)")
    lay.add_argument("--node-size", type=int, default=None,
                     help="ranks per node for the node-aware dispatch (default: the launcher's LOCAL_WORLD_SIZE)")
    lay.add_argument("--activation-checkpointing", nargs="?", const="full", default="none",
                     choices=("none", "full", "selective", "attention"), metavar="POLICY",
                     help="what the backward recomputes of each decoder layer: full (the flag alone), selective "
                          "(norms, activations, casts) or attention (the attention block); default none")

    d = p.add_argument_group("data")
    d.add_argument("--data", nargs="+", default=["stdlib"],
                   help="stdlib (the Python standard library's sources), local .txt/.py/.md/.jsonl files or "
                        "folders, or hf:NAME[:CONFIG[:SPLIT]] (online only)")
    d.add_argument("--text-field", default="text", help="field holding the text in .jsonl records and HF datasets")
    d.add_argument("--max-corpus-tokens", type=int, default=None, help="cap on the tokens read from --data")
    d.add_argument("--seq-len", type=int, default=256, help="tokens per packed sequence")
    d.add_argument("--micro-batch-size", type=int, default=4,
                   help="sequences per data-parallel rank per micro-step (--plan chooses its own)")
    d.add_argument("--grad-accum", type=int, default=1,
                   help="micro-steps per optimizer step (with --pp > 1: --microbatches instead; --plan chooses them)")
    d.add_argument("--seed", type=int, default=0)

    o = p.add_argument_group("optimisation")
    o.add_argument("--steps", type=int, default=200, help="optimizer steps in total (a resumed run counts from 0)")
    o.add_argument("--lr", type=float, default=3e-3)
    o.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decay ends at lr * this")
    o.add_argument("--warmup-steps", type=int, default=None,
                   help="linear warmup steps (default: a tenth of --steps, at most 20)")
    o.add_argument("--weight-decay", type=float, default=0.1)
    o.add_argument("--beta1", type=float, default=0.9)
    o.add_argument("--beta2", type=float, default=0.95)
    o.add_argument("--bf16-moments", action="store_true",
                   help="AdamW keeps its two moments in bf16 (moe_ep.AdamW, as DeepSeek-V3 trained): 12 bytes per "
                        "trained parameter instead of 16; betas up to 0.992")
    o.add_argument("--max-grad-norm", type=float, default=1.0, help="clip the global gradient norm (0: no clipping)")
    o.add_argument("--max-consecutive-skips", type=int, default=20,
                   help="a step whose loss or gradient norm is not finite on any rank is skipped on every rank; stop "
                        "the run after this many in a row (0: never stop)")
    o.add_argument("--aux-loss-coef", type=float, default=None,
                   help="load-balancing loss weight (default: the model config's router_aux_loss_coef)")
    o.add_argument("--aux-loss", default="local", choices=["local", "global", "sequence"],
                   help="local: each rank balances its own tokens (transformers' loss); global: expert counts "
                        "summed over every data-parallel rank first (Megatron-Core's global aux loss); sequence: "
                        "each sequence balanced on its own (DeepSeek-V3's sequence-wise balance loss)")
    o.add_argument("--z-loss-coef", type=float, default=0.0, help="router z-loss weight (ST-MoE)")
    o.add_argument("--chunked-loss", action="store_true",
                   help="compute the LM loss through the head in chunks of tokens, never holding the full logits "
                        "(TrainStep(chunked_loss=True))")
    o.add_argument("--expert-bias-rate", type=float, default=None,
                   help="step of the aux-loss-free expert bias (DeepSeek-V3's e_score_correction_bias; default: "
                        f"{DEFAULT_EXPERT_BIAS_RATE} for models whose routers hold one, else 0)")

    out = p.add_argument_group("output")
    out.add_argument("--output-dir", default="runs/mixtral-tiny", help="checkpoints, metrics.jsonl, token cache")
    out.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints (0: only the last)")
    out.add_argument("--keep-checkpoints", type=int, default=2, help="complete checkpoints kept on disk")
    add_run_folder_flags(out)
    out.add_argument("--export-dir", default=None,
                     help="at the end, write a Hugging Face folder that plain transformers loads: a new or empty "
                          "folder, or an earlier export (replaced), outside --output-dir")
    out.add_argument("--step-timeout", type=float, default=1800.0,
                     help="seconds one step (with its checkpoint) may take before every rank stops with an error")
    out.add_argument("--startup-timeout", type=float, default=1800.0,
                     help="seconds from the process group to the first step (tokenizing, reading checkpoints and "
                          "weights) before a rank that has not got there is reported and every rank still starting "
                          "exits")
    add_preempt_signal(out)
    out.add_argument("--log-every", type=int, default=1)
    out.add_argument("--tensorboard", action="store_true", help="also log to OUTPUT_DIR/tensorboard")
    out.add_argument("--peak-tflops", type=float, default=None,
                     help="peak dense TFLOP/s of one device for the MFU estimate (default: known GPUs only)")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def add_run_folder_flags(parser) -> None:
    """``--resume`` and ``--overwrite``, the same flags in every script of the example."""
    parser.add_argument("--resume", nargs="?", const="auto", default="auto", metavar="auto|never|CHECKPOINT",
                        help="auto (the newest complete checkpoint in --output-dir, if any; also a bare --resume), "
                             "never, or a checkpoint folder: resuming an older one sets the later checkpoints aside, "
                             "not deleted")
    parser.add_argument("--overwrite", action="store_true",
                        help="start afresh: delete the run's checkpoints and logs in --output-dir (only what the "
                             "script made and marked; never while another job holds the folder)")


def check_run_folder_flags(args) -> None:
    if args.overwrite and args.resume not in ("auto", "never"):
        raise UsageError(f"--overwrite starts afresh; it cannot be combined with --resume {args.resume}")
    if args.resume not in ("auto", "never") and not Path(args.resume).is_dir():
        raise UsageError(f"--resume: {args.resume} is not a checkpoint folder (or use auto / never)")


SEED_LIMIT = 2 ** 32  # numpy's generators, and the data order derived from the seed, stay in int64 below it


def check_seed_and_seq_len(args) -> None:
    """``--seed`` and ``--seq-len``, the same flags in every script of the example."""
    if not 0 <= args.seed < SEED_LIMIT:
        raise UsageError(f"--seed must be an int in [0, 2**32), got {args.seed}")
    if args.seq_len < 2:
        raise UsageError(f"--seq-len must be >= 2 (a sequence's first token predicts nothing: one token gives no "
                         f"loss), got {args.seq_len}")


def check_startup_timeout(seconds: float) -> None:
    """``--startup-timeout`` (a finite number > 0 already): at most what the watchdog can wait."""
    if seconds > StartupWatchdog.MAX_TIMEOUT_S:
        raise UsageError(f"--startup-timeout must be at most {StartupWatchdog.MAX_TIMEOUT_S:g} s (a year), got "
                         f"{seconds:g}")


def add_preempt_signal(parser) -> None:
    """``--preempt-signal``, the same flag in every script of the example."""

    def read(value: str) -> signal.Signals:
        try:
            return parse_signal(value)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    parser.add_argument("--preempt-signal", type=read, default=signal.SIGTERM, metavar="SIGNAL",
                        help="a signal that, like SIGTERM (always handled), makes every rank finish its step, write "
                             "one checkpoint and exit with status 75; the same command resumes (SLURM: "
                             "--signal=USR1@120 and USR1 here, README)")


POSITIVE = ("ep", "dp_replicate", "pp", "seq_len", "micro_batch_size", "grad_accum", "steps", "log_every",
            "keep_checkpoints")
LAYOUT_DEFAULTS = {"ep": 1, "dp_replicate": 1, "pp": 1, "dp_shard": None, "microbatches": None, "schedule": None,
                   "grad_accum": 1}
NON_NEGATIVE = ("checkpoint_every", "warmup_steps", "weight_decay", "max_grad_norm", "z_loss_coef",
                "max_consecutive_skips")
# Families whose routers steer the top-k with a bias updated outside the gradient (DeepSeek-V3's
# aux-loss-free balancing, at the rate of its report) instead of an auxiliary loss.
BIAS_BALANCED_MODEL_TYPES = ("deepseek_v3",)
DEFAULT_EXPERT_BIAS_RATE = 1e-3


def balancing(args: argparse.Namespace, config) -> tuple[float, float]:
    """(aux loss coefficient, expert bias rate) for the model: the flags, else the config's
    router_aux_loss_coef (0 for families without one) and the bias rate of bias-balanced families."""
    aux = args.aux_loss_coef if args.aux_loss_coef is not None else getattr(config, "router_aux_loss_coef", 0.0)
    bias_default = DEFAULT_EXPERT_BIAS_RATE if config.model_type in BIAS_BALANCED_MODEL_TYPES else 0.0
    return aux, bias_default if args.expert_bias_rate is None else args.expert_bias_rate


def check_flag_values(args: argparse.Namespace) -> None:
    """Ranges of single flags, independent of the model and the world; the default warmup
    resolved from --steps (so that a short trial run such as --steps 5 needs no other flag)."""
    for name in POSITIVE:
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup_steps is None:
        args.warmup_steps = min(20, args.steps // 10)
    # `not value >= 0` also refuses NaN, which every comparison calls false.
    for name in (*NON_NEGATIVE, "aux_loss_coef", "expert_bias_rate"):
        value = getattr(args, name)
        if value is not None and not (0 <= value < math.inf):
            raise UsageError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {value}")
    for name in ("dp_shard", "microbatches", "max_corpus_tokens", "global_batch_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    check_seed_and_seq_len(args)
    if args.peak_tflops is not None and not 0 < args.peak_tflops < math.inf:
        raise UsageError(f"--peak-tflops must be a finite number > 0, got {args.peak_tflops}")
    for name in ("step_timeout", "startup_timeout", "lr"):
        if not 0 < getattr(args, name) < math.inf:
            raise UsageError(f"--{name.replace('_', '-')} must be a finite number > 0, got {getattr(args, name)}")
    check_startup_timeout(args.startup_timeout)
    if not 0 <= args.min_lr_ratio <= 1:
        raise UsageError(f"--min-lr-ratio must be in [0, 1], got {args.min_lr_ratio}")
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(args, name) < 1:
            raise UsageError(f"--{name} must be in [0, 1), got {getattr(args, name)}")
    if args.bf16_moments:
        _check_bf16_moments(args)
    if args.warmup_steps >= args.steps and args.steps > 1:
        raise UsageError(f"--warmup-steps ({args.warmup_steps}) must be smaller than --steps ({args.steps})")
    if args.global_batch_tokens is not None and not args.plan:
        raise UsageError("--global-batch-tokens is read by --plan only; without it the batch is "
                         "--micro-batch-size x --grad-accum x data-parallel ranks")
    if args.plan:
        given = [name for name, default in LAYOUT_DEFAULTS.items() if getattr(args, name) != default]
        if given:
            flags = ", ".join("--" + n.replace("_", "-") for n in given)
            raise UsageError(f"--plan chooses the layout itself; do not also give {flags}")
    if args.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise UsageError("--tensorboard needs the `tensorboard` package (pip install tensorboard)")
    check_run_folder_flags(args)
    if Path(args.output_dir).exists() and not Path(args.output_dir).is_dir():
        raise UsageError(f"--output-dir: {args.output_dir} exists and is not a folder")


def _check_bf16_moments(args) -> None:
    """moe_ep.AdamW's own refusal of hyperparameters bf16 moments cannot follow, before any work."""
    import torch

    from moe_ep import AdamW

    try:
        AdamW([torch.nn.Parameter(torch.zeros(1))], lr=args.lr, betas=(args.beta1, args.beta2),
              weight_decay=args.weight_decay, moments_dtype=torch.bfloat16)
    except ValueError as err:
        raise UsageError(f"--beta1/--beta2 with --bf16-moments: {err}") from None


def check_against_model(args: argparse.Namespace, config, tokenizer) -> None:
    """Flags that must agree with the model's config."""
    if args.expert_bias_rate and config.model_type not in BIAS_BALANCED_MODEL_TYPES:
        raise UsageError(
            f"--expert-bias-rate {args.expert_bias_rate}: {config.model_type} routers hold no expert bias "
            f"(e_score_correction_bias); only {', '.join(BIAS_BALANCED_MODEL_TYPES)} models do"
        )
    max_pos = getattr(config, "max_position_embeddings", None)
    if max_pos is not None and args.seq_len > max_pos:
        raise UsageError(
            f"--seq-len {args.seq_len} exceeds the model's max_position_embeddings ({max_pos}); "
            f"use --seq-len <= {max_pos}"
        )
    if tokenizer.vocab_size > config.vocab_size:
        raise UsageError(
            f"tokenizer {tokenizer.name} has {tokenizer.vocab_size} tokens but the model's vocab_size is "
            f"{config.vocab_size}"
        )
