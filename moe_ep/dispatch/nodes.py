"""Node-aware dispatch and combine: each token crosses the network at most once per destination
node (DeepEP's internode scheme, on ``torch.distributed`` collectives).

The ``ep`` group of ``nodes x node_size`` ranks, numbered node by node, is split in two:
``inter``, this rank and the ranks with its local index on every node (node order), and
``intra``, this rank's node (local order). Rank ``n node_size + g`` of the ep group is rank
``n`` of its inter group and rank ``g`` of its intra group; node ``n`` owns experts
``[n G L, (n+1) G L)`` (``G = node_size``).

- Dispatch, stage 1 (``inter``): one row per (token, destination node) to the rank with this
  rank's local index there, through the single-stage exchange (``rank_exchange``'s phases)
  with the node as the "rank" and its ``G L`` experts as the "local" ones: a row carrying
  several of the node's experts carries their node-local ids and weights.
- Stage 2 (``intra``): the forwarding rank dispatches each received row, through the same
  exchange, to the ranks of its node that own one of the row's experts (``plan_forwarding``,
  the empty columns of a row masked), so a row reaches each expert rank once.
- Combine, reversed: the expert ranks weight and sum as in the single-stage combine, and the
  forwarding rank sums the outputs of the node's ranks for each row (float32, fixed order)
  before the one copy goes back over the network; the source applies a single row's routing
  weight and sums its tokens' rows.

Counts (DeepEP's notify step): a forwarding rank's stage-2 sends are known at the sources, since
a forwarded row goes to the ranks of the node that the single-stage plan of its token names, with
the same keys. So each source sends, in stage 1's count exchange, beside its rows' counts per
node, what those rows add to each of that node's ranks (``plan_by_node``); the forwarding rank
sums them and exchanges them over its node; then both stages' sizes are read with ONE host sync
per layer (``exchange_node_counts``), as in the single-stage scheme, which also lets
``overlap_chunks`` chunks share it (``moe_ep.dispatch.overlap``).

Dropless only. Selection: ``dispatch_mode`` "auto" uses this scheme when the ep group spans
several whole nodes (node size from the launcher's ``LOCAL_WORLD_SIZE``, or given) and the
dispatch is dropless; "node" pins it, "flat" the single-stage scheme."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .layout import DispatchedTokens, NodeDispatchLayout
from .rank_exchange import (
    ExchangeSizes, RowPlan, SentRows, all_to_all_counts, combine_to_ranks, dispatched_tokens, plan_rows, return_rows,
    send_planned_rows,
)

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
    if (node_groups, group) not in _CHECKED_NODE_GROUPS:  # the members once per pair: this runs every layer
        _check_members(node_groups, group, size)
        _CHECKED_NODE_GROUPS.add((node_groups, group))


# (NodeGroups, ep group) pairs whose members check_node_groups found right.
_CHECKED_NODE_GROUPS: set = set()


def _check_members(node_groups: NodeGroups, group, size: int) -> None:
    """The members, not only this rank's place in each group: groups that hold this rank at the
    right place can still be the wrong ones (inter and intra swapped: ranks 0 and 3 of 2 x 2
    passed and waited for the others in the exchange while ranks 1 and 2 raised)."""
    rank, ep_ranks = dist.get_rank(group), dist.get_process_group_ranks(group)
    node, local = divmod(rank, size)
    expected = {"intra": ep_ranks[node * size:(node + 1) * size], "inter": ep_ranks[local::size]}
    for name, members in expected.items():
        held = dist.get_process_group_ranks(getattr(node_groups, name))
        if sorted(held) != sorted(members):
            raise ValueError(
                f"node_groups do not match the ep group: rank {rank} of it (global ranks {ep_ranks}, numbered node "
                f"by node) needs node_groups.{name} of global ranks {members}, got {held} (build them with "
                "moe_ep.dispatch.split_by_node)"
            )
    inter_rank, intra_rank = dist.get_rank(node_groups.inter), dist.get_rank(node_groups.intra)
    if (inter_rank, intra_rank) != (node, local):
        raise ValueError(
            f"node_groups do not match the ep group: rank {rank} of it must be rank {node} of node_groups.inter and "
            f"rank {local} of node_groups.intra, it is {inter_rank} and {intra_rank} (ranks numbered node by node: "
            "build them with moe_ep.dispatch.split_by_node)"
        )


def check_node_size(node_size) -> None:
    if node_size is not None and (isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1):
        raise ValueError(
            f"node_size must be a positive int or None (the launcher's {LOCAL_WORLD_SIZE}), got {node_size!r}")


def check_dispatch_mode(dispatch_mode, capacity_factor) -> None:
    if dispatch_mode not in DISPATCH_MODES:
        raise ValueError(f"dispatch_mode must be one of {DISPATCH_MODES}, got {dispatch_mode!r}")
    if dispatch_mode == "node" and capacity_factor is not None:
        raise ValueError(
            f"dispatch_mode='node' is dropless only, so capacity_factor must be None, got {capacity_factor!r} "
            "(dispatch_mode='auto' uses the single-stage dispatch in capacity mode)"
        )


def launcher_node_size() -> int | None:
    """The processes per node as the launcher says (``LOCAL_WORLD_SIZE``), None when unset."""
    value = os.environ.get(LOCAL_WORLD_SIZE)
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"the environment variable {LOCAL_WORLD_SIZE} must be a positive int, got {value!r}")
    return int(value)


def node_size_for(dispatch_mode: str, ep: int, node_size: int | None, capacity_factor: float | None) -> int | None:
    """The node size the ep group is split by, or None for the single-stage dispatch: "auto" splits
    a dropless ep group that spans several whole nodes; "node" needs one and says why not.
    ``node_size`` None: the launcher's."""
    check_dispatch_mode(dispatch_mode, capacity_factor)
    check_node_size(node_size)
    if dispatch_mode == "flat":
        return None
    size = launcher_node_size() if node_size is None else node_size
    spans_nodes = size is not None and ep > size and ep % size == 0
    if dispatch_mode == "auto":
        return size if spans_nodes and capacity_factor is None else None
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
    if isinstance(ep_groups, (str, bytes)) or not isinstance(ep_groups, Sequence) or not all(
            isinstance(g, Sequence) and all(isinstance(r, int) and not isinstance(r, bool) for r in g)
            for g in ep_groups):
        raise TypeError(f"ep_groups must be a list of every ep group's global ranks (lists of ints, in ep order), "
                        f"got {type(ep_groups).__name__}: {ep_groups!r}")
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


