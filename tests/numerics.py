"""How the tests compare numbers: ``||out - ref|| / ||ref||`` against a float64 reference, with
one tolerance per dtype (ARCHITECTURE.md, Conventions). A tolerance is never loosened to pass."""

import torch

TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    denom = ref.norm()
    if denom == 0:
        return out.norm().item()
    return ((out - ref).norm() / denom).item()
