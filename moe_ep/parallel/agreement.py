"""Ranks agree or stop: a collective entry point (``parallelize``, ``TrainStep``) first confirms
that every rank was given the same arguments and the same model, and otherwise stops on every
rank with one message naming the first difference (the rank, the field, both values).

Without it a difference surfaces later and worse: ranks given different ``ep`` build different
sub-groups and wait for each other forever; ranks whose models have different expert counts
exchange buffers of different sizes and abort inside the backend; ranks given different
coefficients or learning rates train silently apart. And a rank that refuses its own arguments
would leave the others waiting in the first collective it never reaches, so the local checks run
inside the agreement and their outcome is part of what the ranks compare.

Cost: one all-gather of four 64-bit fingerprints per rank (the description that every rank
shares, the key of the ranks that must also agree on their local part, that local part, and the
outcome of the local checks) and one host read of the result, at setup. Only when the
fingerprints differ are the descriptions themselves gathered (``all_gather_object``) to name the
difference; that path ends in an error."""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

ABSENT = "(absent)"


class RanksDisagree(ValueError):
    """The ranks of a collective call were given different arguments or models, or some of them
    refused theirs: raised on every rank, naming the first difference."""


@dataclass(frozen=True)
class Description:
    """What one rank was given, as ``field -> value`` strings in a fixed order.

    ``shared``: what every rank must agree on. ``local``: what only the ranks with the same
    ``peers`` key must agree on (the parameters of a pipeline stage are the same on every rank
    holding that stage, and differ between stages)."""

    shared: Mapping[str, str]
    peers: str = ""
    local: Mapping[str, str] = field(default_factory=dict)


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def shown(value) -> str:
    """``value`` as a string that equal values give on every rank: floats exactly, tensors by
    their contents, containers element by element, and an object whose ``repr`` holds a memory
    address by its type."""
    if isinstance(value, torch.Tensor):
        return f"tensor({value.detach().cpu().tolist()!r}, dtype={value.dtype})"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(shown(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {shown(v)}" for k, v in value.items()) + "}"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    text = repr(value)
    return f"<{type(value).__qualname__}>" if _ADDRESS.search(text) else text


def parameter_fields(named_parameters, prefix: str = "") -> dict[str, str]:
    """``"parameter NAME" -> "shape dtype"`` for each parameter (a DTensor by its global shape)."""
    return {f"parameter {prefix}{name}": f"{tuple(p.shape)} {p.dtype}" for name, p in named_parameters}


def _fingerprint(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def _joined(fields: Mapping[str, str]) -> str:
    return "\n".join(f"{k}\0{v}" for k, v in fields.items())


def _collective_device(group) -> torch.device:
    backend = str(dist.get_backend(group))
    if "gloo" in backend or "cpu" in backend or backend == "mpi":
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def _first_difference(mine: Mapping[str, str], theirs: Mapping[str, str]) -> str | None:
    for key in [*mine, *(k for k in theirs if k not in mine)]:
        if mine.get(key, ABSENT) != theirs.get(key, ABSENT):
            return key
    return None


def _disagreement(descriptions: list[Description]) -> str | None:
    """The first difference: the lowest rank whose shared description differs from rank 0's,
    else the lowest whose local part differs from that of the lowest rank with its key."""
    reference = descriptions[0].shared
    for rank, description in enumerate(descriptions[1:], start=1):
        key = _first_difference(description.shared, reference)
        if key is not None:
            return (f"ranks disagree on {key}: rank {rank} has {description.shared.get(key, ABSENT)}, rank 0 has "
                    f"{reference.get(key, ABSENT)}")
    first_with = {}
    for rank, description in enumerate(descriptions):
        peer = first_with.setdefault(description.peers, rank)
        key = _first_difference(description.local, descriptions[peer].local)
        if key is not None:
            where = f" (the ranks holding {description.peers})" if description.peers else ""
            return (f"ranks disagree{where} on {key}: rank {rank} has {description.local.get(key, ABSENT)}, rank "
                    f"{peer} has {descriptions[peer].local.get(key, ABSENT)}")
    return None


def check_agreement(caller: str, description: Description, *, group: dist.ProcessGroup | None = None,
                    error: BaseException | None = None) -> None:
    """Confirm that every rank of ``group`` (None: the default group) holds the same
    ``description`` and the same outcome of its local checks (``error``: what they raised here,
    None if they passed); collective.

    Raises ``RanksDisagree`` on every rank when the descriptions differ (naming the first
    difference), or on the ranks whose checks passed when another rank's failed (naming it).
    Returns otherwise, a rank whose own checks failed included: it re-raises its own error."""
    if dist.get_backend(group) == "fake" or dist.get_world_size(group) == 1:
        return  # one process (torch's fake group plans for many without them): nothing to agree with
    outcome = "" if error is None else f"{type(error).__name__}: {error}"
    fingerprint = torch.tensor(
        [_fingerprint(_joined(description.shared)), _fingerprint(description.peers),
         _fingerprint(_joined(description.local)), _fingerprint(outcome)],
        dtype=torch.int64, device=_collective_device(group),
    )
    gathered = [torch.empty_like(fingerprint) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, fingerprint, group=group)
    # host sync: once per call, at setup (parallelize, TrainStep's construction).
    rows = torch.stack(gathered).tolist()
    peers_of = {}
    consistent = all(row[0] == rows[0][0] and row[3] == rows[0][3] for row in rows) and all(
        peers_of.setdefault(row[1], row[2]) == row[2] for row in rows)
    if consistent:
        return
    everyone = [None] * len(rows)
    dist.all_gather_object(everyone, (description, outcome), group=group)
    difference = _disagreement([d for d, _ in everyone])
    rank = dist.get_rank(group)
    if difference is not None:
        raise RanksDisagree(
            f"{caller}: {difference}. Every rank must pass the same arguments and the same model; stopped on "
            "every rank"
        ) from error
    if error is None:
        failed = next(r for r, (_, o) in enumerate(everyone) if o)
        raise RanksDisagree(f"{caller}: rank {failed} refused its arguments ({everyone[failed][1]}); stopped on "
                            f"every rank (rank {rank}'s were accepted)")


@contextmanager
def ranks_agree(caller: str, description: Description, *, group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Run the block (the caller's local checks, no collective inside), then ``check_agreement``
    with its outcome: a rank whose checks raise still meets the others, so that no rank waits for
    it, and every rank stops alike."""
    try:
        yield
    except Exception as error:
        try:
            check_agreement(caller, description, group=group, error=error)
        except RanksDisagree as disagreement:
            disagreement.on_every_rank = True
            raise
        # Every rank raises here, this error or a RanksDisagree naming it: said once, by rank 0.
        error.on_every_rank = True
        raise
    check_agreement(caller, description, group=group)
