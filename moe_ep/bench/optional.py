"""Lazy imports of components that may not exist yet in a checkout (Triton kernels, the Hugging
Face registration, the dispatcher) or in an older transformers. A missing component is reported as
"not available" with the reason; any other import failure is a bug and propagates."""

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
    # The module asked for, one of its parent packages, or a part of moe_ep that has not landed
    # (a kernel module importing a sibling launcher still being written). A third-party package
    # missing from the environment is not expected: it propagates.
    return module == missing or module.startswith(missing + ".") or missing.split(".")[0] == "moe_ep"


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
