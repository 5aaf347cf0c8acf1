"""The scenarios of test_hf_loops.py (2 processes) and test_hf_loops_4_ranks.py (4): the example
scripts trainer.py (transformers' Trainer) and accelerate_loop.py (a hand-written Accelerator loop)
with moe_ep's expert parallelism, the same scripts without it (``--baseline``: transformers' own
experts, plain data parallel) on the same processes, and one process accumulating the same
per-rank batches (``--baseline --grad-accum world x 2``). All runs of one world are launched
together (hf_loops_driver.py), so a world starts once."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import NamedTuple

from example_runs import free_port, run_to_end

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "mixtral"
DRIVER = Path(__file__).resolve().parent / "hf_loops_driver.py"
SCRIPTS = ("trainer", "accelerate_loop")
STEPS = 6
GRAD_ACCUM = 2
# Small: the tiny Mixtral on 32-token sequences, 2 per micro-batch, a checkpoint every 2 steps;
# the aux loss is on (the scripts' default coefficient).
COMMON = ("--steps", str(STEPS), "--seq-len", "32", "--micro-batch-size", "2", "--checkpoint-every", "2",
          "--max-corpus-tokens", "40000", "--seed", "3")
# Each script's checkpoint of step 2 in its output folder ("{run}" in a run's flags), and of step 6.
STEP_2 = {"trainer": "{run}/checkpoint-2", "accelerate_loop": "{run}/checkpoints/step_00000002"}
STEP_6 = {"trainer": "{run}/checkpoint-6", "accelerate_loop": "{run}/checkpoints/step_00000006"}
# A large file of every checkpoint (the model's DCP shard, as accelerate writes it for FSDP2 on one
# process): checked by the ranks' shared checksums after start-up, not before.
MODEL_SHARD = "pytorch_model_fsdp_0/__0_0.distcp"


class Run(NamedTuple):
    name: str  # "<script> <what>", also the output folder's name
    script: str
    flags: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    flip: str | None = None  # a file ("{run}/...") whose byte is flipped before the run

    @property
    def folder(self) -> str:
        return self.name.replace(" ", "_")


def world_runs(processes: int, layout: tuple[str, ...], *, resume: bool, bf16: bool) -> list[Run]:
    """Per script: moe_ep with ``layout``, the baseline on the same processes (keeping only its
    newest checkpoint: ``--keep-checkpoints 1``); with ``resume`` a
    moe_ep run stopped after step 4, resumed to the end, then rolled back to its checkpoint of step
    2 and trained to the end again, and the finished moe_ep run run again; with ``bf16`` both again under accelerate's
    ``mixed_precision=bf16`` (4 steps, no checkpoints)."""
    runs = []
    ga = ("--grad-accum", str(GRAD_ACCUM))
    for script in SCRIPTS:
        runs += [Run(f"{script} ep", script, (*COMMON, *ga, *layout)),
                 Run(f"{script} baseline", script, (*COMMON, *ga, "--baseline", "--keep-checkpoints", "1"))]
        if resume:
            # The finished expert-parallel run, run again with the same command: nothing to train.
            runs += [Run(f"{script} ep", script, (*COMMON, *ga, *layout)),
                     Run(f"{script} stopped", script, (*COMMON, *ga, *layout, "--stop-after", "4")),
                     Run(f"{script} stopped", script, (*COMMON, *ga, *layout, "--resume")),
                     Run(f"{script} stopped", script, (*COMMON, *ga, *layout, "--resume", STEP_2[script]))]
        if bf16:
            short = ("--steps", "4", "--checkpoint-every", "0")
            env = (("ACCELERATE_MIXED_PRECISION", "bf16"),)
            runs += [Run(f"{script} ep bf16", script, (*COMMON, *ga, *layout, *short), env),
                     Run(f"{script} baseline bf16", script, (*COMMON, *ga, "--baseline", *short), env)]
    return runs


def one_process_runs(worlds: tuple[int, ...], *, with_moe_ep: bool = False) -> list[Run]:
    """One process accumulating the micro-batches that ``world`` ranks take in one step; with
    ``with_moe_ep`` also each script with moe_ep on that one process (``--ep 1``: no launcher gave
    it a process group, so the script makes one of one rank), and the same command again once a
    byte of its last checkpoint's model shard is flipped (``--resume auto`` falls back to the
    checkpoint of step 4 and trains steps 5 and 6 again)."""
    runs = []
    for world in worlds:
        accumulate = ("--grad-accum", str(GRAD_ACCUM * world))
        for script in SCRIPTS:
            runs.append(Run(f"{script} one process x{world}", script, (*COMMON, *accumulate, "--baseline")))
            if with_moe_ep:
                ep = Run(f"{script} ep one process x{world}", script, (*COMMON, *accumulate, "--ep", "1"))
                runs += [ep, ep._replace(flip=f"{STEP_6[script]}/{MODEL_SHARD}")]
    return runs


def launch(runs: list[Run], processes: int, out: Path, *, timeout: float) -> str:
    """All ``runs`` in one ``accelerate launch`` of ``processes`` CPU processes, each writing into
    ``out / run.folder``; returns the launch's output (also in ``out / launch-<processes>.log``)
    and asserts every run ended with status 0."""
    def at(text: str, run: Run) -> str:
        return text.replace("{run}", str(out / run.folder))

    table = [[run.script, [*(at(flag, run) for flag in run.flags), "--output-dir", str(out / run.folder)],
              dict(run.env), None if run.flip is None else at(run.flip, run)] for run in runs]
    env = dict(os.environ, OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="true",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "ACCELERATE_MIXED_PRECISION"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(EXAMPLE / "configs" / "cpu.yaml"),
           "--num_processes", str(processes), "--main_process_port", str(free_port()), str(DRIVER), json.dumps(table)]
    code, output = run_to_end(cmd, env, timeout)
    (out / f"launch-{processes}.log").write_text(output)
    assert code == 0, output[-6000:]
    codes = [line for line in output.splitlines() if line.startswith("RUN ")]
    assert codes == [f"RUN {i} rc=0" for i in range(len(runs))], output[-6000:]
    return output


def launch_world(out: Path, processes: int, layout: tuple[str, ...], *, resume: bool, bf16: bool,
                 with_moe_ep_alone: bool = False) -> Path:
    """``world_runs`` on ``processes`` processes, then the one-process runs they are compared with
    (``one_process_runs``)."""
    launch(world_runs(processes, layout, resume=resume, bf16=bf16), processes, out, timeout=500)
    launch(one_process_runs((processes,), with_moe_ep=with_moe_ep_alone), 1, out, timeout=200)
    return out


def world_fixture(processes: int, layout: tuple[str, ...], *, resume: bool, bf16: bool):
    """A module-scoped fixture named ``runs``: the folder of ``launch_world``'s runs."""
    import pytest

    @pytest.fixture(scope="module")
    def runs(tmp_path_factory):
        return launch_world(tmp_path_factory.mktemp(f"hf_loops_{processes}"), processes, layout, resume=resume,
                            bf16=bf16)

    return runs


