"""The op layer: the expert MLPs of one MoE layer (``moe_experts``, on Triton or PyTorch), the
router (``route_topk``), the load-balancing losses and the expert bias, the LM head's chunked
cross-entropy (``linear_cross_entropy``), on one device and without knowledge of modules, process
groups or Hugging Face (the losses' optional ``group`` sums their statistics over a process group
the caller gives). Below it: ``moe_ep.kernels``."""

from .experts import moe_experts
from .experts_op import repeatable_backward, set_repeatable_backward
from .linear_cross_entropy import linear_cross_entropy
from .losses import expert_counts, load_balancing_loss, router_z_loss, update_expert_bias_
from .routing import route_topk

__all__ = ["expert_counts", "linear_cross_entropy", "load_balancing_loss", "moe_experts", "repeatable_backward",
           "route_topk", "router_z_loss", "set_repeatable_backward", "update_expert_bias_"]
