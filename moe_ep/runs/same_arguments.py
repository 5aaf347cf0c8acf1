"""The ranks of a job agree on the run's arguments before any work.

Every rank of a launched job parses its own command line and looks at the file system on its own
node. Ranks given another seed, step count or checkpoint cadence would train apart or stop at
different steps; ranks with another output folder (a relative path from another working folder),
another ``--overwrite`` or ``--resume``, another view of the checkpoints or of the data would write
or read different things and meet in collectives that do not match. So once the process group
exists, and before anything is written, the ranks compare what must be equal with the layout's
machinery (``moe_ep.parallel.agreement``: one all-gather of fingerprints, the values themselves
only when they differ), and a difference stops every rank with one line naming the argument, the
rank and both values."""

from __future__ import annotations

from collections.abc import Mapping

import torch.distributed as dist

from ..parallel.agreement import Description, RanksDisagree, check_agreement, shown
from .errors import UsageError


def agree_on_arguments(script: str, arguments: Mapping[str, object], *, group=None) -> None:
    """Confirm that every rank of ``group`` (None: the default group) holds the same
    ``arguments`` (name -> value, compared as ``shown`` strings); collective. Raises an agreed
    ``UsageError`` on every rank naming the first difference; returns at once without a process
    group."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        check_agreement(script, Description({name: shown(value) for name, value in arguments.items()}), group=group)
    except RanksDisagree as err:
        message = str(err).replace("Every rank must pass the same arguments and the same model",
                                   "Every rank must be launched with the same command and see the same files")
        raise UsageError(message, agreed=True) from None
