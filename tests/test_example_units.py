"""examples/mixtral in one process: data, flags that must fail before any work, checkpoints that a
crash mid-write never exposes, and pretrained weights read by slice."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "mixtral"
sys.path.insert(0, str(EXAMPLE))

import checkpoint as ckpt  # noqa: E402
import data  # noqa: E402
import train  # noqa: E402
from errors import UsageError  # noqa: E402
from models import tiny_config  # noqa: E402


# ---------------------------------------------------------------------------------------------- data


def test_byte_tokenizer_round_trip_and_specials():
    tok = data.ByteTokenizer()
    text = "def f(x):\n    return 'ünï'  # ✓\n"
    ids = tok.encode(text)
    assert ids.max() < 256 and tok.decode(ids) == text
    assert {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id} == {256, 257, 258}
    assert tok.vocab_size == 259 <= tiny_config().vocab_size


def test_stdlib_corpus_is_the_standard_library_only():
    files = data.stdlib_sources()
    assert len(files) > 100
    assert all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts or "test" in f.parts for f in files)
    assert files == sorted(files)


def test_schedule_deals_disjoint_blocks_that_make_up_the_single_rank_batch():
    n, global_batch = 37, 8
    single = data.BatchSchedule(n, global_batch, dp_rank=0, dp_size=1, seed=3)
    ranks = [data.BatchSchedule(n, global_batch, dp_rank=r, dp_size=4, seed=3) for r in range(4)]
    for step in range(12):  # crosses several epochs of 37 sequences
        parts = [r.indices(step) for r in ranks]
        assert sum(parts, []) == single.indices(step)
        assert len(set(sum(parts, []))) == global_batch or step * global_batch % n > n - global_batch
    # One epoch visits every sequence exactly once.
    seen = [i for s in range(n * global_batch // global_batch) for i in single.indices(s)][:n]
    assert sorted(seen) == list(range(n))
    # A pure function of the step: a fresh schedule (a resumed run) gives the same batches.
    again = data.BatchSchedule(n, global_batch, dp_rank=2, dp_size=4, seed=3)
    assert again.indices(9) == ranks[2].indices(9)
    assert data.BatchSchedule(n, global_batch, 0, 1, seed=4).indices(0) != single.indices(0)


def test_packing_frames_documents_and_drops_the_tail(tmp_path):
    (tmp_path / "a.txt").write_text("abc")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "xy"}) + "\n\n" + json.dumps({"text": "z"}) + "\n")
    spec = data.resolve_data([str(tmp_path)], "text")
    tok = data.ByteTokenizer()
    tokens = data.cached_tokens(spec, tok, tmp_path / "cache", is_local_main=True, barrier=lambda: None)
    B, E = tok.bos_token_id, tok.eos_token_id
    assert tokens.tolist() == [B, *b"abc", E, B, *b"xy", E, B, *b"z", E]
    packed = data.PackedSequences(tokens, 4)
    assert packed.num_sequences == len(tokens) // 4 and packed[1].tolist() == tokens[4:8].tolist()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [f"tokens-{data.corpus_key(spec, tok, None)}.npy"]


def test_corpus_smaller_than_a_batch_is_an_error():
    with pytest.raises(UsageError, match="fewer than one global batch of 8"):
        data.BatchSchedule(5, 8, 0, 2, seed=0)


# ----------------------------------------------------------------------------- flags fail fast


def run_main(argv, tmp_path, capsys, world_size=1):
    out = tmp_path / "out"
    env = {"WORLD_SIZE": str(world_size), "RANK": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        code = train.main(["--experts-implementation", "eager", "--output-dir", str(out), *argv])
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    err = capsys.readouterr().err
    assert code == 2, err
    assert not out.exists(), "a bad flag must stop the run before anything is written"
    return err


def test_missing_data_file(tmp_path, capsys):
    err = run_main(["--data", str(tmp_path / "nope.txt")], tmp_path, capsys)
    assert err.startswith("error: --data: ") and "nope.txt does not exist" in err


def test_unsupported_data_suffix(tmp_path, capsys):
    (tmp_path / "x.csv").write_text("a,b")
    assert "has suffix '.csv'" in run_main(["--data", str(tmp_path / "x.csv")], tmp_path, capsys)


def test_jsonl_without_the_text_field(tmp_path, capsys):
    (tmp_path / "d.jsonl").write_text(json.dumps({"body": "hello"}) + "\n")
    err = run_main(["--data", str(tmp_path / "d.jsonl")], tmp_path, capsys)
    assert "d.jsonl:1 has no string field 'text' (--text-field); it has ['body']" in err


def test_jsonl_that_is_not_json(tmp_path, capsys):
    (tmp_path / "d.jsonl").write_text("{not json\n")
    assert "d.jsonl:1 is not valid JSON" in run_main(["--data", str(tmp_path / "d.jsonl")], tmp_path, capsys)


def test_sequence_longer_than_the_model(tmp_path, capsys):
    err = run_main(["--seq-len", "2048"], tmp_path, capsys)
    assert "--seq-len 2048 exceeds the model's max_position_embeddings (1024)" in err


def test_layout_that_does_not_match_the_processes(tmp_path, capsys):
    err = run_main(["--dp-replicate", "2", "--dp-shard", "2"], tmp_path, capsys, world_size=2)
    assert "needs pp*dp_replicate*dp_shard = 4 processes, but 2 were launched" in err
    err = run_main(["--pp", "3"], tmp_path, capsys, world_size=2)
    assert "--pp 3 x --dp-replicate 1 = 3 does not divide the 2 processes launched" in err


@pytest.mark.parametrize("argv, world_size, message", [
    (["--pp", "2", "--grad-accum", "2"], 2,
     "--grad-accum 2 does not apply with pipeline stages (--pp 2): the pipeline's --microbatches are the step's"),
    (["--pp", "2", "--schedule", "pipedream"], 2,
     "--schedule: schedule must be one of ('gpipe', '1f1b', 'interleaved-1f1b', 'zbv'), got 'pipedream'"),
    (["--pp", "2", "--microbatches", "1"], 4,
     "--microbatches 1: schedule '1f1b' needs at least pp=2 micro-batches, got 1"),
    (["--pp", "2", "--schedule", "interleaved-1f1b", "--microbatches", "3"], 2,
     "--microbatches 3: schedule 'interleaved-1f1b' needs a multiple of pp=2 micro-batches, got 3"),
    (["--pp", "4", "--schedule", "zbv"], 4,
     "--pp 4 needs 8 pipeline stages (2 per rank for zbv), one decoder layer at least each, but the model has 4"),
    (["--pp", "8"], 8, "--pp 8 needs 8 pipeline stages, one decoder layer at least each, but the model has 4 layers"),
    (["--schedule", "gpipe"], 2, "--schedule applies to pipeline stages only (--pp > 1)"),
    (["--microbatches", "4", "--schedule", "1f1b"], 2, "--schedule and --microbatches apply to pipeline stages only"),
    (["--plan", "--schedule", "zbv"], 2, "--plan chooses the layout itself; do not also give --schedule"),
    (["--plan", "--grad-accum", "2"], 2, "--plan chooses the layout itself; do not also give --grad-accum"),
])
def test_pipeline_flags_that_cannot_apply_fail_before_any_work(argv, world_size, message, tmp_path, capsys):
    assert message in run_main(argv, tmp_path, capsys, world_size=world_size)


def test_rank_view_gives_each_rank_its_stages_under_the_models_names():
    """ZB-V on 2 ranks and 4 layers puts stages 0 and 3 on rank 0, 1 and 2 on rank 1: each rank's
    view holds its layers once, under the full model's names, and the ranks together hold the
    model's state dict exactly (what a pipeline checkpoint stores and any layout loads)."""
    from layout import rank_view

    from moe_ep.parallel import CausalLMStage

    model, _ = tiny_model_and_optimizer()
    stage = [CausalLMStage(model, [i], first=i == 0, last=i == 3) for i in range(4)]
    views = [rank_view(model, [stage[0], stage[3]]), rank_view(model, [stage[1], stage[2]])]
    full = model.state_dict()
    held = [v.state_dict() for v in views]
    assert not held[0].keys() & held[1].keys() and held[0].keys() | held[1].keys() == full.keys()
    assert {k.split(".")[2] for k in held[0] if k.startswith("model.layers.")} == {"0", "3"}
    for part in held:
        for name, t in part.items():
            assert t.data_ptr() == full[name].data_ptr(), name
    assert views[0].config is model.config


