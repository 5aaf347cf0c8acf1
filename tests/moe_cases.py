"""Routing cases shared by the expert-op tests: odd sizes, every top-k, empty experts, one hot
expert, no tokens, one token; and the forward-and-gradients runner the expert-op tests share."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Case:
    name: str
    T: int
    H: int
    I: int
    E: int
    K: int
    routing: str = "random"  # random | one_expert | skip_last (expert E-1 gets no token)

    def make(self, dtype, device="cpu", seed=0, weights_dtype=torch.float32):
        """(x, idx, w, gate_up, down): floats in ``dtype`` except the routing weights, which models
        usually keep in float32 (``weights_dtype`` picks theirs)."""
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(self.T, self.H, generator=g)
        gate_up = torch.randn(self.E, 2 * self.I, self.H, generator=g) / self.H**0.5
        down = torch.randn(self.E, self.H, self.I, generator=g) / self.I**0.5
        w = torch.rand(self.T, self.K, generator=g) + 0.1
        if self.routing == "one_expert":
            assert self.K == 1
            idx = torch.full((self.T, 1), self.E // 2, dtype=torch.long)
        else:
            pool = self.E - 1 if self.routing == "skip_last" else self.E
            scores = torch.rand(self.T, pool, generator=g)
            idx = scores.topk(self.K, dim=-1).indices
        x, gate_up, down = (t.to(device=device, dtype=dtype) for t in (x, gate_up, down))
        return x, idx.to(device), w.to(device=device, dtype=weights_dtype), gate_up, down


def run_with_grads(fn, x, idx, w, gate_up, down, dy):
    """``fn``'s output and its gradients in (hidden states, routing weights, gate_up, down) for the
    output gradient ``dy``; an input the output does not depend on gets a zero gradient."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, gate_up, down)]
    xl, wl, gul, dl = leaves
    y = fn(xl, idx, wl, gul, dl)
    grads = torch.autograd.grad(y, leaves, dy.to(device=y.device, dtype=y.dtype), allow_unused=True)
    return y.detach(), [g if g is not None else torch.zeros_like(l) for g, l in zip(grads, leaves)]


CASES = [
    Case("odd", T=37, H=24, I=20, E=5, K=2),
    Case("odd_unaligned", T=13, H=17, I=9, E=3, K=2),
    Case("k1", T=19, H=16, I=16, E=4, K=1),
    Case("k_eq_e", T=11, H=16, I=8, E=4, K=4),
    Case("empty_expert", T=23, H=16, I=24, E=6, K=2, routing="skip_last"),
    Case("one_expert", T=17, H=16, I=16, E=4, K=1, routing="one_expert"),
    Case("t1", T=1, H=16, I=8, E=4, K=2),
    Case("t0", T=0, H=16, I=8, E=4, K=2),
    Case("k3_of_5", T=9, H=16, I=8, E=5, K=3),
    # Fine-grained experts as Qwen3-MoE, OLMoE and DeepSeek-V3 have them: many small experts, top-8.
    Case("fine_grained", T=12, H=32, I=16, E=16, K=8),
]