@dataclass(frozen=True)
class NodePlan:
    """What a source knows of both stages of one dispatch before the counts: its stage-1 rows
    (one per token and destination node), and for each destination node the ``[node_size, C]``
    counts those rows add to the stage-2 sends of the rank forwarding them there, flattened."""

    first: RowPlan
    forwarded_NC: torch.Tensor  # [nodes, node_size * C] int32
    rank_experts: int  # L, the experts of one rank
    rank_multi: bool  # stage-2 rows can carry several experts


def plan_by_node(top_k_index, top_k_weights, nodes: NodeGroups, num_experts: int) -> NodePlan:
    """``NodePlan`` of this rank's tokens. A forwarded row's columns are its token's experts on
    that node, so its stage-2 rows are the single-stage plan's rows of the token to that node's
    ranks, with the same keys: their counts, grouped by node, are what each forwarding rank sends."""
    ep = nodes.num_nodes * nodes.node_size
    first = plan_rows(top_k_index, top_k_weights, nodes.num_nodes, num_experts)
    ranks = plan_rows(top_k_index, top_k_weights, ep, num_experts)
    return NodePlan(first, ranks.send_RC.reshape(nodes.num_nodes, -1), ranks.experts_per_rank, ranks.multi)


@dataclass(frozen=True)
class NodeCounts:
    """Both stages' received counts and sizes of one dispatch (``exchange_node_counts``)."""

    first_recv_RC: torch.Tensor
    first: ExchangeSizes
    second_recv_RC: torch.Tensor
    second: ExchangeSizes


