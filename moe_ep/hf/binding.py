"""How moe_ep runs one transformers module it drives: the backend of the local op (experts and
fused routers) and, for an experts module under expert parallelism, the dispatcher that takes its
whole forward. ``bind`` records it (``moe_ep.patch`` the backend, ``moe_ep.parallelize`` the
dispatcher); ``binding_of`` is how the ``"moe_ep"`` experts forward and the fused routers read it.
This is the one hook between the Hugging Face layer and the dispatch layer, so that a reader can
follow a forward from ``moe_ep_experts_forward`` to ``ExpertParallelDispatcher``: look for
``bind(`` and ``binding_of(``."""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch


class ExpertsDispatcher(Protocol):
    """Runs an experts module's forward elsewhere: ``dispatcher(experts, hidden_states [T, H],
    top_k_index [T, K], top_k_weights [T, K]) -> [T, H]``, where ``experts`` exposes the module's
    ``gate_up_proj`` and ``down_proj`` (cast to the autocast dtype under autocast).
    ``moe_ep.dispatch.ExpertParallelDispatcher`` is the one moe_ep installs."""

    def __call__(self, experts, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor: ...


@dataclasses.dataclass(frozen=True)
class Binding:
    backend: str | None = None  # "triton", "torch" or None: the op's default (moe_experts, route_topk)
    dispatcher: ExpertsDispatcher | None = None  # experts only: takes the forward when set
    # fused routers only: (nodes, max_nodes) of node-limited routing (moe_ep.ops.route_topk)
    node_limit: tuple[int, int] | None = None


_UNBOUND = Binding()
# Kept in the module's own __dict__ (so copies, FSDP's class swap and torch.compile see it), under
# a private name that only this file uses.
_SLOT = "_moe_ep_binding"


def binding_of(module: torch.nn.Module) -> Binding:
    """What moe_ep was told about ``module``; the defaults when nothing was."""
    return module.__dict__.get(_SLOT, _UNBOUND)


def bind(module: torch.nn.Module, **changes) -> Binding:
    """Set some fields of ``module``'s binding (``backend=...``, ``dispatcher=...``); returns it."""
    binding = dataclasses.replace(binding_of(module), **changes)
    module.__dict__[_SLOT] = binding
    return binding
