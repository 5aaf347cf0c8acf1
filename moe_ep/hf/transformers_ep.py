"""Our dispatcher as an entry of transformers' expert-parallel registry
(``transformers.distributed.expert_parallel.EPImplementationInterface``), so that
``DistributedConfig(ep_size=N, ep_implementation="moe_ep")`` uses it. The registry exists in
recent transformers 5.x only; ``register_transformers_ep`` says whether it found one."""

from __future__ import annotations

import importlib.util

EP_IMPLEMENTATION = "moe_ep"
_REGISTRY_MODULE = "transformers.distributed.expert_parallel"


def _registry_module():
    # find_spec of a dotted name imports its parents and raises when one is missing: each level
    # is looked up in turn, so a transformers without any part of the path answers None.
    parts = _REGISTRY_MODULE.split(".")
    if any(importlib.util.find_spec(".".join(parts[:i])) is None for i in range(1, len(parts) + 1)):
        return None
    module = importlib.import_module(_REGISTRY_MODULE)
    return module if hasattr(module, "EPImplementationInterface") else None


def _tp_slice(t, tp_mesh):
    """This rank's rows of a batch its tensor-parallel group shares: Replicate -> Shard(0) is a
    local chunk, whose backward all-gathers the rows' gradients (each rank's are partial)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return DTensor.from_local(t, tp_mesh, [Replicate()], run_check=False).redistribute(tp_mesh, [Shard(0)]).to_local()


def _tp_gather(rows, tp_mesh, num_tokens: int):
    """The group's row slices back into the whole batch on every rank (one all-gather, uneven or
    empty slices too); the backward keeps this rank's rows of the gradient."""
    from torch.distributed.tensor import DTensor, Shard

    hidden = rows.shape[1]
    return DTensor.from_local(rows.contiguous(), tp_mesh, [Shard(0)], shape=(num_tokens, hidden),
                              stride=(hidden, 1)).full_tensor()


def _implementation_class(module):
    from ..dispatch import dispatch
    from ..dispatch.dispatcher import combine_checked, join_checked

    class MoeEpAllToAll(module.EPImplementation):
        """Tokens go once to each rank owning one of their experts; the expert rank applies the
        routing weights and reduces; one row per (token, rank) comes back. The experts run with
        their own forward (any experts implementation) on local ids and the received weights.

        With tensor parallelism the ranks of a TP group hold the same batch: each dispatches its
        slice of it (as transformers' all-to-all does), so a token goes through the experts once,
        and the outputs are all-gathered back over the TP group."""

        def __init__(self, experts, ep_mesh, tp_mesh):
            super().__init__(experts, ep_mesh, tp_mesh)
            self.group = ep_mesh.get_group()
            self.num_experts = self.num_local_experts * ep_mesh.size()

        def __call__(self, hidden_states, top_k_index, top_k_weights):
            num_tokens = hidden_states.shape[0]
            tp = self.tp_mesh.size() > 1
            if tp:
                hidden_states, top_k_index, top_k_weights = (
                    _tp_slice(t, self.tp_mesh) for t in (hidden_states, top_k_index, top_k_weights)
                )
            y_TH = self._dispatch_combine(hidden_states, top_k_index, top_k_weights)
            return _tp_gather(y_TH, self.tp_mesh, num_tokens) if tp else y_TH

        def _dispatch_combine(self, hidden_states, top_k_index, top_k_weights):
            tokens = dispatch(hidden_states, top_k_index, top_k_weights, group=self.group, num_experts=self.num_experts)
            if tokens.layout.num_pairs:
                expert_output = self.experts_forward(tokens.hidden_states, tokens.expert_ids, tokens.weights)
            else:
                # Nothing to compute here. The experts still run, on one zero row (local expert 0,
                # weight 0) cut off again: their parameters get a zero gradient, so the FSDP
                # reduce-scatter of the expert shards runs on this rank as on its peers, and no
                # experts implementation has to cope with an empty batch.
                placeholder = tokens.hidden_states.new_zeros(1, tokens.hidden_states.shape[1])
                expert_output = self.experts_forward(
                    placeholder, tokens.expert_ids.new_zeros(1, 1), tokens.weights.new_zeros(1, 1)
                )[:0]
            # The experts' own forward may cut its output off the graph (eager experts answer zero
            # rows with a fresh zeros_like); joined, this rank still enters both backward all-to-alls.
            expert_output = join_checked(expert_output.to(hidden_states.dtype), tokens)
            return combine_checked(expert_output, tokens.layout)

    return MoeEpAllToAll


def register_transformers_ep() -> bool:
    """Register ``"moe_ep"`` in transformers' expert-parallel registry. Idempotent. Returns False,
    registering nothing, when the installed transformers has no such registry."""
    module = _registry_module()
    if module is None:
        return False
    current = module.EPImplementationInterface._global_mapping.get(EP_IMPLEMENTATION)
    if current is not None and current.__module__ == __name__:
        return True
    if current is not None:
        raise ValueError(
            f"transformers' expert-parallel implementation {EP_IMPLEMENTATION!r} is already registered by "
            f"{current.__module__}.{current.__qualname__}; moe_ep will not overwrite it"
        )
    module.EPImplementationInterface.register(EP_IMPLEMENTATION, _implementation_class(module))
    return True
