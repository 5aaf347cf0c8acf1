"""Runs a cluster user can trust, for any training loop: the output folder held by one job
(``OutputLock``, ``hold_output_dir``) and never written into where it is the user's (ownership
markers), atomic sharded checkpoints with manifests and checksums (``save_checkpoint``,
``load_checkpoint``, ``latest_checkpoint``), resume resolution that skips damaged checkpoints
(``resume_target``, ``verified_resume``), the metrics log (``Reporter``, ``StepLog``), errors
said in one line with an exit status (``UsageError``, ``RunError``, ``run_reported``), and a stop
on a preemption signal that the ranks agree on at a step boundary (``Preemption``, ``Preempted``,
exit status ``PREEMPTED_EXIT_STATUS``), and each step of a ``TrainStep`` loop guarded so that a
failing, hanging or non-finite step stops every rank with one line naming the last checkpoint
(``StepGuard``, ``step_metrics``).

The top of the package, beside ``training``: it may use every layer below and nothing imports it.
examples/mixtral's train.py (moe_ep's TrainStep), trainer.py (transformers' Trainer) and
accelerate_loop.py (accelerate) are built on it; ``RunFolder`` is the output folder of a loop
whose checkpoints its own library writes."""

from .checkpoint import (
    branch_step,
    check_resume_data,
    checkpoint_due,
    complete_checkpoints,
    damage_report,
    is_complete,
    latest_checkpoint,
    load_checkpoint,
    manifest_must_list,
    quiet_single_process,
    read_trainer_state,
    remove_incomplete,
    resume_candidates,
    resume_target,
    save_checkpoint,
    set_aside_later_checkpoints,
    step_folders,
    verified_resume,
)
from .errors import (
    RunError,
    UsageError,
    configuration_errors,
    exit_process,
    library_writes,
    lost_peer,
    report_failure,
    run_reported,
    said_by_every_rank,
    write_failure,
)
from .integrity import digest, files_in, local_problems, seal, verify, write_manifest
from .metrics import (
    ExpertLoad,
    Reporter,
    StepLog,
    Throughput,
    flops_per_token,
    peak_flops,
    read_metrics,
    summary_lines,
)
from .ownership import (
    MARKER,
    METRICS,
    TRASH_PREFIX,
    OutputLock,
    check_export_target,
    check_output_folders,
    clear_run,
    delete_atomically,
    describe_holder,
    export_files,
    export_lock,
    files_added_to_export,
    hold_output_dir,
    make_managed_dir,
    mark,
    marker_kind,
    related,
    unique_tmp,
)
from .preemption import PREEMPTED_EXIT_STATUS, Preempted, Preemption, parse_signal
from .run_folder import FINAL, RunFolder
from .same_arguments import agree_on_arguments
from .startup import StartupWatchdog
from .step_loop import StepGuard, step_metrics

__all__ = [
    # errors
    "RunError", "UsageError", "configuration_errors", "exit_process", "library_writes", "lost_peer", "report_failure", "run_reported", "said_by_every_rank",
    "write_failure",
    # the output folder: ownership and the lock
    "FINAL", "MARKER", "METRICS", "TRASH_PREFIX", "OutputLock", "RunFolder", "check_export_target",
    "check_output_folders", "clear_run", "delete_atomically", "describe_holder", "export_files", "export_lock",
    "files_added_to_export", "hold_output_dir",
    "make_managed_dir", "mark", "marker_kind", "related", "unique_tmp",
    # integrity
    "digest", "files_in", "local_problems", "seal", "verify", "write_manifest",
    # checkpoints and resume
    "branch_step", "check_resume_data", "checkpoint_due", "complete_checkpoints", "damage_report", "is_complete",
    "latest_checkpoint", "load_checkpoint", "manifest_must_list", "quiet_single_process", "read_trainer_state", "remove_incomplete",
    "resume_candidates", "resume_target", "save_checkpoint", "set_aside_later_checkpoints", "step_folders",
    "verified_resume",
    # the ranks' agreement on a run's arguments, the start-up watchdog
    "StartupWatchdog", "agree_on_arguments",
    # each step of a TrainStep loop
    "StepGuard", "step_metrics",
    # preemption
    "PREEMPTED_EXIT_STATUS", "Preempted", "Preemption", "parse_signal",
    # metrics
    "ExpertLoad", "Reporter", "StepLog", "Throughput", "flops_per_token", "peak_flops", "read_metrics",
    "summary_lines",
]
