"""Hugging Face integration: the ``"moe_ep"`` experts implementation of transformers' registry and
``patch(model)`` for models already built. Importing this package touches neither transformers
nor any model; ``register()`` and ``patch()`` are explicit."""

from .layout import activation_name, experts_activation
from .patch import fused_routers, is_patched, patch
from .registry import (
    EXPERTS_IMPLEMENTATION,
    is_registered,
    moe_ep_experts_forward,
    register,
    register_if_installed,
)
from .version import MIN_TRANSFORMERS_VERSION, require_transformers

__all__ = [
    "EXPERTS_IMPLEMENTATION",
    "MIN_TRANSFORMERS_VERSION",
    "activation_name",
    "experts_activation",
    "fused_routers",
    "is_patched",
    "is_registered",
    "moe_ep_experts_forward",
    "patch",
    "register",
    "register_if_installed",
    "require_transformers",
]
