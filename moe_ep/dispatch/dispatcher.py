"""Stateless expert-parallel dispatch and combine over the ``ep`` process group: the public
``dispatch`` / ``combine`` / ``join_to_dispatch``, each validating its arguments once, over two
schemes:

- single-stage (``moe_ep.dispatch.rank_exchange``): each token goes once to each rank that owns
  one of its chosen experts; one host sync per layer (dropless) or none (capacity mode);
- node-aware (``moe_ep.dispatch.nodes``, dropless, with ``node_groups``): each token goes once to
  each node that owns one of its experts and is forwarded inside it; one host sync per layer too.

Capacity mode needs the same number of tokens on every rank (see ``dispatch``). ARCHITECTURE.md
draws the whole flow, forward and backward."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..ops.validate import check_routing, check_tensor
from .capacity import check_capacity_factor
from .layout import DispatchedTokens, DispatchLayout, NodeDispatchLayout
from .nodes import NodeGroups, check_node_groups, combine_by_node, dispatch_by_node
from .rank_exchange import combine_to_ranks, dispatch_to_ranks
from .repeats import merge_repeated_experts


def check_num_experts(num_experts, ep: int, *, name: str = "num_experts") -> int:
    """The one check that ``num_experts`` experts split evenly over ``ep`` expert-parallel ranks;
    returns the experts per rank ``L = num_experts / ep``. ``name`` says what the count is."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1 or num_experts % ep:
        raise ValueError(
            f"{name} must be a positive int divisible by ep={ep} (every expert-parallel rank holds the same "
            f"number of experts), got {num_experts!r}"
        )
    return num_experts // ep


def check_dispatch_args(hidden_states, top_k_index, top_k_weights, group, num_experts) -> int:
    """Validates the public arguments; returns the expert-parallel group size."""
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup, got {type(group).__name__}")
    ep = dist.get_world_size(group)
    check_num_experts(num_experts, ep)
    check_routing(hidden_states, top_k_index, top_k_weights, num_experts)
    return ep


def dispatch(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    num_experts: int,
    capacity_factor: float | None = None,
    node_groups: NodeGroups | None = None,
) -> DispatchedTokens:
    """Send this rank's tokens ``[T, H]`` to the ranks owning their chosen experts.

    ``top_k_index [T, K]`` holds global expert ids, ``top_k_weights [T, K]`` their weights (an
    expert a token names in several slots is one pair of their summed weight). Returns
    the (row, local expert) pairs this rank's experts must compute and the layout ``combine``
    needs. Every rank of ``group`` must call it (collective), whatever its number of tokens.
    Differentiable in ``hidden_states`` and ``top_k_weights``; their backward exchanges run on
    the ranks where they require grad, so every rank must pass them alike (``moe_experts_ep``
    sees to it where the experts' weights require grad).

    ``node_groups`` (``moe_ep.dispatch.NodeGroups``, dropless only): the node-aware scheme
    (``moe_ep.dispatch.nodes``), each token sent once to each destination node and forwarded
    inside it; None: every destination rank gets its own copy.

    Capacity mode (``capacity_factor`` not None) needs the same number of tokens T on every rank
    of the group: the padded buffers are sized from it. It is checked with the count exchange,
    before any row moves, but the check reads a device value: on the CPU a mismatch raises
    ValueError on every rank; on CUDA it is queued (``torch._assert_async``, so as not to add the
    host sync this mode exists to avoid), the host goes on to launch the row all-to-all with
    mismatched sizes, and the job fails with a device-side assert at its next synchronisation, or
    stops in that exchange until ``moe_ep.fail_fast``'s or the process group's timeout. Pad every
    rank's batch to one length (a fixed sequence length and micro-batch size), or use dropless
    mode."""
    check_dispatch_args(hidden_states, top_k_index, top_k_weights, group, num_experts)
    check_capacity_factor(capacity_factor)
    check_node_groups(node_groups, group, capacity_factor)
    return dispatch_checked(hidden_states, top_k_index, top_k_weights, group, num_experts, capacity_factor,
                            node_groups)


