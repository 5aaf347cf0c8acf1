"""examples/mixtral in one process: data, flags that must fail before any work, checkpoints that a
crash mid-write never exposes, and pretrained weights read by slice."""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "mixtral"
sys.path.insert(0, str(EXAMPLE))

import data  # noqa: E402
import train  # noqa: E402
from models import tiny_config  # noqa: E402

from moe_ep.runs import RunError, UsageError, ownership  # noqa: E402
from moe_ep.runs import checkpoint as ckpt  # noqa: E402


# ---------------------------------------------------------------------------------------------- data


def test_byte_tokenizer_round_trip_and_specials():
    tok = data.ByteTokenizer()
    text = "def f(x):\n    return 'ünï'  # ✓\n"
    ids = tok.encode(text)
    assert ids.max() < 256 and bytes(ids.tolist()).decode("utf-8") == text
    assert (tok.bos_token_id, tok.eos_token_id) == (256, 257)
    assert tok.vocab_size == 259 <= tiny_config().vocab_size


def test_stdlib_corpus_is_the_standard_library_only():
    files = data.stdlib_sources()
    assert len(files) > 100
    assert all(f.suffix == ".py" for f in files)
    # Parts below the stdlib root only: the folders above it may have any name (say /home/test).
    root = Path(sysconfig.get_paths()["stdlib"])
    assert not any({"site-packages", "test"} & set(f.relative_to(root).parts) for f in files)
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
    cache_file = data.token_cache_file(spec, tok, tmp_path / "cache", None)
    tokens = data.cached_tokens(spec, tok, cache_file, is_writer=True, barrier=lambda: None, intact=False)
    B, E = tok.bos_token_id, tok.eos_token_id
    assert tokens.tolist() == [B, *b"abc", E, B, *b"xy", E, B, *b"z", E]
    packed = data.PackedSequences(tokens, 4)
    assert packed.num_sequences == len(tokens) // 4 and packed[1].tolist() == tokens[4:8].tolist()
    key = data.corpus_key(spec, tok, None)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [
        ".moe_ep-owner", f"tokens-{key}.manifest.json", f"tokens-{key}.npy"]
    assert data.token_cache_problems(cache_file) == []


def test_half_written_caches_of_a_killed_run_are_removed_from_the_runs_cache_folder_only(tmp_path):
    from moe_ep.runs import make_managed_dir

    cache = make_managed_dir(tmp_path / "token_cache", "token_cache")
    (cache / ".tokens-0123456789abcdef.npy.4242.tmp").write_bytes(bytes(64))
    (cache / ".tokens-0123456789abcdef.manifest.json.node7-4242-9f3a01bc.tmp").write_text("{")  # its manifest's
    (cache / "tokens-0123456789abcdef.npy").write_bytes(bytes(8))
    assert [p.name for p in data.remove_interrupted_writes(cache)] == [
        ".tokens-0123456789abcdef.npy.4242.tmp", ".tokens-0123456789abcdef.manifest.json.node7-4242-9f3a01bc.tmp"]
    assert sorted(p.name for p in cache.iterdir()) == [".moe_ep-owner", "tokens-0123456789abcdef.npy"]
    users = tmp_path / "mine"
    users.mkdir()
    (users / ".tokens-0123456789abcdef.npy.4242.tmp").write_bytes(bytes(64))
    assert data.remove_interrupted_writes(users) == [] and len(list(users.iterdir())) == 1


@pytest.mark.parametrize("max_tokens", [None, 3, 7, 12, 100])
@pytest.mark.parametrize("checksum_tokens", [1 << 20, 6])
def test_survey_counts_the_byte_token_stream_before_tokenizing(max_tokens, checksum_tokens, tmp_path, monkeypatch):
    """The figures that validate checks (corpus size, a resume's data) are those of the token
    stream the run trains on, the cap and the checksum's reach cutting inside a document or not."""
    monkeypatch.setattr(data, "CHECKSUM_TOKENS", checksum_tokens)
    (tmp_path / "a.txt").write_text("abc\r\nü")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "xy"}) + "\n" + json.dumps({"text": "z"}) + "\n")
    spec = data.resolve_data([str(tmp_path)], "text")
    tok = data.ByteTokenizer()
    cache_file = data.token_cache_file(spec, tok, tmp_path / "cache", max_tokens)
    surveyed = data.survey_corpus(spec, tok, None, max_tokens)
    assert not cache_file.exists()
    tokens = data.cached_tokens(spec, tok, cache_file, is_writer=True, barrier=lambda: None, intact=False,
                                max_tokens=max_tokens)
    assert surveyed == data.corpus_stats(tokens)
    assert tokens[1:8].tolist() == [*b"abc\r\n", 0xC3, 0xBC][: len(tokens) - 1]  # the file's bytes, CRLF kept
    # The free-space check's bound of the cache, before anything was read, holds what was written.
    assert cache_file.stat().st_size <= data.token_cache_bytes(spec, tok, max_tokens)
    # Once the cache exists it vouches for the files, which are not read again.
    monkeypatch.setattr(data, "iter_documents", None)
    assert data.survey_corpus(spec, tok, cache_file, max_tokens) == surveyed


