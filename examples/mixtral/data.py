"""Training data: a corpus found on the machine or given by the user, tokenized once (by rank 0) into a
cache file, packed into fixed-length sequences and dealt out to data-parallel ranks by a schedule
that is a pure function of the step, so a resumed run reads exactly the batches it would have read.

Sources (``--data``):
  ``stdlib``                   the Python standard library's ``.py`` sources (works offline anywhere)
  ``PATH [PATH ...]``          ``.txt``/``.py``/``.md`` files (one document each) or ``.jsonl`` files
                               (one document per line, text in ``--text-field``); a directory stands
                               for the supported files under it
  ``hf:NAME[:CONFIG[:SPLIT]]`` a Hugging Face dataset, only when online and the ``datasets`` package
                               is installed
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from moe_ep.runs import (RunError, UsageError, digest, local_problems, make_managed_dir, marker_kind, related,
                         unique_tmp, write_failure, write_manifest)

TEXT_SUFFIXES = (".txt", ".py", ".md", ".rst")
JSONL_SUFFIXES = (".jsonl",)


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255 plus BOS and EOS: nothing to download or train, every text is
    representable, and the ids are stable across machines."""

    name = "byte"
    bos_token_id = 256
    eos_token_id = 257
    # Id 258 is reserved for padding, which packed sequences never use; it stays in the vocabulary
    # so that the tiny config (vocab_size 259), its checkpoints and its exports keep their shapes.
    vocab_size = 259

    def encode(self, text: str) -> np.ndarray:
        # Strict: documents are checked to be valid Unicode before start-up (check_encodable).
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)


class PretrainedTokenizer:
    """A model's own tokenizer (``AutoTokenizer``) behind the interface of ``ByteTokenizer``."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(path)
        # Named by what its files hold, not by the path as typed: the same tokenizer by another
        # path continues a run, another one in the same folder does not (data identity, cache key).
        self.name = f"pretrained:{tokenizer_fingerprint(Path(path))}"
        self.vocab_size = len(self._tok)
        # Families without a BOS token (Qwen) separate documents by EOS alone.
        self.bos_token_id = self._tok.bos_token_id
        self.eos_token_id = self._tok.eos_token_id
        if self.eos_token_id is None:
            raise UsageError(f"--tokenizer: the tokenizer of {path} has no EOS token, which ends every document of "
                             "the packed stream; use --tokenizer byte")

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False), dtype=np.int64)


# The files of a tokenizer folder that decide how text becomes ids.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt")


def tokenizer_fingerprint(folder: Path) -> str:
    """The first 16 hex digits of a SHA-256 over the tokenizer files of ``folder`` (names and
    contents)."""
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            h.update(f"{name}|{(folder / name).stat().st_size}|".encode())
            h.update((folder / name).read_bytes())
    return h.hexdigest()[:16]


def stdlib_sources() -> list[Path]:
    """The standard library's own ``.py`` files: installed packages and the regression-test suite
    (odd encodings, generated data) are left out, so the corpus is the same on every CPython of
    one version."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "__pycache__"}
    files = [p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts)]
    if not files:
        raise UsageError(f"--data stdlib: found no .py sources under {root}")
    return sorted(files)


@dataclass(frozen=True)
class DataSpec:
    """What to read: local files, or a Hugging Face dataset id."""

    files: tuple[Path, ...] = ()
    hf_dataset: tuple[str, str | None, str] | None = None
    text_field: str = "text"

    def describe(self) -> str:
        if self.hf_dataset:
            return "hf:" + ":".join(p for p in self.hf_dataset if p)
        return f"{len(self.files)} file(s), {sum(f.stat().st_size for f in self.files) / 1e6:.1f} MB"


