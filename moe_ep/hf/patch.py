"""``patch(model)``: switch a built transformers MoE model to moe_ep's experts and fused router.

Nothing about the model's structure changes: no module is replaced, no class is swapped, no
parameter is renamed or reshaped, so ``state_dict``, ``save_pretrained``, checkpoint conversion,
FSDP wrapping and transformers' output-recording hooks see the model they expect. What changes:
``config._experts_implementation`` (transformers' own switch), the backend bound to each experts
and router module (``moe_ep.hf.binding``), and, with ``fused_router=True``, the router instances'
``forward``.
Every check runs before the first change, so a refused model is left untouched."""

from __future__ import annotations

import torch

from ..ops.backend import BACKENDS
from ..ops.routing import node_limited_groups
from .binding import bind
from .layout import experts_activation, experts_modules
from .registry import EXPERTS_IMPLEMENTATION, register
from .routers import FUSED_ROUTER_FORWARDS, fused_router_forward, router_key, verify_fused_router

# The attribute that holds a router's live forward. accelerate's hooks (device_map dispatch,
# offloading) move the original forward to ``_old_forward`` and wrap it; patching under them keeps
# the hook in place.
_ACCELERATE_FORWARD = "_old_forward"


def _forward_slot(router: torch.nn.Module) -> str:
    return _ACCELERATE_FORWARD if hasattr(router, "_hf_hook") and hasattr(router, _ACCELERATE_FORWARD) else "forward"


def _installed_forward(router: torch.nn.Module):
    """The function behind the router's instance-level forward, None when it runs its class's."""
    bound = router.__dict__.get(_forward_slot(router))
    if bound is None:
        return None
    func = getattr(bound, "__func__", None)
    if func is getattr(type(router), "forward"):
        return None
    return func if func is not None else bound


class _BoundForward:
    """``func`` bound to ``router``, as a method is, and picklable: a bound method pickles as a
    lookup of ``func``'s name on the router, which its class lacks, so ``torch.save`` of a patched
    model wrote a file that no ``torch.load`` could read."""

    __slots__ = ("__func__", "__self__")

    def __init__(self, func, router: torch.nn.Module):
        self.__func__, self.__self__ = func, router

    def __call__(self, *args, **kwargs):
        return self.__func__(self.__self__, *args, **kwargs)

    def __reduce__(self):
        return type(self), (self.__func__, self.__self__)


def _set_router_forward(router: torch.nn.Module, func) -> None:
    slot = _forward_slot(router)
    if slot == "forward" and func is None:
        router.__dict__.pop("forward", None)
        return
    setattr(router, slot, _BoundForward(func if func is not None else type(router).forward, router))


def _router_of(model: torch.nn.Module, experts_name: str) -> tuple[str, torch.nn.Module | None]:
    """The router sibling of an experts module: every supported family calls it ``gate``."""
    parent_name, _, _ = experts_name.rpartition(".")
    parent = model.get_submodule(parent_name)
    router_name = f"{parent_name}.gate" if parent_name else "gate"
    return router_name, getattr(parent, "gate", None)


def _check_router(name: str, router: torch.nn.Module | None) -> None:
    if router is None:
        raise ValueError(
            f"fused_router=True: the MoE block around {name.rpartition('.')[0]!r} has no 'gate' router module; "
            "pass fused_router=False to keep the model's own routing"
        )
    if fused_router_forward(router) is None:
        supported = ", ".join(sorted(k.rpartition(".")[2] for k in FUSED_ROUTER_FORWARDS))
        raise ValueError(
            f"fused_router=True: router {name!r} of class {router_key(router)} has no fused-router semantics in "
            f"moe_ep (supported: {supported}); pass fused_router=False to keep its own routing"
        )
    verify_fused_router(router)
    installed = _installed_forward(router)
    if installed is not None and installed not in FUSED_ROUTER_FORWARDS.values():
        raise ValueError(
            f"fused_router=True: router {name!r} already has an instance-level forward ({installed!r}) installed by "
            "something other than moe_ep; patch before installing it, or pass fused_router=False"
        )