def test_the_stream_identity_sees_its_order_and_every_token(tmp_path, monkeypatch):
    """The data identity a resume is checked against: two files read in the other order, or a
    byte changed past the first CHECKSUM_TOKENS tokens, leave the length and the token sum as
    they were but not the stream's SHA-256."""
    monkeypatch.setattr(data, "HASH_CHUNK_TOKENS", 3)  # hashed in pieces as a long stream is
    for name, text in (("a.txt", "ab" * 5), ("b.txt", "cd" * 5)):
        (tmp_path / name).write_text(text)
    tok = data.ByteTokenizer()

    def stats(*names):
        return data.survey_corpus(data.resolve_data([str(tmp_path / n) for n in names], "text"), tok, None, None)

    first = stats("a.txt", "b.txt")
    swapped = stats("b.txt", "a.txt")
    assert (swapped["corpus_tokens"], swapped["token_sum"]) == (first["corpus_tokens"], first["token_sum"])
    assert swapped["token_sha256"] != first["token_sha256"]
    monkeypatch.setattr(data, "CHECKSUM_TOKENS", 4)
    first = stats("a.txt", "b.txt")
    (tmp_path / "a.txt").write_text("ab" * 4 + "ba")
    assert stats("a.txt", "b.txt")["token_sum"] == first["token_sum"]
    assert stats("a.txt", "b.txt")["token_sha256"] != first["token_sha256"]


def test_a_rewritten_file_gets_a_new_token_cache_even_with_its_size_and_mtime_restored(tmp_path):
    """cp -p, rsync -a and tar x restore a file's mtime: its ctime and inode still tell."""
    path = tmp_path / "a.txt"
    path.write_text("a" * 40)
    before = path.stat()
    spec, tok = data.resolve_data([str(path)], "text"), data.ByteTokenizer()
    key = data.corpus_key(spec, tok, None)
    (tmp_path / "b.txt").write_text("b" * 40)
    os.replace(tmp_path / "b.txt", path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert data.corpus_key(spec, tok, None) != key


def test_a_data_folder_reads_each_document_once_and_no_hidden_file(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "a.txt").write_text("a")
    (root / "B.TXT").write_text("b")
    (root / "sub" / "c.jsonl").write_text(json.dumps({"text": "c"}) + "\n")
    (root / "._a.txt").write_bytes(b"\x00\x05\x16\x07")  # macOS metadata, not UTF-8
    (root / ".git" / "d.py").write_text("d")
    (root / "link.txt").symlink_to(root / "a.txt")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "e.md").write_text("e")
    (root / "linked").symlink_to(elsewhere)
    (elsewhere / "loop").symlink_to(root)  # back up the tree: walked once
    spec = data.resolve_data([str(root), str(root / "sub")], "text")
    assert sorted(p.resolve().relative_to(tmp_path).as_posix() for p in spec.files) == [
        "corpus/B.TXT", "corpus/a.txt", "corpus/sub/c.jsonl", "elsewhere/e.md"]
    assert sorted(data.iter_documents(spec)) == ["a", "b", "c", "e"]


def test_documents_that_cannot_be_read_are_named_in_one_line(tmp_path):
    big = tmp_path / "big.jsonl"
    big.write_text('{"text": "x", "n": ' + "9" * 5000 + "}\n")
    with pytest.raises(UsageError, match=r"big.jsonl:1 is JSON this reader cannot take \(ValueError: "):
        list(data.iter_documents(data.resolve_data([str(big)], "text")))
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(UsageError, match=r"deep.jsonl:1 is JSON this reader cannot take \(RecursionError"):
        list(data.iter_documents(data.resolve_data([str(deep)], "text")))
    gone = tmp_path / "gone.txt"
    gone.write_text("x")
    spec = data.resolve_data([str(gone)], "text")
    gone.unlink()
    with pytest.raises(UsageError, match=r"--data: .*gone.txt cannot be read \(No such file or directory\)"):
        list(data.iter_documents(spec))


def test_a_tokenizer_without_bos_ends_each_document_with_eos_alone(tmp_path):
    class NoBos(data.ByteTokenizer):
        bos_token_id = None

    (tmp_path / "a.txt").write_text("hi")
    (tmp_path / "b.txt").write_text("yo")
    spec = data.resolve_data([str(tmp_path)], "text")
    framed = list(data.framed_documents(spec, NoBos(), np.uint16))
    assert [f.tolist() for f in framed] == [[*b"hi", 257], [*b"yo", 257]]
    assert data.survey_corpus(spec, NoBos(), None, None)["corpus_tokens"] == 6


def test_a_pretrained_tokenizer_is_named_by_its_files_not_its_path(tmp_path, monkeypatch):
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text('{"model": 1}')
    (folder / "tokenizer_config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    same = data.tokenizer_fingerprint(Path("tok"))
    assert data.tokenizer_fingerprint(folder) == same
    (folder / "tokenizer.json").write_text('{"model": 2}')
    assert data.tokenizer_fingerprint(folder) != same


def test_schedule_needs_one_global_batch():
    with pytest.raises(ValueError, match="num_sequences=5 must be >= global_batch=8"):
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


def test_expert_bias_rate_needs_a_bias_balanced_model(tmp_path, capsys):
    err = run_main(["--expert-bias-rate", "0.001"], tmp_path, capsys)
    assert "--expert-bias-rate 0.001: mixtral routers hold no expert bias" in err and "deepseek_v3" in err
    assert "--expert-bias-rate must be a finite number >= 0, got -1.0" in run_main(["--expert-bias-rate", "-1"],
                                                                                 tmp_path, capsys)
    assert "--aux-loss-coef must be a finite number >= 0, got -0.5" in run_main(["--aux-loss-coef", "-0.5"], tmp_path,
                                                                              capsys)


def test_an_accelerate_config_asking_what_train_py_does_not_do_is_refused(tmp_path, capsys, monkeypatch):
    # train.py shards with moe_ep.parallelize and reads only mixed_precision from the config: FSDP1,
    # offload, accelerate's activation checkpointing or a dynamo backend ran silently without them.
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR")
    err = run_main([], tmp_path, capsys)
    assert "the accelerate config asks for what train.py does not do: fsdp_offload_params: true" in err, err
    assert "dynamo_backend: inductor (pass --compile-blocks instead)" in err
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "false")
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "NO")
    train.check_accelerate_config()  # FSDP2 with nothing more: what parallelize does itself


