"""The ``"moe_ep"`` entry of transformers' experts registry (``ALL_EXPERTS_FUNCTIONS``), so that
``from_pretrained(..., experts_implementation="moe_ep")``, ``from_config(...)`` and
``model.set_experts_implementation("moe_ep")`` run the experts of every supported MoE family on
``moe_ep.moe_experts`` without changing a parameter name or shape."""

from __future__ import annotations

import importlib.util
import warnings

import torch

from ..ops.experts import moe_experts
from .autocast import autocast_dtype
from .binding import binding_of
from .layout import experts_activation
from .version import require_transformers

EXPERTS_IMPLEMENTATION = "moe_ep"


class _ExpertsInDtype:
    """An experts module as a dispatcher reads it (``gate_up_proj``, ``down_proj``), with both
    weights cast to ``dtype``; the casts are differentiable, so gradients reach the module's own
    parameters (DTensor shards included) in their dtype."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype):
        self.module = module
        self.gate_up_proj = module.gate_up_proj.to(dtype)
        self.down_proj = module.down_proj.to(dtype)

    def __repr__(self) -> str:
        return f"{type(self.module).__name__} in {self.gate_up_proj.dtype}"


def moe_ep_experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """transformers' experts forward signature. The module's binding (``moe_ep.hf.binding``) says
    how it runs: its expert-parallel dispatcher, set by ``moe_ep.parallelize``, takes the call;
    without one the local ``moe_experts`` op runs with the backend ``moe_ep.patch`` bound.

    Under autocast both paths compute in the autocast dtype, as ``F.linear`` in the eager experts
    does: the activations and weights are cast before the local op or the dispatcher sees them
    (the dispatcher then reads the cast weights), and the output is cast back to the dtype of
    ``hidden_states``."""
    activation = experts_activation(self)  # also refuses unsupported layouts before any dispatch
    compute_dtype = autocast_dtype(hidden_states.device)
    experts, x_TH = self, hidden_states
    if compute_dtype is not None:
        experts, x_TH = _ExpertsInDtype(self, compute_dtype), hidden_states.to(compute_dtype)
    binding = binding_of(self)
    if binding.dispatcher is not None:
        y_TH = binding.dispatcher(experts, x_TH, top_k_index, top_k_weights)
    else:
        y_TH = moe_experts(
            x_TH,
            top_k_index,
            top_k_weights,
            experts.gate_up_proj,
            experts.down_proj,
            activation=activation,
            backend=binding.backend,
        )
    return y_TH.to(hidden_states.dtype)


def register() -> None:
    """Register ``"moe_ep"`` in transformers' experts registry. Idempotent; patches no model.

    Raises ImportError when transformers is missing or older than 5.17, and ValueError when another
    function already holds the name ``"moe_ep"``."""
    require_transformers()
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    current = ExpertsInterface._global_mapping.get(EXPERTS_IMPLEMENTATION)
    if current is moe_ep_experts_forward:
        return
    if current is not None and _qualname(current) != _qualname(moe_ep_experts_forward):
        raise ValueError(
            f"the experts implementation name {EXPERTS_IMPLEMENTATION!r} is already registered by "
            f"{_qualname(current)}; moe_ep will not overwrite it"
        )
    # Registered globally (class mapping), so every ExpertsInterface instance sees it, including
    # the one transformers' modeling_utils validates experts_implementation= against.
    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, moe_ep_experts_forward)


def register_if_installed() -> bool:
    """What ``import moe_ep`` runs once transformers imports its experts registry: register when
    transformers is installed. Returns False without touching anything when it is not (the
    integration is optional); warns and returns False when it is too old, so the rest of moe_ep
    stays importable while ``patch()`` and ``register()`` still raise the version error."""
    if importlib.util.find_spec("transformers") is None:
        return False
    try:
        require_transformers()
    except ImportError as err:
        warnings.warn(f"{err}; the 'moe_ep' experts implementation is not registered", stacklevel=2)
        return False
    register()
    return True


def is_registered() -> bool:
    from transformers.integrations.moe import ExpertsInterface

    return ExpertsInterface._global_mapping.get(EXPERTS_IMPLEMENTATION) is moe_ep_experts_forward


def _qualname(fn) -> str:
    # A reloaded moe_ep module registers a new function object under the same name: that is us.
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
