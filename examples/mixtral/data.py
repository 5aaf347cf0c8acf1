"""Training data: a corpus found on the machine or given by the user, tokenized once per node into a
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

from errors import UsageError

TEXT_SUFFIXES = (".txt", ".py", ".md", ".rst")
JSONL_SUFFIXES = (".jsonl",)


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255 plus BOS, EOS and PAD: nothing to download or train, every
    text is representable, and the ids are stable across machines."""

    name = "byte"
    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 258
    vocab_size = 259

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class PretrainedTokenizer:
    """A model's own tokenizer (``AutoTokenizer``) behind the interface of ``ByteTokenizer``."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(path)
        self.name = f"pretrained:{path}"
        self.vocab_size = len(self._tok)
        self.bos_token_id = self._tok.bos_token_id
        self.eos_token_id = self._tok.eos_token_id
        self.pad_token_id = self._tok.pad_token_id

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False), dtype=np.int64)

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids))


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
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES + JSONL_SUFFIXES)
            if not found:
                raise UsageError(
                    f"--data: directory {item} holds no {'/'.join(TEXT_SUFFIXES + JSONL_SUFFIXES)} files"
                )
            files.extend(found)
        elif path.suffix in TEXT_SUFFIXES + JSONL_SUFFIXES:
            files.append(path)
        else:
            raise UsageError(
                f"--data: {item} has suffix {path.suffix!r}; expected one of {TEXT_SUFFIXES + JSONL_SUFFIXES}"
            )
    for path in files:
        if path.suffix in JSONL_SUFFIXES:
            check_jsonl_head(path, text_field)
    return DataSpec(files=tuple(files), text_field=text_field)


def check_jsonl_head(path: Path, text_field: str) -> None:
    """Read the first record so a wrong ``--text-field`` or a non-JSON file fails before any work."""
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                parse_jsonl_line(path, lineno, line, text_field)
                return
    raise UsageError(f"--data: {path} is empty")


def parse_jsonl_line(path: Path, lineno: int, line: str, text_field: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise UsageError(f"--data: {path}:{lineno} is not valid JSON ({err.msg})") from None
    if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise UsageError(
            f"--data: {path}:{lineno} has no string field {text_field!r} (--text-field); it has {keys}"
        )
    return record[text_field]


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


def iter_documents(spec: DataSpec) -> Iterator[str]:
    if spec.hf_dataset:
        import datasets

        name, config, split = spec.hf_dataset
        for record in datasets.load_dataset(name, config, split=split, streaming=True):
            if not isinstance(record.get(spec.text_field), str):
                raise UsageError(f"--data hf:{name}: records have no string field {spec.text_field!r}; they have {sorted(record)}")
            yield record[spec.text_field]
        return
    for path in spec.files:
        if path.suffix in JSONL_SUFFIXES:
            with path.open(encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        yield parse_jsonl_line(path, lineno, line, spec.text_field)
        else:
            yield path.read_text(encoding="utf-8", errors="replace")


def corpus_key(spec: DataSpec, tokenizer, max_tokens: int | None) -> str:
    """Names the cache file: changes whenever a file, the tokenizer or the cap changes."""
    h = hashlib.sha256()
    h.update(f"{tokenizer.name}|{tokenizer.vocab_size}|{spec.text_field}|{max_tokens}|{spec.hf_dataset}".encode())
    for path in spec.files:
        st = path.stat()
        h.update(f"|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def tokenize_corpus(spec: DataSpec, tokenizer, max_tokens: int | None = None) -> np.ndarray:
    """All documents as one token stream, each framed by BOS ... EOS."""
    dtype = np.uint16 if tokenizer.vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32
    pieces, total = [], 0
    for text in iter_documents(spec):
        ids = tokenizer.encode(text)
        framed = np.empty(ids.size + 2, dtype=dtype)
        framed[0], framed[-1] = tokenizer.bos_token_id, tokenizer.eos_token_id
        framed[1:-1] = ids
        pieces.append(framed)
        total += framed.size
        if max_tokens is not None and total >= max_tokens:
            break
    if not pieces:
        raise UsageError(f"--data: no documents in {spec.describe()}")
    tokens = np.concatenate(pieces)
    return tokens[:max_tokens] if max_tokens is not None else tokens


def cached_tokens(spec: DataSpec, tokenizer, cache_dir: Path, *, is_local_main: bool, barrier, max_tokens=None) -> np.ndarray:
    """Tokenize once per node: the node's first process writes the cache (to a temporary name,
    then an atomic rename, so a killed writer leaves nothing that looks complete); the others wait
    at ``barrier`` and map the file read-only."""
    path = cache_dir / f"tokens-{corpus_key(spec, tokenizer, max_tokens)}.npy"
    if is_local_main and not path.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            np.save(f, tokenize_corpus(spec, tokenizer, max_tokens))
        os.replace(tmp, path)
    barrier()
    return np.load(path, mmap_mode="r")


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
            raise UsageError(
                f"the corpus packs into {num_sequences} sequence(s), fewer than one global batch of "
                f"{global_batch}; give more data, a shorter --seq-len or a smaller batch"
            )
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
