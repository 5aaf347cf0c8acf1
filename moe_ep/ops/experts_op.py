"""The autograd and fake-tensor wiring that both backends of ``moe_experts`` share. Each backend
defines two ``torch.library`` custom ops with one convention::

    fwd(x_TH, idx_TK, w_TK, gate_up_E2IH, down_EHI, *options) -> (y_TH, *saved)
    bwd(dy_TH, x_TH, w_TK, gate_up_E2IH, down_EHI, *saved, *options)
        -> (dx_TH, dw_TK, d_gate_up_E2IH, d_down_EHI)

``options`` are the non-tensor arguments (the activation, a row block size) and ``saved`` what
the backward needs beyond the inputs (routing metadata, the GEMM-1 output). Only ``y_TH`` is
differentiated; ``register_experts_autograd`` gives the forward its autograd formula and the
backward its fake implementation, so ``torch.compile`` and FSDP2 see each op as one opaque node."""

from __future__ import annotations

import torch

from .validate import refuse_double_backward


def _gradients_like(x_TH, w_TK, gate_up_E2IH, down_EHI) -> tuple[torch.Tensor, ...]:
    return (x_TH.new_empty(x_TH.shape), w_TK.new_empty(w_TK.shape), gate_up_E2IH.new_empty(gate_up_E2IH.shape),
            down_EHI.new_empty(down_EHI.shape))


def register_experts_autograd(fwd, bwd) -> None:
    """Wire the custom ops ``fwd`` and ``bwd`` of one backend (the convention above)."""

    @bwd.register_fake
    def _(dy_TH, x_TH, w_TK, gate_up_E2IH, down_EHI, *saved_and_options):
        return _gradients_like(x_TH, w_TK, gate_up_E2IH, down_EHI)

    def setup_context(ctx, inputs, output):
        x_TH, _, w_TK, gate_up_E2IH, down_EHI, *options = inputs
        ctx.options = options
        # The saved outputs get no gradient: without this autograd would allocate and zero-fill
        # one of each one's size (GEMM 1's output: 2I columns per routed row) for every backward.
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x_TH, w_TK, gate_up_E2IH, down_EHI, *output[1:])

    def backward(ctx, dy_TH, *_saved_grads):
        x_TH, w_TK, gate_up_E2IH, down_EHI, *saved = ctx.saved_tensors
        dx, dw, d_gate_up, d_down = bwd(dy_TH.contiguous(), x_TH, w_TK, gate_up_E2IH, down_EHI, *saved, *ctx.options)
        return (dx, None, dw, d_gate_up, d_down, *(None for _ in ctx.options))

    fwd.register_autograd(backward, setup_context=setup_context)
    refuse_double_backward(bwd, "moe_experts")
