"""``LiveBytes``: the bytes that tensors made by ATen ops hold at once, counted on the CPU where no
allocator keeps statistics. A storage is counted from the op that made it (one whose output shares
no storage with its inputs) until the last tensor seen on it is freed; moe_ep's custom ops are
entered, so their Python bodies count too."""

from __future__ import annotations

import itertools
import weakref

import torch
from torch._library.custom_ops import _maybe_get_opdef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# Triton's interpreter copies a kernel's arguments to the host and back through ``set_``: staging
# of the interpreter, not memory a GPU launch holds.
_INTERPRETER_COPIES = ("aten.set_.",)


class LiveBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self._storages: dict[int, list] = {}  # data_ptr -> [tensors seen, bytes, allocation id]
        self._events: list[tuple[int, int]] = []  # (allocation id, +bytes or -bytes), in order
        self._ids = itertools.count()

    def _release(self, ptr: int) -> None:
        entry = self._storages[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            del self._storages[ptr]
            self._events.append((entry[2], -entry[1]))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        opdef = _maybe_get_opdef(func) if func.namespace == "moe_ep" else None
        if opdef is not None:
            with self:
                return opdef._init_fn(*args, **kwargs)
        out = func(*args, **kwargs)
        if str(func).startswith(_INTERPRETER_COPIES):
            return out
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.untyped_storage().data_ptr() == 0:
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr in self._storages:
                self._storages[ptr][0] += 1
            elif ptr in inputs:
                continue  # a view of, or a write into, a tensor made before
            else:
                i = next(self._ids)
                self._storages[ptr] = [1, t.untyped_storage().nbytes(), i]
                self._events.append((i, t.untyped_storage().nbytes()))
            weakref.finalize(t, self._release, ptr)
        return out

    def peak(self, excluding=()) -> int:
        """The most bytes live at once, leaving out the storages of the tensors ``excluding`` (an
        op's outputs, say) that are still live."""
        skip = {self._storages[t.untyped_storage().data_ptr()][2] for t in excluding
                if t.untyped_storage().data_ptr() in self._storages}
        live = most = 0
        for i, nbytes in self._events:
            if i not in skip:
                live += nbytes
                most = max(most, live)
        return most
