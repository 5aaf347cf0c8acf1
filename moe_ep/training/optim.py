"""AdamW whose two moments are stored in a narrower dtype than the weights: ``AdamW(params,
moments_dtype=torch.bfloat16)``.

Why. With float32 master weights AdamW's moments are half of the 16 bytes a trained parameter
costs (weights, gradient, two moments). DeepSeek-V3 was trained with both moments in bf16 (its
technical report's low-precision storage, which reports no observable loss of quality), as
Megatron-Core's precision-aware optimizer allows (``--exp-avg-dtype``/``--exp-avg-sq-dtype``): 12
bytes per parameter instead of 16. The planner models it (``plan(bf16_moments=True)``).

The update is ``torch.optim.AdamW``'s (decoupled weight decay, bias correction, ``eps`` added
after the square root), computed in float32 (float64 for float64 weights or moments) from the stored moments
and this step's gradient; the new moments update the weights at that precision and are rounded to
``moments_dtype`` only to be stored. With ``moments_dtype=torch.float32`` and float32 weights it is
``torch.optim.AdamW``, bit for bit. One parameter at a time, so the transients are those of the
largest parameter; parameters may be FSDP2's DTensor shards (the update is element-wise, so each
rank updates its shard as one process would the whole tensor).

bf16 keeps 8 significant bits, so a stored moment moves only when a step changes it by more than
half its last place: a moment whose decay ``1 - beta`` is below ``2^-7`` can stop moving (with
torch's ``beta2 = 0.999`` the second moment of a gradient that shrinks stays where it was and the
updates end up 25x too small after 8,000 steps). bf16 moments therefore take ``beta <= 1 - 2^-7``
(0.992; DeepSeek-V3 trained with (0.9, 0.95), the default here); a longer average needs
``moments_dtype=torch.float32``.

State: ``step`` (a float32 scalar tensor, as torch's), ``exp_avg`` and ``exp_avg_sq`` under
torch's names, in ``moments_dtype``; a loaded state dict (``load_state_dict``, DCP) gets its
moments in that dtype straight from the saved values (torch's own loading would pass them
through the parameter's dtype first, and a bf16 moment of a float16 weight underflows there),
so checkpoints written with float32 moments (torch's AdamW) load too, where their betas are ones
bf16 moments can keep (a state saved with torch's default beta2 = 0.999 is refused by name: load
it with ``moments_dtype=torch.float32``)."""

from __future__ import annotations

import math
import numbers

import torch