def test_expert_parallel_degree_must_divide(tmp_path, capsys):
    err = run_main(["--ep", "3", "--dp-shard", "3"], tmp_path, capsys, world_size=3)
    assert "--ep 3 must divide the model's 8 experts" in err
    err = run_main(["--ep", "2", "--dp-shard", "3"], tmp_path, capsys, world_size=3)
    assert "--ep 2 must divide --dp-shard 3" in err


def test_bad_model_and_values(tmp_path, capsys):
    assert "neither a named config (tiny, mixtral-8x7b, mixtral-8x22b)" in run_main(["--model", "huge"], tmp_path, capsys)
    (tmp_path / "empty").mkdir()
    assert "has no config.json" in run_main(["--model", str(tmp_path / "empty")], tmp_path, capsys)
    assert "--micro-batch-size must be >= 1, got 0" in run_main(["--micro-batch-size", "0"], tmp_path, capsys)
    assert "--warmup-steps (20) must be smaller than --steps (5)" in run_main(["--steps", "5"], tmp_path, capsys)
    assert "is not a checkpoint folder" in run_main(["--resume", str(tmp_path / "none")], tmp_path, capsys)
    assert "--plan chooses the layout itself; do not also give --ep" in run_main(["--plan", "--ep", "2"], tmp_path, capsys)
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        assert "--tensorboard needs the `tensorboard` package" in run_main(["--tensorboard"], tmp_path, capsys)


