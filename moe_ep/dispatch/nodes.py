"""Node-aware dispatch and combine: each token crosses the network at most once per destination
node (DeepEP's internode scheme, on ``torch.distributed`` collectives).

The ``ep`` group of ``nodes x node_size`` ranks, numbered node by node, is split in two:
``inter``, this rank and the ranks with its local index on every node (node order), and
``intra``, this rank's node (local order). Rank ``n node_size + g`` of the ep group is rank
``n`` of its inter group and rank ``g`` of its intra group; node ``n`` owns experts
``[n G L, (n+1) G L)`` (``G = node_size``).

- Dispatch, stage 1 (``inter``): one row per (token, destination node) to the rank with this
  rank's local index there, through the single-stage exchange (``rank_exchange.send_rows``)
  with the node as the "rank" and its ``G L`` experts as the "local" ones: a row carrying
  several of the node's experts carries their node-local ids and weights.
- Stage 2 (``intra``): the forwarding rank dispatches each received row to the ranks of its
  node that own one of the row's experts (``rank_exchange.dispatch_to_ranks``, the empty
  columns of a row masked), so a row reaches each expert rank once.
- Combine, reversed: the expert ranks weight and sum as in the single-stage combine, and the
  forwarding rank sums the outputs of the node's ranks for each row (float32, fixed order)
  before the one copy goes back over the network; the source applies a single row's routing
  weight and sums its tokens' rows.

Dropless only; two host syncs per layer (each stage's count exchange gives its split sizes).
Selection: ``dispatch_mode`` "auto" uses this scheme when the ep group spans several whole nodes
(node size from the launcher's ``LOCAL_WORLD_SIZE``, or given) and the dispatch is dropless;
"node" pins it, "flat" the single-stage scheme."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .layout import DispatchedTokens, NodeDispatchLayout
from .rank_exchange import combine_to_ranks, dispatch_to_ranks, return_rows, send_rows

DISPATCH_MODES = ("auto", "flat", "node")
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"  # what torchrun and accelerate set: the processes of a node


@dataclass(frozen=True)
class NodeGroups:
    """This rank's two groups of the node-aware scheme (see the module docstring)."""

    inter: dist.ProcessGroup
    intra: dist.ProcessGroup

    @property
    def num_nodes(self) -> int:
        return dist.get_world_size(self.inter)

    @property
    def node_size(self) -> int:
        return dist.get_world_size(self.intra)


def check_node_groups(node_groups, group, capacity_factor) -> None:
    """That ``node_groups`` (None = the single-stage scheme) split the ep ``group`` as the module
    docstring says, and that the dispatch is dropless."""
    if node_groups is None:
        return
    if not isinstance(node_groups, NodeGroups):
        raise TypeError(f"node_groups must be a moe_ep.dispatch.NodeGroups or None, got {type(node_groups).__name__}")
    if capacity_factor is not None:
        raise ValueError(
            f"node_groups: the node-aware dispatch is dropless only, so capacity_factor must be None, got "
            f"{capacity_factor!r} (use the single-stage dispatch, node_groups=None, for capacity mode)"
        )
    ep, nodes, size = dist.get_world_size(group), node_groups.num_nodes, node_groups.node_size
    if nodes * size != ep:
        raise ValueError(
            f"node_groups must split the ep group of {ep} ranks into nodes x node_size, got {nodes} nodes x {size}"
        )
    rank = dist.get_rank(group)
    inter_rank, intra_rank = dist.get_rank(node_groups.inter), dist.get_rank(node_groups.intra)
    if rank != inter_rank * size + intra_rank:
        raise ValueError(
            f"node_groups do not match the ep group: rank {rank} of it must be rank {rank // size} of "
            f"node_groups.inter and rank {rank % size} of node_groups.intra, it is {inter_rank} and {intra_rank} (ranks numbered node by "
            "node: build them with moe_ep.dispatch.split_by_node)"
        )


def check_node_size(node_size) -> None:
    if node_size is not None and (isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1):
        raise ValueError(
            f"node_size must be a positive int or None (the launcher's {LOCAL_WORLD_SIZE}), got {node_size!r}")


def check_dispatch_mode(dispatch_mode, capacity_factor, overlap_chunks: int = 1) -> None:
    if dispatch_mode not in DISPATCH_MODES:
        raise ValueError(f"dispatch_mode must be one of {DISPATCH_MODES}, got {dispatch_mode!r}")
    if dispatch_mode == "node" and capacity_factor is not None:
        raise ValueError(
            f"dispatch_mode='node' is dropless only, so capacity_factor must be None, got {capacity_factor!r} "
            "(dispatch_mode='auto' uses the single-stage dispatch in capacity mode)"
        )
    if dispatch_mode == "node" and overlap_chunks > 1:
        raise ValueError(
            f"dispatch_mode='node' does not overlap its exchanges, so overlap_chunks must be 1, got {overlap_chunks} "
            "(dispatch_mode='auto' uses the single-stage dispatch with overlap_chunks > 1)"
        )


