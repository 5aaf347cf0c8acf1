"""Hugging Face integration: the ``"moe_ep"`` experts implementation of transformers' registry and
``patch(model)`` for models already built.

``import moe_ep`` (see ``moe_ep/__init__.py``) arranges for ``register_if_installed()`` to run
when transformers imports its experts registry, which adds ``"moe_ep"`` to it (and moe_ep's
expert-parallel entry to transformers' expert-parallel registry); nothing else is touched: no
class, no model, no router. ``patch(model)`` switches a built model, on request.

Routers: ``patch(model, fused_router=True)`` (the default) runs each MoE router on
``moe_ep.route_topk``, which computes the logits in float32 (``routers.py`` says where that can
differ from a family's own bf16 router, and how each class is verified first)."""

from .binding import Binding, ExpertsDispatcher, bind, binding_of
from .layout import activation_name, experts_activation, experts_modules, num_experts_of
from .patch import fused_routers, is_patched, limit_routing_to_nodes, patch
from .registry import (
    EXPERTS_IMPLEMENTATION,
    is_registered,
    moe_ep_experts_forward,
    register,
    register_if_installed,
)
from .transformers_ep import register_transformers_ep
from .version import MIN_TRANSFORMERS_VERSION, require_transformers

__all__ = [
    "Binding",
    "ExpertsDispatcher",
    "EXPERTS_IMPLEMENTATION",
    "MIN_TRANSFORMERS_VERSION",
    "activation_name",
    "bind",
    "binding_of",
    "experts_activation",
    "experts_modules",
    "fused_routers",
    "is_patched",
    "is_registered",
    "limit_routing_to_nodes",
    "moe_ep_experts_forward",
    "num_experts_of",
    "patch",
    "register",
    "register_if_installed",
    "register_transformers_ep",
    "require_transformers",
]
