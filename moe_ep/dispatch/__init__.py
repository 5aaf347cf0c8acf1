"""Expert-parallel token dispatch: stateless ``dispatch`` / ``combine`` over a process group,
dropless or with a capacity, single-stage or node-aware (``NodeGroups``, ``split_by_node``)
(``join_to_dispatch`` for experts that may return a tensor outside the autograd graph), the
``moe_experts_ep`` layer built on them, the dispatcher object that ``moe_ep.parallelize`` binds
to transformers experts modules, and the byte count of moe_ep's schemes and transformers'.
Nothing here knows transformers (its expert-parallel registry entry is
``moe_ep.hf.transformers_ep``)."""

from .capacity import capacity_keep_mask, expert_capacity
from .dispatcher import combine, dispatch, join_to_dispatch
from .expert_parallel import ExpertParallelDispatcher, moe_experts_ep
from .layout import DispatchedTokens, DispatchLayout, NodeDispatchLayout
from .nodes import DISPATCH_MODES, NodeGroups, split_by_node
from .wire_bytes import (
    CountExchangeBytes, NodeWireBytes, WireBytes, count_exchange_bytes, node_count_exchange_bytes, node_wire_bytes,
    wire_bytes,
)

__all__ = [
    "CountExchangeBytes",
    "DISPATCH_MODES",
    "DispatchLayout",
    "DispatchedTokens",
    "ExpertParallelDispatcher",
    "NodeDispatchLayout",
    "NodeGroups",
    "NodeWireBytes",
    "WireBytes",
    "capacity_keep_mask",
    "combine",
    "count_exchange_bytes",
    "dispatch",
    "expert_capacity",
    "join_to_dispatch",
    "moe_experts_ep",
    "node_count_exchange_bytes",
    "node_wire_bytes",
    "split_by_node",
    "wire_bytes",
]