@pytest.mark.parametrize("flag, value", [("--z-loss-coef", "nan"), ("--aux-loss-coef", "inf"), ("--lr", "nan"),
                                         ("--max-grad-norm", "nan"), ("--weight-decay", "inf"),
                                         ("--step-timeout", "inf"), ("--startup-timeout", "-1.5"),
                                         ("--max-consecutive-skips", "-1")])
def test_non_finite_or_negative_flag_values_are_refused(flag, value, tmp_path, capsys):
    err = run_main([flag, value], tmp_path, capsys)
    assert f"{flag} must be a finite number" in err and err.rstrip().endswith(f"got {value}"), err


@pytest.mark.parametrize("flag, value, message", [
    ("--peak-tflops", "nan", "--peak-tflops must be a finite number > 0, got nan"),
    ("--peak-tflops", "-5", "--peak-tflops must be a finite number > 0, got -5.0"),
    ("--seed", "-1", "--seed must be an int in [0, 2**32), got -1"),
    ("--seed", str(2 ** 62), f"--seed must be an int in [0, 2**32), got {2 ** 62}"),
    ("--seq-len", "1", "--seq-len must be >= 2 (a sequence's first token predicts nothing"),
    ("--startup-timeout", "1e10", "--startup-timeout must be at most 3.1536e+07 s (a year), got 1e+10"),
])
def test_out_of_range_values_of_the_scripts_flags_are_refused(flag, value, message, tmp_path, capsys):
    assert message in run_main([flag, value], tmp_path, capsys)


@pytest.mark.parametrize("value", ["0", "-2"])
def test_the_loops_keep_at_least_one_checkpoint(value):
    """trainer.py's and accelerate_loop.py's --keep-checkpoints (RunFolder.prune) keeps the newest."""
    import loops

    args = loops.build_parser("test", "runs/test").parse_args(["--keep-checkpoints", value])
    with pytest.raises(UsageError, match=rf"--keep-checkpoints must be >= 1 \(the newest is the one to resume\), "
                                         rf"got {value}"):
        loops.check_args(args, 1)


def test_bf16_moments_refuse_a_decay_they_cannot_follow(tmp_path, capsys):
    assert ("--beta1/--beta2 with --bf16-moments: betas=(0.9, 0.999) with moments_dtype=torch.bfloat16: a moment "
            "whose decay 1 - beta is below 2^-7 stops moving in bf16") in run_main(
        ["--bf16-moments", "--beta2", "0.999"], tmp_path, capsys)


