"""Running examples/mixtral from the tests: the flags every run shares, launch commands
(accelerate, torchrun) and in-process runs, waiting on and stopping a launch and its ranks,
reading a run's losses and checkpoints, and copying a run to damage. Shared by
test_example_launch.py and the fault-injection modules of tests/faults/ (no test module imports
another). Importing it puts the example's folder on ``sys.path``, so tests import the example's
own modules (``data``, ``export``, ``train``) by name; the run machinery is ``moe_ep.runs``."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "mixtral"
STEPS = 6
# Small enough for 2 cores; the corpus cap keeps tokenization under a second.
COMMON = [
    "--model", "tiny", "--steps", str(STEPS), "--warmup-steps", "2", "--lr", "3e-3", "--seq-len", "64",
    "--micro-batch-size", "2", "--checkpoint-every", "2", "--keep-checkpoints", "5", "--max-corpus-tokens", "200000",
    "--no-progress", "--seed", "11",
]
# Expert parallel over both ranks (FSDP2 over the same two ranks for the dense weights).
LAYOUT = ["--ep", "2"]

sys.path.insert(0, str(EXAMPLE))


def env(**extra: str):
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
             **extra)
    e.pop("WORLD_SIZE", None)
    e.pop("RANK", None)
    return e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_cmd(out: Path, *extra: str, processes: int = 2, layout=LAYOUT) -> list[str]:
    return accelerate_script_cmd("train.py", *COMMON, *layout, "--output-dir", str(out), *extra, processes=processes)


def accelerate_script_cmd(script: str, *flags: str, processes: int = 2) -> list[str]:
    """``accelerate launch`` of any of the example's scripts with exactly ``flags``."""
    return [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(EXAMPLE / "configs" / "cpu.yaml"),
        "--num_processes", str(processes), "--main_process_port", str(free_port()), str(EXAMPLE / script), *flags,
    ]


def torchrun_cmd(out: Path, *extra: str, processes: int = 2, layout=LAYOUT) -> list[str]:
    """The same run through torchrun (no accelerate launcher; --standalone picks a free port)."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
        str(EXAMPLE / "train.py"), *COMMON, *layout, "--output-dir", str(out), *extra,
    ]


def run(cmd, timeout=240) -> str:
    code, output = run_to_end(cmd, env(), timeout)
    assert code == 0, output[-6000:]
    return output


def run_to_end(cmd, environment: dict, timeout: float) -> tuple[int, str]:
    """Run a launcher to its end: (its exit status, its output, stdout then stderr). One that has
    not ended after ``timeout`` s is killed with every process under it, and the test fails with
    what it printed (a hung world says where it hung; its ranks do not outlive the test)."""
    proc = subprocess.Popen(cmd, env=environment, cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_launch(proc)
        out, err = proc.communicate()
        raise AssertionError(f"{cmd[2]} ... did not end within {timeout:.0f} s; its output:\n{(out + err)[-6000:]}"
                             ) from None
    return proc.returncode, out + err


def launch(cmd, log: Path, **extra_env: str) -> subprocess.Popen:
    """Start a launcher in its own session, its output (all ranks') going to ``log``."""
    with open(log, "w") as f:
        return subprocess.Popen(cmd, env=env(**extra_env), cwd=ROOT, start_new_session=True, stdout=f,
                                stderr=subprocess.STDOUT, text=True)


def wait_until(condition, proc: subprocess.Popen, message: str, timeout: float = 240) -> None:
    """Poll ``condition`` while the launch runs; fail with ``message`` if it ends or time runs out."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"{message}: the launch ended with status {proc.returncode}"
        assert time.monotonic() < deadline, message
        time.sleep(0.05)


def paused_files(tmp_checkpoint: Path, ranks: int) -> list[Path]:
    """What moe_ep.runs.checkpoint's pause hook touches in the ``.tmp-`` folder, one per rank."""
    return [tmp_checkpoint / f"paused-rank{r:05d}" for r in range(ranks)]


def rank_processes(proc: subprocess.Popen, script: str = "train.py") -> dict[int, psutil.Process]:
    """The launch's ranks (processes running the example's ``script``) by their RANK."""
    found = {}
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            if script in " ".join(p.cmdline()) and "RANK" in (environ := p.environ()):
                found[int(environ["RANK"])] = p
        except psutil.NoSuchProcess:
            continue
    return found


def kill_launch(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every process under it (torchrun starts its workers in their own
    sessions, so its whole tree is found by pid, not by process group)."""
    if proc.poll() is None:
        tree = psutil.Process(proc.pid).children(recursive=True)
        for p in tree:
            p.kill()
        os.kill(proc.pid, signal.SIGKILL)
        psutil.wait_procs(tree, timeout=30)
    proc.wait(timeout=30)


def train_in_process(argv) -> int:
    """train.py's main in this process (world size 1): saves an interpreter start. One intra-op
    thread, as the launched ranks have (OMP_NUM_THREADS=1): on a busy 2-core machine a second
    spinning thread slows these tiny steps twentyfold."""
    import train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train.main(argv)
    finally:
        torch.set_num_threads(threads)


def losses(out: Path) -> dict[int, float]:
    """Step -> loss, as moe_ep.runs.read_metrics reads the log (a step run again after a resume, its
    last value)."""
    from moe_ep.runs import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl")}


def export_of(out: Path) -> Path:
    """Where a run in ``out`` exports: beside it (an export never goes inside the run folder)."""
    return out.with_name(out.name + "-hf")


def trained_model(ckpt: Path):
    """A run's sharded checkpoint loaded into the example's model, with the moe_ep kernels and
    fused router it was trained with."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from models import tiny_config

    from moe_ep.hf import patch

    model = patch(AutoModelForCausalLM.from_config(tiny_config()))
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    return model


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``folder`` with its size and modification time: what "nothing touched" means."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def copy_run(base: Path, dest: Path) -> Path:
    """A copy of the base run to damage: the large DCP shards are hard links (a damaged one is
    written anew by ``rewrite``, never changed in place), everything else real copies."""
    from moe_ep.runs.checkpoint import SHARD_SUFFIX

    def link_shards(src, dst):
        return os.link(src, dst) if src.endswith(SHARD_SUFFIX) else shutil.copy2(src, dst)

    shutil.copytree(base, dest, copy_function=link_shards)
    return dest


def rewrite(path: Path, data: bytes) -> None:
    """Replace a file's bytes through a new inode (the copy's shards are links to the base run's)."""
    path.unlink()
    path.write_bytes(data)


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    rewrite(path, bytes(data))
