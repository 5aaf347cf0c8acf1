"""AdamW whose two moments are stored in a narrower dtype than the weights: ``AdamW(params,
moments_dtype=torch.bfloat16)``.

Why. With float32 master weights AdamW's moments are half of the 16 bytes a trained parameter
costs (weights, gradient, two moments). DeepSeek-V3 was trained with both moments in bf16 (its
technical report's low-precision storage, which reports no observable loss of quality), as
Megatron-Core's precision-aware optimizer allows (``--exp-avg-dtype``/``--exp-avg-sq-dtype``): 12
bytes per parameter instead of 16. The planner models it (``plan(bf16_moments=True)``).

The update is ``torch.optim.AdamW``'s (decoupled weight decay, bias correction, ``eps`` added
after the square root), computed in float32 from the stored moments and this step's gradient; the
new moments update the weights at that precision and are rounded to ``moments_dtype`` only to be
stored. With ``moments_dtype=torch.float32`` it is ``torch.optim.AdamW``. One parameter at a
time, so the float32 transients are those of the largest parameter; parameters may be FSDP2's
DTensor shards (the update is element-wise, so each rank updates its shard as one process would
the whole tensor).

State: ``step`` (a float32 scalar tensor, as torch's), ``exp_avg`` and ``exp_avg_sq`` under
torch's names, in ``moments_dtype``; a loaded state dict (``load_state_dict``, DCP) gets its
moments back in that dtype, so checkpoints written with float32 moments load too."""

from __future__ import annotations

import math

import torch

_MOMENTS = ("exp_avg", "exp_avg_sq")


class AdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW(params, lr, betas, eps, weight_decay)`` whose moments are stored in
    ``moments_dtype`` (the module docstring says how it computes)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, moments_dtype: torch.dtype = torch.bfloat16):
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0.0 <= lr < math.inf:
            raise ValueError(f"lr must be a finite number >= 0, got {lr!r}")
        if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
        if not isinstance(eps, (int, float)) or not 0.0 <= eps < math.inf:
            raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
        if not isinstance(weight_decay, (int, float)) or not 0.0 <= weight_decay < math.inf:
            raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")
        if not isinstance(moments_dtype, torch.dtype) or not moments_dtype.is_floating_point:
            raise ValueError(f"moments_dtype must be a floating-point torch.dtype (torch.bfloat16, torch.float32), "
                             f"got {moments_dtype!r}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.moments_dtype = moments_dtype
        for group in self.param_groups:
            for p in group["params"]:
                if not p.dtype.is_floating_point:
                    raise ValueError(f"AdamW updates floating-point parameters, got one of {p.dtype}")
        # torch's load_state_dict casts a state's tensors to its parameter's dtype.
        self.register_load_state_dict_post_hook(AdamW._moments_to_dtype)

    def _moments_to_dtype(self) -> None:
        for state in self.state.values():
            for name in _MOMENTS:
                if name in state and state[name].dtype != self.moments_dtype:
                    state[name] = state[name].to(self.moments_dtype)

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
                grad = p.grad.float()
                # float32 moments: .float() is the state itself, updated in place as torch does.
                exp_avg = state["exp_avg"].float().lerp_(grad, 1 - beta1)
                exp_avg_sq = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                for name, value in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
                    if value is not state[name]:
                        state[name].copy_(value)
                bias1, bias2 = 1 - beta1**step, 1 - beta2**step
                denom = (exp_avg_sq.sqrt() / bias2**0.5).add_(eps)
                # torch.optim.AdamW's operations in its order: bitwise equal with float32 moments.
                weights = p if p.dtype == torch.float32 else p.float()
                weights.mul_(1 - lr * decay).addcdiv_(exp_avg, denom, value=-lr / bias1)
                if weights is not p:
                    p.copy_(weights)
        return loss