def test_the_run_folder_cannot_be_or_lie_inside_a_data_folder(tmp_path, capsys):
    """Its metrics.jsonl would be read as data at the next start of the same command."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some text " * 100)
    for out in (corpus, corpus / "run"):
        code = train.main(["--experts-implementation", "eager", "--data", str(corpus), "--output-dir", str(out)])
        assert code == 2 and f"--output-dir: {out} is" in capsys.readouterr().err
        assert sorted(p.name for p in corpus.iterdir()) == ["a.txt"]


def test_a_data_path_that_is_not_a_regular_file_is_refused(tmp_path, capsys):
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)  # read forever if opened
    assert f"--data: {fifo} is not a regular file" in run_main(["--data", str(fifo)], tmp_path, capsys)


def test_balancing_follows_the_family_unless_flagged():
    from options import DEFAULT_EXPERT_BIAS_RATE, balancing, build_parser
    from transformers import DeepseekV3Config

    parse = build_parser().parse_args
    mixtral, deepseek = tiny_config(), DeepseekV3Config()
    # Mixtral: its config's aux loss, no bias; DeepSeek-V3 has no aux loss coefficient, a bias.
    assert balancing(parse([]), mixtral) == (mixtral.router_aux_loss_coef, 0.0)
    assert balancing(parse([]), deepseek) == (0.0, DEFAULT_EXPERT_BIAS_RATE)
    assert balancing(parse(["--aux-loss-coef", "0.01", "--expert-bias-rate", "0"]), deepseek) == (0.01, 0.0)


def test_missing_data_file(tmp_path, capsys):
    err = run_main(["--data", str(tmp_path / "nope.txt")], tmp_path, capsys)
    assert err.startswith("error: --data: ") and "nope.txt does not exist" in err


def test_unsupported_data_suffix(tmp_path, capsys):
    (tmp_path / "x.csv").write_text("a,b")
    assert "has suffix '.csv'" in run_main(["--data", str(tmp_path / "x.csv")], tmp_path, capsys)


def test_jsonl_without_the_text_field(tmp_path, capsys):
    (tmp_path / "d.jsonl").write_text(json.dumps({"body": "hello"}) + "\n")
    err = run_main(["--data", str(tmp_path / "d.jsonl")], tmp_path, capsys)
    assert "d.jsonl:1 has no string field 'text' (--text-field): it has the fields ['body']" in err


def test_jsonl_that_is_not_json(tmp_path, capsys):
    (tmp_path / "d.jsonl").write_text("{not json\n")
    assert "d.jsonl:1 is not valid JSON" in run_main(["--data", str(tmp_path / "d.jsonl")], tmp_path, capsys)


def test_every_jsonl_line_is_checked_before_any_work(tmp_path, capsys):
    good = json.dumps({"text": "x" * 300}) + "\n"
    (tmp_path / "d.jsonl").write_text(good * 20 + "\n" + json.dumps({"body": "y"}) + "\n" + good)
    err = run_main(["--data", str(tmp_path / "d.jsonl")], tmp_path, capsys)
    assert "d.jsonl:22 has no string field 'text' (--text-field): it has the fields ['body']" in err
    (tmp_path / "d.jsonl").write_text(good * 3 + "{broken\n")
    assert "d.jsonl:4 is not valid JSON" in run_main(["--data", str(tmp_path / "d.jsonl")], tmp_path, capsys)
    (tmp_path / "d.jsonl").write_text(good + '{"text": "half of a pair \\ud83d"}\n')
    err = run_main(["--data", str(tmp_path / "d.jsonl")], tmp_path, capsys)
    assert "d.jsonl:2, field 'text' holds a lone surrogate (\\ud83d at character 15), which is not Unicode text" in err
    (tmp_path / "d.jsonl").write_text("")
    assert "--data: no documents in 1 file(s)" in run_main(["--data", str(tmp_path / "d.jsonl")], tmp_path, capsys)


def test_text_that_is_not_utf8_is_refused_with_its_byte_offset(tmp_path, capsys):
    (tmp_path / "notes.txt").write_bytes("naïve text\n".encode("latin-1"))
    err = run_main(["--data", str(tmp_path / "notes.txt")], tmp_path, capsys)
    assert "notes.txt is not UTF-8: byte offset 2 of the file (invalid continuation byte, byte 0xef)" in err
    line = (json.dumps({"text": "ok"}) + "\n").encode()
    (tmp_path / "d.jsonl").write_bytes(line * 2 + b'{"text": "caf\xe9"}\n')
    err = run_main(["--data", str(tmp_path / "d.jsonl")], tmp_path, capsys)
    assert f"d.jsonl:3 is not UTF-8: byte offset {2 * len(line) + 13} of the file" in err


def test_corpus_smaller_than_a_global_batch_stops_before_any_work(tmp_path, capsys):
    (tmp_path / "small.txt").write_text("x" * 1000)
    err = run_main(["--data", str(tmp_path / "small.txt"), "--seq-len", "300", "--micro-batch-size", "2"],
                   tmp_path, capsys, world_size=2)
    assert ("--data: the corpus's 1,002 tokens pack into 3 sequence(s) of --seq-len 300, fewer than one global "
            "batch of 4; give more data, a shorter --seq-len or a smaller batch") in err


def fake_datasets(records, monkeypatch):
    """A stand-in for the `datasets` package (not installed, and offline here) streaming ``records``."""
    import importlib.machinery
    import types

    module = types.ModuleType("datasets")
    module.__spec__ = importlib.machinery.ModuleSpec("datasets", None)
    module.load_dataset = lambda name, config, split, streaming: iter(records)
    monkeypatch.setitem(sys.modules, "datasets", module)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)


def test_hf_dataset_without_the_text_field_stops_before_any_work(tmp_path, capsys, monkeypatch):
    fake_datasets([{"body": "hello"}], monkeypatch)
    err = run_main(["--data", "hf:someone/corpus"], tmp_path, capsys)
    assert ("--data hf:someone/corpus:train: records have no string field 'text' (--text-field); "
            "they have ['body']") in err
    fake_datasets([], monkeypatch)
    assert "--data hf:someone/corpus:test: the split 'test' holds no records" in run_main(
        ["--data", "hf:someone/corpus::test"], tmp_path, capsys)


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
     "--schedule: schedule must be one of ('gpipe', '1f1b', 'interleaved-1f1b', 'interleaved-1f1b-overlap', 'zbv', 'dualpipev'), got 'pipedream'"),
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
    from moe_ep.planner import MODEL_NAMES

    named = ", ".join(("tiny", *MODEL_NAMES))
    assert f"neither a named config ({named})" in run_main(["--model", "huge"], tmp_path, capsys)
    (tmp_path / "empty").mkdir()
    assert "has no config.json" in run_main(["--model", str(tmp_path / "empty")], tmp_path, capsys)
    assert "--micro-batch-size must be >= 1, got 0" in run_main(["--micro-batch-size", "0"], tmp_path, capsys)
    assert "--warmup-steps (20) must be smaller than --steps (5)" in run_main(["--steps", "5", "--warmup-steps", "20"],
                                                                              tmp_path, capsys)
    assert "is not a checkpoint folder" in run_main(["--resume", str(tmp_path / "none")], tmp_path, capsys)
    assert "--plan chooses the layout itself; do not also give --ep" in run_main(["--plan", "--ep", "2"], tmp_path, capsys)


def test_tensorboard_without_the_package(tmp_path, capsys, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else find_spec(name, *a))
    err = run_main(["--tensorboard"], tmp_path, capsys)
    assert "error: --tensorboard needs the `tensorboard` package (pip install tensorboard)" in err


def test_tensorboard_logs_the_step_and_the_expert_load(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from moe_ep.runs import metrics

    reporter = metrics.Reporter(tmp_path, enabled=True, total_steps=2, progress=False, tensorboard=True)
    for step, loss in ((1, 2.5), (2, 2.25)):
        reporter.step({"step": step, "loss": loss, "aux_loss": 0.125, "z_loss": None, "grad_norm": 1.0, "lr": 1e-3,
                       "tokens_per_s": 100.0, "mfu": None}, torch.tensor([[1.0, 3.0], [2.0, 2.0]]))
    reporter.close()
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert sorted(events.Tags()["scalars"]) == [
        "expert_load_max_over_mean/layer0", "expert_load_max_over_mean/layer1", "train/aux_loss", "train/grad_norm",
        "train/loss", "train/lr", "train/tokens_per_s"]
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 2.5), (2, 2.25)]
    assert [e.value for e in events.Scalars("expert_load_max_over_mean/layer0")] == [1.5, 1.5]
    # Resumed at step 1 (after a crash, or rolled back): step 2 again, its earlier event purged
    # from what TensorBoard shows, as read_metrics drops its record.
    reporter = metrics.Reporter(tmp_path, enabled=True, total_steps=3, progress=False, tensorboard=True)
    for step, loss in ((2, 2.0), (3, 1.75)):
        reporter.step({"step": step, "loss": loss, "aux_loss": None, "z_loss": None, "grad_norm": 1.0, "lr": 1e-3,
                       "tokens_per_s": 100.0, "mfu": None}, None)
    reporter.close()
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 2.5), (2, 2.0), (3, 1.75)]


# -------------------------------------------------------------------------------- checkpoints


def tiny_model_and_optimizer(seed=0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def save(root, step, model, opt):
    state = {"step": step, "tokens_seen": 0, "world_size": 1, "data": {}}
    return ckpt.save_checkpoint(root, step, model, opt, state, rank=0, barrier=lambda: None, keep=3)


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["flipped_byte", "unlisted_file", "trainer_state"])
def test_load_checkpoint_verifies_the_checkpoint_and_loads_nothing_damaged(tmp_path, damage):
    """The README's loop (latest_checkpoint, then load_checkpoint) never loads damage: DCP checks no
    content (a flipped byte in a shard loaded a wrong expert weight silently), so load_checkpoint
    verifies the manifest itself unless told the caller did (verified=True)."""
    root = tmp_path / "checkpoints"
    model, opt = tiny_model_and_optimizer()
    path = save(root, 2, model, opt)
    if damage == "flipped_byte":
        victim = next(path.glob("*.distcp"))
        data = bytearray(victim.read_bytes())
        data[int(len(data) * 0.3)] ^= 0x40
        victim.write_bytes(bytes(data))
        said = f"{victim.name} does not match its checksum"
    elif damage == "unlisted_file":
        (path / "__1_0.distcp").write_bytes(b"not a shard")
        said = "does not list __1_0.distcp"
    else:  # still valid JSON, another step
        victim = path / "trainer_state.json"
        victim.write_text(victim.read_text().replace('"step": 2', '"step": 3'))
        said = "trainer_state.json does not match its checksum"
    fresh, fresh_opt = tiny_model_and_optimizer(seed=1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(RunError, match=said):
        ckpt.load_checkpoint(ckpt.latest_checkpoint(root), fresh, fresh_opt, rank=0, world_size=1)
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in before.items())
    assert not fresh_opt.state


@pytest.mark.slow
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
    """What a folder holds, but the run's ownership marker."""
    return sorted(p.name for p in root.iterdir() if p.name != ownership.MARKER)