def resolve_data(data: list[str], text_field: str) -> DataSpec:
    """Turn ``--data`` into a ``DataSpec``; every missing or unsupported path is an error now,
    before any process group or model exists."""
    if data == ["stdlib"]:
        return DataSpec(files=tuple(stdlib_sources()), text_field=text_field)
    if len(data) == 1 and data[0].startswith("hf:"):
        return DataSpec(hf_dataset=parse_hf_dataset(data[0]), text_field=text_field)
    files: list[Path] = []
    for item in data:
        if item == "stdlib" or item.startswith("hf:"):
            raise UsageError(f"--data: {item!r} cannot be combined with other sources, got {data}")
        path = Path(item).expanduser()
        if not path.exists():
            raise UsageError(f"--data: {item} does not exist")
        if path.is_dir():
            found = folder_documents(path)
            if not found:
                raise UsageError(
                    f"--data: directory {item} holds no {'/'.join(TEXT_SUFFIXES + JSONL_SUFFIXES)} files"
                )
            files.extend(found)
        elif path.suffix.lower() in TEXT_SUFFIXES + JSONL_SUFFIXES:
            if not path.is_file():  # a FIFO or a device would be read forever
                raise UsageError(f"--data: {item} is not a regular file")
            files.append(path)
        else:
            raise UsageError(
                f"--data: {item} has suffix {path.suffix!r}; expected one of {TEXT_SUFFIXES + JSONL_SUFFIXES}"
            )
    # A file named twice (overlapping --data items, a link beside its target) is read once.
    unique = {}
    for path in files:
        unique.setdefault(path.resolve(), path)
    return DataSpec(files=tuple(unique.values()), text_field=text_field)


def folder_documents(folder: Path) -> list[Path]:
    """The supported files under ``folder`` (suffixes in any case), in a fixed order, linked
    subfolders followed once; hidden files and folders (``.git``, ``.ipynb_checkpoints``, macOS's
    ``._`` files) are not documents."""
    found, visited = [], set()
    for root, dirs, names in os.walk(folder, followlinks=True):
        real = Path(root).resolve()
        if real in visited:  # a link back up the tree, or to a folder walked already
            dirs[:] = []
            continue
        visited.add(real)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in names:
            path = Path(root) / name
            if (not name.startswith(".") and path.suffix.lower() in TEXT_SUFFIXES + JSONL_SUFFIXES
                    and path.is_file()):
                found.append(path)
    return sorted(found)


def check_output_outside_data(data: list[str], output_dir: Path) -> None:
    """The run folder neither is nor lies inside a ``--data`` folder: its own files
    (``metrics.jsonl``) would be read as data when the same command starts again."""
    for item in data:
        folder = Path(item).expanduser()
        if folder.is_dir() and (relation := related(output_dir, folder)) in ("is", "is inside"):
            raise UsageError(f"--output-dir: {output_dir} {relation} the --data folder {item}, whose files are all "
                             "read as data (the run's metrics.jsonl too, once written): choose an --output-dir "
                             "outside it")


def parse_jsonl_line(path: Path, lineno: int, offset: int, raw: bytes, text_field: str) -> str:
    """The text of one ``.jsonl`` line (``raw``, starting at byte ``offset`` of the file)."""
    line = decode_utf8(raw, f"{path}:{lineno}", offset)
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise UsageError(f"--data: {path}:{lineno} is not valid JSON ({err.msg})") from None
    except (ValueError, RecursionError) as err:  # valid JSON Python's parser will not take
        raise UsageError(f"--data: {path}:{lineno} is JSON this reader cannot take ({type(err).__name__}: "
                         f"{str(err).splitlines()[0] if str(err) else 'nested too deeply'})") from None
    if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
        if not isinstance(record, dict):
            found = f"the line is a JSON {type(record).__name__}, not an object"
        elif text_field in record:
            found = f"its {text_field!r} is a JSON {type(record[text_field]).__name__}"
        else:
            found = f"it has the fields {sorted(record)}"
        raise UsageError(f"--data: {path}:{lineno} has no string field {text_field!r} (--text-field): {found}")
    check_encodable(record[text_field], f"{path}:{lineno}, field {text_field!r}")
    return record[text_field]


def decode_utf8(raw: bytes, where: str, offset: int) -> str:
    """Strict UTF-8: a corpus in another encoding would otherwise train on replacement characters."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UsageError(
            f"--data: {where} is not UTF-8: byte offset {offset + err.start} of the file "
            f"({err.reason}, byte 0x{raw[err.start]:02x}); convert the file to UTF-8"
        ) from None


def check_encodable(text: str, where: str) -> None:
    """JSON escapes (``"\\ud800"``) can smuggle lone surrogates into a string: no tokenizer can
    encode them, and a byte tokenizer would otherwise have to replace them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise UsageError(
            f"--data: {where} holds a lone surrogate (\\u{ord(text[err.start]):04x} at character {err.start}), "
            "which is not Unicode text"
        ) from None


