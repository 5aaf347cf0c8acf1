"""What trainer.py (transformers' Trainer) and accelerate_loop.py (a hand-written Accelerator loop)
share: their flags, the tiny Mixtral with its load-balancing loss, the data, the run folder and the
per-step log. Both train the same model on the same sequences, with moe_ep's expert parallelism or,
with ``--baseline``, as the same script without it (transformers' own experts, plain data
parallel), so that their losses can be compared step by step.

Data: the Python standard library's sources as bytes (nothing is downloaded), packed into
``--seq-len`` windows and shuffled once by ``--seed``; the loops then read them in order, so step
``s`` of any layout, on any number of processes, trains on the same global batch (data-parallel
rank ``r`` takes micro-batches ``r, r + world, ...`` of it, as accelerate shards a loader).

The run folder (``--output-dir``) follows ownership.py: it is created and marked by the script, or
must be one the same script marked (an empty folder is taken over); a folder holding anything else
is refused before any work, as is a run folder that holds checkpoints when ``--resume`` is not
given (a new run would write over them). Rank 0 holds the folder's lock for the job. The final
model goes to ``OUTPUT_DIR/final``, marked as an export, replaced only when it is one."""

from __future__ import annotations

import argparse
import signal
import json
import math
import os
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from data import ByteTokenizer, PackedSequences, resolve_data, tokenize_corpus
from moe_ep.runs.preemption import Preempted, Preemption

from errors import UsageError
from models import tiny_config
from options import add_preempt_signal
from ownership import (
    CHECKPOINT_BYTES_PER_PARAMETER,
    EXPORT_BYTES_PER_PARAMETER,
    LOCK_FILE,
    MARKER,
    OutputLock,
    check_free_space,
    check_writable,
    make_managed_dir,
    mark,
    marker_kind,
    not_ours_message,
    ours,
)

FINAL = "final"
METRICS = "metrics.jsonl"
# Left in the run folder by a run stopped by a preemption signal: the same command continues it
# (as if given --resume) until the run reaches --steps, so a requeued job needs no other command.
PREEMPTED = "preempted"
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
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--aux-loss-coef", type=float, default=0.02,
                   help="the model's load-balancing loss coefficient (router_aux_loss_coef); 0 turns it off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-corpus-tokens", type=int, default=400_000, help="cap on the tokens read from the stdlib")
    p.add_argument("--output-dir", default=default_output)
    p.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints (0: none)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --output-dir (implied after a preemption)")
    add_preempt_signal(p)
    return p


def check_args(args, world_size: int) -> None:
    """Flags and layout, before any process group, model or file exists."""
    for name in ("ep", "dp_replicate", "steps", "seq_len", "micro_batch_size", "grad_accum", "max_corpus_tokens"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("lr", "max_grad_norm"):
        if not 0 < getattr(args, name) < math.inf:
            raise UsageError(f"--{name.replace('_', '-')} must be a finite number > 0, got {getattr(args, name)}")
    if not 0 <= args.aux_loss_coef < math.inf:
        raise UsageError(f"--aux-loss-coef must be a finite number >= 0, got {args.aux_loss_coef}")
    if not 0 <= args.warmup_steps < args.steps:
        raise UsageError(f"--warmup-steps must be in [0, --steps), got {args.warmup_steps}")
    if args.checkpoint_every < 0:
        raise UsageError(f"--checkpoint-every must be >= 0, got {args.checkpoint_every}")
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

    return moe_ep.parallelize(moe_ep.patch(model), ep=args.ep, dp_replicate=args.dp_replicate)


@contextmanager
def configuration_errors():
    """moe_ep's and accelerate's refusals of a layout or configuration (ValueError, raised alike on
    every rank before any work) as one line by rank 0."""
    try:
        yield
    except ValueError as err:
        raise UsageError(str(err), agreed=True) from err


def count_parameters(args) -> int:
    from transformers import MixtralForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in MixtralForCausalLM(model_config(args)).parameters())