def step_records(folder: Path) -> dict[int, dict]:
    """Step -> its record as the run's history stands (read_metrics: a resumed run logs the steps
    after its checkpoint again)."""
    from moe_ep.runs import read_metrics

    return {record["step"]: record for record in read_metrics(folder / "metrics.jsonl")}


def records_before_the_last_resume(folder: Path, tmp: Path) -> dict[int, dict]:
    """step_records of the run's history as it stood before its last resume."""
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    last = max(i for i, line in enumerate(lines) if "resumed_from_step" in json.loads(line))
    (tmp / "metrics.jsonl").write_text("\n".join(lines[:last]) + "\n")
    return step_records(tmp)


def max_rel_diff(a: dict[int, dict], b: dict[int, dict], key: str) -> float:
    """Largest ``|a - b| / |b|`` of ``key`` over the steps both logged (asserting they logged the
    same steps)."""
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max(abs(a[s][key] - b[s][key]) / abs(b[s][key]) for s in b)


def max_abs_diff(a: dict[int, dict], b: dict[int, dict], key: str) -> float:
    return max(abs(a[s][key] - b[s][key]) for s in b)


def final_logits(folder: Path):
    """The saved model, loaded with plain ``from_pretrained`` (no moe_ep option), on fixed tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=ids).logits.double()


def check_against_baseline_and_one_process(runs: Path, script: str, processes: int) -> None:
    """The moe_ep run's per-step losses and gradient norms against the baseline on the same
    processes and one process accumulating the same batches, to the float32 tolerance; and its
    final model's logits against the baseline's."""
    import torch

    from numerics import TOLERANCE, rel_err

    ep, baseline = step_records(runs / f"{script}_ep"), step_records(runs / f"{script}_baseline")
    one = step_records(runs / f"{script}_one_process_x{processes}")
    assert sorted(ep) == list(range(1, STEPS + 1))
    for other in (baseline, one):
        for key in ("loss", "grad_norm"):
            assert max_rel_diff(ep, other, key) <= TOLERANCE[torch.float32], (key, ep, other)
    ep_logits = final_logits(runs / f"{script}_ep" / "final")
    assert rel_err(ep_logits, final_logits(runs / f"{script}_baseline" / "final")) <= TOLERANCE[torch.float32]
