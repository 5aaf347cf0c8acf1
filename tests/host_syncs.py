"""Host-sync audit: every read of a tensor value by the host, with the moe_ep frame that caused
it (``HostSyncRecorder``), for the dispatcher's tests."""

from __future__ import annotations

import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import moe_ep

# The package's own folder, as imported and with links resolved: a path substring such as
# "/moe_ep/" would also match this test file when the checkout sits in a folder named moe_ep.
PACKAGE_DIRS = tuple({Path(moe_ep.__file__).parent, Path(moe_ep.__file__).resolve().parent})


def moe_ep_site(frames) -> str:
    """The innermost frame inside the moe_ep package as "path/in/package.py:function"."""
    for frame in reversed(frames):
        path = Path(frame.filename)
        for package in PACKAGE_DIRS:
            if path.is_relative_to(package):
                return f"{path.relative_to(package).as_posix()}:{frame.name}"
    return "outside moe_ep"


class HostSyncRecorder(TorchDispatchMode):
    """Records host reads: ops that copy a value to the host (``.item()``, ``int()``, ``bool()``
    go through ``_local_scalar_dense``) or whose output size depends on values (``nonzero``,
    boolean-mask indexing and friends), plus ``Tensor.tolist``/``numpy``, which bypass the
    dispatcher. On the CPU a ``.cpu()`` copy is a no-op it cannot see: the CUDA audit below covers
    that."""

    SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "masked_scatter", "unique", "_unique2",
                "unique_consecutive", "equal", "is_nonzero", "bincount", "histc"}
    MASK_INDEX_OPS = {"index", "index_put", "index_put_", "_index_put_impl_"}

    def __init__(self):
        super().__init__()
        self.sites: list[str] = []
        self._patched = {}

    def _record(self, what: str) -> None:
        self.sites.append(f"{what} @ {moe_ep_site(traceback.extract_stack())}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in self.SYNC_OPS or (name == "repeat_interleave" and "output_size" not in (kwargs or {})):
            self._record(name)
        elif name in self.MASK_INDEX_OPS and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ())
        ):
            self._record(f"{name} with a bool mask")
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        for method in ("tolist", "numpy"):
            original = getattr(torch.Tensor, method)
            self._patched[method] = original

            def wrapper(tensor, *a, _original=original, _method=method, **k):
                self._record(_method)
                return _original(tensor, *a, **k)

            setattr(torch.Tensor, method, wrapper)
        return super().__enter__()

    def __exit__(self, *exc):
        for method, original in self._patched.items():
            setattr(torch.Tensor, method, original)
        return super().__exit__(*exc)


# The value checks of the public ops read values on the CPU only; on CUDA they are queued on the
# device (torch._assert_async), so they are no host sync where one matters.
CPU_ONLY_CHECKS = ("ops/validate.py:check_indices_in_range", "ops/validate.py:check_on_device")
