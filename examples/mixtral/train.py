"""Expert-parallel training of Mixtral-style models, launched by `accelerate launch` or `torchrun`.

CPU, 2 gloo processes, the tiny model on the Python standard library's sources:

    ACCELERATE_USE_CPU=true accelerate launch --config_file examples/mixtral/configs/cpu.yaml \\
        examples/mixtral/train.py --model tiny --ep 2

and with 2 pipeline stages on 4 processes: ``--num_processes 4`` and ``--pp 2 --ep 2``.

Everything a user can get wrong (flags, data files, sequence length, layout against the number of
processes) is checked before the process group, the model or the data exist. See README.md beside
this file for GPUs, clusters and the planner.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from moe_ep import AdamW, TrainStep, experts_modules, num_experts_of
from moe_ep.runs import (
    ExpertLoad,
    Preempted,
    Preemption,
    Reporter,
    StartupWatchdog,
    StepGuard,
    Throughput,
    UsageError,
    agree_on_arguments,
    branch_step,
    check_output_folders,
    check_resume_data,
    checkpoint_due,
    clear_run,
    configuration_errors,
    describe_holder,
    exit_process,
    flops_per_token,
    hold_output_dir,
    load_checkpoint,
    mark,
    marker_kind,
    peak_flops,
    read_trainer_state,
    remove_incomplete,
    resume_target,
    run_reported,
    said_by_every_rank,
    save_checkpoint,
    set_aside_later_checkpoints,
    step_metrics,
    summary_lines,
    verified_resume,
)

from data import (
    BatchSchedule,
    ByteTokenizer,
    DataSpec,
    PackedSequences,
    PretrainedTokenizer,
    cached_tokens,
    check_corpus_size,
    check_output_outside_data,
    corpus_stats,
    local_batch,
    remove_interrupted_writes,
    resolve_data,
    survey_corpus,
    token_cache_bytes,
    token_cache_file,
    token_cache_problems,
)
from layout import (
    RunLayout, apply_layout, check_compile_blocks, describe_dispatcher, dispatcher_options, layout_from_flags,
    layout_from_plan, rank_view,
)
from models import (
    ModelSource,
    build_model,
    configure_experts,
    count_parameters,
    materialize,
    resolve_model,
    seed_everything,
)
from options import balancing, build_parser, check_against_model, check_flag_values


def lr_at(step: int, args) -> float:
    """Linear warmup, then cosine decay to ``lr * min_lr_ratio``; a pure function of the step, so a
    resumed run needs no scheduler state."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    span = max(1, args.steps - args.warmup_steps)
    progress = min(1.0, (step - args.warmup_steps) / span)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_step(target, optimizer, args, layout, *, aux_coef: float, bias_rate: float, autocast_dtype) -> TrainStep:
    """moe_ep's TrainStep for every layout, so that the logged losses mean the same with and
    without pipeline stages: the LM loss is the mean over the global batch's tokens, the aux and z
    losses means over layers and micro-batches of each layer's loss (Megatron-Core's form;
    transformers' ``output_router_logits`` loss pools all layers' statistics instead, which a
    pipeline cannot do). ``layout.microbatches`` are the pipeline's micro-batches with ``pp > 1``
    and the gradient-accumulation steps without. A step whose loss or gradient norm is not finite on
    any rank is skipped on every rank; ``--max-consecutive-skips`` in a row stop the run (0: never)."""
    # Clipping to an infinite norm still measures it, for the log.
    return TrainStep(target, optimizer, microbatches=layout.microbatches, aux_loss_coef=aux_coef,
                     global_aux_loss=args.aux_loss == "global" and aux_coef > 0,
                     sequence_aux_loss=args.aux_loss == "sequence" and aux_coef > 0, z_loss_coef=args.z_loss_coef,
                     expert_bias_rate=bias_rate,
                     max_grad_norm=args.max_grad_norm if args.max_grad_norm > 0 else math.inf,
                     max_consecutive_skips=args.max_consecutive_skips or None, autocast_dtype=autocast_dtype,
                     chunked_loss=args.chunked_loss)