@pytest.mark.slow
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
        ownership.clear_run(tmp_path / "out")
    monkeypatch.undo()
    assert names(tmp_path / "out") == [".trash-checkpoints"] and ckpt.latest_checkpoint(root) is None
    ownership.clear_run(tmp_path / "out")
    assert names(tmp_path / "out") == []


def test_resume_on_other_data_or_without_its_rng_states_stops_before_any_work(tmp_path, capsys, monkeypatch):
    """The data identity of a checkpoint is compared, and its ranks' RNG files looked for, before
    anything is tokenized or written."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("x" * 2000)
    argv = ["--data", str(corpus), "--seq-len", "64", "--micro-batch-size", "2"]
    _, checked = validate_with_world(argv, 1, monkeypatch, tmp_path)
    stream = np.array([256, *[ord("x")] * 2000, 257], dtype="<u2")  # BOS, the bytes, EOS as the cache stores them
    assert checked.identity == {"corpus_tokens": 2002, "token_sum": 256 + 2000 * ord("x") + 257,
                                "token_sha256": hashlib.sha256(stream.tobytes()).hexdigest(), "seq_len": 64,
                                "global_batch": 2, "seed": 0, "tokenizer": "byte"}
    model, opt = tiny_model_and_optimizer()
    trainer_state = {"step": 4, "world_size": 1, "data": checked.identity}
    saved = ckpt.save_checkpoint(tmp_path / "saved", 4, model, opt, trainer_state, rank=0, barrier=lambda: None, keep=1)
    assert train.validate(train.build_parser().parse_args(
        ["--experts-implementation", "eager", "--output-dir", str(tmp_path / "out"), *argv, "--resume", str(saved)]
    )).resume == saved

    corpus.write_text("x" * 2100)
    err = run_main([*argv, "--resume", str(saved)], tmp_path, capsys)
    assert (f"--resume {saved}: the checkpoint was trained on other data or another global batch (corpus_tokens: 2002 "
            "then, 2102 now; token_sum: ") in err
    err = run_main([*argv, "--micro-batch-size", "3", "--resume", str(saved)], tmp_path, capsys)
    assert "global_batch: 2 then, 3 now" in err

    ckpt.rng_file(saved, 0).unlink()
    err = run_main([*argv, "--resume", str(saved)], tmp_path, capsys)
    assert f"--resume: the checkpoint {saved} is damaged: rng-rank00000.pt is missing; resume another checkpoint" in err


def test_resume_of_another_models_checkpoint_stops_before_any_work(tmp_path, capsys, monkeypatch):
    """A checkpoint records its model's config.json: one of another model (here: top-1 of the same
    experts, whose tensors have the same shapes, or fewer layers, whose tensors the model would
    read only in part) is refused by the fields that differ, before anything is written."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("x" * 2000)
    argv = ["--data", str(corpus), "--seq-len", "64", "--micro-batch-size", "2"]
    _, checked = validate_with_world(argv, 1, monkeypatch, tmp_path)
    model, opt = tiny_model_and_optimizer()
    trainer_state = {"step": 4, "world_size": 1, "data": checked.identity}
    same = ckpt.save_checkpoint(tmp_path / "same", 4, model, opt, trainer_state, rank=0, barrier=lambda: None, keep=1,
                                config=checked.source.config)
    assert train.validate(train.build_parser().parse_args(
        ["--output-dir", str(tmp_path / "out"), *argv, "--resume", str(same)])).resume == same
    for field, other in (("num_experts_per_tok", 1), ("num_hidden_layers", 1)):
        config = tiny_config()
        want = getattr(config, field)
        setattr(config, field, other)
        saved = ckpt.save_checkpoint(tmp_path / field, 4, model, opt, trainer_state, rank=0, barrier=lambda: None,
                                     keep=1, config=config)
        err = run_main([*argv, "--resume", str(saved)], tmp_path, capsys)
        assert (f"--resume {saved}: the checkpoint is of another model ({field}: {other} then, {want} now); resuming "
                "would load its weights into this one") in err