def launcher_node_size() -> int | None:
    """The processes per node as the launcher says (``LOCAL_WORLD_SIZE``), None when unset."""
    value = os.environ.get(LOCAL_WORLD_SIZE)
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"the environment variable {LOCAL_WORLD_SIZE} must be a positive int, got {value!r}")
    return int(value)


def node_size_for(dispatch_mode: str, ep: int, node_size: int | None, capacity_factor: float | None,
                  overlap_chunks: int = 1) -> int | None:
    """The node size the ep group is split by, or None for the single-stage dispatch: "auto" splits
    a dropless ep group that spans several whole nodes, unless its exchanges overlap the experts
    (``overlap_chunks`` > 1, single-stage only); "node" needs one and says why not.
    ``node_size`` None: the launcher's."""
    check_dispatch_mode(dispatch_mode, capacity_factor, overlap_chunks)
    check_node_size(node_size)
    if dispatch_mode == "flat":
        return None
    size = launcher_node_size() if node_size is None else node_size
    spans_nodes = size is not None and ep > size and ep % size == 0
    if dispatch_mode == "auto":
        return size if spans_nodes and capacity_factor is None and overlap_chunks == 1 else None
    if size is None:
        raise ValueError(
            f"dispatch_mode='node' needs the node size: pass node_size or launch with torchrun or accelerate "
            f"(which set {LOCAL_WORLD_SIZE})"
        )
    if not spans_nodes:
        raise ValueError(
            f"dispatch_mode='node' needs an ep group over several whole nodes: ep={ep} must be a multiple of "
            f"node_size={size} larger than it"
        )
    return size


def split_by_node(ep_groups: Sequence[Sequence[int]], node_size: int) -> NodeGroups:
    """Creates the inter- and intra-node groups of every ep group in ``ep_groups`` (global ranks,
    in ep order; rank r on node ``r // node_size``) and returns this rank's. A collective: every
    rank of the default group calls it with the same arguments (``dist.new_group``'s rule)."""
    check_node_size(node_size)
    if node_size is None:
        raise ValueError("node_size must be a positive int, got None")
    rank, mine = dist.get_rank(), {}
    for ranks in ep_groups:
        ranks = list(ranks)
        if len(ranks) % node_size:
            raise ValueError(f"an ep group of {len(ranks)} ranks does not split into nodes of node_size={node_size}")
        nodes = [ranks[i:i + node_size] for i in range(0, len(ranks), node_size)]
        for node in nodes:
            if len({r // node_size for r in node}) != 1:
                raise ValueError(f"ranks {node} of the ep group {ranks} should share a node of {node_size} and do not")
        for kind, members in [("intra", node) for node in nodes] + [("inter", list(local)) for local in zip(*nodes)]:
            created = dist.new_group(members)
            if rank in members:
                mine[kind] = created
    if set(mine) != {"inter", "intra"}:
        raise ValueError(f"rank {rank} is in none of the ep groups {[list(g) for g in ep_groups]}")
    return NodeGroups(inter=mine["inter"], intra=mine["intra"])


def dispatch_by_node(hidden_states, top_k_index, top_k_weights, nodes: NodeGroups, num_experts: int
                     ) -> DispatchedTokens:
    """The two-stage dispatch (module docstring) on arguments ``dispatch`` validated."""
    node_experts = num_experts // nodes.num_nodes
    first = send_rows(hidden_states, top_k_index, top_k_weights, nodes.inter, num_experts)
    # A received row's columns: its node-local experts, node_experts where it has fewer.
    forwarded = dispatch_to_ranks(first.x_recv_SH, first.ids_recv_SC, first.w_recv_SC, nodes.intra, node_experts,
                                  None, kept_TK=first.ids_recv_SC < node_experts)
    layout = NodeDispatchLayout(
        intra=forwarded.layout,
        inter_group=nodes.inter,
        num_tokens=top_k_index.shape[0],
        send_splits=first.sizes.send_splits,
        recv_splits=first.sizes.recv_splits,
        token_src=first.token_src,
        source_reader=first.source_reader,
        source_weights=first.source_weights,
    )
    return DispatchedTokens(hidden_states=forwarded.hidden_states, expert_ids=forwarded.expert_ids,
                            weights=forwarded.weights, layout=layout)


def combine_by_node(expert_output: torch.Tensor, layout: NodeDispatchLayout) -> torch.Tensor:
    """The two-stage combine: each forwarded row summed over its node's expert ranks on the
    forwarding rank, then its one copy back over the network."""
    rows_SH = combine_to_ranks(expert_output, layout.intra)
    return return_rows(rows_SH, layout.inter_group, layout.send_splits, layout.recv_splits, layout.token_src,
                       layout.source_reader, layout.source_weights, padded=False)