def prepare_model(args, source, layout, device, mp_dtype):
    """HF classes, our expert kernels, then the layout; meta models are materialised shard by
    shard after it: random ones initialised, pretrained ones read from their safetensors slices
    (nothing drawn at random first). Returns (target, module, parameters, active parameters per
    token, bytes read per pretrained tensor or None): ``target`` is what trains (the model, or
    with ``--pp > 1`` this rank's moe_ep PipelineStages), ``module`` what this rank holds under
    the model's names (the model, or its stages, layout.rank_view) for the optimizer,
    checkpoints and metrics."""
    meta = source.meta_init if args.init == "auto" or source.pretrained_dir is not None else args.init == "meta"
    model = build_model(source, seed=args.seed, meta=meta)
    model = configure_experts(model, args.experts_implementation, args.backend)
    total_params, active_params = count_parameters(model)
    if not meta and device.type != "cpu":
        model.to(device)
    # parallelize's refusals (a cut no stage can make): those of its agreement alike on every rank.
    with configuration_errors(checked_alike=False):
        target = apply_layout(model, layout, mixed_precision=mp_dtype, compile_blocks=args.compile_blocks,
                              dispatcher=dispatcher_options(args, layout))
    module = model if layout.pp == 1 else rank_view(model, target.modules)
    bytes_read = None
    if source.pretrained_dir is not None:
        from pretrained import load_pretrained

        bytes_read = load_pretrained(model, source.pretrained_dir, device, part=module)
    elif meta:
        materialize(model, device, seed=args.seed, part=module)
    target.train()
    return target, module, total_params, active_params, bytes_read


def pretrained_read_report(bytes_read: dict[str, int], world_size: int) -> str:
    """One line for rank 0: what the ranks read of the pretrained checkpoint (collective)."""
    mine = (sum(bytes_read.values()), sum(n for name, n in bytes_read.items() if ".experts." in name))
    per_rank = [mine] * world_size
    if dist.is_initialized():
        # host sync: once, after loading.
        dist.all_gather_object(per_rank, mine)
    totals = [t for t, _ in per_rank]
    return (f"pretrained weights read by slice: {min(totals):,} to {max(totals):,} bytes per rank; expert tensors "
            f"{sum(e for _, e in per_rank):,} bytes over all {world_size} rank(s)")


def make_optimizer(model, args) -> torch.optim.Optimizer:
    """AdamW (its moments in bf16 with --bf16-moments); no weight decay on vectors (norm weights,
    biases)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if args.bf16_moments:
        return AdamW(groups, lr=args.lr, betas=(args.beta1, args.beta2), moments_dtype=torch.bfloat16)
    return torch.optim.AdamW(groups, lr=args.lr, betas=(args.beta1, args.beta2))


# The optimizer's hyperparameters that flags set (the learning rate is set at every step).
OPTIMIZER_FLAGS = {"weight_decay": "--weight-decay", "betas": "--beta1/--beta2"}


def take_flagged_hyperparameters(optimizer: torch.optim.Optimizer, wanted: list[dict]) -> list[str]:
    """After a resume, the hyperparameters this command's flags give (``wanted``: each group's, as
    make_optimizer set them) over the ones the checkpoint's optimizer state carried; the flags that
    changed them."""
    changed = []
    for group, values in zip(optimizer.param_groups, wanted):
        for key, flag in OPTIMIZER_FLAGS.items():
            if group[key] != values[key]:
                group[key] = values[key]
                changed.append(flag)
    return sorted(set(changed))


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def select_tokenizer(source, choice: str):
    if source.pretrained_dir is None or choice == "byte":
        return ByteTokenizer()
    if not any(source.pretrained_dir.glob("tokenizer*")):
        raise UsageError(f"--model: {source.pretrained_dir} has no tokenizer files (tokenizer.json / tokenizer.model); "
                         "pass --tokenizer byte for a model trained on bytes")
    return PretrainedTokenizer(str(source.pretrained_dir))


def mixed_precision_dtype() -> torch.dtype | None:
    """accelerate's --mixed_precision (carried in the environment by `accelerate launch`)."""
    mode = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if mode == "no":
        return None
    if mode == "bf16":
        return torch.bfloat16
    raise UsageError(f"mixed precision {mode!r} is not supported; use bf16 (accelerate config mixed_precision)")


