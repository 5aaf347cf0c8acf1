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


def under_transformers_parallelism(module: torch.nn.Module) -> bool:
    """Whether transformers' own expert (or tensor) parallelism drives ``module``, and so may hand
    it sentinel expert ids. transformers 5.24+ says so in the flag ``_is_expert_parallel`` that
    ``@use_experts_implementation`` puts on every experts module; releases without the flag (5.17)
    mark every module of a model they distributed with ``_is_hooked`` and send sentinels from any
    expert-parallel router."""
    flag = getattr(module, "_is_expert_parallel", None)
    if flag is not None:
        return bool(flag)
    return bool(getattr(module, "_is_hooked", False))


def skip_sentinel_slots(
    module: torch.nn.Module, idx_TK: torch.Tensor, w_TK: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' expert-parallel routers that give each rank the whole batch (5.24's
    ``AllReduceEP``, every 5.17 expert-parallel model) mark a slot whose expert another rank owns
    with the id ``L`` (this rank's expert count) and weight 0; its experts must skip it. Here such a
    slot becomes a slot of local expert 0 with weight 0: it adds exactly 0 to its token's output, and
    no gradient reaches the hidden state, the expert weights (the weight is 0) or the routing weight
    (``masked_fill`` passes none at the filled slot). Computed on the device, with no host sync and
    no shape that depends on the data; where there is no sentinel it costs two element-wise ops on
    ``[T, K]``. The price where there are sentinels: their rows go through expert 0's GEMMs (as
    transformers' ``batched_mm`` clamps and computes them too). Ids below 0 or above ``L`` are left
    for ``moe_experts``' range check to refuse."""
    sentinel_TK = idx_TK == module.gate_up_proj.shape[0]
    return idx_TK.masked_fill(sentinel_TK, 0), w_TK.masked_fill(sentinel_TK, 0)


def moe_ep_experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """transformers' experts forward signature. The module's binding (``moe_ep.hf.binding``) says
    how it runs: its expert-parallel dispatcher, set by ``moe_ep.parallelize``, takes the call;
    without one the local ``moe_experts`` op runs with the backend ``moe_ep.patch`` bound, on
    this rank's experts under transformers' own expert parallelism, whose sentinel ids it skips
    (``skip_sentinel_slots``).

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
        if under_transformers_parallelism(self):
            top_k_index, top_k_weights = skip_sentinel_slots(self, top_k_index, top_k_weights)
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