def exchange_node_counts(plans: list[NodePlan], nodes: NodeGroups) -> list[NodeCounts]:
    """Both stages' counts of several dispatches (``overlap_chunks``' chunks): one collective over
    each group, and ONE host sync for them all."""
    widths = [plan.first.send_RC.shape[1] + plan.forwarded_NC.shape[1] for plan in plans]
    sent = torch.cat([torch.cat([plan.first.send_RC, plan.forwarded_NC], dim=1) for plan in plans], dim=1)
    firsts, seconds = [], []
    for plan, block in zip(plans, all_to_all_counts(sent, nodes.inter).split(widths, dim=1)):
        first_columns = plan.first.send_RC.shape[1]
        firsts.append(block[:, :first_columns])
        # What every node's sources route through this rank to each rank of its node.
        seconds.append(block[:, first_columns:].sum(0, dtype=torch.int32).view(nodes.node_size, -1))
    second_recv = all_to_all_counts(torch.cat(seconds, dim=1), nodes.intra).split([s.shape[1] for s in seconds],
                                                                                    dim=1)
    counts = []
    for plan, first_recv_RC, second_send_RC, second_recv_RC in zip(plans, firsts, seconds, second_recv):
        counts += [(plan.first.send_RC, first_recv_RC, plan.first.experts_per_rank, plan.first.multi),
                   (second_send_RC, second_recv_RC, plan.rank_experts, plan.rank_multi)]
    sizes = ExchangeSizes.dropless(counts)
    return [NodeCounts(first_recv_RC, first, second_recv_RC, second)
            for first_recv_RC, second_recv_RC, first, second in zip(firsts, second_recv, sizes[::2], sizes[1::2])]


def plan_forwarding(first: SentRows, nodes: NodeGroups, num_experts: int) -> RowPlan:
    """Stage 2's plan on the forwarding rank: each received row to the ranks of its node that own
    one of its experts; a row's empty columns (id ``node_size L``) go nowhere."""
    node_experts = num_experts // nodes.num_nodes
    return plan_rows(first.ids_recv_SC, first.w_recv_SC, nodes.node_size, node_experts,
                     kept_TK=first.ids_recv_SC < node_experts)


def node_dispatched_tokens(first: SentRows, second: SentRows, nodes: NodeGroups, num_tokens: int,
                           rank_experts: int, *, rows: bool = False) -> DispatchedTokens:
    """What this rank's experts compute (the pairs, or with ``rows`` the received rows; see
    ``DispatchedTokens``), and the layout of both stages for the way back."""
    forwarded = dispatched_tokens(second, nodes.intra, first.x_recv_SH.shape[0], rank_experts, rows=rows)
    layout = NodeDispatchLayout(
        intra=forwarded.layout,
        inter_group=nodes.inter,
        num_tokens=num_tokens,
        send_splits=first.sizes.send_splits,
        recv_splits=first.sizes.recv_splits,
        token_src=first.token_src,
        source_reader=first.source_reader,
        source_weights=first.source_weights,
    )
    return DispatchedTokens(hidden_states=forwarded.hidden_states, expert_ids=forwarded.expert_ids,
                            weights=forwarded.weights, layout=layout)


def dispatch_by_node(hidden_states, top_k_index, top_k_weights, nodes: NodeGroups, num_experts: int, *,
                     rows: bool = False) -> DispatchedTokens:
    """The two-stage dispatch (module docstring) on arguments ``dispatch`` validated."""
    plan = plan_by_node(top_k_index, top_k_weights, nodes, num_experts)
    [counts] = exchange_node_counts([plan], nodes)
    first = send_planned_rows(hidden_states, plan.first, counts.first_recv_RC, counts.first, nodes.inter,
                              padded=False)
    second = send_planned_rows(first.x_recv_SH, plan_forwarding(first, nodes, num_experts), counts.second_recv_RC,
                               counts.second, nodes.intra, padded=False)
    return node_dispatched_tokens(first, second, nodes, top_k_index.shape[0], plan.rank_experts, rows=rows)


def combine_by_node(expert_output: torch.Tensor, layout: NodeDispatchLayout) -> torch.Tensor:
    """The two-stage combine: each forwarded row summed over its node's expert ranks on the
    forwarding rank, then its one copy back over the network."""
    rows_SH = combine_to_ranks(expert_output, layout.intra)
    return return_rows(rows_SH, layout.inter_group, layout.send_splits, layout.recv_splits, layout.token_src,
                       layout.source_reader, layout.source_weights, padded=False)