def check_accelerate_config() -> None:
    """What an accelerate config asks of the model and train.py does not do is refused before any
    work, not ignored: train.py shards the model itself (moe_ep.parallelize, its layout and
    recompute from the flags) and reads only mixed_precision from the config."""
    env = os.environ
    problems = []
    if env.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        if env.get("FSDP_VERSION", "1") != "2":
            problems.append(f"fsdp_version {env.get('FSDP_VERSION', '1')} (moe_ep.parallelize shards with FSDP2)")
        if env.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true":
            problems.append("fsdp_offload_params: true (moe_ep.parallelize does not offload)")
        if env.get("FSDP_ACTIVATION_CHECKPOINTING", "false").lower() == "true":
            problems.append("fsdp_activation_checkpointing: true (pass --activation-checkpointing instead)")
    backend = env.get("ACCELERATE_DYNAMO_BACKEND", "no").lower()
    if backend not in ("no", ""):
        problems.append(f"dynamo_backend: {backend} (pass --compile-blocks instead)")
    if problems:
        raise UsageError("the accelerate config asks for what train.py does not do: " + "; ".join(problems)
                         + "; remove it from the config (train.py's flags set the layout, recompute and compilation)")


def data_identity(args, layout, tokenizer, stats: dict[str, int] | None) -> dict:
    """What a resumed run must share with the saved one to continue it: the token stream
    (``data.corpus_stats``; None where unknown before tokenizing), the packing, the global batch
    and the seed."""
    stats = stats or {"corpus_tokens": None, "token_sum": None, "token_sha256": None}
    return {**stats, "seq_len": args.seq_len, "global_batch": layout.global_batch, "seed": args.seed,
            "tokenizer": tokenizer.name}


class Checked(NamedTuple):
    """What validate found, for train."""

    world_size: int
    rank: int
    source: ModelSource
    tokenizer: ByteTokenizer | PretrainedTokenizer
    layout: RunLayout
    chosen_plan: object | None  # moe_ep.planner's plan, with --plan
    data_spec: DataSpec
    mp_dtype: torch.dtype | None
    # The checkpoint to resume (None: start afresh), then the older ones --resume auto falls back
    # to should its shards not match their checksums.
    resume: Path | None
    fallbacks: tuple[Path, ...]
    token_cache: Path
    token_cache_intact: bool
    # data_identity, its corpus entries None where unknown before tokenizing.
    identity: dict
    # Said by rank 0 at start-up: damaged checkpoints or token cache found and passed over.
    warnings: tuple[str, ...]


def validate(args) -> Checked:
    """Every check that needs no process group and no model weights, before anything is written;
    identical on every rank. The data is read (not tokenized, save for bytes) so that a bad record
    anywhere, a corpus smaller than one global batch, or a resume on other data stops here."""
    check_flag_values(args)
    world_size, rank = env_int("WORLD_SIZE", 1), env_int("RANK", 0)
    source = resolve_model(args.model)
    tokenizer = select_tokenizer(source, args.tokenizer)
    check_against_model(args, source.config, tokenizer)
    chosen_plan = None
    if args.plan:
        layout, chosen_plan = layout_from_plan(args, source.config, world_size, env_int("LOCAL_WORLD_SIZE", world_size))
    else:
        layout = layout_from_flags(args, world_size, source.config)
    if args.compile_blocks:
        check_compile_blocks(layout)
    dispatcher_options(args, layout)
    data_spec = resolve_data(args.data, args.text_field)
    mp_dtype = mixed_precision_dtype()
    check_accelerate_config()
    output_dir = Path(args.output_dir)
    check_output_outside_data(args.data, output_dir)
    token_cache = token_cache_file(data_spec, tokenizer, output_dir / "token_cache", args.max_corpus_tokens)
    cache_bytes = None if token_cache.exists() else token_cache_bytes(data_spec, tokenizer, args.max_corpus_tokens)
    check_output_folders(output_dir, None if args.export_dir is None else Path(args.export_dir),
                         count_parameters(build_model(source, seed=args.seed, meta=True))[0],
                         keep=args.keep_checkpoints,
                         also=None if cache_bytes is None else (cache_bytes, "the token cache"))
    candidates, warnings = resume_target(args.resume, output_dir / "checkpoints", overwrite=args.overwrite)
    # Last: the only checks that read the whole corpus (or its token cache).
    cache_problems = token_cache_problems(token_cache) if token_cache.exists() else None
    if cache_problems:
        warnings.append(f"the token cache {token_cache} is damaged ({'; '.join(cache_problems)}); tokenizing the data "
                        "again")
    intact = cache_problems == []
    stats = survey_corpus(data_spec, tokenizer, token_cache if intact else None, args.max_corpus_tokens)
    if stats is not None:
        check_corpus_size(stats["corpus_tokens"], args.seq_len, layout.global_batch)
    identity = data_identity(args, layout, tokenizer, stats)
    if candidates:
        check_resume_data(candidates[0], identity, config=source.config)
    return Checked(world_size, rank, source, tokenizer, layout, chosen_plan, data_spec, mp_dtype,
                   candidates[0] if candidates else None, tuple(candidates[1:]), token_cache, intact, identity,
                   tuple(warnings))