def parse_hf_dataset(spec: str) -> tuple[str, str | None, str]:
    parts = spec[len("hf:"):].split(":")
    if not parts[0] or len(parts) > 3:
        raise UsageError(f"--data: expected hf:NAME[:CONFIG[:SPLIT]], got {spec!r}")
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0") or os.environ.get("HF_DATASETS_OFFLINE", "0") not in ("", "0"):
        raise UsageError(f"--data {spec}: Hugging Face datasets need the network, but HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set")
    if importlib.util.find_spec("datasets") is None:
        raise UsageError(f"--data {spec}: needs the `datasets` package (pip install datasets)")
    name = parts[0]
    config = parts[1] if len(parts) > 1 and parts[1] else None
    split = parts[2] if len(parts) > 2 and parts[2] else "train"
    return name, config, split


def hf_text(record: dict, spec: DataSpec) -> str:
    if not isinstance(record.get(spec.text_field), str):
        raise UsageError(f"--data {spec.describe()}: records have no string field {spec.text_field!r} (--text-field); "
                         f"they have {sorted(record)}")
    return record[spec.text_field]


def iter_documents(spec: DataSpec) -> Iterator[str]:
    if spec.hf_dataset:
        import datasets

        name, config, split = spec.hf_dataset
        for record in datasets.load_dataset(name, config, split=split, streaming=True):
            text = hf_text(record, spec)
            check_encodable(text, f"{spec.describe()} record")
            yield text
        return
    for path in spec.files:
        try:
            yield from file_documents(path, spec.text_field)
        except OSError as err:  # removed since the run started, or unreadable
            raise UsageError(f"--data: {path} cannot be read ({err.strerror or err})") from None


def file_documents(path: Path, text_field: str) -> Iterator[str]:
    if path.suffix.lower() in JSONL_SUFFIXES:
        # Binary lines, so that an encoding error can name its byte offset in the file.
        with path.open("rb") as f:
            offset = 0
            for lineno, raw in enumerate(f, 1):
                if raw.strip():
                    yield parse_jsonl_line(path, lineno, offset, raw, text_field)
                offset += len(raw)
    else:
        # The file's text exactly as stored (no newline translation): what a byte tokenizer reads
        # is the file's bytes.
        yield decode_utf8(path.read_bytes(), str(path), 0)


# Part of the cache key: bump it whenever the way documents become tokens changes (2: text files read
# as stored, CRLF kept, strict UTF-8), so that an older cache is never taken for the new stream.
TOKENIZATION_VERSION = 2


def corpus_key(spec: DataSpec, tokenizer, max_tokens: int | None) -> str:
    """Names the cache file: changes whenever a file, the tokenizer, the cap or the way documents
    are read changes."""
    h = hashlib.sha256()
    h.update(f"v{TOKENIZATION_VERSION}|{tokenizer.name}|{tokenizer.vocab_size}|{spec.text_field}|{max_tokens}|"
             f"{spec.hf_dataset}".encode())
    for path in spec.files:
        st = path.stat()
        # ctime and the inode too: a rewrite that restores the size and mtime (cp -p, rsync -a,
        # tar x, os.utime) still changes them.
        h.update(f"|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{st.st_ino}".encode())
    return h.hexdigest()[:16]


def token_cache_file(spec: DataSpec, tokenizer, cache_dir: Path, max_tokens: int | None) -> Path:
    return cache_dir / f"tokens-{corpus_key(spec, tokenizer, max_tokens)}.npy"


def token_cache_bytes(spec: DataSpec, tokenizer, max_tokens: int | None) -> int | None:
    """At most what the token cache of local files takes: a token per byte of text at most (the
    byte tokenizer's count; a pretrained tokenizer's tokens each cover a byte or more) and two per
    file for its framing, cut at ``max_tokens``. None for a Hugging Face dataset (streamed: its
    size is known only once read)."""
    if spec.hf_dataset:
        return None
    tokens = sum(path.stat().st_size + 2 for path in spec.files)
    if max_tokens is not None:
        tokens = min(tokens, max_tokens)
    return tokens * np.dtype(token_dtype(tokenizer)).itemsize + 128  # .npy header


def cache_manifest(path: Path) -> str:
    """The name of the manifest of the token cache file ``path`` (beside it)."""
    return path.name.removesuffix(".npy") + ".manifest.json"


def token_cache_problems(path: Path) -> list[str]:
    """What is wrong with an existing token cache file: its manifest (written after it), its size
    and its checksum (empty: intact)."""
    return local_problems(path.parent, manifest=cache_manifest(path), must_list=[path.name])


