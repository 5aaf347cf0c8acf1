"""``moe-ep`` command line. ``moe-ep plan``: choose a parallel layout for a model on a cluster."""

from __future__ import annotations

import argparse
import json
import os
import sys

EXIT_IMPOSSIBLE = 2


def _load_model(value: str):
    """A name from MODEL_NAMES, or a local config.json / model folder (never downloaded)."""
    from .planner import MODEL_NAMES

    if value in MODEL_NAMES:
        return value
    if os.path.exists(value):
        from transformers import AutoConfig

        # A file path loads that file; a folder its config.json.
        return AutoConfig.from_pretrained(value, local_files_only=True)
    raise ValueError(f"--model must be one of {MODEL_NAMES} or a local config.json or model folder, got {value!r}")


def _add_plan_parser(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="choose pp / dp_replicate / dp_shard / ep, micro-batching, schedule and checkpointing",
        description="Print the fastest layout that fits, its per-GPU memory table, its estimated step time "
        "and why the closest alternatives lost.",
    )
    p.add_argument("--model", required=True, help="mixtral-8x7b, mixtral-8x22b, or a local config.json / folder")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--gpu-memory", type=float, required=True, help="GiB per GPU (80 for A100-80GB)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--global-batch-tokens", type=int, default=None, help="tokens per optimizer step (default 4Mi)")
    p.add_argument("--intra-node-bw", type=float, default=200.0, help="GB/s per GPU inside a node")
    p.add_argument("--inter-node-bw", type=float, default=25.0, help="GB/s per GPU across nodes")
    p.add_argument("--peak-tflops", type=float, default=312.0, help="dense bf16 peak per GPU")
    p.add_argument("--efficiency", type=float, default=0.40, help="fraction of the peak the GEMMs reach")
    p.add_argument("--imbalance", type=float, default=None, help="busiest expert rank's load over the mean (1.2)")
    for name in ("pp", "dp-replicate", "dp-shard", "ep", "microbatch-size"):
        p.add_argument(f"--{name}", type=int, default=None, help="fix this choice")
    p.add_argument("--schedule", default=None, help="fix the schedule: none, gpipe, 1f1b, interleaved-1f1b, zbv")
    p.add_argument("--checkpointing", choices=("on", "off"), default=None, help="fix activation checkpointing")
    p.add_argument("--alternatives", type=int, default=5, help="how many rejected layouts to explain")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def _run_plan(args) -> int:
    from .planner import plan
    from .planner.memory import DEFAULT_IMBALANCE
    from .planner.search import DEFAULT_GLOBAL_BATCH_TOKENS

    result = plan(
        _load_model(args.model),
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        gpu_memory_gib=args.gpu_memory,
        seq_len=args.seq_len,
        global_batch_tokens=args.global_batch_tokens or DEFAULT_GLOBAL_BATCH_TOKENS,
        intra_node_gbps=args.intra_node_bw,
        inter_node_gbps=args.inter_node_bw,
        peak_tflops=args.peak_tflops,
        efficiency=args.efficiency,
        imbalance=DEFAULT_IMBALANCE if args.imbalance is None else args.imbalance,
        pp=args.pp,
        dp_replicate=args.dp_replicate,
        dp_shard=args.dp_shard,
        ep=args.ep,
        microbatch_size=args.microbatch_size,
        schedule=args.schedule,
        checkpointing=None if args.checkpointing is None else args.checkpointing == "on",
        num_alternatives=args.alternatives,
    )
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.report())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moe-ep", description="Mixture-of-Experts expert parallelism tools")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_plan_parser(sub)
    args = parser.parse_args(argv)
    try:
        return _run_plan(args)
    except ValueError as err:
        # PlanError and argument errors: say what is wrong and what would be needed, no traceback.
        print(f"moe-ep {args.command}: {err}", file=sys.stderr)
        return EXIT_IMPOSSIBLE


if __name__ == "__main__":
    sys.exit(main())
