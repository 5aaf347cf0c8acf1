"""The op layer: the expert MLPs of one MoE layer (``moe_experts``, on Triton or PyTorch), the
router (``route_topk``), the load-balancing losses and the expert bias, on one device and without
knowledge of modules, process groups or Hugging Face (the losses' optional ``group`` sums their
statistics over a process group the caller gives). Below it: ``moe_ep.kernels``."""

from .experts import moe_experts
from .losses import expert_counts, load_balancing_loss, router_z_loss, update_expert_bias_
from .routing import route_topk

__all__ = ["expert_counts", "load_balancing_loss", "moe_experts", "route_topk", "router_z_loss", "update_expert_bias_"]
