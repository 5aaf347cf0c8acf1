"""Activation recomputation of a transformers model's decoder layers, by policy
(``moe_ep.planner.recompute`` says what each policy keeps and runs again):

- ``"full"``: transformers' own checkpointing of every decoder layer, non-reentrant.
- ``"selective"``: the same checkpoint of every decoder layer, selective: its ``context_fn``
  (:func:`selective_contexts`) gives the forward a dispatch mode that keeps the outputs of the ops
  :func:`selective_policy` saves (the GEMMs, the attention kernels, moe_ep's custom ops) and the
  recompute one that hands them back instead of running those ops again; everything else runs
  again. This is PyTorch's selective activation checkpoint (the policy answers in its
  ``CheckpointPolicy``) with one difference: only the kept ops are counted and matched between
  the forward and the recompute. ``create_selective_checkpoint_contexts`` matches every op, and
  the FSDP2 unit of the experts inside a layer legitimately runs different runtime ops (profiler
  ranges, all-gather copies) in the recompute than in the forward (with pipeline stages, whose
  weights stay gathered), which it refuses (pytorch/torchtitan#3427).
- ``"attention"``: torch's composable (hook-based) non-reentrant checkpoint of every decoder
  layer's ``self_attn``, so the parameter names stay the model's.

Under ``"full"`` and ``"selective"`` the expert-parallel dispatcher runs again in the recompute,
all-to-alls and the dropless count exchange included, in the same order on every rank: its
collectives write into buffers they are handed (they cannot be replayed from a cache) and they
give the same rows again, so the recompute is exact. ``"attention"`` never recomputes them."""

from __future__ import annotations

import functools
import logging
from collections import defaultdict, deque

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

from ..planner.recompute import recompute_policy

logger = logging.getLogger(__name__)

_aten = torch.ops.aten
# The ops whose outputs "selective" keeps: the GEMMs and the attention kernels, the compute a
# recompute would repeat. Looked up by name: some are missing from some builds of torch.
_SAVED_ATEN_OPS = frozenset(
    getattr(_aten, name) for name in (
        "mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_mm", "_scaled_grouped_mm",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
        "_flash_attention_forward", "_efficient_attention_forward",
    ) if hasattr(_aten, name)
)
# moe_ep's custom ops (the experts' GEMMs with their routing metadata and GEMM-1 output, the
# fused router) and the flash-attn package's kernels are kept whole.
_SAVED_NAMESPACES = frozenset({"moe_ep", "flash_attn"})


def keeps_output(func) -> bool:
    """Whether the ``"selective"`` policy keeps ``func``'s outputs (else they are recomputed)."""
    return func.namespace in _SAVED_NAMESPACES or getattr(func, "overloadpacket", None) in _SAVED_ATEN_OPS


def selective_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """The ``"selective"`` policy, in the form of PyTorch's selective activation checkpoint
    (usable with ``create_selective_checkpoint_contexts`` too): ``MUST_SAVE`` for what
    :func:`keeps_output` names, ``PREFER_RECOMPUTE`` for the rest."""
    return CheckpointPolicy.MUST_SAVE if keeps_output(func) else CheckpointPolicy.PREFER_RECOMPUTE


_SAVE = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)