def train(args) -> None:
    wall0 = time.perf_counter()
    with said_by_every_rank():
        checked = validate(args)
    with hold_output_dir(Path(args.output_dir), rank=checked.rank) as previous_holder:
        from accelerate import PartialState

        # The process group (every rank meets the others) before the signals are taken: a rank
        # still waiting for its peers then ends at a signal, as any process does, with nothing
        # written (a Python handler would run only once the rendezvous returned).
        state = PartialState(cpu=not torch.cuda.is_available())
        # Before the run writes anything: a signal during start-up stops it after its first step.
        with (Preemption(signals=(signal.SIGTERM, args.preempt_signal)) as preemption,
              StartupWatchdog(args.startup_timeout) as startup):
            run(args, checked, state, wall0, previous_holder, preemption, startup)


def run(args, checked: Checked, state, wall0: float, previous_holder: dict | None, preemption: Preemption,
        startup: StartupWatchdog) -> None:
    """The job, on accelerate's ``state`` (its process group made)."""
    (world_size, rank, source, tokenizer, layout, chosen_plan, data_spec, mp_dtype, resume, fallbacks, token_cache,
     token_cache_intact, identity, warnings) = checked
    device, barrier = state.device, state.wait_for_everyone
    if state.num_processes != world_size:
        raise UsageError(f"accelerate sees {state.num_processes} processes but WORLD_SIZE is {world_size}")
    is_main = rank == 0
    output_dir = Path(args.output_dir)
    ckpt_root = output_dir / "checkpoints"
    # From here to the step loop, a rank that hangs is reported within --startup-timeout.
    # Before its peers, waiting for it below, could write a cache.
    leftovers = remove_interrupted_writes(output_dir / "token_cache") if is_main else []
    startup.phase("agreeing on the arguments")
    # Before anything is written: every rank was launched with the same command and sees the same
    # folder, checkpoints and data.
    agree_on_arguments("train.py", {**vars(args), "output folder": output_dir.resolve(), "checkpoint to resume": resume,
                                    "fallback checkpoints": fallbacks, "data identity": identity})
    seed_everything(args.seed)

    def warn(message: str) -> None:
        if is_main:
            print(f"warning: {message}", file=sys.stderr, flush=True)

    for message in warnings:
        warn(message)
    if leftovers:
        warn(f"removed the token cache {'files' if len(leftovers) > 1 else 'file'} a killed run left half written: "
             + ", ".join(p.name for p in leftovers))
    if previous_holder is not None:
        warn(f"{output_dir} was held by a job that ended without letting go of it ({describe_holder(previous_holder)}); "
             "this job holds it now")
    if is_main and marker_kind(output_dir) != "run":
        mark(output_dir, "run")
    startup.phase("verifying the checkpoint to resume")
    with said_by_every_rank():
        if resume is not None:
            # Every shard's checksum, the ranks sharing the reading; damage found by any rank is
            # known to all before anything is loaded.
            resume = verified_resume([resume, *fallbacks], explicit=args.resume != "auto", warn=warn)
            if resume != checked.resume:
                check_resume_data(resume, identity, config=source.config)

    # Data: tokenized once (rank 0), then every rank maps the same cache.
    startup.phase("tokenizing the data (or reading its cache)")
    tokens = cached_tokens(data_spec, tokenizer, token_cache, is_writer=state.is_main_process,
                           barrier=barrier, intact=token_cache_intact, max_tokens=args.max_corpus_tokens)
    if identity != (known := data_identity(args, layout, tokenizer, corpus_stats(tokens))):
        # A pretrained tokenizer or a streamed dataset (the token stream is known only now), or a
        # token cache written again after damage: checked against the stream itself.
        with said_by_every_rank():
            check_corpus_size(int(tokens.size), args.seq_len, layout.global_batch)
            identity = known
            if resume is not None:
                check_resume_data(resume, identity, config=source.config)
    packed = PackedSequences(tokens, args.seq_len)
    global_batch = layout.global_batch
    schedule = BatchSchedule(packed.num_sequences, global_batch, layout.dp_rank(rank), layout.dp, args.seed)

    startup.phase("building the model")
    target, module, total_params, active_params, bytes_read = prepare_model(args, source, layout, device, mp_dtype)
    optimizer = make_optimizer(module, args)

    start_step, tokens_seen, branch_points = 0, 0, []
    if is_main:
        if args.overwrite:
            clear_run(output_dir)
        removed = remove_incomplete(ckpt_root)
    barrier()
    # Resumed from an older checkpoint than the newest: the later ones are an abandoned branch,
    # set aside, and the checkpoint resumed is kept from pruning.
    set_aside = None if resume is None else set_aside_later_checkpoints(
        ckpt_root, read_trainer_state(resume)["step"], resume, rank=rank)
    reporter = Reporter(output_dir, enabled=is_main, total_steps=args.steps, progress=not args.no_progress,
                        tensorboard=args.tensorboard)
    if is_main and removed:
        reporter.info(f"removed {len(removed)} incomplete checkpoint(s) left by an interrupted write or deletion: "
                      + ", ".join(p.name for p in removed))
    startup.phase("loading the checkpoint")
    if resume is not None:
        flagged = [{key: group[key] for key in OPTIMIZER_FLAGS} for group in optimizer.param_groups]
        saved = load_checkpoint(resume, module, optimizer, rank=rank, world_size=world_size,
                                verified=True)  # verified_resume above
        if changed := take_flagged_hyperparameters(optimizer, flagged):
            reporter.info(f"the optimizer takes this command's {', '.join(changed)}, not the values it was saved with")
        start_step, tokens_seen = saved["step"], saved["tokens_seen"]
        # Where this run parts from the checkpoints beside it: kept from pruning (the one resumed,
        # or for a branch taken up again by its path, the last checkpoint it shares with them).
        branch = branch_step(ckpt_root, resume, start_step)
        branch_points = saved.get("branch_points", []) + (
            [branch] if set_aside is not None or branch != start_step else [])
        reporter.resumed(start_step, resume, set_aside)
        reporter.info(f"resumed from {resume} at step {start_step}"
                      + ("" if saved["world_size"] == world_size else
                         f" (saved by {saved['world_size']} ranks: per-rank RNG states not restored)"))
    else:
        reporter.started_afresh()
    if reporter.bar is not None:
        reporter.bar.update(start_step)
    if chosen_plan is not None:
        reporter.info(chosen_plan.report())
        steps_per_rank = (f"{layout.microbatches} pipeline micro-batches" if layout.pp > 1
                          else f"{layout.microbatches} accumulation step(s)")
        reporter.info(f"--plan: micro-batch {layout.microbatch_size} x {steps_per_rank} per rank")
    if bytes_read is not None:
        reporter.info(pretrained_read_report(bytes_read, world_size))

    num_layers = source.config.num_hidden_layers
    expert_load = ExpertLoad(module, num_layers, num_experts_of(experts_modules(module)), device,
                             pipeline=layout.pp > 1)
    aux_coef, bias_rate = balancing(args, source.config)
    throughput = Throughput(flops_per_token(source.config, active_params, args.seq_len),
                            peak_flops(device, args.peak_tflops), world_size)
    reporter.info(
        f"model {source.name}: {total_params / 1e6:,.1f}M parameters, {active_params / 1e6:,.1f}M active per token | "
        f"layout {layout.describe()} on {world_size} process(es), {device.type}, "
        f"{'bf16 compute' if mp_dtype is not None else 'fp32'} | experts {args.experts_implementation}"
        + (f", dispatch {describe_dispatcher(dispatcher_options(args, layout), layout.ep)}" if layout.ep > 1 else "")
    )
    reporter.info(
        f"data {data_spec.describe()}: {tokens.size:,} tokens -> {packed.num_sequences:,} sequences of {args.seq_len}; "
        f"global batch {global_batch} sequences = {global_batch * args.seq_len:,} tokens/step"
    )
    if start_step >= args.steps:
        reporter.info(f"nothing to train: the run in {output_dir} is already at step {start_step} >= --steps {args.steps}")

    losses: list[tuple[int, float]] = []
    # Parallelized models cast through FSDP's policy; a lone process uses autocast instead.
    autocast_dtype = mp_dtype if not dist.is_initialized() else None
    guard = StepGuard(step_timeout=args.step_timeout, last_checkpoint=resume, timeout_name="--step-timeout")
    train_step = make_step(target, optimizer, args, layout, aux_coef=aux_coef, bias_rate=bias_rate,
                           autocast_dtype=autocast_dtype)
    startup.reached()
    for step in range(start_step, args.steps):
        done = step + 1
        with guard.step(done):
            lr = lr_at(step, args)
            for group in optimizer.param_groups:
                group["lr"] = lr
            throughput.start()
            batch = local_batch(packed, schedule, step).to(device)
            train_step({"input_ids": batch})
            tokens_seen += global_batch * args.seq_len
            # host sync: once per step, for the log.
            grad_norm, loss, aux_loss, z_loss = step_metrics(train_step, device)
            throughput.stop(global_batch * args.seq_len)
            if train_step.last_step_skipped:
                # Nothing was applied; said at once, whatever --log-every.
                reporter.skipped({"step": done, "loss": loss, "grad_norm": grad_norm, "lr": lr,
                                  "consecutive_skips": train_step.consecutive_skips,
                                  "steps_skipped": train_step.steps_skipped}, args.max_consecutive_skips)
            else:
                losses.append((done, loss))
            if not train_step.last_step_skipped and (done % args.log_every == 0 or done == args.steps):
                tps, mfu = throughput.report()
                reporter.step(
                    {"step": done, "loss": loss, "aux_loss": aux_loss if aux_coef else None,
                     "z_loss": z_loss if args.z_loss_coef else None, "grad_norm": grad_norm, "lr": lr,
                     "tokens_per_s": tps, "mfu": mfu, "tokens": tokens_seen, "epoch": schedule.epoch(done),
                     "steps_skipped": train_step.steps_skipped},
                    expert_load.collect(),
                )
            # Every rank asks at every step boundary but the last (the run ends there anyway).
            preempted = done < args.steps and preemption.stop_requested()
            if preempted or checkpoint_due(done, every=args.checkpoint_every, last=args.steps):
                trainer_state = {"step": done, "tokens_seen": tokens_seen, "world_size": world_size,
                                 "layout": asdict(layout), "model": source.name, "data": identity,
                                 "branch_points": branch_points}
                guard.last_checkpoint = save_checkpoint(ckpt_root, done, module, optimizer, trainer_state, rank=rank,
                                                        barrier=barrier, keep=args.keep_checkpoints,
                                                        config=module.config)
                reporter.info(f"checkpoint {guard.last_checkpoint}")
        if preempted:
            raise Preempted(preemption.signal, done, guard.last_checkpoint)

    last_ckpt = guard.last_checkpoint
    extra = {"checkpoint": last_ckpt, "metrics": output_dir / "metrics.jsonl"}
    if train_step.steps_skipped:
        extra["steps skipped (non-finite loss or gradient norm)"] = train_step.steps_skipped
    if args.export_dir is not None:
        extra["export"] = args.export_dir
    for line in summary_lines(losses=losses, throughput=throughput, wall_s=time.perf_counter() - wall0, extra=extra):
        reporter.info(line)
    reporter.close()
    barrier()
    if dist.is_initialized():
        dist.destroy_process_group()
    if args.export_dir is not None and is_main and last_ckpt is not None:
        # After the process group is gone: a long conversion cannot time out the other ranks.
        from export import export_hf

        export_hf(last_ckpt, Path(args.export_dir))
        print(f"exported a Hugging Face folder to {args.export_dir} (loads with plain transformers)", flush=True)


def main(argv=None) -> int:
    return run_reported(train, build_parser().parse_args(argv))


if __name__ == "__main__":
    exit_process(main())