def dispatch_checked(hidden_states, top_k_index, top_k_weights, group, num_experts: int,
                     capacity_factor: float | None, node_groups: NodeGroups | None = None, *,
                     rows: bool = False) -> DispatchedTokens:
    """``dispatch`` on arguments its caller validated (``check_dispatch_args``,
    ``check_node_groups``); ``rows``: the rows form of ``DispatchedTokens``, else the pairs."""
    top_k_index, top_k_weights = merge_repeated_experts(top_k_index, top_k_weights, num_experts)
    if node_groups is not None:
        return dispatch_by_node(hidden_states, top_k_index, top_k_weights, node_groups, num_experts, rows=rows)
    return dispatch_to_ranks(hidden_states, top_k_index, top_k_weights, group, num_experts, capacity_factor,
                             rows=rows)


class _JoinedToDispatch(torch.autograd.Function):
    """The experts' output, unchanged, as a function of the rows and weights ``dispatch`` handed
    them too. Backward passes no gradient along the extra edges (autograd still visits the nodes
    behind them, with zeros); what matters is that the edges exist."""

    @staticmethod
    def forward(ctx, expert_output_QH, hidden_QH, weights_Q1):
        return expert_output_QH.view_as(expert_output_QH)

    @staticmethod
    def backward(ctx, grad_QH):
        return grad_QH, None, None


def join_to_dispatch(expert_output: torch.Tensor, tokens: DispatchedTokens) -> torch.Tensor:
    """``expert_output`` tied into the autograd graph of ``tokens``' exchanges, so that the
    backward of ``dispatch`` and ``combine`` runs on this rank whatever the experts did: experts
    may return a tensor that is cut off from their inputs when they get no rows (transformers'
    eager experts return a fresh ``zeros_like``), and then this rank would skip the backward
    all-to-alls that every other rank enters, and the group would hang. Costs one graph node
    and no copy; a no-op outside autograd."""
    check_tensor("expert_output", expert_output)
    if not isinstance(tokens, DispatchedTokens):
        raise TypeError(f"tokens must be the DispatchedTokens returned by dispatch, got {type(tokens).__name__}")
    return join_checked(expert_output, tokens)


def join_checked(expert_output: torch.Tensor, tokens: DispatchedTokens) -> torch.Tensor:
    """``join_to_dispatch`` for ``tokens`` of this module's own dispatch."""
    return _JoinedToDispatch.apply(expert_output, tokens.hidden_states, tokens.weights)


def combine(expert_output: torch.Tensor, layout: DispatchLayout | NodeDispatchLayout) -> torch.Tensor:
    """The weighted expert outputs ``[Q, H]`` of ``dispatch``'s pairs back to their tokens:
    ``[T, H]`` on the source rank, in the dtype of ``expert_output``. Collective, differentiable.

    Every rank must also enter the backward of both exchanges, so ``expert_output`` must depend
    on the dispatched rows in the autograd graph; for experts that do not promise that, pass
    their output through ``join_to_dispatch`` first."""
    check_tensor("expert_output", expert_output, ndim=2)
    if not isinstance(layout, (DispatchLayout, NodeDispatchLayout)):
        raise TypeError(f"layout must be the DispatchLayout returned by dispatch, got {type(layout).__name__}")
    if expert_output.shape[0] != layout.num_outputs:
        raise ValueError(
            f"expert_output must have one row per dispatched pair ({layout.num_outputs}), "
            f"got shape {tuple(expert_output.shape)}"
        )
    return combine_checked(expert_output, layout)


def combine_checked(expert_output: torch.Tensor, layout: DispatchLayout | NodeDispatchLayout) -> torch.Tensor:
    """``combine`` of expert outputs its caller computed from this module's own dispatch."""
    if isinstance(layout, NodeDispatchLayout):
        return combine_by_node(expert_output, layout)
    return combine_to_ranks(expert_output, layout)
