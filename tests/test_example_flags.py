"""The example's switches for moe_ep's optional paths: ``--chunked-loss`` (TrainStep's chunked LM
loss: the same losses as the full logits), ``--bf16-moments`` (moe_ep.AdamW) and
``--compile-blocks`` (parallelize's compiled dense blocks: refused before any work under a
recompute policy it cannot run with, and, like ``--activation-checkpointing``, refused by one
process without a launcher, where parallelize is never called, instead of being dropped without
a word); and the dispatcher's ``--overlap-chunks``,
``--dispatch-mode`` and ``--node-size``: checked against the layout before any work, passed to
parallelize, and a 2-rank run as 2 nodes of one rank with overlapped exchanges training like the
plain one."""

from __future__ import annotations

import sys

import pytest
import torch

from example_runs import COMMON, EXAMPLE, losses, train_in_process

sys.path.insert(0, str(EXAMPLE))

import layout as example_layout  # noqa: E402
import train  # noqa: E402

from moe_ep import NO_PIPELINE  # noqa: E402
from moe_ep.runs import UsageError  # noqa: E402
from numerics import TOLERANCE, rel_err  # noqa: E402


@pytest.mark.slow
def test_sequence_aux_loss_flag_balances_each_sequence(tmp_path):
    """``--aux-loss sequence`` reaches TrainStep: the first step's LM loss is the local run's (no
    update yet), its aux loss another value, finite."""
    from moe_ep.runs import read_metrics

    runs = {}
    for mode in ("local", "sequence"):
        out = tmp_path / mode
        assert train_in_process([*COMMON, "--steps", "1", "--checkpoint-every", "0", "--output-dir", str(out),
                                 "--aux-loss", mode]) == 0
        [runs[mode]] = [r for r in read_metrics(out / "metrics.jsonl") if r["step"] == 1]
    assert runs["sequence"]["loss"] == runs["local"]["loss"]  # the LM loss, before any update
    assert 0 < runs["sequence"]["aux_loss"] < float("inf") and runs["sequence"]["aux_loss"] != runs["local"]["aux_loss"]


@pytest.mark.slow
def test_chunked_loss_flag_trains_with_the_same_losses(tmp_path):
    full, chunked = tmp_path / "full", tmp_path / "chunked"
    for out, extra in ((full, []), (chunked, ["--chunked-loss"])):
        assert train_in_process([*COMMON, "--steps", "3", "--checkpoint-every", "0", "--output-dir", str(out),
                                 *extra]) == 0
    full_losses, chunked_losses = losses(full), losses(chunked)
    assert sorted(chunked_losses) == [1, 2, 3]
    assert rel_err(torch.tensor(list(chunked_losses.values())),
                   torch.tensor(list(full_losses.values()))) <= TOLERANCE[torch.float32], (chunked_losses, full_losses)


@pytest.mark.slow
def test_bf16_moments_flag_steps_moe_ep_adamw_with_bf16_moments(tmp_path):
    """--bf16-moments: moe_ep.AdamW with bf16 moments (the decay groups as without it); the first
    loss is the same (no step yet), the next ones within bf16 rounding of the float32 moments', and
    a resume from a checkpoint continues onto the same losses."""
    import argparse

    from moe_ep import AdamW

    model = torch.nn.Linear(3, 2)
    args = argparse.Namespace(bf16_moments=True, weight_decay=0.1, lr=1e-3, beta1=0.9, beta2=0.95)
    optimizer = train.make_optimizer(model, args)
    assert isinstance(optimizer, AdamW) and optimizer.moments_dtype == torch.bfloat16
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]

    plain, narrow, resumed = tmp_path / "plain", tmp_path / "narrow", tmp_path / "resumed"
    for out, extra in ((plain, ["--checkpoint-every", "0"]), (narrow, ["--bf16-moments"])):
        assert train_in_process([*COMMON, "--output-dir", str(out), *extra]) == 0
    plain_losses, narrow_losses = losses(plain), losses(narrow)
    assert sorted(narrow_losses) == list(range(1, 7)) and narrow_losses[1] == plain_losses[1]
    narrow_t, plain_t = (torch.tensor(list(d.values())) for d in (narrow_losses, plain_losses))
    assert rel_err(narrow_t, plain_t) <= TOLERANCE[torch.bfloat16], (narrow_losses, plain_losses)
    # The bf16 moments go through the checkpoint: a resume from step 4 continues bit for bit.
    ckpt = narrow / "checkpoints" / "step_00000004"
    assert train_in_process([*COMMON, "--bf16-moments", "--resume", str(ckpt), "--output-dir", str(resumed)]) == 0
    assert losses(resumed) == {step: narrow_losses[step] for step in (5, 6)}


