"""What trainer.py (transformers' Trainer) and accelerate_loop.py (a hand-written Accelerator loop)
share: their flags, the tiny Mixtral with its load-balancing loss, the data, the run folder and the
per-step log. Both train the same model on the same sequences, with moe_ep's expert parallelism or,
with ``--baseline``, as the same script without it (transformers' own experts, plain data
parallel), so that their losses can be compared step by step.

Data: the Python standard library's sources as bytes (nothing is downloaded), packed into
``--seq-len`` windows and shuffled once by ``--seed``; the loops then read them in order, so step
``s`` of any layout, on any number of processes, trains on the same global batch (data-parallel
rank ``r`` takes micro-batches ``r, r + world, ...`` of it, as accelerate shards a loader).

The run folder (``--output-dir``) is moe_ep.runs' RunFolder: created and marked by the script, or
one the same script marked; anything of the user's in it refused before any work; held by rank 0's
lock for the job."""

from __future__ import annotations

import argparse
import signal
import math
import os
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from moe_ep.runs import (
    Preempted,
    Preemption,
    RunFolder,
    StartupWatchdog,
    StepLog,
    UsageError,
    agree_on_arguments,
    describe_holder,
    files_in,
    run_reported,
    said_by_every_rank,
    verified_resume,
)

from data import ByteTokenizer, PackedSequences, corpus_stats, resolve_data, tokenize_corpus
from models import tiny_config
from options import (add_preempt_signal, add_run_folder_flags, check_run_folder_flags, check_seed_and_seq_len,
                     check_startup_timeout)

NUM_EXPERTS = 8  # models.tiny_config's


def build_parser(description: str, default_output: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ep", type=int, default=2, help="expert-parallel degree (moe_ep.parallelize)")
    p.add_argument("--dp-replicate", type=int, default=1,
                   help="HSDP replicas; the dense weights are FSDP-sharded over world / dp-replicate ranks")
    p.add_argument("--baseline", action="store_true",
                   help="the same script without moe_ep: transformers' own experts and router, plain data parallel "
                        "(DDP), for comparison")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps of the schedule")
    p.add_argument("--stop-after", type=int, default=None,
                   help="stop after this step of the --steps schedule (a checkpoint is written there); continue "
                        "later with --resume")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=2, help="sequences per rank per micro-batch")
    p.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (warmup, then linear decay)")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="linear warmup steps (default: 2, or --steps - 1 where that is fewer)")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--aux-loss-coef", type=float, default=0.02,
                   help="the model's load-balancing loss coefficient (router_aux_loss_coef); 0 turns it off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-corpus-tokens", type=int, default=400_000, help="cap on the tokens read from the stdlib")
    p.add_argument("--output-dir", default=default_output)
    p.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints (0: none)")
    p.add_argument("--keep-checkpoints", type=int, default=None,
                   help="complete checkpoints kept on disk, the older ones deleted once a newer one is sealed "
                        "(default: every one, as the library keeps them)")
    add_run_folder_flags(p)
    p.add_argument("--startup-timeout", type=float, default=1800.0,
                   help="seconds from the process group to the first step before a rank that has not got there is "
                        "reported and every rank still starting exits")
    add_preempt_signal(p)
    return p