class RunFolder:
    """``--output-dir`` and what the script may do in it (module docstring)."""

    def __init__(self, path: Path, kind: str, checkpoint_glob: str, managed: tuple[str, ...] = ()):
        self.path = path
        self.kind = kind
        self.checkpoint_glob = checkpoint_glob
        self.managed = managed  # subfolders the script makes (with their own markers)
        self.final = path / FINAL
        self.lock = OutputLock(path)

    def checkpoints(self) -> list[Path]:
        """This run's complete checkpoints, oldest first."""
        found = [p for p in self.path.glob(self.checkpoint_glob) if p.is_dir()]
        return sorted(found, key=lambda p: int(p.name.rpartition("-")[2].rpartition("_")[2]))

    def check(self, *, resume: bool, parameters: int) -> None:
        """Before any work, on every rank: nothing of the user's is in the way, the folder is
        writable and has room for a checkpoint and the final model."""
        if self.path.exists() and not self.path.is_dir():
            raise UsageError(f"--output-dir: {self.path} exists and is not a folder")
        if self.path.exists() and marker_kind(self.path) != self.kind and not self._holds_nothing():
            raise UsageError(not_ours_message(self.path, "--output-dir"))
        for name in self.managed:
            if (self.path / name).exists() and not ours(self.path / name, name):
                raise UsageError(not_ours_message(self.path / name, "--output-dir"))
        found = self.checkpoints() if self.path.exists() else []
        if found and not resume:
            raise UsageError(f"--output-dir {self.path} holds checkpoints of an earlier run (up to {found[-1].name}); "
                             "pass --resume to continue it, or choose a new --output-dir")
        if resume and not found:
            raise UsageError(f"--resume: {self.path} holds no checkpoint of this script")
        if self.final.exists() and not ours(self.final, "export"):
            raise UsageError(not_ours_message(self.final, "--output-dir"))
        check_writable(self.path, "--output-dir")
        check_free_space(self.path, (CHECKPOINT_BYTES_PER_PARAMETER + EXPORT_BYTES_PER_PARAMETER) * parameters,
                         "one checkpoint and the final model", "--output-dir")

    def _holds_nothing(self) -> bool:
        """Empty but for a marker or the lock, which rank 0 may be creating while its peers check."""
        return self.path.is_dir() and all(p.name.startswith(MARKER) or p.name == LOCK_FILE
                                          for p in self.path.iterdir())

    def claim(self) -> None:
        """Rank 0, after ``check`` and with the lock held: create and mark the folder."""
        self.path.mkdir(parents=True, exist_ok=True)
        if marker_kind(self.path) != self.kind:
            mark(self.path, self.kind)
        for name in self.managed:
            make_managed_dir(self.path / name, name)

    def saved_final(self, log: StepLog, is_main: bool) -> None:
        """After the final model is written: mark it as an export (rank 0) and say where it is; a
        preempted run is complete now."""
        if is_main:
            mark(self.final, "export")
            (self.path / PREEMPTED).unlink(missing_ok=True)
        log.info(f"saved the model to {self.final} (loads with plain from_pretrained)")


class StepLog:
    """One line per optimizer step on rank 0, and the same figures in ``metrics.jsonl`` (appended
    to by a resumed run)."""

    def __init__(self, folder: Path, enabled: bool):
        self.path = folder / METRICS
        self.enabled = enabled

    def step(self, record: dict) -> None:
        if not self.enabled:
            return
        grad_norm = record.get("grad_norm")
        print(f"step {record['step']:5d} | loss {record['loss']:.6f} | grad_norm "
              f"{'-' if grad_norm is None else f'{grad_norm:.4f}'} | lr {record['lr']:.2e}", flush=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def info(self, message: str) -> None:
        if self.enabled:
            print(message, flush=True)


@contextmanager
def checked_run(args, kind: str, checkpoint_glob: str, managed: tuple[str, ...] = ()):
    """Every check before any work, on every rank (flags, layout, data, run folder), then the job:
    rank 0 holds the folder's lock while it runs (the other ranks join it through the process
    group). Yields (data, run folder, world size, rank)."""
    world_size, rank = env_int("WORLD_SIZE", 1), env_int("RANK", 0)
    check_args(args, world_size)
    data = make_data(args, world_size)
    run = RunFolder(Path(args.output_dir), kind, checkpoint_glob, managed)
    args.resume = args.resume or (run.path / PREEMPTED).is_file()
    run.check(resume=args.resume, parameters=count_parameters(args))
    if rank == 0:
        run.lock.acquire()
    try:
        yield data, run, world_size, rank
    finally:
        run.lock.release()


def preempted(run: RunFolder, preemption: Preemption, step: int, checkpoint: Path, *, is_main: bool) -> Preempted:
    """What every rank raises after the checkpoint of a preempted run; rank 0 notes in the run
    folder that the same command continues it."""
    if is_main:
        (run.path / PREEMPTED).write_text(f"{checkpoint}\n")
    return Preempted(preemption.signal, step, checkpoint)


def finished(log: StepLog, step: int, args) -> bool:
    """Whether the run reached --steps; says how to continue when --stop-after stopped it."""
    if step < args.steps:
        log.info(f"stopped after step {step}; continue with --resume")
        return False
    return True


def preemption(args) -> Preemption:
    """SIGTERM and --preempt-signal recorded while the run trains (moe_ep.runs.preemption)."""
    return Preemption(signals=(signal.SIGTERM, args.preempt_signal))


def script_main(train, description: str, default_output: str, argv=None) -> int:
    from errors import run_reported

    return run_reported(train, build_parser(description, default_output).parse_args(argv))


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))