@pytest.mark.slow
def test_export_replaces_an_earlier_export_whole(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    import export

    model, opt = tiny_model_and_optimizer()
    saved = ckpt.save_checkpoint(tmp_path / "run" / "checkpoints", 1, model, opt,
                                 {"step": 1, "world_size": 1, "data": {}}, rank=0, barrier=lambda: None, keep=1,
                                 config=model.config)
    out = tmp_path / "hf"
    assert export.export_hf(saved, out) == out and ownership.marker_kind(out) == "export"
    (out / "stale.txt").write_text("from an earlier export")
    # Written by that export (its marker lists it), not added by a user since: replaced with it.
    ownership.mark(out, "export", files=[*ownership.marker_info(out)["files"], "stale.txt"])
    # Killed between moving the old folder aside and renaming the new one in: no partial folder
    # under the name, only the two whole ones beside it.
    real_rename = os.rename

    def crash(src, dst):
        if Path(src).name == ".tmp-hf":
            raise KeyboardInterrupt("killed")
        real_rename(src, dst)

    monkeypatch.setattr(export.os, "rename", crash)
    with pytest.raises(KeyboardInterrupt):
        export.export_hf(saved, out)
    monkeypatch.undo()
    assert names(tmp_path) == [".moe_ep-lock-hf", ".tmp-hf", ".trash-hf", "run"]  # the lock stays, let go
    assert (tmp_path / ".trash-hf" / "stale.txt").is_file() and (tmp_path / ".tmp-hf" / "model.safetensors").is_file()

    assert export.export_hf(saved, out) == out
    assert names(tmp_path) == [".moe_ep-lock-hf", "hf", "run"] and not (out / "stale.txt").exists()
    exported = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert exported.keys() == model.state_dict().keys()
    assert all(torch.equal(t, model.state_dict()[name]) for name, t in exported.items())

    # "." (a path without a name, which the folders beside it are named after): the folder it
    # stands for, refused as a user's and left as it was.
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    monkeypatch.chdir(user)
    with pytest.raises(UsageError, match=rf"--out: {user} is a non-empty folder that no moe_ep export wrote"):
        export.export_hf(saved, Path("."))
    assert names(user) == ["notes.txt"]
    # Into another run's checkpoints/, where that run would take it for a damaged checkpoint.
    other = tmp_path / "other" / "checkpoints"
    ckpt.save_checkpoint(other, 2, model, opt, {"step": 2, "world_size": 1, "data": {}}, rank=0, barrier=lambda: None,
                         keep=1)
    with pytest.raises(UsageError, match=rf"--out {other / 'step_00000008'} is inside {other}, a folder a moe_ep run "
                                         r"manages \(its marker says 'checkpoints'\)"):
        export.export_hf(saved, other / "step_00000008")
    assert names(other) == ["step_00000002"]


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


@pytest.mark.parametrize("layout", ["fused", "legacy", "state_dict"])
@pytest.mark.parametrize("change,expected", [
    ({"num_local_experts": 4}, [r"expected \[4, 128\], found \[8, 128\]",
                                r"(more than the config's 4 experts|expected \[4, 512, 128\], found \[8, 512, 128\])"]),
    ({"intermediate_size": 128}, [r"(expected \[8, 256, 128\], found \[8, 512, 128\]|expected \[128, 128\], found \[256, 128\])"]),
    ({"hidden_size": 64, "head_dim": 16}, [r"model.embed_tokens.weight in model.safetensors: expected \[\d+, 64\], found \[\d+, 128\]"]),
], ids=["fewer_experts", "narrower_experts", "narrower_model"])
def test_weights_that_do_not_match_their_config_are_refused_before_any_read(tiny_checkpoints, layout, change, expected,
                                                                              tmp_path):
    """A config.json that disagrees with its safetensors (fewer or narrower experts, another hidden
    size): every mismatched tensor named with its file and both shapes, nothing allocated or read."""
    import shutil

    from moe_ep.runs import UsageError
    from models import build_model, resolve_model
    from pretrained import load_pretrained
    from transformers import AutoConfig

    full, root = tiny_checkpoints
    folder = tmp_path / "changed"
    if layout == "state_dict":  # transformers 5's own names, fused experts (save_pretrained writes per expert)
        from safetensors.torch import save_file

        folder.mkdir()
        save_file({n: t.contiguous() for n, t in full.items()}, folder / "model.safetensors", metadata={"format": "pt"})
        shutil.copy(root / "fused" / "config.json", folder)
    else:
        shutil.copytree(root / layout, folder)
    config = AutoConfig.from_pretrained(folder)
    for key, value in change.items():
        setattr(config, key, value)
    config.save_pretrained(folder)
    source = resolve_model(str(folder))
    model = build_model(source, seed=0, meta=True)
    with pytest.raises(UsageError, match="do not match its config.json") as raised:
        load_pretrained(model, source.pretrained_dir, torch.device("cpu"))
    message = str(raised.value)
    assert all(re.search(e, message) for e in expected), message
    assert raised.value.agreed
    assert all(p.device.type == "meta" for p in model.parameters())  # nothing allocated


def test_a_missing_tensor_is_named(tiny_checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    from moe_ep.runs import UsageError
    from models import build_model, resolve_model
    from pretrained import load_pretrained

    _, root = tiny_checkpoints
    folder = tmp_path / "missing"
    folder.mkdir()
    tensors = load_file(root / "fused" / "model.safetensors")
    del tensors["model.layers.2.post_attention_layernorm.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text((root / "fused" / "config.json").read_text())
    source = resolve_model(str(folder))
    with pytest.raises(UsageError, match=r"\(1 tensors\): model.layers.2.post_attention_layernorm.weight: missing"):
        load_pretrained(build_model(source, seed=0, meta=True), source.pretrained_dir, torch.device("cpu"))


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


def validate_with_world(argv, world_size, monkeypatch, tmp_path, local_world_size=None):
    from options import build_parser

    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world_size or world_size))
    monkeypatch.setenv("RANK", "0")
    args = build_parser().parse_args(
        ["--experts-implementation", "eager", "--output-dir", str(tmp_path / "out"), *argv])
    return args, train.validate(args)


def test_plan_chooses_a_layout_for_the_launched_processes(monkeypatch, tmp_path):
    args, (_, _, _, _, layout, plan, *_) = validate_with_world(
        ["--plan", "--gpu-memory-gib", "80", "--global-batch-tokens", "4096", "--seq-len", "256"], 2, monkeypatch,
        tmp_path)
    assert layout.world_size == 2 and plan.layout.dp_shard == layout.dp_shard and plan.layout.ep == layout.ep
    # The plan's micro-batching is the run's: without stages its micro-batches are accumulation steps.
    assert layout.microbatch_size == plan.layout.microbatch_size
    assert layout.microbatches == plan.layout.microbatches
    assert layout.global_batch * args.seq_len == 4096


def test_plan_may_choose_pipeline_stages_and_the_cut(monkeypatch, tmp_path):
    """One node of 4 with room to spare and 8 sequences per step: the planner prefers 4 pipeline
    stages of one layer each over sharding (its cost model); the example takes its schedule,
    micro-batches and cut, and the global batch stays the plan's."""
    args, (_, _, _, _, layout, plan, *_) = validate_with_world(
        ["--plan", "--gpu-memory-gib", "1", "--global-batch-tokens", "512", "--seq-len", "64"], 4, monkeypatch, tmp_path
    )
    assert (layout.pp, layout.dp, layout.schedule, layout.microbatches) == (4, 1, "1f1b", 8)
    assert layout.split_points == tuple(plan.best.split_points) == (1, 2, 3)
    assert layout.microbatch_size == plan.layout.microbatch_size == 1
    assert layout.global_batch * args.seq_len == 512


def test_plan_errors_say_what_is_missing(monkeypatch, tmp_path):
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="--plan on a machine without CUDA needs --gpu-memory-gib"):
            validate_with_world(["--plan"], 2, monkeypatch, tmp_path)
    with pytest.raises(UsageError, match="^--plan: "):
        validate_with_world(["--plan", "--gpu-memory-gib", "80", "--global-batch-tokens", "1000"], 2, monkeypatch,
                            tmp_path)
    with pytest.raises(UsageError, match="--global-batch-tokens is read by --plan only"):
        validate_with_world(["--global-batch-tokens", "4096"], 2, monkeypatch, tmp_path)


