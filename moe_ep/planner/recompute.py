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
# The policies a split backward runs under (ZB-V, DualPipeV: the input gradients, then the weight
# gradients in a second autograd pass, which recomputes again): "selective" replays the outputs its
# forward kept once, and "attention" torch's composable checkpoint cannot recompute twice.
SPLIT_BACKWARD_POLICIES = ("none", "full")


def check_split_backward_recompute(name: str, policy: str, schedule: str, splits_backward: bool) -> None:
    """Refuse a recompute ``policy`` (the argument ``name``) that ``schedule`` cannot run."""
    if splits_backward and policy not in SPLIT_BACKWARD_POLICIES:
        raise ValueError(
            f"{name}={policy!r} cannot run under schedule={schedule!r}: its backward runs in two autograd passes "
            f"(input, then weight gradients), and the {policy!r} recompute runs once per forward; use "
            f"{' or '.join(map(repr, SPLIT_BACKWARD_POLICIES))}, or a schedule without a split backward"
        )


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


def recompute_passes(policy: str, splits_backward: bool) -> int:
    """How often a layer's backward recomputes what ``policy`` dropped: once, but under a split
    backward (``splits_backward``: ZB-V, DualPipeV) twice, once in the input-gradient pass and once
    in the weight-gradient pass (``moe_ep.parallel.pipeline.weight_pass``: once for all of its
    parameter groups); 0 for ``"none"``."""
    if policy == "none":
        return 0
    return 2 if splits_backward else 1

DESCRIPTIONS = {
    "none": "none",
    "full": "full (every decoder layer)",
    "selective": "selective (norms, rotary, gated activations, casts; GEMM and expert outputs kept)",
    "attention": "attention (each layer's attention block)",
}