_MOMENTS = ("exp_avg", "exp_avg_sq")
MOMENTS_DTYPES = (torch.bfloat16, torch.float32, torch.float64)
# The smallest decay 1 - beta a bf16 moment follows: a step's change of at least one last place
# of the 8 significant bits (2^-7 of the value at most).
_BF16_MIN_DECAY = 2.0**-7
# torch.optim.AdamW's options this one does not implement: refused where they are set (a group
# added or loaded from torch's state dict), not ignored.
_NOT_IMPLEMENTED = ("amsgrad", "maximize", "capturable", "differentiable", "fused")


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_hyperparameters(group: dict, moments_dtype: torch.dtype, where: str = "") -> None:
    """A parameter group's options: ValueError naming the first one this optimizer cannot apply as
    asked. ``where`` says which group, for an error about one of several."""
    missing = [name for name in ("lr", "betas", "eps", "weight_decay") if name not in group]
    if missing:
        raise ValueError(f"the options{where or ' of the parameter group'} lack {', '.join(missing)}: not an AdamW's "
                         "(a state dict of another optimizer?)")
    lr, betas, eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    if not _is_real(lr) or not 0.0 <= lr < math.inf:
        raise ValueError(f"lr{where} must be a finite real number >= 0, got {lr!r}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(_is_real(b) and 0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"betas{where} must be two real numbers in [0, 1), got {betas!r}")
    for name, value in (("eps", eps), ("weight_decay", decay)):
        if not _is_real(value) or not 0.0 <= value < math.inf:
            raise ValueError(f"{name}{where} must be a finite real number >= 0, got {value!r}")
    if moments_dtype == torch.bfloat16 and any(0 < 1 - b < _BF16_MIN_DECAY for b in betas):
        raise ValueError(
            f"betas{where}={tuple(betas)!r} with moments_dtype=torch.bfloat16: a moment whose decay 1 - beta is "
            f"below 2^-7 stops moving in bf16 (a step's change rounds back to the stored value); use betas of at "
            f"most {1 - _BF16_MIN_DECAY} (DeepSeek-V3 trained with (0.9, 0.95) in bf16) or "
            "moments_dtype=torch.float32")
    if group.get("decoupled_weight_decay") is False and decay:
        # torch.optim.Adam's groups: an L2 term added to the gradient, not AdamW's decoupled decay.
        raise ValueError(f"decoupled_weight_decay=False with weight_decay={decay!r}{where}: an L2 penalty "
                         "(torch.optim.Adam's), which this AdamW does not apply (it decays the weights decoupled)")
    unsupported = [name for name in _NOT_IMPLEMENTED if group.get(name)]
    if unsupported:
        raise ValueError(f"moe_ep's AdamW does not implement {', '.join(f'{n}=True' for n in unsupported)}{where} "
                         "(torch.optim.AdamW does)")


class AdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW(params, lr, betas, eps, weight_decay)`` whose moments are stored in
    ``moments_dtype`` (the module docstring says how it computes, and which betas bf16 can keep;
    the default betas are (0.9, 0.95), not torch's (0.9, 0.999), for that reason)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, moments_dtype: torch.dtype = torch.bfloat16):
        if moments_dtype not in MOMENTS_DTYPES:
            raise ValueError(f"moments_dtype must be one of {', '.join(map(str, MOMENTS_DTYPES))}, got "
                             f"{moments_dtype!r} (float16 and float8 lose small second moments to underflow)")
        self.moments_dtype = moments_dtype
        super().__init__(params, dict(lr=lr, betas=tuple(betas) if isinstance(betas, (tuple, list)) else betas,
                                      eps=eps, weight_decay=weight_decay))

    def add_param_group(self, param_group: dict) -> None:
        """torch's, with the group's options and parameters checked (``__init__``'s groups too)."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        where = f" of parameter group {len(self.param_groups) - 1}" if len(self.param_groups) > 1 else ""
        try:
            check_hyperparameters(group, self.moments_dtype, where)
            for p in group["params"]:
                if not p.dtype.is_floating_point:
                    raise ValueError(f"AdamW updates real floating-point parameters, got one of {p.dtype}{where}")
        except ValueError:
            self.param_groups.pop()
            raise

    def __getstate__(self):
        return {**super().__getstate__(), "moments_dtype": self.moments_dtype}

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, with the saved groups' options checked first (a refused state leaves the
        optimizer as it was), the moments cast once to ``moments_dtype`` from their saved values,
        and a plain-number ``step`` made a tensor, as torch's AdamW does."""
        for i, group in enumerate(state_dict["param_groups"]):
            check_hyperparameters(group, self.moments_dtype, f" of saved parameter group {i}")
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        saved = {i: {name: state_dict["state"][i][name] for name in _MOMENTS if name in state_dict["state"].get(i, {})}
                 for i in ids}
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for i, p in zip(ids, params):
            state = self.state.get(p)
            if not state:
                continue
            for name, value in saved[i].items():
                state[name] = value.to(device=p.device, dtype=self.moments_dtype)
            if "step" in state and not isinstance(state["step"], torch.Tensor):
                state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamW does not take sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    for name in _MOMENTS:
                        state[name] = torch.zeros_like(p, dtype=self.moments_dtype, memory_format=torch.preserve_format)
                state["step"] += 1
                step = state["step"].item()  # a CPU tensor, as torch keeps it: no device sync
                compute = torch.promote_types(torch.promote_types(p.dtype, self.moments_dtype), torch.float32)
                grad = p.grad.to(compute)
                # Moments stored in the compute dtype: .to() is the state itself, updated in place as torch does.
                exp_avg = state["exp_avg"].to(compute).lerp_(grad, 1 - beta1)
                exp_avg_sq = state["exp_avg_sq"].to(compute).mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                for name, value in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
                    if value is not state[name]:
                        state[name].copy_(value)
                bias1, bias2 = 1 - beta1**step, 1 - beta2**step
                denom = (exp_avg_sq.sqrt() / bias2**0.5).add_(eps)
                # torch.optim.AdamW's operations in its order: bitwise equal with float32 moments.
                weights = p if p.dtype == compute else p.to(compute)
                weights.mul_(1 - lr * decay).addcdiv_(exp_avg, denom, value=-lr / bias1)
                if weights is not p:
                    p.copy_(weights)
        return loss