@pytest.mark.parametrize("policy", ["selective", "attention"])
def test_compile_blocks_under_a_recompute_policy_it_cannot_run_with_stops_before_any_work(policy, tmp_path, capsys):
    out = tmp_path / "out"
    code = train.main(["--compile-blocks", "--activation-checkpointing", policy, "--output-dir", str(out)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"--compile-blocks: compile_blocks with activation_checkpointing={policy!r}" in err
    assert not out.exists()


def _one_process_layout(checkpointing: str) -> example_layout.RunLayout:
    return example_layout.RunLayout(pp=1, dp_replicate=1, dp_shard=1, ep=1, microbatch_size=2, microbatches=1,
                                    schedule=NO_PIPELINE, checkpointing=checkpointing)


@pytest.mark.parametrize("checkpointing, compile_blocks, named", [
    ("full", False, "--activation-checkpointing apply"),
    ("none", True, "--compile-blocks apply"),
    ("selective", True, "--activation-checkpointing and --compile-blocks apply"),
])
def test_one_process_without_a_launcher_refuses_what_only_parallelize_applies(checkpointing, compile_blocks, named):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(UsageError, match=f"{named} through moe_ep.parallelize, .* torchrun --nproc-per-node 1"):
        example_layout.apply_layout(model, _one_process_layout(checkpointing), mixed_precision=None,
                                    compile_blocks=compile_blocks)
    assert example_layout.apply_layout(model, _one_process_layout("none"), mixed_precision=None) is model


def test_a_launched_run_passes_the_switches_to_parallelize(monkeypatch):
    seen = {}
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr("moe_ep.parallelize", lambda model, **kw: seen.update(kw) or model)
    example_layout.apply_layout(torch.nn.Linear(2, 2), _one_process_layout("full"), mixed_precision=None,
                                compile_blocks=True)
    assert seen["compile_blocks"] is True and seen["activation_checkpointing"] == "full"


@pytest.mark.parametrize("flags, message", [
    (["--overlap-chunks", "2"], "--overlap-chunks: overlap_chunks=2 applies to the expert-parallel dispatcher; "
                                "ep=1 has none"),
    (["--overlap-chunks", "0"], "--overlap-chunks: overlap_chunks must be a positive int"),
    (["--dispatch-mode", "node"], "--dispatch-mode: dispatch_mode='node' applies to the expert-parallel dispatcher"),
    (["--node-size", "0"], "--node-size: node_size must be a positive int or None"),
])
def test_dispatcher_flags_it_cannot_apply_stop_before_any_work(flags, message, tmp_path, capsys):
    out = tmp_path / "out"
    code = train.main([*flags, "--output-dir", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert not out.exists()


def test_dispatcher_flags_are_checked_against_the_layout_and_reach_parallelize(monkeypatch):
    layout = example_layout.RunLayout(pp=1, dp_replicate=1, dp_shard=4, ep=4, microbatch_size=2, microbatches=1,
                                      schedule=NO_PIPELINE, checkpointing="none")
    flags = train.build_parser().parse_args(["--ep", "4", "--overlap-chunks", "2", "--dispatch-mode", "node", "--node-size", "2"])
    options = example_layout.dispatcher_options(flags, layout)
    assert options == {"overlap_chunks": 2, "dispatch_mode": "node", "node_size": 2}
    assert example_layout.describe_dispatcher(options, 4) == (
        "node-aware over 2 nodes x 2, exchanges overlapped over 2 chunks")
    # A node as large as the ep group: "node" cannot split it, said in terms of the flags.
    whole = train.build_parser().parse_args(["--ep", "4", "--dispatch-mode", "node", "--node-size", "4"])
    with pytest.raises(UsageError, match="--dispatch-mode and --node-size: dispatch_mode='node' needs an ep group"):
        example_layout.dispatcher_options(whole, layout)
    seen = {}
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr("moe_ep.parallelize", lambda model, **kw: seen.update(kw) or model)
    example_layout.apply_layout(torch.nn.Linear(2, 2), layout, mixed_precision=None, dispatcher=options)
    assert {k: seen[k] for k in options} == options


@pytest.mark.slow
def test_node_aware_overlapped_dispatch_trains_like_the_plain_two_rank_run(two_rank_run, tmp_path):
    # The session's 2-rank run (--ep 2), again as 2 nodes of one rank with the exchanges overlapped.
    from example_runs import run, torchrun_cmd

    out = tmp_path / "node_overlap"
    log = run(torchrun_cmd(out, "--overlap-chunks", "2", "--dispatch-mode", "node", "--node-size", "1"))
    assert "dispatch node-aware over 2 nodes x 1, exchanges overlapped over 2 chunks" in log, log[-2000:]
    plain, overlapped = losses(two_rank_run[0]), losses(out)
    assert sorted(overlapped) == sorted(plain)
    assert rel_err(torch.tensor(list(overlapped.values())),
                   torch.tensor(list(plain.values()))) <= TOLERANCE[torch.float32], (overlapped, plain)