def check_args(args, world_size: int) -> None:
    """Flags and layout, before any process group, model or file exists."""
    for name in ("ep", "dp_replicate", "steps", "seq_len", "micro_batch_size", "grad_accum", "max_corpus_tokens"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("lr", "max_grad_norm", "startup_timeout"):
        if not 0 < getattr(args, name) < math.inf:
            raise UsageError(f"--{name.replace('_', '-')} must be a finite number > 0, got {getattr(args, name)}")
    check_startup_timeout(args.startup_timeout)
    if not 0 <= args.aux_loss_coef < math.inf:
        raise UsageError(f"--aux-loss-coef must be a finite number >= 0, got {args.aux_loss_coef}")
    if args.warmup_steps is None:
        args.warmup_steps = min(2, args.steps - 1)
    if not 0 <= args.warmup_steps < args.steps:
        raise UsageError(f"--warmup-steps must be in [0, --steps), got {args.warmup_steps}")
    if args.checkpoint_every < 0:
        raise UsageError(f"--checkpoint-every must be >= 0, got {args.checkpoint_every}")
    if args.keep_checkpoints is not None and args.keep_checkpoints < 1:
        raise UsageError(f"--keep-checkpoints must be >= 1 (the newest is the one to resume), got "
                         f"{args.keep_checkpoints}")
    check_run_folder_flags(args)
    check_seed_and_seq_len(args)
    if args.stop_after is not None:
        if not 1 <= args.stop_after <= args.steps:
            raise UsageError(f"--stop-after must be in [1, --steps], got {args.stop_after}")
        if not args.checkpoint_every or args.stop_after % args.checkpoint_every:
            raise UsageError(f"--stop-after {args.stop_after} must be a multiple of --checkpoint-every "
                             f"({args.checkpoint_every}), so that the run can continue from there")
    if args.baseline:
        return
    if world_size % args.dp_replicate:
        raise UsageError(f"--dp-replicate {args.dp_replicate} must divide the {world_size} launched processes")
    dp_shard = world_size // args.dp_replicate
    if dp_shard % args.ep or NUM_EXPERTS % args.ep:
        raise UsageError(f"--ep {args.ep} must divide both the {NUM_EXPERTS} experts and dp_shard = world / "
                         f"dp-replicate = {dp_shard}")


def lr_at(step: int, args) -> float:
    """Linear warmup to --lr, then linear decay to 0 at --steps: a pure function of the optimizer
    step, so the schedule is the same on any number of processes and after a resume."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    return args.lr * max(0.0, (args.steps - step) / max(1, args.steps - args.warmup_steps))


class Sequences(torch.utils.data.Dataset):
    """Packed byte sequences, shuffled once by the seed; ``input_ids`` and ``labels`` (the model
    shifts them)."""

    def __init__(self, packed: PackedSequences, seed: int):
        self.packed = packed
        self.order = np.random.default_rng(seed).permutation(packed.num_sequences)

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int) -> dict:
        ids = torch.from_numpy(self.packed[int(self.order[i])])
        return {"input_ids": ids, "labels": ids.clone()}


def make_data(args, world_size: int) -> Sequences:
    """The sequences of all ``--steps`` (one pass, no epoch boundary to agree on)."""
    tokens = tokenize_corpus(resolve_data(["stdlib"], "text"), ByteTokenizer(), args.max_corpus_tokens)
    packed = PackedSequences(tokens, args.seq_len)
    needed = args.micro_batch_size * args.grad_accum * world_size * args.steps
    if packed.num_sequences < needed:
        raise UsageError(f"--steps {args.steps} need {needed} sequences of {args.seq_len} tokens, the data gives "
                         f"{packed.num_sequences}: raise --max-corpus-tokens or lower --steps")
    return Sequences(packed, args.seed)


def data_identity(args, data: Sequences, world_size: int) -> dict:
    """What a resumed run must share with the saved one to continue it, as train.py records it:
    the token stream, the packing, the global batch (the loops resume by counting the global
    batches done) and the seed. Recorded in each checkpoint's manifest (RunFolder)."""
    global_batch = args.micro_batch_size * args.grad_accum * world_size
    return {**corpus_stats(data.packed.tokens), "seq_len": args.seq_len, "global_batch": global_batch,
            "seed": args.seed}


def model_config(args):
    config = tiny_config()
    config.output_router_logits = args.aux_loss_coef > 0
    config.router_aux_loss_coef = args.aux_loss_coef
    return config


def make_model(args, device: torch.device):
    """The tiny Mixtral on ``device``, identical on every rank (seeded); with moe_ep, its experts and
    routers on moe_ep's kernels and split over ``--ep`` ranks, its dense weights FSDP2-sharded.
    Needs the process group."""
    from transformers import MixtralForCausalLM

    torch.manual_seed(args.seed)
    model = MixtralForCausalLM(model_config(args)).to(device)
    if args.baseline:
        return model
    import moe_ep

    if not torch.distributed.is_initialized():
        # One process that no launcher gave a process group (`python`, `accelerate launch
        # --num_processes 1`): parallelize runs on a group of its own, of one rank.
        backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
        torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1)
    return moe_ep.parallelize(moe_ep.patch(model), ep=args.ep, dp_replicate=args.dp_replicate)


def count_parameters(args) -> int:
    from transformers import MixtralForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in MixtralForCausalLM(model_config(args)).parameters())


