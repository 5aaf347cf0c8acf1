"""Compiled dense blocks: ``torch.compile`` on the dense parts of every decoder layer, in place.

What is compiled. Inside each decoder layer, every submodule that holds no experts module is
compiled whole with ``fullgraph=True`` (attention, norms, the router, shared experts); one that
holds the experts module (the MoE block) is entered and its other children are compiled the same
way. The experts module and the layer itself stay eager: each is an FSDP2 unit, and FSDP2's hooks
are ``torch._dynamo.disable``-d, so a compiled layer would break its graph at the experts' hooks
and the expert-parallel dispatcher's count exchange (a host sync), and a graph break under
activation checkpointing sends the whole checkpointed layer back to eager (torchtitan compiles
its MoE blocks the same way for that reason). ``fullgraph=True`` makes any graph break in the
dense path an error instead of a silent slowdown. moe_ep's ops (the fused router, the experts)
are custom ops with fake implementations, so a compiled region calls them as one opaque op.

In place (``nn.Module.compile``): parameter names, state-dict keys and the modules' hooks stay
what they were, so FSDP2, checkpoints and TrainStep's hooks see the same model."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch._functorch.config
from torch import nn

from ..hf.layout import experts_modules
from .fsdp import transformer_blocks

# torch.compile's keywords that compile_blocks passes on; fullgraph is always True (a graph break
# in the dense path is an error).
COMPILE_OPTIONS = ("backend", "mode", "options", "dynamic")

# The recompute policies that compiled dense blocks cannot run under, and why.
_UNCOMPILABLE_RECOMPUTE = {
    "selective": "its checkpoint runs each layer under a TorchDispatchMode, under which torch.compile does not trace "
                 "(a compiled region would find no frame to compile)",
    "attention": "its hook-based checkpoint of self_attn would run inside the compiled attention region",
}


def check_compilable_recompute(name: str, policy: str) -> None:
    """Refuse compiled dense blocks (asked for by ``name``) under the recompute ``policy`` (a name
    of ``moe_ep.planner.recompute``) when they cannot run together."""
    if policy in _UNCOMPILABLE_RECOMPUTE:
        raise ValueError(f"{name} with activation_checkpointing={policy!r}: {_UNCOMPILABLE_RECOMPUTE[policy]}; "
                         "compiled dense blocks run with 'full' or 'none'")


def compile_options(name: str, value) -> dict | None:
    """``value`` (False, True or a dict of torch.compile keywords) as the keywords to compile with,
    None for no compilation; ``name`` is the argument's name in the error."""
    if value is False or value is None:
        return None
    if value is True:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a bool or a dict of torch.compile keywords {COMPILE_OPTIONS}, got "
                        f"{type(value).__name__}")
    unknown = sorted(set(value) - set(COMPILE_OPTIONS))
    if unknown:
        raise ValueError(f"{name} takes the torch.compile keywords {COMPILE_OPTIONS} (fullgraph is always True), "
                         f"got {unknown}")
    backend = value.get("backend", "inductor")
    if not (isinstance(backend, str) or callable(backend)):
        raise TypeError(f"{name}['backend'] must be a backend name or a callable, got {type(backend).__name__}")
    if value.get("mode") is not None and not isinstance(value["mode"], str):
        raise TypeError(f"{name}['mode'] must be a str or None, got {type(value['mode']).__name__}")
    if value.get("options") is not None and not isinstance(value["options"], Mapping):
        raise TypeError(f"{name}['options'] must be a dict or None, got {type(value['options']).__name__}")
    if value.get("mode") is not None and value.get("options") is not None:
        raise ValueError(f"{name} gives both 'mode' and 'options'; torch.compile takes one of them")
    if value.get("dynamic") not in (None, True, False):
        raise TypeError(f"{name}['dynamic'] must be a bool or None, got {value['dynamic']!r}")
    return dict(value)


