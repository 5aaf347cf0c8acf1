"""The expert-parallel MoE layer: dispatch, the local experts (``moe_experts`` on this rank's
shard, local ids), combine. ``moe_experts_ep`` is the functional form; ``ExpertParallelDispatcher``
is what ``moe_ep.parallel.parallelize`` binds to a transformers experts module
(``moe_ep.hf.binding``), which the ``"moe_ep"`` experts implementation calls."""

from __future__ import annotations

import struct

import torch
import torch.distributed as dist

from ..ops.activations import ACTIVATIONS, check_activation
from ..ops.backend import resolve_backend
from ..ops.experts import check_expert_weights, run_experts
from ..ops.validate import FLOAT_DTYPES, check_on_device, check_tensor, has_values
from .capacity import check_capacity_factor
from .dispatcher import check_dispatch_args, check_num_experts, combine_checked, dispatch_checked, join_checked
from .lanes import lane_group
from .nodes import NodeGroups, check_node_groups
from .overlap import check_overlap_chunks, moe_experts_overlapped


def moe_experts_ep(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_local: torch.Tensor,
    down_local: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    capacity_factor: float | None = None,
    activation: str = "silu",
    backend: str | None = None,
    node_groups: NodeGroups | None = None,
    overlap_chunks: int = 1,
) -> torch.Tensor:
    """``moe_experts`` with the ``E = L * ep`` experts spread over ``group``: this rank holds
    experts ``[rank L, (rank+1) L)`` as ``gate_up_local [L, 2I, H]`` and ``down_local [L, H, I]``.
    ``top_k_index`` holds global ids; a token may name one expert in several slots, as with
    ``moe_experts`` (they travel as one pair of the summed weight, ``moe_ep.dispatch.repeats``).
    Returns ``[T, H]`` for this rank's tokens. Collective.
    ``node_groups``: the node-aware dispatch (``moe_ep.dispatch.nodes``), None the single-stage.
    ``overlap_chunks``: 1 runs dispatch, experts and combine one after another; ``n > 1`` cuts the
    tokens into ``n`` chunks of consecutive tokens pipelined on asynchronous all-to-alls, so one
    chunk's exchanges travel while another chunk's experts compute, forward and backward
    (``moe_ep.dispatch.overlap``). The same outputs and gradients (the experts' weight gradients
    summed over the chunks, within float32 rounding); the count exchange of all chunks is still
    one collective per group and one host sync per layer; dropless only (ValueError with a
    ``capacity_factor``), single-stage or node-aware.
    Every argument is checked here, once: the dispatch, the local experts and the combine that
    follow take what this call validated and what the dispatch made."""
    check_tensor("gate_up_local", gate_up_local, ndim=3)
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup, got {type(group).__name__}")
    if gate_up_local.shape[0] == 0:
        raise ValueError(f"gate_up_local must hold this rank's experts (at least one), got shape "
                         f"{tuple(gate_up_local.shape)}")
    num_experts = gate_up_local.shape[0] * dist.get_world_size(group)
    check_dispatch_args(hidden_states, top_k_index, top_k_weights, group, num_experts)
    check_expert_weights(hidden_states, gate_up_local, down_local, names=("gate_up_local", "down_local"))
    check_capacity_factor(capacity_factor)
    check_node_groups(node_groups, group, capacity_factor)
    check_overlap_chunks(overlap_chunks, capacity_factor)
    check_activation(activation)
    backend = resolve_backend(backend, hidden_states.device)
    hidden_states, top_k_weights = joined_to_the_graph(hidden_states, top_k_weights, gate_up_local, down_local)
    check_ranks_agree(group, {
        "experts per rank (gate_up_local.shape[0])": gate_up_local.shape[0],
        "hidden size (hidden_states.shape[1])": hidden_states.shape[1],
        "top_k (top_k_index.shape[1])": top_k_index.shape[1],
        "hidden_states.dtype": hidden_states.dtype,
        "capacity_factor": capacity_factor,
        "node_groups (nodes)": None if node_groups is None else node_groups.num_nodes,
        "overlap_chunks": overlap_chunks,
        "activation": activation,
        "backend 'auto' (a collective on its first call)": backend == "auto",
        "hidden_states requires grad (backward exchanges)": hidden_states.requires_grad,
        "top_k_weights requires grad (backward exchanges)": top_k_weights.requires_grad,
    }, hidden_states.device, node_groups)
    if overlap_chunks > 1:
        return moe_experts_overlapped(hidden_states, top_k_index, top_k_weights, gate_up_local, down_local,
                                      group=group, num_experts=num_experts, activation=activation, backend=backend,
                                      chunks=overlap_chunks, node_groups=node_groups)
    # The received rows go to the experts as they came, each with its local experts: the experts
    # gather each pair's row and sum each row's pairs in their own kernels.
    tokens = dispatch_checked(hidden_states, top_k_index, top_k_weights, group, num_experts, capacity_factor,
                              node_groups, rows=True)
    out_SH = run_experts(tokens.hidden_states, tokens.expert_ids, tokens.weights, gate_up_local, down_local,
                         activation, backend, group, tokens.layout.num_pairs)
    # The experts keep even an empty batch in the graph, but the backward all-to-alls that every
    # rank must enter should not hang on that promise.
    return combine_checked(join_checked(out_SH, tokens), tokens.layout)