# -------------------------------------------------------------------------------- checkpoints


def tiny_model_and_optimizer(seed=0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def save(root, step, model, opt):
    state = {"step": step, "tokens_seen": 0, "world_size": 1, "data": {}}
    return ckpt.save_checkpoint(root, step, model, opt, state, rank=0, barrier=lambda: None, keep=3)


def test_interrupted_checkpoint_write_is_never_picked_up(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    model, opt = tiny_model_and_optimizer()
    save(root, 2, model, opt)

    # Crash after every shard, the metadata, the RNG and trainer state are written, just before the rename.
    real_rename = os.rename

    def crash(src, dst):
        if Path(src).name.startswith(".tmp-step_"):
            raise KeyboardInterrupt("killed")
        real_rename(src, dst)

    monkeypatch.setattr(ckpt.os, "rename", crash)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    with pytest.raises(KeyboardInterrupt):
        save(root, 4, model, opt)
    monkeypatch.undo()
    partial = root / ".tmp-step_00000004"
    assert (partial / ".metadata").is_file() and (partial / "trainer_state.json").is_file()
    # A hand-made folder with the final name but no DCP metadata does not count either.
    (root / "step_00000006").mkdir()
    (root / "step_00000006" / "trainer_state.json").write_text("{}")

    assert ckpt.latest_checkpoint(root) == root / "step_00000002"
    assert ckpt.remove_incomplete(root) == [partial] and not partial.exists()
    fresh, fresh_opt = tiny_model_and_optimizer(seed=1)
    state = ckpt.load_checkpoint(root / "step_00000002", fresh, fresh_opt, rank=0, world_size=1)
    assert state["step"] == 2
    reference, _ = tiny_model_and_optimizer(seed=0)
    for (name, a), b in zip(fresh.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), name


def test_old_checkpoints_are_pruned(tmp_path):
    root = tmp_path / "checkpoints"
    model, opt = tiny_model_and_optimizer()
    for step in (1, 2, 3, 4):
        save(root, step, model, opt)
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step_00000002", "step_00000003", "step_00000004"]


def killed_mid_delete(path, *args, **kwargs):
    """shutil.rmtree killed part-way: some shards and the RNG state gone, the DCP metadata and the
    trainer state still there (what is_complete looks for)."""
    path = Path(path)
    for f in [*sorted(path.glob("*.distcp"))[:1], *path.glob("rng-rank*.pt")]:
        f.unlink()
    raise KeyboardInterrupt("killed")


def names(root):
    return sorted(p.name for p in root.iterdir())


def test_interrupted_prune_replace_and_overwrite_never_expose_a_partial_checkpoint(tmp_path, monkeypatch):
    root = tmp_path / "out" / "checkpoints"
    model, opt = tiny_model_and_optimizer()
    for step in (1, 2, 3):
        save(root, step, model, opt)

    # Killed while pruning step 1 (keep=3): the half-deleted folder is no longer under its name.
    monkeypatch.setattr(ckpt.shutil, "rmtree", killed_mid_delete)
    with pytest.raises(KeyboardInterrupt):
        save(root, 4, model, opt)
    monkeypatch.undo()
    trash = root / ".trash-step_00000001"
    assert names(root) == [".trash-step_00000001", "step_00000002", "step_00000003", "step_00000004"]
    assert (trash / ".metadata").is_file() and (trash / "trainer_state.json").is_file()
    assert not list(trash.glob("rng-rank*.pt"))
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step_00000002", "step_00000003", "step_00000004"]
    assert ckpt.remove_incomplete(root) == [trash] and not trash.exists()

    # Re-saving step 4 (a resumed run) killed while deleting the checkpoint it replaces: the new
    # one holds the name, the old one is only trash.
    monkeypatch.setattr(ckpt.shutil, "rmtree", killed_mid_delete)
    with pytest.raises(KeyboardInterrupt):
        save(root, 4, model, opt)
    monkeypatch.undo()
    assert names(root) == [".trash-step_00000004", "step_00000002", "step_00000003", "step_00000004"]
    assert ckpt.latest_checkpoint(root) == root / "step_00000004"
    assert len(list((root / "step_00000004").glob("*.distcp"))) == 1 and (root / "step_00000004" / "rng-rank00000.pt").is_file()

    # Killed between moving the old step 4 aside and renaming the new one into place: no step 4
    # at all, the last complete checkpoint before it is the one resumed.
    real_rename = os.rename

    def crash(src, dst):
        if Path(src).name.startswith(".tmp-step_"):
            raise KeyboardInterrupt("killed")
        real_rename(src, dst)

    monkeypatch.setattr(ckpt.os, "rename", crash)
    with pytest.raises(KeyboardInterrupt):
        save(root, 4, model, opt)
    monkeypatch.undo()
    assert names(root) == [".tmp-step_00000004", ".trash-step_00000004", "step_00000002", "step_00000003"]
    assert ckpt.latest_checkpoint(root) == root / "step_00000003"
    assert len(ckpt.remove_incomplete(root)) == 2

    # --overwrite killed while deleting the checkpoints: they are gone as a whole, and the next
    # --overwrite clears what is left.
    monkeypatch.setattr(ckpt.shutil, "rmtree", lambda path, *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        ckpt.clear_run(tmp_path / "out")
    monkeypatch.undo()
    assert names(tmp_path / "out") == [".trash-checkpoints"] and ckpt.latest_checkpoint(root) is None
    ckpt.clear_run(tmp_path / "out")
    assert names(tmp_path / "out") == []


# ------------------------------------------------------------------------------ pretrained slices


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory):
    """The same tiny model saved fused (transformers 5) and in the legacy per-expert layout."""
    from safetensors.torch import save_file

    model, _ = tiny_model_and_optimizer(seed=5)
    root = tmp_path_factory.mktemp("pretrained")
    model.save_pretrained(root / "fused")
    legacy = {}
    for name, t in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, inter = name[: -len(".mlp.experts.gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                legacy[f"{prefix}.block_sparse_moe.experts.{e}.w1.weight"] = t[e, :inter].clone()
                legacy[f"{prefix}.block_sparse_moe.experts.{e}.w3.weight"] = t[e, inter:].clone()
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len(".mlp.experts.down_proj")]
            for e in range(t.shape[0]):
                legacy[f"{prefix}.block_sparse_moe.experts.{e}.w2.weight"] = t[e].clone()
        elif name.endswith("mlp.gate.weight"):
            legacy[name.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = t.clone()
        else:
            legacy[name] = t.clone()
    (root / "legacy").mkdir()
    save_file(legacy, root / "legacy" / "model.safetensors", metadata={"format": "pt"})
    model.config.save_pretrained(root / "legacy")
    return model.state_dict(), root


@pytest.mark.parametrize("layout", ["fused", "legacy"])
def test_slices_read_only_the_owned_region(tiny_checkpoints, layout):
    from pretrained import SafetensorsFolder

    full, root = tiny_checkpoints
    reader = SafetensorsFolder(root / layout)
    gate_up = full["model.layers.1.mlp.experts.gate_up_proj"]  # [8, 512, 128]; I = 256
    # Experts 2..3 (an ep shard) and rows 200..300 straddling the gate/up boundary (an FSDP shard).
    for offset, shape in [((2, 0, 0), (2, 512, 128)), ((5, 200, 0), (1, 100, 128)), ((0, 256, 64), (8, 1, 64))]:
        region = reader.read("model.layers.1.mlp.experts.gate_up_proj", offset, shape)
        index = tuple(slice(o, o + s) for o, s in zip(offset, shape))
        assert torch.equal(region, gate_up[index])
    down = reader.read("model.layers.3.mlp.experts.down_proj", (6, 10, 0), (2, 7, 256))
    assert torch.equal(down, full["model.layers.3.mlp.experts.down_proj"][6:8, 10:17])
    router = reader.read("model.layers.0.mlp.gate.weight", (4, 0), (4, 128))
    assert torch.equal(router, full["model.layers.0.mlp.gate.weight"][4:])
    read = (2 * 512 * 128 + 100 * 128 + 8 * 64 + 2 * 7 * 256 + 4 * 128) * 4
    assert reader.bytes_read == read  # nothing beyond the requested regions
    with pytest.raises(KeyError, match="model.layers.9.mlp.experts.down_proj is not in the checkpoint"):
        reader.read("model.layers.9.mlp.experts.down_proj", (0, 0, 0), (1, 1, 1))
    reader.close()


@pytest.mark.parametrize("layout", ["fused", "legacy"])
def test_meta_model_loads_pretrained_weights_with_no_random_init(tiny_checkpoints, layout, monkeypatch):
    from models import build_model, resolve_model
    from pretrained import load_pretrained

    full, root = tiny_checkpoints
    source = resolve_model(str(root / layout))
    model = build_model(source, seed=0, meta=True)
    initialised = []
    init_weights = model._init_weights
    monkeypatch.setattr(model, "_init_weights", lambda m: (initialised.append(type(m).__name__), init_weights(m)))
    read = load_pretrained(model, source.pretrained_dir, torch.device("cpu"))
    # The model's own init runs only for the rotary table, which checkpoints do not hold.
    assert initialised == ["MixtralRotaryEmbedding"]
    state = model.state_dict()
    assert state.keys() == full.keys() == read.keys()
    for name, t in full.items():
        assert torch.equal(state[name], t), name
        assert read[name] == t.numel() * t.element_size(), name
    reference, _ = tiny_model_and_optimizer()
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)


def test_delayed_init_is_deterministic_and_breaks_expert_symmetry():
    from models import ModelSource, build_model, materialize

    source = ModelSource("tiny", tiny_config(), None, True)
    a, b = (build_model(source, seed=0, meta=True) for _ in range(2))
    materialize(a, torch.device("cpu"), seed=7)
    materialize(b, torch.device("cpu"), seed=7)
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name
    gate_up = a.model.layers[0].mlp.experts.gate_up_proj
    assert 0.015 < gate_up.std().item() < 0.025  # the config's initializer_range, 0.02
    assert not torch.equal(gate_up[0], gate_up[1])
    assert torch.equal(a.model.layers[0].input_layernorm.weight, torch.ones(128))
    assert np.isfinite(a.model.rotary_emb.inv_freq.numpy()).all()


# ------------------------------------------------------------------------------------ --plan


def validate_with_world(argv, world_size, monkeypatch):
    from options import build_parser

    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    args = build_parser().parse_args(["--experts-implementation", "eager", *argv])
    return args, train.validate(args)


def test_plan_chooses_a_layout_for_the_launched_processes(monkeypatch):
    args, (_, _, _, _, layout, plan, *_) = validate_with_world(
        ["--plan", "--gpu-memory-gib", "80", "--global-batch-tokens", "4096", "--seq-len", "256"], 2, monkeypatch
    )
    assert layout.world_size == 2 and plan.layout.dp_shard == layout.dp_shard and plan.layout.ep == layout.ep
    # The plan's micro-batching is the run's: without stages its micro-batches are accumulation steps.
    assert layout.microbatch_size == plan.layout.microbatch_size
    assert layout.microbatches == plan.layout.microbatches
    assert layout.global_batch * args.seq_len == 4096


def test_plan_may_choose_pipeline_stages_and_the_cut(monkeypatch):
    """One node of 4 with room to spare and 8 sequences per step: the planner prefers 4 pipeline
    stages of one layer each over sharding (its cost model); the example takes its schedule,
    micro-batches and cut, and the global batch stays the plan's."""
    args, (_, _, _, _, layout, plan, *_) = validate_with_world(
        ["--plan", "--gpu-memory-gib", "1", "--global-batch-tokens", "512", "--seq-len", "64"], 4, monkeypatch
    )
    assert (layout.pp, layout.dp, layout.schedule, layout.microbatches) == (4, 1, "1f1b", 8)
    assert layout.split_points == tuple(plan.best.split_points) == (1, 2, 3)
    assert layout.microbatch_size == plan.layout.microbatch_size == 1
    assert layout.global_batch * args.seq_len == 512


def test_plan_errors_say_what_is_missing(monkeypatch):
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="--plan on a machine without CUDA needs --gpu-memory-gib"):
            validate_with_world(["--plan"], 2, monkeypatch)
    with pytest.raises(UsageError, match="^--plan: "):
        validate_with_world(["--plan", "--gpu-memory-gib", "80", "--global-batch-tokens", "1000"], 2, monkeypatch)
    with pytest.raises(UsageError, match="--global-batch-tokens is read by --plan only"):
        validate_with_world(["--global-batch-tokens", "4096"], 2, monkeypatch)


def test_fresh_start_over_existing_checkpoints_needs_overwrite(tmp_path, capsys, monkeypatch):
    model, opt = tiny_model_and_optimizer()
    save(tmp_path / "out" / "checkpoints", 2, model, opt)
    monkeypatch.setenv("WORLD_SIZE", "1")
    code = train.main(["--experts-implementation", "eager", "--output-dir", str(tmp_path / "out"), "--resume", "never"])
    err = capsys.readouterr().err
    assert code == 2 and "--resume never, but" in err and "step_00000002; pass --overwrite to delete them" in err
    assert train.main(["--output-dir", str(tmp_path / "out"), "--overwrite", "--resume", str(tmp_path)]) == 2
    assert "--overwrite starts afresh; it cannot be combined with --resume" in capsys.readouterr().err


def test_hf_dataset_needs_the_network_and_the_package(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UsageError, match="need the network, but HF_HUB_OFFLINE"):
        data.resolve_data(["hf:wikitext:wikitext-2-raw-v1"], "text")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(data.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UsageError, match="needs the `datasets` package"):
        data.resolve_data(["hf:wikitext"], "text")
    with pytest.raises(UsageError, match="expected hf:NAME"):
        data.resolve_data(["hf:"], "text")


# ------------------------------------------------------------------------------------ metrics


def test_expert_load_counts_every_routed_slot_and_flops_follow_the_active_parameters():
    import metrics
    from models import build_model, count_parameters, resolve_model

    model, _ = tiny_model_and_optimizer()
    load = metrics.ExpertLoad(model, num_layers=4, num_experts=8, device="cpu")
    ids = torch.randint(0, 256, (3, 17))
    with torch.no_grad():
        model(input_ids=ids)
    counts = load.collect()
    assert counts.shape == (4, 8) and counts.sum(1).tolist() == [3 * 17 * 2] * 4
    assert load.counts_LE.sum() == 0  # collect() starts a new interval
    assert metrics.balance(torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])) == [1.0, 4.0]

    big = build_model(resolve_model("mixtral-8x7b"), seed=0, meta=True)
    total, active = count_parameters(big)
    assert 46.6e9 < total < 46.8e9 and 12.8e9 < active < 13.0e9  # Mixtral-8x7B: 46.7B, 12.9B active
    per_token = metrics.flops_per_token(big.config, active, 4096)
    embed = 32000 * 4096
    assert per_token == 6 * (active - embed) + 12 * 32 * 4096 * 4096
    assert metrics.peak_flops(torch.device("cpu"), None) is None
    assert metrics.peak_flops(torch.device("cpu"), 100.0) == 100e12


def test_hub_model_that_cannot_be_fetched(tmp_path, capsys, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    err = run_main(["--model", "nobody/no-such-moe"], tmp_path, capsys)
    assert "--model nobody/no-such-moe: not in the local cache and the Hub cannot be reached" in err