def dense_regions(layer: nn.Module, experts: set[nn.Module]) -> list[nn.Module]:
    """The largest submodules of ``layer`` that hold none of ``experts``, in module order. torch's
    own modules (a bare ``nn.Linear`` gate, a ``ModuleList``) are entered instead: dynamo does not
    trace them as a compiled call of their own, and one GEMM alone gains nothing."""
    regions = []
    for child in layer.children():
        if child in experts:
            continue
        if type(child).__module__.startswith("torch.") or any(m in experts for m in child.modules()):
            regions.extend(dense_regions(child, experts))
        else:
            regions.append(child)
    return regions


def compiled_regions(model: nn.Module) -> list[str]:
    """The names of ``model``'s submodules compiled in place (``nn.Module.compile``)."""
    return [name for name, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None]


def check_compilable(model: nn.Module) -> None:
    """Refuse a model whose dense blocks cannot be compiled: one with submodules compiled already
    (compiling again would compile the compiled call), or one that records its router logits
    (``output_router_logits``: transformers' recording hooks read a ContextVar, which dynamo cannot
    trace in a fullgraph region, so the first step failed deep inside dynamo)."""
    already = compiled_regions(model)
    if already:
        raise ValueError(f"{type(model).__name__} has submodules compiled already ({already[0]!r}, ...): compile "
                         "its dense blocks once, with parallelize(compile_blocks=...) or the Trainer's torch_compile")
    config = getattr(model, "config", None)
    if any(getattr(c, "output_router_logits", False) for c in (config, getattr(config, "text_config", None))):
        raise ValueError(f"{type(model).__name__} records its router logits (config.output_router_logits=True), "
                         "whose hooks compiled blocks cannot trace: compile no blocks, or set it to False (the "
                         "Trainer's load-balancing loss with it; TrainStep computes one itself: aux_loss_coef)")


def compile_dense_blocks(model: nn.Module, options: dict, *, split_backward: bool = False) -> None:
    """Compile the dense regions of each of ``model``'s decoder layers in place with ``options``
    (torch.compile's keywords, from :func:`compile_options`) and ``fullgraph=True``.
    ``split_backward``: a pipeline schedule will run input-gradient passes that keep the graph
    (ZB-V, DualPipeV), which AOTAutograd's donated buffers refuse ("compiled with non-empty
    donated buffers which requires ... retain_graph=False"); they are then switched off, for the
    process (AOTAutograd reads the setting when it compiles, at the first call, and torch keeps
    it process-wide), at the cost of the few buffers the backward could have reused."""
    check_compilable(model)
    if split_backward:
        torch._functorch.config.donated_buffer = False
    experts = {m for _, m in experts_modules(model)}
    blocks = transformer_blocks(model)
    regions = [region for block in blocks for region in dense_regions(block, experts)]
    _allow_a_graph_per_layer(len(blocks), len(regions))
    for region in regions:
        region.compile(fullgraph=True, **options)


# Graphs one compiled region's code may need per layer with a KV cache: the prefill's and the
# decode's (static, then dynamic, shapes), with room to spare.
GRAPHS_PER_LAYER = 4


def _allow_a_graph_per_layer(layers: int, regions: int) -> None:
    """The layers' regions of one kind share their code, so dynamo counts their graphs together.
    Without a KV cache they share one; with one (a forward with ``use_cache=True``, transformers'
    default, and ``generate``) the cache's update guards on each layer's index and cache entry, so
    every layer compiles its own, and past torch's recompile limit (8 graphs per code object)
    ``fullgraph=True`` made a model of more than 8 layers fail with FailOnRecompileLimitHit. The
    limits are raised for the process to what the model needs, never lowered."""
    import torch._dynamo.config as dynamo

    dynamo.recompile_limit = max(dynamo.recompile_limit, GRAPHS_PER_LAYER * layers)
    dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, GRAPHS_PER_LAYER * regions)