def remove_interrupted_writes(cache_dir: Path) -> list[Path]:
    """The temporary files of token caches and their manifests whose writer was killed (cached_tokens,
    each under a name of its own), in a token
    cache folder that is the run's; for the job's rank 0 while it holds the folder and before its
    peers can write (they wait for it to agree on the arguments). Returns what it removed."""
    if marker_kind(cache_dir) != "token_cache":
        return []
    removed = [p for pattern in (".tokens-*.npy.*.tmp", ".tokens-*.manifest.json.*.tmp") for p in cache_dir.glob(pattern)
               if p.is_file() and not p.is_symlink()]
    for path in removed:
        path.unlink()
    return removed


def cached_tokens(spec: DataSpec, tokenizer, path: Path, *, is_writer: bool, barrier, intact: bool,
                  max_tokens: int | None = None) -> np.ndarray:
    """Tokenize once into ``path`` (``token_cache_file``) unless an ``intact`` cache is there
    (checked before start-up, token_cache_problems): one process of the job (``is_writer``: global
    rank 0; the run folder is shared by every node, as its checkpoints need) writes it to a
    temporary name, renames it (atomic) and writes its manifest last, so a killed writer leaves
    nothing that passes the check; the others wait at ``barrier`` and map the file read-only. One
    writer per node raced in the shared folder: a peer's rename took the manifest's temporary from
    under another (two simulated nodes failed 16 launches of 24)."""
    if is_writer and not intact:
        tokens = tokenize_corpus(spec, tokenizer, max_tokens)
        folder = make_managed_dir(path.parent, "token_cache")
        tmp = unique_tmp(folder, f".{path.name}.")
        try:
            with open(tmp, "wb") as f:
                np.save(f, tokens)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            write_manifest(folder, {path.name: digest(path)}, manifest=cache_manifest(path))
        except OSError as err:
            raise RunError(write_failure(path, err)) from None
    barrier()
    return np.load(path, mmap_mode="r")


def framed_documents(spec: DataSpec, tokenizer, dtype) -> Iterator[np.ndarray]:
    """Each document's tokens framed by BOS ... EOS (EOS alone without a BOS token)."""
    bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    for text in iter_documents(spec):
        ids = tokenizer.encode(text)
        framed = np.empty(len(bos) + ids.size + 1, dtype=dtype)
        framed[:len(bos)], framed[-1] = bos, tokenizer.eos_token_id
        framed[len(bos):-1] = ids
        yield framed


def token_dtype(tokenizer) -> type:
    return np.uint16 if tokenizer.vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32


def tokenize_corpus(spec: DataSpec, tokenizer, max_tokens: int | None = None) -> np.ndarray:
    """All documents as one token stream, cut at ``max_tokens``."""
    pieces, total = [], 0
    for framed in framed_documents(spec, tokenizer, token_dtype(tokenizer)):
        pieces.append(framed)
        total += framed.size
        if max_tokens is not None and total >= max_tokens:
            break
    if not pieces:
        raise UsageError(f"--data: no documents in {spec.describe()}")
    tokens = np.concatenate(pieces)
    return tokens[:max_tokens] if max_tokens is not None else tokens


# A resumed run must read the data of the run it continues: the stream's length, the sum of its
# first CHECKSUM_TOKENS tokens (what checkpoints recorded before the hash) and the SHA-256 of the
# whole stream (its order, and every token past the first million) are part of every checkpoint.
CHECKSUM_TOKENS = 1 << 20
HASH_CHUNK_TOKENS = 1 << 24


class StreamHash:
    """The SHA-256 of a token stream fed in pieces, as little-endian tokens of the cache's dtype."""

    def __init__(self, dtype):
        self._dtype = np.dtype(dtype).newbyteorder("<")
        self._sha = hashlib.sha256()

    def update(self, tokens: np.ndarray) -> None:
        for start in range(0, tokens.size, HASH_CHUNK_TOKENS):
            self._sha.update(np.ascontiguousarray(tokens[start:start + HASH_CHUNK_TOKENS], dtype=self._dtype).data)

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


def corpus_stats(tokens: np.ndarray) -> dict:
    stream = StreamHash(tokens.dtype)
    stream.update(tokens)
    return {"corpus_tokens": int(tokens.size), "token_sum": int(tokens[:CHECKSUM_TOKENS].sum(dtype="int64")),
            "token_sha256": stream.hexdigest()}


