"""Expert-parallel training in a hand-written accelerate loop, launched by ``accelerate launch``.

    ACCELERATE_USE_CPU=true accelerate launch --config_file examples/mixtral/configs/cpu.yaml \\
        examples/mixtral/accelerate_loop.py --ep 2

What moe_ep adds to an ordinary accelerate loop is two lines: ``moe_ep.parallelize(model, ep=...)``
(in ``loops.make_model``) and ``moe_ep.configure_accelerator(accelerator, model)`` before
``accelerator.prepare``. The rest is accelerate's: ``accumulate``, ``backward``,
``clip_grad_norm_``, ``gather_for_metrics``, ``save_state``/``load_state`` (DCP shards of model
and optimizer) and ``get_state_dict`` for the final ``save_pretrained``. ``--baseline`` runs the
same loop without moe_ep. See README.md beside this file."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from moe_ep.runs import RunFolder, StepLog, configuration_errors, delete_atomically, exit_process, library_writes

from loops import (
    checked_run,
    claim_run,
    finished,
    lr_at,
    make_model,
    preempted,
    preemption,
    process_group,
    say_nothing_to_train,
    script_main,
    startup_watchdog,
)

CHECKPOINTS = "checkpoints"


class Progress:
    """The optimizer steps taken: saved and loaded with the accelerator's state."""

    def __init__(self):
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


def save_checkpoint(accelerator, run: RunFolder, step: int, keep: int | None) -> Path:
    """accelerate's ``save_state`` into ``checkpoints/.tmp-step_N``, sealed with its manifest
    (RunFolder.seal) and renamed to ``step_N`` by rank 0 once every rank wrote its shards: a
    checkpoint under its final name is always complete; then the older ones beyond ``keep`` go
    (RunFolder.prune). No ``step_N`` is there already: a resume set the later checkpoints aside
    (``claim_run``)."""
    root = run.path / CHECKPOINTS
    final, tmp = root / f"step_{step:08d}", root / f".tmp-step_{step:08d}"
    if accelerator.is_main_process and tmp.exists():
        delete_atomically(tmp)  # the run's own leftover of a save cut short: its files must not mix in
    accelerator.wait_for_everyone()
    with library_writes(tmp, only_writes=True):
        accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    run.seal(tmp, step=step)
    if accelerator.is_main_process:
        os.rename(tmp, final)
    run.prune(keep, rank=accelerator.process_index)
    accelerator.wait_for_everyone()
    return final


def train(args) -> None:
    with checked_run(args, "accelerate_loop", f"{CHECKPOINTS}/step_*", managed=(CHECKPOINTS,)) as (
            data, run, candidates, world_size, rank):
        process_group()  # the Accelerator below takes it up
        with preemption(args) as stop, startup_watchdog(args) as startup:
            _train(args, data, run, candidates, world_size, rank, stop, startup)


def _train(args, data, run: RunFolder, candidates, world_size: int, rank: int, stop, startup) -> None:
    from accelerate import Accelerator

    import moe_ep

    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum, cpu=not torch.cuda.is_available())
    log = StepLog(run.path, enabled=accelerator.is_main_process)
    startup.phase("building the model")
    with configuration_errors():
        model = make_model(args, accelerator.device)
        if not args.baseline:
            moe_ep.configure_accelerator(accelerator, model)
    # Only once accelerate's configuration has been checked: claiming the folder sets later
    # checkpoints aside for a rollback, records the resume in the log and, for --overwrite,
    # deletes the run's checkpoints, none of which a refused configuration may leave behind.
    resume = claim_run(args, data, run, candidates, rank, log, startup)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    loader = torch.utils.data.DataLoader(data, batch_size=args.micro_batch_size, shuffle=False, drop_last=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if resume is not None:
        accelerator.load_state(str(resume))
    log.info(f"{'baseline (transformers experts, DDP)' if args.baseline else f'moe_ep ep={args.ep}'} on "
             f"{world_size} process(es), mixed precision {accelerator.mixed_precision}")
    batches = iter(accelerator.skip_first_batches(loader, progress.step * args.grad_accum))
    last = args.stop_after or args.steps
    if progress.step >= last:
        say_nothing_to_train(log, run, progress.step, args)
    model.train()
    startup.reached()
    while progress.step < last:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(progress.step, args)
        micro_losses = []
        for _ in range(args.grad_accum):
            with accelerator.accumulate(model):
                loss = model(**next(batches)).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            micro_losses.append(accelerator.gather_for_metrics(loss.detach().reshape(1)))
        progress.step += 1
        # host sync: once per step, for the log.
        log.step({"step": progress.step, "loss": torch.cat(micro_losses).mean().item(),
                  "grad_norm": float(grad_norm), "lr": optimizer.param_groups[0]["lr"]})
        # Every rank asks at every step boundary but the last (the run ends there anyway).
        preempt = progress.step < last and stop.stop_requested()
        if preempt or (args.checkpoint_every and progress.step % args.checkpoint_every == 0):
            checkpoint = save_checkpoint(accelerator, run, progress.step, args.keep_checkpoints)
            log.info(f"checkpoint {checkpoint}")
        if preempt:
            raise preempted(stop, progress.step, checkpoint)
    if not finished(log, progress.step, args):
        return
    state_dict = accelerator.get_state_dict(model)  # every rank: gathers the full weights on rank 0
    if accelerator.is_main_process:
        with library_writes(run.final, only_writes=True):
            accelerator.unwrap_model(model).save_pretrained(str(run.final), state_dict=state_dict)
    accelerator.wait_for_everyone()
    run.saved_final(log, is_main=accelerator.is_main_process)


def main(argv=None) -> int:
    return script_main(train, "Expert-parallel training in a hand-written accelerate loop; launch with `accelerate launch`.",
                       "runs/mixtral-tiny-accelerate", argv)


if __name__ == "__main__":
    exit_process(main())
