"""examples/mixtral end to end on the CPU: `accelerate launch` with 2 gloo processes against a
single-process run of the same model and data; a run killed mid-way (while it writes a checkpoint)
resumes onto the uninterrupted run's losses bit for bit; the exported folder loads with plain
transformers in a fresh process and gives the trained model's logits; `torchrun` continues
training it, each rank reading its slices of the weights. Pipeline stages on 4 processes (flags
and --plan) against the same script without stages in one process (moe_ep's TrainStep either
way), their checkpoints resumed bit for bit, under the planner's layout, and exported."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from example_runs import (
    COMMON,
    EXAMPLE,
    LAYOUT,
    STEPS,
    accelerate_cmd,
    env,
    export_of,
    free_port,
    kill_launch,
    launch,
    losses,
    paused_files,
    run,
    run_to_end,
    torchrun_cmd,
    train_in_process,
    trained_model,
    wait_until,
)
from numerics import TOLERANCE, rel_err

from moe_ep.runs import read_metrics

# Launches the example with accelerate and torchrun: not in the quick subset (bash scripts/test.sh --quick).
pytestmark = pytest.mark.slow

# 2 pipeline stages on 4 processes, each stage FSDP-sharded over 2 with its experts split over the
# same 2; 4 micro-batches of 1 sequence per data-parallel rank: a global batch of 8 sequences, the
# batch that the planner's layout for 4 processes below (4 stages, 8 micro-batches) also takes.
PIPELINE = ["--pp", "2", "--ep", "2", "--micro-batch-size", "1"]
PLANNED = ["--plan", "--gpu-memory-gib", "1", "--global-batch-tokens", "512"]
PIPELINE_BATCH = 8


def test_two_process_launch_trains_and_matches_one_process(two_rank_run, tmp_path):
    out, log = two_rank_run
    assert "layout pp=1 dp_replicate=1 dp_shard=2 ep=2 mb=2x1 on 2 process(es), cpu, fp32 | experts moe_ep" in log
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


def test_two_simulated_nodes_sharing_the_run_folder_match_the_two_process_launch(two_rank_run, tmp_path):
    """Two torchrun agents on this host as two nodes of one process each (--nnodes 2), one run
    folder as a cluster's shared file system gives them: the token cache is written once, by global
    rank 0 (every node's first process wrote it, and their renames raced: 16 launches of 24
    failed), and the losses are the 2-process launch's (the same layout; across two nodes the
    dispatch sends each token once per destination node)."""
    from concurrent.futures import ThreadPoolExecutor

    out, port = tmp_path / "two_nodes", free_port()

    def node(rank: int) -> tuple[int, str]:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank),
               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
               str(EXAMPLE / "train.py"), *COMMON, *LAYOUT, "--output-dir", str(out)]
        return run_to_end(cmd, env(), 240)

    with ThreadPoolExecutor(2) as pool:
        (code_0, log_0), (code_1, log_1) = pool.map(node, (0, 1))
    assert code_0 == code_1 == 0, (log_0[-3000:], log_1[-3000:])
    assert "layout pp=1 dp_replicate=1 dp_shard=2 ep=2 mb=2x1 on 2 process(es)" in log_0 + log_1
    cache = sorted(p.name for p in (out / "token_cache").iterdir() if p.name != ".moe_ep-owner")
    assert len(cache) == 2 and cache[0].endswith(".manifest.json") and cache[1] == cache[0].replace(
        ".manifest.json", ".npy"), cache  # one cache and its manifest, no temporary left
    a, b = losses(out), losses(two_rank_run[0])
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    got = torch.tensor([a[s] for s in sorted(a)], dtype=torch.float64)
    want = torch.tensor([b[s] for s in sorted(b)], dtype=torch.float64)
    assert rel_err(got, want) <= TOLERANCE[torch.float32], (got, want)


def test_killed_run_resumes_onto_the_same_losses_bit_for_bit(two_rank_run, tmp_path):
    out = tmp_path / "killed"
    # moe_ep.runs.checkpoint's test hook: both ranks stop inside the step-4 save, their shards and RNG
    # states written into the .tmp- folder, the folder not yet renamed; the run is killed there.
    proc = launch(accelerate_cmd(out), out.with_name("killed.log"), MOE_EP_TEST_PAUSE_IN_CHECKPOINT="4")
    partial = out / "checkpoints" / ".tmp-step_00000004"
    try:
        wait_until(lambda: all(p.exists() for p in paused_files(partial, 2)), proc,
                   "the run did not reach the step-4 checkpoint in time")
    finally:
        kill_launch(proc)
    assert (partial / ".metadata").is_file() and not (out / "checkpoints" / "step_00000004").exists()
    assert max(losses(out)) == 4

    log = run(accelerate_cmd(out))
    assert f"resumed from {out / 'checkpoints' / 'step_00000002'} at step 2" in log
    assert "removed 1 incomplete checkpoint(s) left by an interrupted write or deletion: .tmp-step_00000004" in log
    assert losses(out) == losses(two_rank_run[0])  # exact float equality, every step


EXPORT_CHECK = """
import sys, torch, transformers
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])
assert type(model).__name__ == "MixtralForCausalLM", type(model)
assert not any(name.startswith("moe_ep") for name in sys.modules), "the export must not need moe_ep"
ids = torch.tensor([list(b"def train(model):\\n    return model")])
with torch.no_grad():
    torch.save(model(input_ids=ids).logits, sys.argv[2])
