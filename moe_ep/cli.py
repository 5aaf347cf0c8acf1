"""``moe-ep`` command line. ``moe-ep plan``: choose a parallel layout for a model on a cluster."""

from __future__ import annotations

import argparse
import json
import math
import sys

EXIT_IMPOSSIBLE = 2


def _bounded(name: str):
    """An argparse type for the planner input ``name``, with the range the planner accepts
    (``moe_ep.planner.inputs.BOUNDS``): argparse names the flag in its error."""
    from .planner.inputs import BOUNDS

    bound = BOUNDS[name]

    def parse(text: str):
        try:
            value = float(text)
            if bound.kind is int:
                if not math.isfinite(value) or value != int(value):
                    raise ValueError(text)
                value = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {bound.describe()}, got {text!r}") from None
        try:
            return bound.check("value", value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {bound.describe()}, got {text!r}") from None

    parse.__name__ = bound.describe()
    return parse


def _add_plan_parser(sub) -> argparse.ArgumentParser:
    from .planner import CLUSTERS
    from .planner.presets import DEFAULT_CLUSTER, efficiencies_for
    from .planner.recompute import RECOMPUTE_POLICIES

    # Without --cluster the planner takes DEFAULT_CLUSTER's figures for everything not given; each
    # option's help names the figure it would get, so the help says what the plan will assume.
    preset = CLUSTERS[DEFAULT_CLUSTER]
    efficiencies = efficiencies_for(preset.gpu.family)

    def default(figure) -> str:
        return f"default: the --cluster preset's, without one {DEFAULT_CLUSTER}'s {figure:g}"

    p = sub.add_parser(
        "plan",
        help="choose pp / dp_replicate / dp_shard / ep, micro-batching, schedule and checkpointing",
        description="Print the fastest layout that fits (by the headroom rule), its per-GPU memory table, its "
        "estimated step time with the MFU that follows from the stated efficiencies, and why the closest "
        "alternatives lost.",
    )
    from .planner import MODEL_NAMES

    p.add_argument("--model", help=f"one of {', '.join(MODEL_NAMES)}, or a local config.json / folder "
                                   "(required unless --anchors)")
    p.add_argument("--cluster", choices=tuple(CLUSTERS),
                   help="a preset whose figures every other option defaults to (and may override); without it "
                        f"--gpus-per-node and --gpu-memory are required and every other figure is {DEFAULT_CLUSTER}'s "
                        f"({preset.description}, {preset.gpu.name}), as each option's default says")
    p.add_argument("--nodes", type=_bounded("nodes"), help="required unless --anchors")
    p.add_argument("--gpus-per-node", type=_bounded("gpus_per_node"), help="required without --cluster")
    p.add_argument("--gpu-memory", type=_bounded("gpu_memory_gib"),
                   help="GiB per GPU (80 for A100-80GB); required without --cluster")
    p.add_argument("--seq-len", type=_bounded("seq_len"), default=4096)
    p.add_argument("--global-batch-tokens", type=_bounded("global_batch_tokens"), default=None,
                   help="tokens per optimizer step (default 4Mi)")
    p.add_argument("--intra-node-bw", type=_bounded("intra_node_gbps"),
                   help=f"GB/s per GPU over NVLink (NCCL bus bw); {default(preset.gpu.nvlink_gbps)}")
    p.add_argument("--inter-node-bw", type=_bounded("inter_node_gbps"),
                   help="GB/s per GPU across nodes: the node's network over its GPUs; "
                        f"{default(preset.network_gbps_per_gpu)} ({preset.network} over {preset.gpus_per_node} GPUs)")
    p.add_argument("--peak-tflops", type=_bounded("peak_tflops"),
                   help=f"dense bf16 peak per GPU; {default(preset.gpu.peak_tflops)}")
    p.add_argument("--hbm-bw", type=_bounded("hbm_gbps"),
                   help=f"GB/s of GPU memory bandwidth; {default(preset.gpu.hbm_gbps)}")
    p.add_argument("--calibration", metavar="FILE",
                   help="a result JSON of 'python -m moe_ep.bench kernels' from the cluster's GPU (without "
                        f"--cluster, an {preset.gpu.family}): its measured efficiencies replace the defaults")
    for kind in ("grouped-gemm", "dense-gemm", "attention", "memory"):
        field = kind.replace("-", "_")
        p.add_argument(f"--{kind}-efficiency", type=_bounded(f"{field}_efficiency"),
                       help="fraction of the peak (of HBM bandwidth for memory) this kind of kernel reaches; "
                            f"{default(getattr(efficiencies, field))}, or the --calibration file's")
    p.add_argument("--reserve-fraction", type=_bounded("reserve_fraction"), default=0.10,
                   help="GPU memory kept back for the CUDA context, NCCL and fragmentation (0.10)")
    p.add_argument("--imbalance", type=_bounded("imbalance"), default=None,
                   help="busiest expert rank's load over the mean in steady training (1.2)")
    p.add_argument("--startup-imbalance", type=_bounded("startup_imbalance"), default=None,
                   help="the same early in dropless training, which expert buffers are sized for (2.0)")
    p.add_argument("--max-nodes", type=_bounded("max_nodes"), default=None,
                   help="node-limited routing: each token's experts on at most this many nodes (DeepSeek-V3: 4)")
    p.add_argument("--balanced-routing", action="store_true",
                   help="routing forced to balance, as benchmarks that force it: --imbalance 1 --startup-imbalance 1")
    p.add_argument("--capacity-factor", type=_bounded("capacity_factor"), default=None,
                   help="plan for the dispatcher's capacity mode (default: dropless)")
    p.add_argument("--overlap-chunks", type=_bounded("overlap_chunks"), default=1,
                   help="plan for parallelize(overlap_chunks=N): each MoE layer's all-to-alls overlapped with the "
                        "experts of its other chunks (default 1: none)")
    p.add_argument("--chunked-loss", action="store_true",
                   help="plan for moe_ep's chunked loss (TrainStep(chunked_loss=True)): no full logits in the head")
    p.add_argument("--bf16-moments", action="store_true",
                   help="plan for AdamW with its moments in bf16 (moe_ep.training.AdamW): 12 bytes per sharded "
                        "parameter instead of 16")
    p.add_argument("--compile-blocks", action="store_true",
                   help="plan for compiled dense blocks (parallelize(compile_blocks=True)): the memory-bound bytes "
                        "Inductor's fused kernels move; recompute 'none' or 'full'")
    p.add_argument("--min-headroom", type=_bounded("min_headroom"), default=None,
                   help="fraction of GPU memory a winning layout keeps free unless it is faster by more than "
                        "--speed-margin (0.10)")
    p.add_argument("--speed-margin", type=_bounded("speed_margin"), default=None, help="(0.05)")
    for name in ("pp", "dp-replicate", "dp-shard", "ep"):
        p.add_argument(f"--{name}", type=_bounded(name.replace("-", "_")), default=None, help="fix this choice")
    p.add_argument("--microbatch-size", type=_bounded("microbatch_size"), default=None, help="fix this choice")
    p.add_argument("--schedule", default=None,
                   help="fix the schedule: none, gpipe, 1f1b, interleaved-1f1b, interleaved-1f1b-overlap, zbv, dualpipev")
    p.add_argument("--checkpointing", choices=("on", "off", *RECOMPUTE_POLICIES), default=None,
                   help="fix the recompute policy (on: full, off: none)")
    p.add_argument("--virtual-stages", type=_bounded("virtual_stages"), default=None,
                   help="fix interleaved 1F1B's stages per pipeline rank (implies --schedule interleaved-1f1b)")
    p.add_argument("--alternatives", type=_bounded("num_alternatives"), default=5,
                   help="how many rejected layouts to explain")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--anchors", action="store_true",
                   help="instead of planning one model: plan published MoE training runs with their published "
                        "layouts and print the planned figures beside the published ones, with their sources "
                        "(takes only --calibration and --json)")
    return p