# ------------------------------------------------------------- accelerate configs and SLURM


@pytest.mark.parametrize("name, processes, machines, mixed_precision", [
    ("cpu.yaml", 2, 1, "no"), ("1x8gpu.yaml", 8, 1, "bf16"), ("2x8-a100-mixtral-8x7b.yaml", 16, 2, "bf16"),
])
def test_accelerate_configs_load_with_accelerates_own_loader(name, processes, machines, mixed_precision):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType

    config = load_config_from_file(str(EXAMPLE / "configs" / name))
    assert (config.num_processes, config.num_machines, config.mixed_precision) == (processes, machines, mixed_precision)
    # MULTI_GPU without use_cpu: the torchrun launcher, also on the CPU (see cpu.yaml).
    assert config.distributed_type == DistributedType.MULTI_GPU and not config.use_cpu


def sbatch_argv(tmp_path, *extra: str) -> list[str]:
    """What slurm.sbatch hands to `accelerate` on a node, run with stand-ins for srun, scontrol and
    accelerate (2 nodes; the node's SLURM_NODEID is 1)."""
    import subprocess

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stubs = {
        "scontrol": "echo node-a; echo node-b",
        "srun": 'while [[ $1 == --* ]]; do shift; done\nSLURM_NODEID=1 exec "$@"',
        "accelerate": 'printf "%s\\0" "$@" > "$ARGV_FILE"; printf "%s\\n" "$PET_SIGNALS_TO_HANDLE" > "$ARGV_FILE.signals"',
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("REPO", "CONFIG", "GPUS_PER_NODE", "MAIN_PORT")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", SLURM_SUBMIT_DIR=str(EXAMPLE.parents[1]),
               SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="node-[a-b]", ARGV_FILE=str(tmp_path / "argv"),
               OUTPUT_DIR=str(tmp_path / "run out"))
    subprocess.run(["bash", str(EXAMPLE / "slurm.sbatch"), *extra], env=env, check=True, timeout=60)
    return [a.decode() for a in (tmp_path / "argv").read_bytes().split(b"\0")[:-1]]


