"""moe_ep: Mixture-of-Experts kernels and expert parallelism for PyTorch."""

from .experts import moe_experts
from .routing import route_topk

__all__ = ["moe_experts", "route_topk"]
__version__ = "0.1.0"