def _run_anchors(args) -> int:
    from .planner.anchors import anchor_report

    report = anchor_report(calibration=args.calibration)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format())
    return 0


def _run_plan(args) -> int:
    from .planner import plan
    if args.balanced_routing:
        args.imbalance = args.startup_imbalance = 1.0

    given = dict(
        gpus_per_node=args.gpus_per_node, gpu_memory_gib=args.gpu_memory, intra_node_gbps=args.intra_node_bw,
        inter_node_gbps=args.inter_node_bw, peak_tflops=args.peak_tflops, hbm_gbps=args.hbm_bw,
        grouped_gemm_efficiency=args.grouped_gemm_efficiency, dense_gemm_efficiency=args.dense_gemm_efficiency,
        attention_efficiency=args.attention_efficiency, memory_efficiency=args.memory_efficiency,
        global_batch_tokens=args.global_batch_tokens, imbalance=args.imbalance,
        startup_imbalance=args.startup_imbalance, min_headroom=args.min_headroom, speed_margin=args.speed_margin,
    )
    result = plan(
        args.model,
        nodes=args.nodes,
        cluster=args.cluster,
        seq_len=args.seq_len,
        calibration=args.calibration,
        reserve_fraction=args.reserve_fraction,
        capacity_factor=args.capacity_factor,
        overlap_chunks=args.overlap_chunks,
        chunked_loss=args.chunked_loss,
        bf16_moments=args.bf16_moments,
        compiled_blocks=args.compile_blocks,
        pp=args.pp,
        dp_replicate=args.dp_replicate,
        dp_shard=args.dp_shard,
        ep=args.ep,
        microbatch_size=args.microbatch_size,
        schedule=args.schedule,
        checkpointing={"on": "full", "off": "none"}.get(args.checkpointing, args.checkpointing),
        virtual_stages=args.virtual_stages,
        max_nodes=args.max_nodes,
        num_alternatives=args.alternatives,
        **{k: v for k, v in given.items() if v is not None},
    )
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.report())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moe-ep", description="Mixture-of-Experts expert parallelism tools")
    sub = parser.add_subparsers(dest="command", required=True)
    plan_parser = _add_plan_parser(sub)
    args = parser.parse_args(argv)
    if args.anchors:
        # The anchors fix everything else as their sources published it. What was given is what a
        # parse with every default unset still holds (a flag given its default value included).
        unset = object()
        plan_parser.set_defaults(**dict.fromkeys(vars(args), unset))
        given = [k for k, v in vars(parser.parse_args(argv)).items()
                 if k not in ("command", "anchors", "calibration", "json") and v is not unset]
        if given:
            flags = ", ".join("--" + k.replace("_", "-") for k in given)
            plan_parser.error(f"--anchors plans the published layouts and takes only --calibration and --json, "
                              f"got {flags}")
    elif args.model is None or args.nodes is None:
        plan_parser.error("--model and --nodes are required (or give --anchors)")
    elif args.cluster is None and (args.gpus_per_node is None or args.gpu_memory is None):
        plan_parser.error("--gpus-per-node and --gpu-memory are required without --cluster (or name a --cluster)")
    if args.balanced_routing and (args.imbalance is not None or args.startup_imbalance is not None):
        plan_parser.error("--balanced-routing sets --imbalance and --startup-imbalance to 1: give either, not both")
    try:
        return _run_anchors(args) if args.anchors else _run_plan(args)
    except ValueError as err:
        # PlanError and argument errors: say what is wrong and what would be needed, no traceback.
        print(f"moe-ep {args.command}: {err}", file=sys.stderr)
        return EXIT_IMPOSSIBLE


if __name__ == "__main__":
    sys.exit(main())
