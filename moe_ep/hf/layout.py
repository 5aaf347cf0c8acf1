"""Which transformers experts modules our kernels serve, and with which activation.

transformers' ``@use_experts_implementation`` decorator records the weight layout of an experts
class in flags on each instance. Our kernels need the fused, gate-first, untransposed layout
(``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``), no biases, the default gated activation
SiLU or exact GELU, and nothing applied between the down projection and the routing weight. Any
other layout is refused with an error that names the flag, never computed wrongly."""

from __future__ import annotations

import torch

# (flag, value our kernels need, why another value is refused); getattr default = the value
# transformers assumes when a flag does not exist in the installed version.
_LAYOUT_FLAGS = (
    ("has_gate", True, "non-gated experts (up_proj only) have no gate half for the fused SwiGLU/GeGLU"),
    ("is_concatenated", True, "an interleaved gate/up layout is not the [gate; up] layout the kernels read"),
    ("is_transposed", False, "transposed expert weights are not the [E, out, in] layout the kernels read"),
    ("has_bias", False, "the expert kernels have no bias terms"),
    ("has_post_expert_norm", False, "a norm after each expert does not fit the fused routing-weight epilogue"),
)


def _is_experts_module(module: torch.nn.Module) -> bool:
    """Instances of classes decorated with ``@use_experts_implementation`` carry these flags."""
    return all(hasattr(module, flag) for flag in ("has_gate", "has_bias", "is_transposed"))


def experts_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The transformers experts modules of ``model`` (classes decorated with
    ``@use_experts_implementation``), with their names, in module order."""
    return [(name, m) for name, m in model.named_modules() if _is_experts_module(m)]


def expert_count(module: torch.nn.Module) -> int:
    """The experts of one experts module, whatever its layout: the leading dimension of its first
    projection, ``gate_up_proj`` or, in non-gated experts (NemotronH's), ``up_proj``. Such a model
    is still parallelized without expert parallelism, and refused by name with it."""
    first = module.gate_up_proj if getattr(module, "has_gate", True) else module.up_proj
    return first.shape[0]


def num_experts_of(modules: list[tuple[str, torch.nn.Module]]) -> int:
    """The one expert count of the MoE layers ``experts_modules`` found (ValueError if they differ)."""
    counts = {name: expert_count(m) for name, m in modules}
    if len(set(counts.values())) != 1:
        raise ValueError(f"every MoE layer must have the same number of experts to share one ep layout, got {counts}")
    return next(iter(counts.values()))


def experts_activation(module: torch.nn.Module) -> str:
    """The ``activation`` argument of ``moe_experts`` for a transformers experts module.

    Raises ValueError naming every unsupported layout flag, a custom ``_apply_gate`` or an
    activation other than SiLU and exact GELU."""
    name = type(module).__name__
    refused = [
        f"{name}.{flag}={getattr(module, flag)!r} is not supported by moe_ep: {why} (needs {flag}={needed!r})"
        for flag, needed, why in _LAYOUT_FLAGS
        if getattr(module, flag, needed) != needed
    ]
    if refused:
        raise ValueError("; ".join(refused))
    from transformers.integrations.moe import _default_apply_gate

    if getattr(type(module), "_apply_gate", _default_apply_gate) is not _default_apply_gate:
        raise ValueError(
            f"{name} overrides _apply_gate (a custom gated activation) which moe_ep's fused kernels do not "
            "implement; they compute act(gate) * up with act = SiLU or exact GELU"
        )
    for weight in ("gate_up_proj", "down_proj"):
        if not isinstance(getattr(module, weight, None), torch.Tensor):
            raise ValueError(f"{name} has no {weight} tensor; moe_ep needs fused gate_up_proj and down_proj weights")
    return activation_name(getattr(module, "act_fn", None), owner=name)


def activation_name(act_fn, *, owner: str = "experts") -> str:
    """``"silu"`` or ``"gelu"`` for a transformers/torch activation module, or torch's functional
    SiLU (LFM2-MoE's experts hold ``F.silu`` itself), else ValueError."""
    from transformers import activations

    silu = (torch.nn.SiLU, activations.SiLUActivation)
    if isinstance(act_fn, silu) or act_fn is torch.nn.functional.silu:
        return "silu"
    # GELUActivation is erf GELU in both its implementations; its subclasses and the tanh/fast
    # approximations are different functions.
    if type(act_fn) is activations.GELUActivation:
        return "gelu"
    if type(act_fn) is torch.nn.GELU and act_fn.approximate == "none":
        return "gelu"
    raise ValueError(
        f"{owner}.act_fn={act_fn!r} is not supported by moe_ep: the fused kernels implement SiLU (SwiGLU) and exact "
        "GELU (GeGLU) only (hidden_act 'silu', 'swish' or 'gelu')"
    )
