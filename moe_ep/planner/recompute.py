"""Activation recomputation policies: which parts of each decoder layer the backward recomputes
instead of keeping. ``moe_ep.parallelize(activation_checkpointing=...)`` applies them
(``moe_ep.parallel.recompute``); the planner models their saved bytes (``activations``) and their
extra work (``compute``, ``comm``) and chooses among them.

- ``"none"``: everything autograd saves is kept.
- ``"full"``: whole decoder layers: each keeps its input; the backward runs the layer's forward
  again, expert GEMMs and all-to-alls included.
- ``"selective"``: the cheap, memory-heavy parts: the outputs of the GEMMs (projections, router,
  dense MLP and shared expert), of the attention kernel and of moe_ep's expert and router ops are
  kept; the norms, rotary embedding, gated activations, casts, residual adds, the routing
  metadata and the dispatcher's row movements and all-to-alls run again.
- ``"attention"``: the attention block only (its projections, q/k norms, rotary embedding, the
  attention kernel): it keeps its input; the MLP and the experts keep what they save.
"""

from __future__ import annotations

RECOMPUTE_POLICIES = ("none", "full", "selective", "attention")
# The policies compiled dense blocks run under (``moe_ep.parallel.compile`` says why not the others).
COMPILED_BLOCKS_POLICIES = ("none", "full")


def recompute_policy(name: str, value) -> str:
    """``value`` as a policy name: a name of ``RECOMPUTE_POLICIES``, or a bool (True: ``"full"``,
    False: ``"none"``, the meaning the option had before it took names). ``name`` is the argument
    an error names."""
    if isinstance(value, bool):
        return "full" if value else "none"
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a bool or one of {RECOMPUTE_POLICIES}, got {type(value).__name__}")
    if value not in RECOMPUTE_POLICIES:
        raise ValueError(f"{name} must be a bool or one of {RECOMPUTE_POLICIES}, got {value!r}")
    return value

# The policies whose recompute runs the expert-parallel dispatcher (and its all-to-alls) again.
RERUN_DISPATCH = ("full", "selective")

DESCRIPTIONS = {
    "none": "none",
    "full": "full (every decoder layer)",
    "selective": "selective (norms, rotary, gated activations, casts; GEMM and expert outputs kept)",
    "attention": "attention (each layer's attention block)",
}