"""


def test_export_loads_with_plain_transformers_and_gives_the_trained_logits(two_rank_run, tmp_path):
    out, _ = two_rank_run
    export = export_of(out)
    assert (export / "config.json").is_file() and "moe_ep" not in (export / "config.json").read_text()
    logits_file = tmp_path / "logits.pt"
    clean_env = {k: v for k, v in env().items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-c", EXPORT_CHECK, str(export), str(logits_file)], env=clean_env,
                   cwd=tmp_path, check=True, timeout=120)

    ids = torch.tensor([list(b"def train(model):\n    return model")])
    with torch.no_grad():
        trained = trained_model(out / "checkpoints" / f"step_{STEPS:08d}")(input_ids=ids).logits
    exported = torch.load(logits_file)
    assert rel_err(exported, trained) <= TOLERANCE[torch.float32]


def test_pretrained_weights_read_by_slice_on_two_ranks_match_one_process(two_rank_run, tmp_path, capsys):
    """Continue training the exported model, launched by torchrun: each of the 2 ranks reads only
    its experts and FSDP shards from the safetensors file; the losses must be those of one
    process reading it whole."""
    from safetensors.torch import load_file

    export = export_of(two_rank_run[0])
    pretrained = ["--model", str(export), "--tokenizer", "byte", "--steps", "2", "--warmup-steps", "1",
                  "--checkpoint-every", "0"]
    log = run(torchrun_cmd(tmp_path / "two", *pretrained))
    assert f"model {export}:" in log
    assert train_in_process([*COMMON, *pretrained, "--grad-accum", "2", "--output-dir", str(tmp_path / "one")]) == 0
    one_log = capsys.readouterr().out
    two, one = losses(tmp_path / "two"), losses(tmp_path / "one")
    assert sorted(two) == sorted(one) == [1, 2]
    # The first loss is the exported model's own (the run it came from ended near it).
    assert abs(two[1] - losses(two_rank_run[0])[STEPS]) < 0.5
    a = torch.tensor([two[1], two[2]], dtype=torch.float64)
    b = torch.tensor([one[1], one[2]], dtype=torch.float64)
    assert rel_err(a, b) <= TOLERANCE[torch.float32], (a, b)

    # What was read: ep=2 x FSDP over the same 2 ranks splits every tensor in two, so the two
    # ranks' reads add up to the checkpoint, each below it, and the experts are read once.
    tensors = load_file(export / "model.safetensors")
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    experts = sum(t.numel() * t.element_size() for name, t in tensors.items() if ".experts." in name)
    read = re.search(r"pretrained weights read by slice: ([\d,]+) to ([\d,]+) bytes per rank; expert tensors "
                     r"([\d,]+) bytes over all 2 rank\(s\)", log)
    assert read is not None, log[-3000:]
    least, most, expert_bytes = (int(g.replace(",", "")) for g in read.groups())
    assert least + most == total and most < total and expert_bytes == experts, (least, most, expert_bytes, total)
    assert (f"pretrained weights read by slice: {total:,} to {total:,} bytes per rank; expert tensors {experts:,} "
            "bytes over all 1 rank(s)") in one_log


def test_two_rank_checkpoint_resumes_in_one_process(two_rank_run, tmp_path):
    """DCP reshards on load: the expert-parallel run's step-4 checkpoint continues in a single
    process (same global batch through 2 accumulation steps) onto the 2-rank losses."""
    ckpt = two_rank_run[0] / "checkpoints" / "step_00000004"
    out = tmp_path / "one"
    assert train_in_process([*COMMON, "--grad-accum", "2", "--resume", str(ckpt), "--output-dir", str(out)]) == 0
    resumed, ref = losses(out), losses(two_rank_run[0])
    assert sorted(resumed) == [5, 6]
    a = torch.tensor([resumed[5], resumed[6]], dtype=torch.float64)
    b = torch.tensor([ref[5], ref[6]], dtype=torch.float64)
    assert rel_err(a, b) <= TOLERANCE[torch.float32], (a, b)


def test_a_resume_takes_the_optimizer_flags_of_its_command(two_rank_run, tmp_path, capsys):
    """--weight-decay and --beta1/--beta2 given at a resume replace the values the checkpoint's
    optimizer state carried, and the run says so: step 5 (before the first update) as the
    uninterrupted run, step 6 not."""
    ckpt = two_rank_run[0] / "checkpoints" / "step_00000004"
    out = tmp_path / "changed"
    argv = [*COMMON, "--grad-accum", "2", "--resume", str(ckpt), "--output-dir", str(out), "--weight-decay", "5",
            "--beta1", "0"]
    assert train_in_process(argv) == 0
    assert "the optimizer takes this command's --beta1/--beta2, --weight-decay" in capsys.readouterr().out
    resumed, ref = losses(out), losses(two_rank_run[0])
    assert abs(resumed[5] - ref[5]) <= TOLERANCE[torch.float32] * abs(ref[5])
    assert abs(resumed[6] - ref[6]) > 1e-3 * abs(ref[6])


def test_resuming_with_other_data_is_refused(two_rank_run, tmp_path, capsys):
    ckpt = two_rank_run[0] / "checkpoints" / "step_00000004"
    argv = [*COMMON, "--micro-batch-size", "3", "--resume", str(ckpt), "--output-dir", str(tmp_path / "other")]
    assert train_in_process(argv) == 2
    err = capsys.readouterr().err
    assert f"--resume {ckpt}: the checkpoint was trained on other data or another global batch" in err
    assert "global_batch: 4 then, 3 now" in err
    assert not (tmp_path / "other").exists()  # refused before the data was tokenized


# ------------------------------------------------------------------------------- pipeline stages


def pipeline_cmd(out: Path, *extra: str, layout=PIPELINE) -> list[str]:
    return accelerate_cmd(out, *extra, processes=4, layout=layout)


def records(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(out / "metrics.jsonl")}


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline")
    log = run(pipeline_cmd(out, "--export-dir", str(export_of(out))))
    return out, log


@pytest.fixture(scope="module")
def pipeline_reference(tmp_path_factory):
    """The pipeline's global batch of 8 sequences in one process, through train.py without stages:
    8 accumulation steps of 1 sequence (the data-parallel ranks' blocks in turn), the same
    TrainStep and losses, without a schedule. Returns ({step: (loss, aux)}, its final checkpoint)."""
    out = tmp_path_factory.mktemp("pipeline_reference")
    argv = [*COMMON, "--micro-batch-size", "1", "--grad-accum", str(PIPELINE_BATCH), "--checkpoint-every", "0",
            "--output-dir", str(out)]
    assert train_in_process(argv) == 0
    return {s: (r["loss"], r["aux_loss"]) for s, r in records(out).items()}, out / "checkpoints" / f"step_{STEPS:08d}"


def assert_matches_reference(out: Path, reference: dict, steps) -> None:
    got = records(out)
    a = torch.tensor([[got[s]["loss"], got[s]["aux_loss"]] for s in steps], dtype=torch.float64)
    b = torch.tensor([reference[s] for s in steps], dtype=torch.float64)
    assert rel_err(a, b) <= TOLERANCE[torch.float32], (a, b)


def test_pipeline_stages_on_four_processes_match_one_process(pipeline_run, pipeline_reference):
    out, log = pipeline_run
    assert "layout pp=2 dp_replicate=1 dp_shard=2 ep=2 mb=1x4 1f1b on 4 process(es)" in log
    assert "global batch 8 sequences = 512 tokens/step" in log
    got = records(out)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got[STEPS]["loss"] < got[1]["loss"] - 0.5
    assert_matches_reference(out, pipeline_reference[0], range(1, STEPS + 1))
    # Every routed slot of the step counted once, on whichever stage holds its layer; the pass
    # torch's stages make to infer shapes before their first step is not.
    for r in got.values():
        assert [sum(layer) for layer in r["expert_load"]] == [PIPELINE_BATCH * 64 * 2] * 4, r["step"]


def test_pipeline_checkpoint_resumes_bit_for_bit(pipeline_run, tmp_path):
    out = tmp_path / "resumed"
    ckpt = pipeline_run[0] / "checkpoints" / "step_00000004"
    log = run(pipeline_cmd(out, "--resume", str(ckpt)))
    assert f"resumed from {ckpt} at step 4" in log
    resumed, uninterrupted = records(out), records(pipeline_run[0])
    assert sorted(resumed) == [5, 6]
    for s in (5, 6):
        for key in ("loss", "aux_loss", "grad_norm", "expert_load"):
            assert resumed[s][key] == uninterrupted[s][key], (s, key)  # exact


def test_plan_with_pipeline_stages_resumes_another_layouts_checkpoint(pipeline_run, pipeline_reference, tmp_path):
    """--plan on one node of 4 picks 4 stages of one layer (1F1B, 8 micro-batches of 1); it takes
    over the 2-stage expert-parallel run's step-4 checkpoint (DCP reshards it by name) and
    continues onto the single-process losses."""
    out = tmp_path / "planned"
    ckpt = pipeline_run[0] / "checkpoints" / "step_00000004"
    log = run(pipeline_cmd(out, "--resume", str(ckpt), layout=PLANNED))
    assert "decoder layers per stage [1, 1, 1, 1]" in log
    assert "--plan: micro-batch 1 x 8 pipeline micro-batches per rank" in log
    assert "layout pp=4 dp_replicate=1 dp_shard=1 ep=1 mb=1x8 1f1b on 4 process(es)" in log
    assert f"resumed from {ckpt} at step 4" in log
    assert sorted(records(out)) == [5, 6]
    assert_matches_reference(out, pipeline_reference[0], (5, 6))


def test_pipeline_checkpoint_exports_to_a_plain_transformers_folder(pipeline_run, pipeline_reference, tmp_path):
    """export.py reads a pipeline run's checkpoint (each stage's shards under the model's names)
    into the same folder train.py --export-dir wrote, whose logits are the single-process model's."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import export

    out = pipeline_run[0]
    ckpt = out / "checkpoints" / f"step_{STEPS:08d}"
    assert export.main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "hf")]) == 0
    mine, at_end = load_file(tmp_path / "hf" / "model.safetensors"), load_file(export_of(out) / "model.safetensors")
    assert mine.keys() == at_end.keys() and all(torch.equal(mine[k], at_end[k]) for k in mine)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ids = torch.tensor([list(b"def train(model):\n    return model")])
    with torch.no_grad():
        exported, trained = model(input_ids=ids).logits, trained_model(pipeline_reference[1])(input_ids=ids).logits
    assert rel_err(exported, trained) <= TOLERANCE[torch.float32]