def survey_corpus(spec: DataSpec, tokenizer, cache_file: Path | None, max_tokens: int | None) -> dict[str, int] | None:
    """The checks of the data that need its contents, run by every rank before start-up (nothing
    is written): every document of local files is read (strict UTF-8, every ``.jsonl`` line, the
    lines beyond ``--max-corpus-tokens`` too) and the first record of a Hugging Face dataset.
    Returns ``corpus_stats`` of the token stream the run will train on where that is known without
    tokenizing: from the token cache, which an earlier run wrote from these very files (so they
    are not read again), or counted for the byte tokenizer, whose tokens are the text's bytes.
    None for a pretrained tokenizer without a cache, and for Hugging Face datasets (streamed).
    ``cache_file``: an intact token cache of these files, or None."""
    if cache_file is not None:
        return corpus_stats(np.load(cache_file, mmap_mode="r"))
    if spec.hf_dataset:
        import datasets

        name, config, split = spec.hf_dataset
        first = next(iter(datasets.load_dataset(name, config, split=split, streaming=True)), None)
        if first is None:
            raise UsageError(f"--data {spec.describe()}: the split {split!r} holds no records")
        hf_text(first, spec)
        return None
    if not isinstance(tokenizer, ByteTokenizer):
        if not sum(1 for _ in iter_documents(spec)):
            raise UsageError(f"--data: no documents in {spec.describe()}")
        return None
    head_len = CHECKSUM_TOKENS if max_tokens is None else min(CHECKSUM_TOKENS, max_tokens)
    total, head_sum, stream = 0, 0, StreamHash(token_dtype(tokenizer))
    for framed in framed_documents(spec, tokenizer, token_dtype(tokenizer)):
        head_sum += int(framed[: max(0, head_len - total)].sum(dtype="int64"))
        stream.update(framed if max_tokens is None else framed[: max(0, max_tokens - total)])
        total += framed.size
    if not total:
        raise UsageError(f"--data: no documents in {spec.describe()}")
    return {"corpus_tokens": total if max_tokens is None else min(total, max_tokens), "token_sum": head_sum,
            "token_sha256": stream.hexdigest()}


def check_corpus_size(corpus_tokens: int, seq_len: int, global_batch: int) -> None:
    sequences = corpus_tokens // seq_len
    if sequences < global_batch:
        raise UsageError(
            f"--data: the corpus's {corpus_tokens:,} tokens pack into {sequences} sequence(s) of --seq-len {seq_len}, "
            f"fewer than one global batch of {global_batch}; give more data, a shorter --seq-len or a smaller batch"
        )


class PackedSequences:
    """Fixed-length windows over the token stream; the remainder shorter than one window is dropped."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens = tokens
        self.seq_len = seq_len
        self.num_sequences = tokens.size // seq_len

    def __getitem__(self, i: int) -> np.ndarray:
        return np.asarray(self.tokens[i * self.seq_len:(i + 1) * self.seq_len], dtype=np.int64)


class BatchSchedule:
    """Which sequences each data-parallel rank trains on at each step.

    The global stream is epoch-wise shuffled with a seeded permutation; step ``s`` consumes global
    positions ``[s*G, (s+1)*G)`` and rank ``r`` takes the ``r``-th contiguous block of
    ``G / dp_size`` of them. Everything is a function of (seed, step), so resuming needs nothing but
    the step, and changing the number of ranks at equal global batch keeps the global batch."""

    def __init__(self, num_sequences: int, global_batch: int, dp_rank: int, dp_size: int, seed: int):
        if global_batch % dp_size:
            raise ValueError(f"global_batch={global_batch} must be divisible by dp_size={dp_size}")
        if num_sequences < global_batch:
            raise ValueError(f"num_sequences={num_sequences} must be >= global_batch={global_batch} "
                             "(train.py checks it first: check_corpus_size)")
        self.num_sequences = num_sequences
        self.global_batch = global_batch
        self.local_batch = global_batch // dp_size
        self.dp_rank = dp_rank
        self.seed = seed
        self._perm_epoch, self._perm = -1, None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm, self._perm_epoch = torch.randperm(self.num_sequences, generator=g), epoch
        return self._perm

    def indices(self, step: int) -> list[int]:
        start = step * self.global_batch + self.dp_rank * self.local_batch
        out = []
        for pos in range(start, start + self.local_batch):
            epoch, offset = divmod(pos, self.num_sequences)
            out.append(int(self._permutation(epoch)[offset]))
        return out

    def epoch(self, step: int) -> float:
        return step * self.global_batch / self.num_sequences


def local_batch(packed: PackedSequences, schedule: BatchSchedule, step: int) -> torch.Tensor:
    """``[local_batch, seq_len]`` int64 token ids of this rank at ``step``."""
    return torch.from_numpy(np.stack([packed[i] for i in schedule.indices(step)]))