# (group, configuration) pairs every rank of the group was found to share (check_ranks_agree).
_AGREED: set = set()


def _code(value) -> int:
    """A field of ``check_ranks_agree`` as a non-negative int below 2**62 that equal values give
    on every rank (the halved float64 bits of a float, 0 for None)."""
    if value is None:
        return 0
    if isinstance(value, bool):
        return 1 + value
    if isinstance(value, int):
        return 1 + value
    if isinstance(value, torch.dtype):
        return 1 + FLOAT_DTYPES.index(value)
    if isinstance(value, str):
        return 1 + ACTIVATIONS.index(value)
    return 1 + (int.from_bytes(struct.pack("<d", float(value)), "little") >> 2)


def check_ranks_agree(group: dist.ProcessGroup, fields: dict, device: torch.device,
                      node_groups: NodeGroups | None = None) -> None:
    """That every rank of ``group`` called the layer with the same configuration: the sizes of its
    exchanges (experts per rank, H, top-k, dtype, capacity, nodes, chunks) and which of its
    collectives it enters (the selector's, the backward exchanges). A rank that differs would
    exchange buffers of other sizes, which gloo answers by aborting the process (SIGABRT, no Python
    error) and NCCL by a hang or garbage, or skip a collective the others enter. One all-reduce of
    ``2 x len(fields)`` int64 the first time a rank sees a configuration on ``group`` (every rank
    sees it at the same call when they agree), none after: a configuration that one rank changes
    later, alone, is not caught. The verdict is checked as the other value checks are (queued on
    the device on CUDA: no host sync). With ``node_groups`` the all-reduce runs inside each node,
    then across the nodes (the groups the node-aware dispatch uses; together they span ``group``)."""
    if torch.compiler.is_compiling():
        return
    codes = [_code(value) for value in fields.values()]
    key = (group, tuple(codes))
    if key in _AGREED:
        return
    mine = torch.tensor(codes, dtype=torch.int64, device=device)
    both = torch.cat([mine, -mine])
    for over in ([group] if node_groups is None else [node_groups.intra, node_groups.inter]):
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=lane_group(over))
    if not has_values(both):  # fake tensors (the planner's fake process group): nothing to compare
        return
    high, low = both[: mine.numel()], -both[mine.numel():]
    try:
        check_on_device((high == low).all(), "moe_experts_ep: the ranks of the expert-parallel group were called "
                                             f"with different configurations ({', '.join(fields)})")
    except ValueError:  # on the CPU, where the verdict is read at once: name the differences
        differ = [f"{name}: {value!r} on this rank, not on every rank"
                  for (name, value), hi, lo in zip(fields.items(), high.tolist(), low.tolist()) if hi != lo]
        raise ValueError(f"moe_experts_ep: the ranks of the expert-parallel group were called with different "
                         f"configurations (rank {dist.get_rank(group)} of {dist.get_world_size(group)} here): "
                         + "; ".join(differ)) from None
    _AGREED.add(key)


