"""Preemption of launched 2-rank runs of each example script: a signal in the middle of the run
(SIGTERM to every rank, SIGTERM to the launcher only, SLURM's SIGUSR1 to the launcher and every
rank), then the same command. Each case asserts: the ranks stop with the distinct exit status
after one checkpoint, one line says so (the last of the program's own), no traceback of ours, and
the same command resumes onto the undisturbed run's losses bit for bit (the Trainer: from its own
``checkpoint-N``, its semantics). Before that, a rank still waiting for its peers at start-up ends
at a signal."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from example_runs import (
    COMMON,
    EXAMPLE,
    LAYOUT,
    ROOT,
    accelerate_cmd,
    accelerate_script_cmd,
    env,
    free_port,
    kill_launch,
    launch,
    losses,
    rank_processes,
    run,
    torchrun_cmd,
    wait_until,
)
from hf_loops import COMMON as LOOP_COMMON
from hf_loops import GRAD_ACCUM

from moe_ep.runs.preemption import PREEMPTED_EXIT_STATUS

# Launches the examples and signals them: not in the quick subset (bash scripts/test.sh --quick).
pytestmark = pytest.mark.slow

PREEMPTED = re.compile(r"^preempted \((SIG\w+)\) after step (\d+): (.+) written; run the same command to resume$",
                       re.MULTILINE)
# The loops' flags: those of tests/hf_loops.py's expert-parallel runs (the tiny Mixtral on 32-token
# sequences, 6 steps, a checkpoint every 2), whose undisturbed losses conftest.py's two_rank_loops holds.
LOOP_FLAGS = (*LOOP_COMMON, "--grad-accum", str(GRAD_ACCUM), "--ep", "2")


def reached_step(out: Path, step: int):
    return lambda: (out / "metrics.jsonl").exists() and max(losses(out), default=0) >= step


def preempt(cmd, out: Path, log: Path, send, *, script: str = "train.py", after: int = 2, **extra_env) -> str:
    """Launch ``cmd``, call ``send(launcher, ranks)`` once step ``after`` is logged, wait for the
    launch to end; returns its output after checking that it failed, each rank with the distinct
    status, said in one line, with no traceback of the example's."""
    proc = launch(cmd, log, **extra_env)
    try:
        wait_until(reached_step(out, after), proc, f"the run did not reach step {after}")
        send(proc, rank_processes(proc, script))
        assert proc.wait(timeout=240) != 0
    finally:
        kill_launch(proc)
    text = log.read_text()
    assert len(PREEMPTED.findall(text)) == 1, text[-4000:]
    # torchrun's failure summary lists the ranks that had exited when it looked (with the signal at
    # the launcher, it shows its own SignalException instead).
    exits = re.findall(r"exitcode  : (-?\d+)", text)
    assert set(exits) <= {str(PREEMPTED_EXIT_STATUS)}, text[-4000:]
    assert not re.search(r'File ".*examples/mixtral/', text), text[-4000:]
    return text


def stopped_at(text: str) -> tuple[str, int, Path]:
    sig, step, checkpoint = PREEMPTED.search(text).groups()
    return sig, int(step), Path(checkpoint)


def to_ranks(sig):
    return lambda launcher, ranks: [p.send_signal(sig) for p in ranks.values()]


def to_launcher(sig):
    return lambda launcher, ranks: launcher.send_signal(sig)


@pytest.fixture
def undisturbed(two_rank_run):
    """The losses of conftest.py's undisturbed 2-rank run of train.py (the same flags)."""
    return losses(two_rank_run[0])


@pytest.mark.parametrize("case", ["SIGTERM to every rank", "SIGTERM to the launcher", "SIGUSR1 to all (SLURM)"])
def test_train_py_preempted_checkpoints_once_and_resumes_bit_for_bit(undisturbed, tmp_path, case):
    out = tmp_path / "run"
    if case == "SIGTERM to every rank":
        cmd, send, env = torchrun_cmd(out), to_ranks(signal.SIGTERM), {}
    elif case == "SIGTERM to the launcher":
        cmd, send, env = accelerate_cmd(out), to_launcher(signal.SIGTERM), {}
    else:
        # SLURM's --signal=USR1@N reaches the launcher and the ranks; the launcher must handle it.
        cmd = torchrun_cmd(out, "--preempt-signal", "USR1")

        def send(launcher, ranks):
            launcher.send_signal(signal.SIGUSR1)
            to_ranks(signal.SIGUSR1)(launcher, ranks)

        env = {"PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"}
    text = preempt(cmd, out, tmp_path / "preempted.log", send, **env)
    sig, step, checkpoint = stopped_at(text)
    assert sig == ("SIGUSR1" if "USR1" in case else "SIGTERM")
    assert checkpoint == out / "checkpoints" / f"step_{step:08d}" and checkpoint.is_dir()
    assert sorted(losses(out)) == list(range(1, step + 1))
    log = run(cmd)
    assert f"resumed from {checkpoint} at step {step}" in log
    assert losses(out) == undisturbed  # exact, every step


@pytest.mark.parametrize("script", ["trainer.py", "accelerate_loop.py"])
def test_a_preempted_loop_continues_with_the_same_command_bit_for_bit(two_rank_loops, tmp_path, script):
    """SIGTERM to every rank of trainer.py (transformers' Trainer: its own ``checkpoint-N``) or
    accelerate_loop.py (accelerate's ``save_state``) after step 2: the same command, without
    --resume, continues from the preemption's checkpoint onto the undisturbed losses (the
    script's expert-parallel run in two_rank_loops)."""
    undisturbed = two_rank_loops / f"{Path(script).stem}_ep"
    out = tmp_path / "run"
    cmd = accelerate_script_cmd(script, *LOOP_FLAGS, "--output-dir", str(out))
    text = preempt(cmd, out, tmp_path / "preempted.log", to_ranks(signal.SIGTERM), script=script)
    sig, step, checkpoint = stopped_at(text)
    assert sig == "SIGTERM" and checkpoint.is_dir()
    assert checkpoint.name == (f"checkpoint-{step}" if script == "trainer.py" else f"step_{step:08d}")
    run(cmd)
    assert losses(out) == losses(undisturbed)  # exact, every step


@pytest.mark.parametrize("script", ["train.py", "accelerate_loop.py"])
def test_a_rank_still_waiting_for_its_peers_ends_at_a_signal(tmp_path, script):
    """Rank 0 of 2 launched by hand, its peer never comes: it waits in the rendezvous (its store
    listening), where SIGTERM ends it at once, as it ends any process, nothing of the run written;
    a handler of the script's would only run once the rendezvous returned (up to
    --startup-timeout). trainer.py makes its process group as accelerate_loop.py does."""
    port = free_port()
    out = tmp_path / "run"
    flags = [*COMMON, *LAYOUT] if script == "train.py" else list(LOOP_FLAGS)
    with open(tmp_path / "rank0.log", "w") as log:
        proc = subprocess.Popen([sys.executable, str(EXAMPLE / script), *flags, "--output-dir", str(out)],
                                env={**env(), "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
                                cwd=ROOT, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: listening(port), proc, "rank 0 did not open its store", timeout=120)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM, (tmp_path / "rank0.log").read_text()[-3000:]
    finally:
        kill_launch(proc)
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
