"""Argument checks shared by the public ops: fail at the boundary with a message that names the
argument, the value received and what was expected, never deep inside a kernel."""

from __future__ import annotations

import math

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_tensor(name: str, value, *, ndim: int | None = None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {value.layout}")
    if ndim is not None and value.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(value.shape)}")
    return value


def check_number(name: str, value, *, at_least: float | None = None, above: float | None = None,
                 or_none: bool = False) -> None:
    """A finite real number (an int or a float, not a bool) with ``value >= at_least`` and
    ``value > above`` where given: NaN and infinities are refused, since every comparison with
    NaN is false and an infinite weight or rate turns a whole step into NaN. (Finite as a
    comparison, not ``math.isfinite``: torch.compile traces it on the symbolic float a float
    argument becomes under ``dynamic=True``, and an int too large for a float passes.)"""
    if value is None and or_none:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) < math.inf
    ok = ok and (at_least is None or value >= at_least) and (above is None or value > above)
    if not ok:
        bound = "".join(f" {op} {b}" for op, b in ((">=", at_least), (">", above)) if b is not None)
        raise ValueError(f"{name} must be a finite number{bound}{' or None' if or_none else ''}, got {value!r}")


def check_count(name: str, value, *, at_least: int = 0, or_none: bool = False) -> None:
    """An int (not a bool) ``>= at_least``."""
    if value is None and or_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < at_least:
        raise ValueError(f"{name} must be an int >= {at_least}{' or None' if or_none else ''}, got {value!r}")


def check_float(name: str, value: torch.Tensor) -> None:
    if value.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be float32, float16 or bfloat16, got {value.dtype}"
        )


def check_index(name: str, value: torch.Tensor) -> None:
    if value.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must be int64 or int32, got {value.dtype}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"all tensors must be on one device, got {listing}")


def has_values(t: torch.Tensor) -> bool:
    """Meta and fake tensors carry shapes, no values: their value checks are skipped (the real
    run makes them), so that shape propagation (meta initialisation, ``FakeTensorMode``) works."""
    from torch._subclasses.fake_tensor import FakeTensor

    return t.device.type != "meta" and not isinstance(t, FakeTensor)


def _queued_on_device(t: torch.Tensor) -> bool:
    """Checks of tensor values are queued on the device (``torch._assert_async``) where reading
    them back would be a host sync per layer (CUDA) or a graph break (torch.compile): a failure
    then stops the program at the next synchronisation, never silently."""
    return t.device.type == "cuda" or torch.compiler.is_compiling()


def check_on_device(condition: torch.Tensor, message: str) -> None:
    """Raise ValueError(message) unless the 0-d bool ``condition`` holds; queued on the device
    where that avoids a host sync."""
    if _queued_on_device(condition):
        torch._assert_async(condition, message)
    elif not bool(condition):
        raise ValueError(message)


def check_indices_in_range(name: str, idx: torch.Tensor, num_experts: int) -> None:
    """Expert ids must lie in [0, num_experts); on the CPU the error names the values found."""
    if idx.numel() == 0 or not has_values(idx):
        return
    message = f"{name} must hold expert ids in [0, {num_experts})"
    if _queued_on_device(idx):
        torch._assert_async(((idx >= 0) & (idx < num_experts)).all(), message)
        return
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= num_experts:
        raise ValueError(f"{message}, got values in [{lo}, {hi}]")


def check_targets_in_range(name: str, target: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Label ids must lie in [0, vocab) or be ``ignore_index``; on the CPU the error names the
    first value out of range, on CUDA the check is queued on the device: no host sync."""
    if target.numel() == 0 or not has_values(target):
        return
    message = f"{name} must hold token ids in [0, {vocab}) or ignore_index={ignore_index}"
    valid = ((target >= 0) & (target < vocab)) | (target == ignore_index)
    if _queued_on_device(target):
        torch._assert_async(valid.all(), message)
        return
    bad = (~valid).nonzero()
    if bad.shape[0]:
        first = tuple(bad[0].tolist())
        at = first[0] if len(first) == 1 else first
        raise ValueError(f"{message}, got {target[first].item()} at index {at} "
                         f"({bad.shape[0]} of {target.numel()} out of range)")


def check_finite(name: str, t: torch.Tensor) -> None:
    """Every value of ``t`` finite; on the CPU the error names the first non-finite one, on CUDA
    (and under torch.compile) the check is queued on the device: no host sync."""
    if t.numel() == 0 or not has_values(t):
        return
    message = f"{name} must hold finite values"
    if _queued_on_device(t):
        torch._assert_async(torch.isfinite(t).all(), message)
        return
    bad = (~torch.isfinite(t)).nonzero()
    if bad.shape[0]:
        where = tuple(bad[0].tolist())
        raise ValueError(f"{message}, got {t[where].item()} at index {where[0] if len(where) == 1 else where} "
                         f"({bad.shape[0]} of {t.numel()} not finite)")


def check_routing(hidden_states, top_k_index, top_k_weights, num_experts: int) -> None:
    """Tokens and their routing as the expert ops take them: ``hidden_states [T, H]`` and
    ``top_k_weights [T, K]`` float, ``top_k_index [T, K]`` int ids in ``[0, num_experts)`` with
    ``1 <= K <= num_experts``, on one device."""
    check_tensor("hidden_states", hidden_states, ndim=2)
    check_tensor("top_k_index", top_k_index, ndim=2)
    check_tensor("top_k_weights", top_k_weights, ndim=2)
    check_float("hidden_states", hidden_states)
    check_float("top_k_weights", top_k_weights)
    check_index("top_k_index", top_k_index)
    check_same_device(hidden_states=hidden_states, top_k_index=top_k_index, top_k_weights=top_k_weights)
    if top_k_index.shape[0] != hidden_states.shape[0] or top_k_weights.shape != top_k_index.shape:
        raise ValueError(
            f"top_k_index and top_k_weights must both have shape [T={hidden_states.shape[0]}, K], got "
            f"{tuple(top_k_index.shape)} and {tuple(top_k_weights.shape)}"
        )
    K = top_k_index.shape[1]
    if not 1 <= K <= num_experts:
        raise ValueError(f"top_k_index must choose between 1 and E={num_experts} experts per token, got {K}")
    check_indices_in_range("top_k_index", top_k_index, num_experts)


def refuse_double_backward(backward_op, what: str, instead: str = "") -> None:
    """Give ``backward_op`` (the custom op that computes ``what``'s gradients) a derivative that
    raises, naming what is unsupported: without one autograd reports only that the op has no
    formula. A single backward, with ``create_graph=True`` too, is unaffected."""

    def derivative(ctx, *grads):
        raise NotImplementedError(
            f"{what} is differentiable once: double backward (a derivative of its gradients, e.g. "
            "torch.autograd.grad(..., create_graph=True) followed by a backward through that gradient, as gradient "
            f"penalties and Hessian-vector products do) is not supported{instead}"
        )

    backward_op.register_autograd(derivative, setup_context=lambda ctx, inputs, output: None)
