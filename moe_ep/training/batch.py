"""The batch's contents, checked without a host sync of their own and refused alike on every rank.

A bad token id in one rank's batch would end in a raw indexing error there (on CUDA a device-side
assert that poisons the process) while the other ranks wait in the step's next collective and
fail later with a gloo or NCCL error that names nothing. So ``screened`` looks at the batch on its
device: what it finds becomes per-rank flags, and the offending entries are replaced by harmless
ones (token 0, the ignore index) so that the step's forward, backward and collectives run on every
rank as usual. ``TrainStep`` sums the flags over the ranks inside the collectives the step makes
anyway and reads them back with the loss and the gradient norm (the step's one host sync); a rank
that sees a flag raises ``refusal``'s message, the same on every rank, and applies nothing.

Accepted: token ids (``input_ids``) in int64 or int32 (the index dtypes of ``torch.nn.Embedding``
and what tokenizers and transformers produce) within ``[0, vocab_size)``; ``labels`` in the same
dtypes and range, or transformers' ignore index -100. Floats, bools and the other integer dtypes
are refused rather than cast: a float id is a batch built wrong, and casting would hide it."""

from __future__ import annotations

import torch

from .loss import IGNORE_INDEX

TOKEN_DTYPES = (torch.int64, torch.int32)
# The flags' order: per rank, 1.0 where the batch has that problem. "batch form": the batch is not
# one the step can run at all (its type, keys or shape); that rank runs ``stand_in`` instead.
PROBLEMS = ("input_ids dtype", "input_ids range", "labels dtype", "labels range", "batch form")


def screened(ids: torch.Tensor, labels: torch.Tensor | None, vocab_size: int):
    """``(ids, labels, flags)``: the batch with every bad entry replaced (an id by 0, a label by
    the ignore index, a tensor of another dtype by those entirely; labels then in int64, which
    cross-entropy takes), and ``flags`` (float32, ``PROBLEMS``' order) saying what was replaced.
    ``labels`` None: they are ``ids`` (a batch without labels), checked as ids only. No host
    sync."""
    flags = torch.zeros(len(PROBLEMS), device=ids.device)
    if ids.dtype in TOKEN_DTYPES:
        bad = (ids < 0) | (ids >= vocab_size)
        flags[1] = bad.any()
        ids = torch.where(bad, 0, ids)
    else:
        flags[0].fill_(1.0)  # not flags[0] = 1.0: on CUDA that copies a host scalar (a sync)
        ids = torch.zeros(ids.shape, dtype=torch.int64, device=ids.device)
    if labels is None:
        return ids, ids.to(torch.int64), flags
    if labels.dtype in TOKEN_DTYPES:
        bad = ((labels < 0) & (labels != IGNORE_INDEX)) | (labels >= vocab_size)
        flags[3] = bad.any()
        labels = torch.where(bad, IGNORE_INDEX, labels).to(torch.int64)
    else:
        flags[2].fill_(1.0)
        labels = torch.full(labels.shape, IGNORE_INDEX, dtype=torch.int64, device=labels.device)
    return ids, labels, flags


def stand_in(shape: tuple[int, int], device: torch.device, vocab_size: int):
    """``screened``'s triple for a rank whose batch could not run at all: token 0 everywhere,
    every label ignored, of ``shape`` (one the other ranks' collectives can meet), flagged as a
    "batch form" problem."""
    ids = torch.zeros(shape, dtype=torch.int64, device=device)
    ids, labels, flags = screened(ids, torch.full_like(ids, IGNORE_INDEX), vocab_size)
    flags[PROBLEMS.index("batch form")].fill_(1.0)
    return ids, labels, flags


def refusal(ranks_with: list[float], vocab_size: int) -> str | None:
    """The message for the flags summed over the ranks (``PROBLEMS``' order), None when there is
    nothing to refuse; built from those sums only, so every rank raises the same one."""
    found = dict(zip(PROBLEMS, ranks_with))
    where = {name: f"on {int(n)} rank{'s' if n != 1 else ''}" for name, n in found.items()}
    problems = []
    if found["input_ids dtype"]:
        problems.append(f"input_ids are not int64 or int32 {where['input_ids dtype']} (token ids are integers, in one "
                        "of the two dtypes torch.nn.Embedding takes)")
    if found["input_ids range"]:
        problems.append(f"input_ids hold ids outside [0, {vocab_size}) (config.vocab_size) {where['input_ids range']} "
                        f"(pad input_ids with a token id; {IGNORE_INDEX} belongs in labels)")
    if found["labels dtype"]:
        problems.append(f"labels are not int64 or int32 {where['labels dtype']} (labels are token ids or "
                        f"{IGNORE_INDEX}; int32 ones are cast to int64 for cross-entropy)")
    if found["labels range"]:
        problems.append(f"labels hold values outside [0, {vocab_size}) (config.vocab_size) other than the ignore index "
                        f"{IGNORE_INDEX} {where['labels range']}")
    if found["batch form"]:
        problems.append(f"the batch is not one the step can run (its type, keys or shape) {where['batch form']}, "
                        "whose own error names what is wrong")
    if not problems:
        return None
    return "TrainStep refused the batch on every rank, nothing was applied: " + "; ".join(problems)