@contextmanager
def checked_run(args, kind: str, checkpoint_glob: str, managed: tuple[str, ...] = ()):
    """Every check before any work, on every rank (flags, layout, data, run folder, the checkpoints
    to try resuming), then the job: rank 0 holds the folder's lock while it runs (the other ranks
    join it through the process group). Yields (data, run folder, resume candidates, world size,
    rank), the candidates as RunFolder.check gives them."""
    world_size, rank = env_int("WORLD_SIZE", 1), env_int("RANK", 0)
    # The same flags, files and folder on every rank, so the same verdict: rank 0 says it, once.
    with said_by_every_rank():
        check_args(args, world_size)
        data = make_data(args, world_size)
        run = RunFolder(Path(args.output_dir), kind, checkpoint_glob, managed,
                        data=data_identity(args, data, world_size))
        candidates = run.check(resume=args.resume, overwrite=args.overwrite, parameters=count_parameters(args),
                               keep=args.keep_checkpoints)
    with run.held(rank=rank):
        yield data, run, candidates, world_size, rank


def claim_run(args, data: Sequences, run: RunFolder, candidates: tuple[list[Path], list[str]], rank: int,
              log: StepLog, startup: StartupWatchdog) -> Path | None:
    """Once the process group exists and before anything is written: every rank was launched with
    the same command and sees the same folder, checkpoints and data (one line naming a difference,
    on every rank); then rank 0 creates and marks the folder and, for --overwrite, deletes the
    run's checkpoints and log. Of ``candidates`` (checked_run's) the ranks resume the first whose
    checksums they all find intact (the damaged ones skipped with a warning, or, named by
    --resume, refused), returned (None: start afresh). A resume of an older checkpoint than the
    newest sets the later ones aside (a branch, kept for the user, out of reach of --resume auto),
    and the log records the resume (or a fresh start over an earlier run's log) so that no step is
    counted twice; checkpoints cut short by an interrupted save, or damaged, are set aside the same
    way. From here to the step loop a rank that hangs is reported within --startup-timeout."""
    tried, warnings = candidates
    startup.phase("agreeing on the arguments")
    agree_on_arguments(run.kind, {**vars(args), "output folder": run.path.resolve(),
                                  "checkpoints to try resuming": tried,
                                  "checkpoints": [p.name for p in run.checkpoints()], "sequences": len(data)})
    for message in warnings:
        log.warn(message)
    if run.previous_holder is not None:
        log.warn(f"{run.path} was held by a job that ended without letting go of it "
                 f"({describe_holder(run.previous_holder)}); this job holds it now")
    if rank == 0:
        run.claim()
        if args.overwrite:
            run.clear()
    startup.phase("verifying the checkpoint to resume")
    resume = verified_resume(tried, explicit=args.resume != "auto", warn=log.warn, must_list=files_in)
    set_aside = run.set_aside_later(resume, rank=rank)
    if resume is not None:
        log.resumed(run.step_of(resume), resume, set_aside)
        return resume
    log.started_afresh()
    if set_aside is not None:
        log.info(f"starting afresh: the checkpoints cut short by an interrupted save are set aside, not deleted, in "
                 f"{set_aside}")
    return None


def preempted(preemption: Preemption, step: int, checkpoint: Path) -> Preempted:
    """What every rank raises after the checkpoint of a preempted run (the same command, resuming
    the newest checkpoint by default, continues it)."""
    return Preempted(preemption.signal, step, checkpoint)


def say_nothing_to_train(log: StepLog, run: RunFolder, step: int, args) -> None:
    """The run resumed at or past the step it was asked to reach (--stop-after, else --steps)."""
    last = args.stop_after or args.steps
    log.info(f"nothing to train: the run in {run.path} is already at step {step} >= "
             f"{'--stop-after' if args.stop_after else '--steps'} {last}")


def finished(log: StepLog, step: int, args) -> bool:
    """Whether the run reached --steps; says how to continue when --stop-after stopped it."""
    if step < args.steps:
        log.info(f"stopped after step {step}; run it again without --stop-after to continue")
        return False
    return True


def startup_watchdog(args) -> StartupWatchdog:
    return StartupWatchdog(args.startup_timeout)


def process_group():
    """accelerate's PartialState, which makes the process group: before ``preemption`` takes the
    signals, so that a rank still waiting for its peers ends at a signal, as any process does,
    with nothing written (a Python handler would run only once the rendezvous returned)."""
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available())


def preemption(args) -> Preemption:
    """SIGTERM and --preempt-signal recorded while the run trains (moe_ep.runs.preemption)."""
    return Preemption(signals=(signal.SIGTERM, args.preempt_signal))


def script_main(train, description: str, default_output: str, argv=None) -> int:
    return run_reported(train, build_parser(description, default_output).parse_args(argv))


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))