def joined_to_the_graph(hidden_states, top_k_weights, *expert_weights):
    """``hidden_states`` and ``top_k_weights`` requiring grad wherever the step backpropagates
    into the experts (grad enabled, expert weights that require grad: the same on every rank of
    one model). A rank runs the backward exchanges of the rows and routing it sent only where
    those require grad: a rank without tokens passing plain empty tensors finished its backward
    while its peers waited for it in the exchange. The price where they did not require grad on any
    rank (a frozen router, experts-only fine-tuning's first MoE layer): those exchanges, whose
    gradients are dropped. With frozen experts the ranks must pass them alike themselves (a model
    does: its hidden states require grad on every rank, a rank without tokens included)."""
    if not (torch.is_grad_enabled() and any(w.requires_grad for w in expert_weights)):
        return hidden_states, top_k_weights
    return tuple(t if t.requires_grad else t.detach().requires_grad_() for t in (hidden_states, top_k_weights))


def local_shard(param: torch.Tensor) -> torch.Tensor:
    """The rank's own experts of an expert weight: the local tensor of a DTensor sharded over
    the ``ep`` mesh (differentiable: the gradient goes back as a DTensor), else the tensor."""
    from torch.distributed.tensor import DTensor

    return param.to_local() if isinstance(param, DTensor) else param


class ExpertParallelDispatcher:
    """Runs a transformers experts module's forward expert-parallel over ``group``.

    Called as ``dispatcher(module, hidden_states, top_k_index, top_k_weights)`` by the ``"moe_ep"``
    experts implementation; reads the module's ``gate_up_proj`` / ``down_proj`` (this rank's
    ``L = num_experts / ep`` experts, DTensor or plain) at call time, so FSDP's unsharding and
    resharding around the forward are respected. Holds no per-call state. ``node_groups``: the
    node-aware dispatch (``moe_ep.dispatch.split_by_node`` of ``group``), None the single-stage.
    ``overlap_chunks``: ``moe_experts_ep``'s (n > 1: the exchanges of n chunks of the tokens
    overlapped with the experts; dropless only)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_experts: int,
        *,
        activation: str = "silu",
        capacity_factor: float | None = None,
        backend: str | None = None,
        node_groups: NodeGroups | None = None,
        overlap_chunks: int = 1,
    ):
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group must be a torch.distributed.ProcessGroup, got {type(group).__name__}")
        experts_per_rank = check_num_experts(num_experts, dist.get_world_size(group))
        check_activation(activation)
        check_capacity_factor(capacity_factor)
        check_node_groups(node_groups, group, capacity_factor)
        check_overlap_chunks(overlap_chunks, capacity_factor)
        self.group = group
        self.num_experts = num_experts
        self.experts_per_rank = experts_per_rank
        self.activation = activation
        self.capacity_factor = capacity_factor
        self.backend = backend
        self.node_groups = node_groups
        self.overlap_chunks = overlap_chunks

    def __repr__(self) -> str:
        mode = "dropless" if self.capacity_factor is None else f"capacity_factor={self.capacity_factor}"
        if self.node_groups is not None:
            mode += f", node-aware over {self.node_groups.num_nodes} nodes x {self.node_groups.node_size}"
        if self.overlap_chunks > 1:
            mode += f", overlap_chunks={self.overlap_chunks}"
        return (
            f"ExpertParallelDispatcher(ep={dist.get_world_size(self.group)}, num_experts={self.num_experts}, "
            f"{mode}, activation={self.activation!r})"
        )

    def __call__(self, module, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        gate_up = local_shard(module.gate_up_proj)
        down = local_shard(module.down_proj)
        if gate_up.shape[0] != self.experts_per_rank:
            raise ValueError(
                f"{type(module).__name__}.gate_up_proj holds {gate_up.shape[0]} experts on this rank, the dispatcher "
                f"expects {self.experts_per_rank} (num_experts={self.num_experts} over ep="
                f"{dist.get_world_size(self.group)}); was the module sharded by moe_ep.parallel.parallelize?"
            )
        y_TH = moe_experts_ep(
            hidden_states, top_k_index, top_k_weights, gate_up, down,
            group=self.group, capacity_factor=self.capacity_factor,
            activation=self.activation, backend=self.backend, node_groups=self.node_groups,
            overlap_chunks=self.overlap_chunks,
        )
        return y_TH.to(hidden_states.dtype)
