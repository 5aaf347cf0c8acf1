"""examples/mixtral end to end on the CPU: `accelerate launch` with 2 gloo processes against a
single-process run of the same model and data; a run killed mid-way (while it writes a checkpoint)
resumes onto the uninterrupted run's losses bit for bit; the exported folder loads with plain
transformers in a fresh process and gives the trained model's logits."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import psutil
import pytest
import torch

from conftest import TOLERANCE, rel_err

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


def env():
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    e.pop("WORLD_SIZE", None)
    e.pop("RANK", None)
    return e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_cmd(out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(EXAMPLE / "configs" / "cpu.yaml"),
        "--num_processes", "2", "--main_process_port", str(free_port()), str(EXAMPLE / "train.py"),
        *COMMON, *LAYOUT, "--output-dir", str(out), *extra,
    ]


def run(cmd, timeout=240) -> str:
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def train_in_process(argv) -> int:
    """train.py's main in this process (world size 1): saves an interpreter start. One intra-op
    thread, as the launched ranks have (OMP_NUM_THREADS=1): on a busy 2-core machine a second
    spinning thread slows these tiny steps twentyfold."""
    sys.path.insert(0, str(EXAMPLE))
    import train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train.main(argv)
    finally:
        torch.set_num_threads(threads)


def losses(out: Path) -> dict[int, float]:
    """Step -> loss; a step logged twice (re-run after a resume) keeps its last value."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    log = run(accelerate_cmd(out, "--export-dir", str(out / "hf")))
    return out, log


def test_two_process_launch_trains_and_matches_one_process(reference, tmp_path):
    out, log = reference
    assert "layout pp=1 dp_replicate=1 dp_shard=2 ep=2 on 2 process(es), cpu, fp32 | experts moe_ep" in log
    assert "=== summary ===" in log
    assert "expert load max/mean per layer" in log
    dist_losses = losses(out)
    assert sorted(dist_losses) == list(range(1, STEPS + 1))
    assert dist_losses[STEPS] < dist_losses[1] - 0.5, dist_losses

    # The same global batch in one process: 2 micro-batches of 2 instead of 2 ranks of 2.
    single = tmp_path / "single"
    assert train_in_process([*COMMON, "--grad-accum", "2", "--checkpoint-every", "0", "--output-dir", str(single)]) == 0
    one = losses(single)
    a = torch.tensor([dist_losses[s] for s in sorted(dist_losses)], dtype=torch.float64)
    b = torch.tensor([one[s] for s in sorted(one)], dtype=torch.float64)
    assert rel_err(a, b) <= TOLERANCE[torch.float32], (a, b)


