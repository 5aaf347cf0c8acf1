"""Routing cases shared by the expert-op tests: odd sizes, every top-k, empty experts, one hot
expert, no tokens, one token."""

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

    def make(self, dtype, device="cpu", seed=0):
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
        return tuple(
            t.to(device=device, dtype=dtype if t.is_floating_point() and t is not w else t.dtype)
            for t in (x, idx, w, gate_up, down)
        )


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
]
