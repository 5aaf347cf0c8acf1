"""Lazy lookups of the transformers pieces a benchmark compares against (``grouped_mm`` experts,
its all-to-all expert parallelism), which some releases lack or move. A missing piece becomes a
"not available" row with the reason; any other import failure propagates. moe_ep's own modules are
imported directly: they always ship."""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Lookup:
    value: object | None
    reason: str | None  # why value is None

    @property
    def available(self) -> bool:
        return self.value is not None


def _missing_is_expected(missing: str, module: str) -> bool:
    # The module asked for or one of its parent packages; a module it imports that is missing is
    # a broken environment, which propagates.
    return module == missing or module.startswith(missing + ".")


def optional_import(module: str) -> Lookup:
    try:
        return Lookup(importlib.import_module(module), None)
    except ModuleNotFoundError as err:
        if err.name is None or not _missing_is_expected(err.name, module):
            raise
        return Lookup(None, f"not available ({err.name} not found)")


def optional_attr(module: str, *path: str) -> Lookup:
    """``module.path[0].path[1]...``, or why it is not there."""
    found = optional_import(module)
    if not found.available:
        return found
    value = found.value
    for i, name in enumerate(path):
        if not hasattr(value, name):
            return Lookup(None, f"not available ({'.'.join((module, *path[: i + 1]))} not defined)")
        value = getattr(value, name)
    return Lookup(value, None)