def test_slurm_script_forwards_extra_arguments_intact(tmp_path):
    extra = ["--data", "my corpus/it's \"quoted\" $HOME *.txt", "--steps", "7"]
    argv = sbatch_argv(tmp_path, *extra)
    assert argv[:3] == ["launch", "--machine_rank", "1"]
    flags = dict(zip(argv[3:13:2], argv[4:13:2]))
    assert flags == {"--config_file": str(EXAMPLE / "configs" / "2x8-a100-mixtral-8x7b.yaml"), "--num_machines": "2",
                     "--num_processes": "16", "--main_process_ip": "node-a", "--main_process_port": "29500"}
    assert argv[13] == str(EXAMPLE / "train.py")
    assert argv[-6:] == ["--output-dir", str(tmp_path / "run out"), *extra]
    # SLURM's --signal=USR1@300: the launcher forwards USR1 (instead of dying of it), the ranks act on it.
    assert argv[-8:-6] == ["--preempt-signal", "USR1"]
    assert (tmp_path / "argv.signals").read_text().split() == ["SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"]
    assert "#SBATCH --signal=USR1@300\n" in (EXAMPLE / "slurm.sbatch").read_text()


def shutil_usage(free: int):
    import shutil

    return shutil._ntuple_diskusage(total=free, used=0, free=free)


@pytest.mark.slow
def test_slurm_command_validates_on_the_2x8_a100_world(tmp_path, monkeypatch):
    """The training command of slurm.sbatch, checked by train.validate in the world that its
    accelerate config launches (2 nodes of 8): the planner's layout for Mixtral-8x7B is accepted
    for 16 processes, and nothing is written."""
    from accelerate.commands.config.config_args import load_config_from_file

    # No GPU here: the planner is told the A100's memory. A cluster's shared file system has room
    # for a 560 GB checkpoint; this machine's disk may not.
    monkeypatch.setattr(ownership.shutil, "disk_usage", lambda path: shutil_usage(1 << 50))
    argv = sbatch_argv(tmp_path, "--gpu-memory-gib", "80")
    config = load_config_from_file(argv[argv.index("--config_file") + 1])
    assert int(argv[argv.index("--num_processes") + 1]) == config.num_processes == 16
    train_argv = argv[argv.index(str(EXAMPLE / "train.py")) + 1:]
    args, checked = validate_with_world(train_argv, config.num_processes, monkeypatch, tmp_path,
                                        local_world_size=config.num_processes // config.num_machines)
    assert args.model == "mixtral-8x7b" and args.plan
    layout = checked.layout
    assert layout.world_size == 16 and layout.global_batch * args.seq_len == 4194304
    planned = checked.chosen_plan.layout
    assert (planned.pp, planned.dp_replicate, planned.dp_shard, planned.ep, planned.microbatches) == (
        layout.pp, layout.dp_replicate, layout.dp_shard, layout.ep, layout.microbatches)
    assert not (tmp_path / "run out").exists()


@pytest.mark.slow
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
    from moe_ep.runs import metrics
    from models import build_model, count_parameters, resolve_model

    model, _ = tiny_model_and_optimizer()
    load = metrics.ExpertLoad(model, num_layers=4, num_experts=8, device="cpu")
    ids = torch.randint(0, 256, (3, 17))
    with torch.no_grad():
        model(input_ids=ids)
    counts = load.collect()
    assert counts.shape == (4, 8) and counts.sum(1).tolist() == [3 * 17 * 2] * 4
    assert load.counts_LE.sum() == 0  # collect() starts a new interval
    # A layer that routes nothing (a dense one) has no balance, rather than a misleading 0.
    assert metrics.balance(torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0], [0.0] * 4])) == [1.0, 4.0, None]

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


@pytest.mark.parametrize("steps, warmup", [(1, 0), (5, 0), (10, 1), (200, 20), (5000, 20)])
def test_default_warmup_is_a_tenth_of_the_steps_at_most_20(steps, warmup):
    """A short trial run (--steps 5) needs no --warmup-steps; the documented default run keeps 20."""
    from options import build_parser, check_flag_values

    args = build_parser().parse_args(["--steps", str(steps)])
    check_flag_values(args)
    assert args.warmup_steps == warmup
    explicit = build_parser().parse_args(["--steps", str(steps), "--warmup-steps", "0"])
    check_flag_values(explicit)
    assert explicit.warmup_steps == 0


@pytest.mark.slow
def test_export_says_a_full_disk_in_one_line_and_runs_beside_a_process_group(tmp_path, monkeypatch):
    """safetensors reports a full disk as its own SafetensorError, not an OSError: export.py ended in
    a traceback. And its DCP load entered the process group's collectives where one existed (a
    script converting on rank 0), waiting for ranks that never joined: it reads with no_dist."""
    import torch.distributed as dist
    from safetensors import SafetensorError

    import export

    model, opt = tiny_model_and_optimizer()
    state = {"step": 1, "tokens_seen": 0, "world_size": 1, "data": {}}
    path = ckpt.save_checkpoint(tmp_path / "run" / "checkpoints", 1, model, opt, state, rank=0, barrier=lambda: None, keep=1,
                                config=model.config)

    def full(self, *args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    with monkeypatch.context() as patched:
        patched.setattr(type(model), "save_pretrained", full)
        with pytest.raises(RunError, match="No space left on device"):
            export.export_hf(path, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    # One rank of its own: the load must not call into it.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        calls = []
        monkeypatch.setattr(dist, "all_gather_object", lambda *a, **k: calls.append(a))
        monkeypatch.setattr(dist, "gather_object", lambda *a, **k: calls.append(a))
        monkeypatch.setattr(dist, "broadcast_object_list", lambda *a, **k: calls.append(a))
        assert export.export_hf(path, tmp_path / "hf") == (tmp_path / "hf").resolve() and not calls
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()
