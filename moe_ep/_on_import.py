"""``after_import(name, callback)``: run ``callback(module)`` once module ``name`` has been
imported: now if it already is, else right after whoever imports it first has executed it.

This is how ``import moe_ep`` registers with transformers without importing it: the registration
waits for transformers' own registry module, so importing moe_ep (or one of its kernels) stays
cheap and loads no Hugging Face code, yet every model transformers builds afterwards sees the
"moe_ep" entry. A meta-path finder that only wraps the loader the other finders return; it finds
nothing itself."""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable
from types import ModuleType

Callback = Callable[[ModuleType], None]


class _NotifyingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, finder: _AfterImportFinder):
        self.loader, self.finder = loader, finder

    def __getattr__(self, name):
        # get_source, get_filename, is_package, resource readers: the wrapped loader answers.
        if name in ("loader", "finder"):
            raise AttributeError(name)
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        for callback in self.finder.pending.pop(module.__name__, ()):
            callback(module)


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self):
        self.pending: dict[str, list[Callback]] = {}

    def find_spec(self, fullname, path, target=None):
        # The callbacks stay pending until a module is executed: importlib.util.find_spec also
        # asks the finders, for a spec that may never be loaded.
        if fullname not in self.pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is None:
                continue
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _NotifyingLoader(spec.loader, self)
            return spec
        return None


def _finder() -> _AfterImportFinder:
    # One finder per interpreter, also when moe_ep is reloaded: recognised by class name.
    for finder in sys.meta_path:
        if type(finder).__name__ == _AfterImportFinder.__name__:
            return finder
    finder = _AfterImportFinder()
    sys.meta_path.insert(0, finder)
    return finder


def after_import(name: str, callback: Callback) -> None:
    """Call ``callback(module)`` when ``name`` is imported, or now if it is already."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    _finder().pending.setdefault(name, []).append(callback)
