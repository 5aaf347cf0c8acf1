"""Expert-parallel training with transformers' own ``Trainer``, launched by ``accelerate launch``.

    ACCELERATE_USE_CPU=true accelerate launch --config_file examples/mixtral/configs/cpu.yaml \\
        examples/mixtral/trainer.py --ep 2

What moe_ep adds to an ordinary Trainer script is two lines: ``moe_ep.parallelize(model, ep=...)``
(in ``loops.make_model``) and ``moe_ep.ExpertParallelTrainer`` where the script built ``Trainer``.
Everything else (TrainingArguments, gradient accumulation and clipping, mixed precision from the
accelerate config, ``save_steps`` checkpoints, ``resume_from_checkpoint``, ``save_model``) is the
Trainer's own. ``--baseline`` runs the same script without moe_ep. See README.md beside this file."""

from __future__ import annotations

import torch

from moe_ep.runs import RunFolder, StepLog, configuration_errors, exit_process, library_writes, marker_kind

from loops import (
    checked_run,
    claim_run,
    finished,
    make_model,
    preempted,
    preemption,
    process_group,
    say_nothing_to_train,
    script_main,
    startup_watchdog,
)

def log_callback(log: StepLog):
    from transformers import TrainerCallback

    class LogSteps(TrainerCallback):
        """Trainer's per-step logs (``logging_steps=1``) as StepLog lines."""

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                log.step({"step": state.global_step, "loss": logs["loss"], "grad_norm": logs.get("grad_norm"),
                          "lr": logs.get("learning_rate", 0.0)})

    return LogSteps()


def stop_callback(stop_after: int):
    from transformers import TrainerCallback

    class StopAfter(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step >= stop_after:
                control.should_training_stop = True

    return StopAfter()


def startup_callback(startup):
    from transformers import TrainerCallback

    class StepLoopReached(TrainerCallback):
        """The Trainer has built its optimizer and loaded its checkpoint: the start-up is over."""

        def on_train_begin(self, args, state, control, **kwargs):
            startup.reached()

    return StepLoopReached()


def preemption_callback(stop):
    from transformers import TrainerCallback

    class SaveAndStopOnPreemption(TrainerCallback):
        """On the step the ranks agree on (every rank asks at every step end but the last), the
        Trainer's own checkpoint (``checkpoint-N``: model and optimizer shards, scheduler, RNG
        states, trainer state, as ``save_steps`` writes it) and the end of ``train()``."""

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step < state.max_steps and stop.stop_requested():
                control.should_save = True
                control.should_training_stop = True

    return SaveAndStopOnPreemption()


def seal_callback(run: RunFolder, keep: int | None, rank: int):
    from transformers import TrainerCallback

    class SealCheckpoints(TrainerCallback):
        """Every rank, once the Trainer has written ``checkpoint-N`` (under its final name): its
        manifest (RunFolder.seal), without which the checkpoint counts as cut short, and against
        which its files are checked before any resume; then the older ones beyond ``keep`` go
        (RunFolder.prune, not the Trainer's save_total_limit, which deletes them before the new one
        is sealed)."""

        def on_save(self, args, state, control, **kwargs):
            run.seal(run.path / f"checkpoint-{state.global_step}", step=state.global_step)
            run.prune(keep, rank=rank)

    return SealCheckpoints()


def train(args) -> None:
    with checked_run(args, "trainer", "checkpoint-*") as (data, run, candidates, world_size, rank):
        state = process_group()  # which parallelize needs
        with preemption(args) as stop, startup_watchdog(args) as startup:
            _train(args, state, data, run, candidates, world_size, rank, stop, startup)


def _train(args, state, data, run: RunFolder, candidates, world_size: int, rank: int, stop, startup) -> None:
    from transformers import PrinterCallback, Trainer, TrainingArguments

    import moe_ep

    log = StepLog(run.path, enabled=rank == 0)
    training_args = TrainingArguments(
        output_dir=str(run.path), per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=args.grad_accum, max_steps=args.steps, learning_rate=args.lr,
        lr_scheduler_type="linear", warmup_steps=args.warmup_steps, weight_decay=0.0, max_grad_norm=args.max_grad_norm,
        seed=args.seed, logging_steps=1, report_to=[], disable_tqdm=True,
        save_strategy="steps" if args.checkpoint_every else "no", save_steps=args.checkpoint_every or 1,
        # The sequences are shuffled once (loops.Sequences): read in order, every layout trains
        # on the same global batches.
        train_sampling_strategy="sequential", dataloader_drop_last=True, use_cpu=not torch.cuda.is_available(),
    )
    trainer_class = Trainer if args.baseline else moe_ep.ExpertParallelTrainer
    callbacks = [log_callback(log), startup_callback(startup), preemption_callback(stop),
                 seal_callback(run, args.keep_checkpoints, rank)] + ([stop_callback(args.stop_after)] if args.stop_after
                                                                      else [])
    startup.phase("building the model and the Trainer")
    with configuration_errors():
        trainer = trainer_class(model=make_model(args, state.device), args=training_args, train_dataset=data,
                                callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # StepLog says the same, once per step
    # Only once accelerate's configuration has been checked (the Trainer's construction refuses
    # one that disagrees with moe_ep's meshes): claiming the folder sets later checkpoints aside
    # for a rollback, records the resume in the log and, for --overwrite, deletes the run's
    # checkpoints, none of which a refused configuration may leave behind.
    resume = claim_run(args, data, run, candidates, rank, log, startup)
    log.info(f"{'baseline (transformers experts, DDP)' if args.baseline else f'moe_ep ep={args.ep}'} on "
             f"{world_size} process(es), mixed precision {training_args.mixed_precision}")
    # transformers' Trainer resumed at (or past) its last step trains one more step before it
    # checks max_steps, and saves it (checkpoint-N+1): a finished run, or one stopped by
    # --stop-after, run again with the same command crept one step further at every start.
    last = args.stop_after or args.steps
    start = run.step_of(resume) if resume is not None else 0
    if start >= last and (args.stop_after or marker_kind(run.final) == "export"):
        say_nothing_to_train(log, run, start, args)
        finished(log, start, args)
        return
    with library_writes(run.path, only_writes=False):  # its checkpoints are written inside
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    if stop.signal is not None:
        step = trainer.state.global_step
        raise preempted(stop, step, run.path / f"checkpoint-{step}")
    if not finished(log, trainer.state.global_step, args):
        return
    with library_writes(run.final, only_writes=True):
        trainer.save_model(str(run.final))
    run.saved_final(log, is_main=rank == 0)


def main(argv=None) -> int:
    return script_main(train, "Expert-parallel training with transformers' Trainer; launch with `accelerate launch`.",
                       "runs/mixtral-tiny-trainer", argv)


if __name__ == "__main__":
    exit_process(main())