def patch(model: torch.nn.Module, *, backend: str | None = None, fused_router: bool = True) -> torch.nn.Module:
    """Run ``model``'s experts on moe_ep and, with ``fused_router``, its routers on ``route_topk``.

    Args:
        model: a transformers ``PreTrainedModel`` of a supported MoE family (Mixtral, Qwen2-MoE,
            Qwen3-MoE, OLMoE, DeepSeek-V3; with ``fused_router=False`` any family whose experts
            have the fused gated layout).
        backend: ``"triton"``, ``"torch"`` or None (the default of ``moe_experts``/``route_topk``:
            Triton on CUDA, torch elsewhere, ``MOE_EP_BACKEND`` overrides).
        fused_router: replace each router's computation (not its module) by ``route_topk`` with
            the family's semantics; False restores the model's own router forward.

    The fused router computes the router logits in float32 from the activations and the router
    weight (as Megatron-Core does with its router dtype fp32), whereas Mixtral, Qwen2-MoE, Qwen3-MoE
    and OLMoE compute them in the activation dtype. In bf16, two experts whose logits nearly tie
    can round to a tie or swap order, so for such tokens the fused router may choose another
    expert than the model's own router; it chooses what the float32 model would. The returned
    logits are cast to the activation dtype as the model's router returns them. DeepSeek-V3's
    router is float32 already. ``fused_router=False`` keeps the model's own router computation,
    bf16 logits included.

    Before a router's forward is replaced, the fused router is run once per router class and
    configuration against the class's own forward on a 16-token probe in float32 (and for shapes
    and dtypes in bfloat16); a transformers release whose router returns anything else is refused
    with a ValueError naming the class and the installed version, not patched silently.

    Returns ``model``, patched in place. Idempotent: patching again with the same arguments changes
    nothing. Raises ImportError for an unsupported transformers version, TypeError/ValueError
    naming the argument, the unsupported layout flag or the router whose semantics differ otherwise.
    """
    register()
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if not isinstance(fused_router, bool):
        raise TypeError(f"fused_router must be a bool, got {type(fused_router).__name__}")
    experts = experts_modules(model)
    if not experts:
        raise ValueError(
            f"{type(model).__name__} has no experts module (a class decorated with transformers' "
            "@use_experts_implementation); moe_ep.hf.patch only applies to MoE models"
        )
    for _, module in experts:
        experts_activation(module)
    routers = [_router_of(model, name) for name, _ in experts]
    if fused_router:
        for router_name, router in routers:
            _check_router(router_name, router)

    if model.config._experts_implementation != EXPERTS_IMPLEMENTATION:
        model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    for _, module in experts:
        # transformers changes a config only where the source of the model class's module holds
        # @use_experts_implementation (not a subclass defined in the user's script), and a
        # sub-config told otherwise keeps its own: each experts module reads its own config.
        if module.config._experts_implementation != EXPERTS_IMPLEMENTATION:
            module.config._experts_implementation = EXPERTS_IMPLEMENTATION
        bind(module, backend=backend)
    for _, router in routers:
        if router is None:
            continue
        if fused_router:
            bind(router, backend=backend)
            if _installed_forward(router) is None:
                _set_router_forward(router, fused_router_forward(router))
        elif _installed_forward(router) in FUSED_ROUTER_FORWARDS.values():
            _set_router_forward(router, None)
    return model


def limit_routing_to_nodes(model: torch.nn.Module, nodes: int, max_nodes: int | None) -> torch.nn.Module:
    """Route every token of ``model`` to experts on at most ``max_nodes`` of the ``nodes`` nodes
    that expert parallelism spreads each layer's experts over (DeepSeek-V3's node-limited
    routing; ``moe_ep.ops.route_topk``'s ``max_nodes``), so that a token crosses the network at
    most ``max_nodes`` times; ``max_nodes=None`` lifts the limit. This changes which experts a
    token may reach, so it is the model's routing from then on (as it is DeepSeek-V3's in
    training). Needs ``patch(model)``'s fused routers. A DeepSeek-V3 config whose ``n_group`` is
    the node count keeps its groups (``topk_group`` already bounds the nodes; ``max_nodes`` lowers
    it); other group layouts are refused, before any router changes. Returns ``model``."""
    routers = check_node_limit(model, nodes, max_nodes)
    for router in routers:
        bind(router, node_limit=None if max_nodes is None else (nodes, max_nodes))
    return model


def check_node_limit(model: torch.nn.Module, nodes: int, max_nodes: int | None) -> list[torch.nn.Module]:
    """The fused routers ``limit_routing_to_nodes`` would bind, or a ValueError naming the router
    and what it cannot do; changes nothing."""
    routers = []
    for name, _ in experts_modules(model):
        router_name, router = _router_of(model, name)
        if router is None or _installed_forward(router) not in FUSED_ROUTER_FORWARDS.values():
            raise ValueError(
                f"node-limited routing runs in moe_ep's fused routers, but the router of {name} "
                f"({router_name or 'none found'}) is not one: call moe_ep.patch(model) (fused_router=True) first"
            )
        num_experts = router.weight.shape[0]
        try:
            node_limited_groups(num_experts, getattr(router, "num_group", 1), getattr(router, "topk_group", 1), nodes,
                                max_nodes, router.top_k)
        except ValueError as err:
            raise ValueError(f"{router_name}: {err}") from None
        routers.append(router)
    return routers


def is_patched(model: torch.nn.Module) -> bool:
    """True when every experts module of ``model`` runs on moe_ep (routers not considered)."""
    experts = experts_modules(model)
    return bool(experts) and all(m.config._experts_implementation == EXPERTS_IMPLEMENTATION for _, m in experts)


def fused_routers(model: torch.nn.Module) -> list[str]:
    """Names of the router modules whose forward is moe_ep's fused router."""
    return [
        name
        for name, m in model.named_modules()
        if _installed_forward(m) in FUSED_ROUTER_FORWARDS.values()
    ]