def test_killed_run_resumes_onto_the_same_losses_bit_for_bit(reference, tmp_path):
    out = tmp_path / "killed"
    proc = subprocess.Popen(accelerate_cmd(out), env=env(), cwd=ROOT, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    partial = out / "checkpoints" / ".tmp-step_00000004"
    deadline = time.monotonic() + 240
    try:
        # Kill the whole launch the moment the step-4 checkpoint is being written (or, if that write
        # was too quick to see, as soon as step 5 is logged).
        while time.monotonic() < deadline and proc.poll() is None:
            if partial.exists() or (out / "metrics.jsonl").exists() and 5 in losses(out):
                break
            time.sleep(0.005)
        assert proc.poll() is None, proc.stdout.read()
        # torchrun starts its workers in their own sessions: kill the launcher's whole tree by pid.
        tree = psutil.Process(proc.pid).children(recursive=True)
        for p in tree:
            p.kill()
        os.kill(proc.pid, signal.SIGKILL)
        psutil.wait_procs(tree, timeout=30)
    finally:
        proc.wait(timeout=30)
    killed_mid_write = partial.exists()
    before = losses(out)
    assert max(before) < STEPS

    log = run(accelerate_cmd(out))
    resumed_from = 2 if killed_mid_write else 4
    assert f"resumed from {out / 'checkpoints' / f'step_{resumed_from:08d}'} at step {resumed_from}" in log
    if killed_mid_write:
        assert "removed 1 incomplete checkpoint(s) left by an interrupted write: .tmp-step_00000004" in log
    assert losses(out) == losses(reference[0])  # exact float equality, every step


EXPORT_CHECK = """
import sys, torch, transformers
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])
assert type(model).__name__ == "MixtralForCausalLM", type(model)
assert not any(name.startswith("moe_ep") for name in sys.modules), "the export must not need moe_ep"
ids = torch.tensor([list(b"def train(model):\\n    return model")])
with torch.no_grad():
    torch.save(model(input_ids=ids).logits, sys.argv[2])
"""


def test_export_loads_with_plain_transformers_and_gives_the_trained_logits(reference, tmp_path):
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    out, _ = reference
    export = out / "hf"
    assert (export / "config.json").is_file() and "moe_ep" not in (export / "config.json").read_text()
    logits_file = tmp_path / "logits.pt"
    clean_env = {k: v for k, v in env().items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-c", EXPORT_CHECK, str(export), str(logits_file)], env=clean_env,
                   cwd=tmp_path, check=True, timeout=120)

    # The trained model: the run's final sharded checkpoint loaded into the example's model, with
    # the moe_ep kernels and fused router it was trained with.
    sys.path.insert(0, str(EXAMPLE))
    from models import tiny_config

    from moe_ep.hf import patch

    model = patch(AutoModelForCausalLM.from_config(tiny_config()))
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(out / "checkpoints" / f"step_{STEPS:08d}"), no_dist=True)
    ids = torch.tensor([list(b"def train(model):\n    return model")])
    with torch.no_grad():
        trained = model(input_ids=ids).logits
    exported = torch.load(logits_file)
    assert rel_err(exported, trained) <= TOLERANCE[torch.float32]


def test_pretrained_weights_read_by_slice_on_two_ranks_match_one_process(reference, tmp_path):
    """Continue training the exported model: each of the 2 ranks reads only its experts and FSDP
    shards from the safetensors file; the losses must be those of one process reading it whole."""
    export = reference[0] / "hf"
    pretrained = ["--model", str(export), "--tokenizer", "byte", "--steps", "2", "--warmup-steps", "1",
                  "--checkpoint-every", "0"]
    log = run(accelerate_cmd(tmp_path / "two", *pretrained))
    assert f"model {export}:" in log
    assert train_in_process([*COMMON, *pretrained, "--grad-accum", "2", "--output-dir", str(tmp_path / "one")]) == 0
    two, one = losses(tmp_path / "two"), losses(tmp_path / "one")
    assert sorted(two) == sorted(one) == [1, 2]
    # The first loss is the exported model's own (the run it came from ended near it).
    assert abs(two[1] - losses(reference[0])[STEPS]) < 0.5
    a = torch.tensor([two[1], two[2]], dtype=torch.float64)
    b = torch.tensor([one[1], one[2]], dtype=torch.float64)
    assert rel_err(a, b) <= TOLERANCE[torch.float32], (a, b)


def test_two_rank_checkpoint_resumes_in_one_process(reference, tmp_path):
    """DCP reshards on load: the expert-parallel run's step-4 checkpoint continues in a single
    process (same global batch through 2 accumulation steps) onto the 2-rank losses."""
    ckpt = reference[0] / "checkpoints" / "step_00000004"
    out = tmp_path / "one"
    assert train_in_process([*COMMON, "--grad-accum", "2", "--resume", str(ckpt), "--output-dir", str(out)]) == 0
    resumed, ref = losses(out), losses(reference[0])
    assert sorted(resumed) == [5, 6]
    a = torch.tensor([resumed[5], resumed[6]], dtype=torch.float64)
    b = torch.tensor([ref[5], ref[6]], dtype=torch.float64)
    assert rel_err(a, b) <= TOLERANCE[torch.float32], (a, b)


def test_resuming_with_other_data_is_refused(reference, tmp_path, capsys):
    ckpt = reference[0] / "checkpoints" / "step_00000004"
    argv = [*COMMON, "--micro-batch-size", "3", "--resume", str(ckpt), "--output-dir", str(tmp_path / "other")]
    assert train_in_process(argv) == 2
    err = capsys.readouterr().err
    assert f"--resume {ckpt}: the checkpoint was trained on other data or another global batch" in err
    assert not (tmp_path / "other" / "checkpoints").exists()