class _Kept:
    """An output kept from the forward, detached, with the version it had: one modified in place
    since would hand the backward other values than the forward computed."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.version = tensor.detach(), tensor._version

    def value(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise RuntimeError("activation_checkpointing='selective': an output kept for the recompute was modified "
                               "in place after the forward")
        return self.tensor


class _KeepOutputs(TorchDispatchMode):
    """The forward of a checkpointed layer: the outputs of the ops the policy saves, kept in call
    order per op."""

    def __init__(self, policy, kept: dict):
        super().__init__()
        self.policy, self.kept = policy, kept

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.policy(SelectiveCheckpointContext(is_recompute=False), func, *args, **kwargs) in _SAVE:
            self.kept[func].append(tree_map_only(torch.Tensor, _Kept, out))
        return out


class _ReplayOutputs(TorchDispatchMode):
    """The recompute: the kept outputs handed back in the same order, every other op run."""

    def __init__(self, policy, kept: dict):
        super().__init__()
        self.policy, self.kept = policy, kept

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.policy(SelectiveCheckpointContext(is_recompute=True), func, *args, **kwargs) not in _SAVE:
            return func(*args, **kwargs)
        queue = self.kept.get(func)
        if not queue:
            raise RuntimeError(
                f"activation_checkpointing='selective': {func} ran more often in the recompute than in the forward "
                "(a layer's forward must run the same GEMMs, attention kernels and moe_ep ops each time), or the "
                "layer's backward ran twice"
            )
        return tree_map_only(_Kept, _Kept.value, queue.popleft())


def selective_contexts(policy=None) -> tuple[TorchDispatchMode, TorchDispatchMode]:
    """The ``context_fn`` of a selectively checkpointed layer (``policy``: default
    :func:`selective_policy`): the forward's mode and the recompute's, sharing what is kept."""
    kept: dict = defaultdict(deque)
    policy = policy or selective_policy
    return _KeepOutputs(policy, kept), _ReplayOutputs(policy, kept)


def enable_activation_checkpointing(model: nn.Module, policy: str | bool = "full") -> None:
    """Recompute ``model``'s decoder layers in backward by ``policy`` (a name of
    ``moe_ep.planner.recompute.RECOMPUTE_POLICIES``, or True for ``"full"``)."""
    policy = recompute_policy("policy", policy)
    if policy == "none":
        return
    if policy == "attention":
        from torch.distributed._composable import checkpoint

        for attention in attention_blocks(model):
            # Registered first, so it runs before the checkpoint's own pre-hook.
            attention.register_forward_pre_hook(_without_cache, with_kwargs=True)
            checkpoint(attention, use_reentrant=False)
        return
    kwargs = {"use_reentrant": False}
    if policy == "selective":
        kwargs["context_fn"] = selective_contexts
    # transformers renamed the method in 5.2x (``gradient_checkpointing_enable`` remains as a
    # deprecated alias until v6).
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


# The names transformers' attention modules have taken their KV cache by, by release.
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _without_cache(module: nn.Module, args: tuple, kwargs: dict):
    """A recomputed attention block must not write its KV cache a second time: in training with
    gradients it runs without one, as transformers runs its checkpointed decoder layers."""
    if not (module.training and torch.is_grad_enabled()):
        return None
    given = [name for name in _CACHE_KWARGS if kwargs.get(name) is not None]
    if not given:
        return None
    _warn_without_cache(type(module).__name__, given[0])
    return args, {**kwargs, **{name: None for name in given}}


@functools.cache
def _warn_without_cache(module_class: str, name: str) -> None:
    # Once per class: every layer's attention block would say it on every forward.
    logger.warning("activation_checkpointing='attention': %s runs without its KV cache in training (%s=None), "
                   "as transformers runs checkpointed layers", module_class, name)


def check_recompute_support(model: nn.Module, policy: str) -> None:
    """What ``policy`` needs of ``model``, checked before parallelize changes anything."""
    if policy in ("full", "selective") and not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"activation_checkpointing={policy!r}: {type(model).__name__} does not support gradient "
                         "checkpointing")
    if policy == "attention":
        attention_blocks(model)


def attention_blocks(model: nn.Module) -> list[nn.Module]:
    """The attention block (``self_attn``) of each of ``model``'s decoder layers, which the
    ``"attention"`` policy recomputes; all the policy needs of the model (no rotary embedding or
    final norm, as a pipeline stage needs), else ValueError naming the policy."""
    prefix = getattr(model, "base_model_prefix", "model")
    layers = getattr(getattr(model, prefix, None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"activation_checkpointing='attention': {type(model).__name__} has no decoder layers at "
                         f"{prefix}.layers, whose attention blocks it recomputes")
    missing = [i for i, layer in enumerate(layers) if not isinstance(getattr(layer, "self_attn", None), nn.Module)]
    if missing:
        raise ValueError(f"activation_checkpointing='attention': decoder layers {missing} of "
                         f"{type(model).__name__} have no self_attn module")
    return [layer.self_attn for layer in layers]
