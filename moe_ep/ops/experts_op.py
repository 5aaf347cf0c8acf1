"""The autograd and fake-tensor wiring that both backends of ``moe_experts`` share. Each backend
defines two ``torch.library`` custom ops with one convention::

    fwd(x_TH, idx_TK, w_TK, gate_up_E2IH, down_EHI, *options) -> (y_TH, *saved)
    bwd(dy_TH, x_TH, w_TK, gate_up_E2IH, down_EHI, *saved, *options, overwrite_saved=...)
        -> (dx_TH, dw_TK, d_gate_up_E2IH, d_down_EHI)

``options`` are the non-tensor arguments (the activation, a row block size, the bound on the
routed slots) and ``saved`` what the backward needs beyond the inputs (routing metadata, then the
GEMM-1 output). Only ``y_TH`` is
differentiated; ``register_experts_autograd`` gives the forward its autograd formula and the
backward its fake implementation, so ``torch.compile`` and FSDP2 see each op as one opaque node.

The GEMM-1 output (``[rows, 2I]``) is dead once the backward has made its gradient, which has its
shape: with ``overwrite_saved`` the backward writes the gradient over it, so that the backward's
peak holds one such buffer, not two (1.9 GB less at Mixtral-8x7B's experts on 16k tokens). The
graph's backward can then run once: the autograd formula marks the saved output modified, and a
second run (``retain_graph=True``, a pipeline schedule's split input- and weight-gradient passes)
raises instead of reading it. Forwards run under ``repeatable_backward()`` (process-wide, as
the pipeline stages of ZB-V and DualPipeV set it: ``parallel.pipeline.build_stages``) keep it. The ops are declared functional: the
formula asks for the overwrite only on a plain tensor outside a tracer (``torch.compile``,
export), so a traced graph never sees it."""

from __future__ import annotations

import contextlib

import torch

from .validate import refuse_double_backward

_repeatable = False


def set_repeatable_backward(enabled: bool) -> bool:
    """Whether the experts ops recorded from now on, in every thread, keep their saved GEMM-1
    output through the backward, so that their graph's backward can run more than once; returns
    the previous setting. See the module docstring."""
    global _repeatable
    previous, _repeatable = _repeatable, bool(enabled)
    return previous


@contextlib.contextmanager
def repeatable_backward(enabled: bool = True):
    """``set_repeatable_backward(enabled)`` for the forwards run inside the block."""
    previous = set_repeatable_backward(enabled)
    try:
        yield
    finally:
        set_repeatable_backward(previous)


def _unpack(ctx) -> tuple[torch.Tensor, ...]:
    try:
        return ctx.saved_tensors
    except RuntimeError as err:
        if ctx.overwrite_saved and "modified by an inplace operation" in str(err):
            raise RuntimeError(
                "moe_experts: the backward of this forward ran already and wrote its gradient over the saved "
                "GEMM-1 output (one buffer of its size less at the backward's peak); to run a graph's backward more than "
                "once (retain_graph=True, split input- and weight-gradient passes), run its forward under "
                "moe_ep.ops.repeatable_backward()") from err
        raise


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
        ctx.overwrite_saved = not _repeatable
        # The saved outputs get no gradient: without this autograd would allocate and zero-fill
        # one of each one's size (GEMM 1's output: 2I columns per routed row) for every backward.
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x_TH, w_TK, gate_up_E2IH, down_EHI, *output[1:])

    def backward(ctx, dy_TH, *_saved_grads):
        x_TH, w_TK, gate_up_E2IH, down_EHI, *saved = _unpack(ctx)
        gemm1_out = saved[-1]
        overwrite = ctx.overwrite_saved and type(gemm1_out) is torch.Tensor and not torch.compiler.is_compiling()
        if overwrite:
            # Marked first: a backward that fails part-way must not leave it looking intact.
            torch.autograd.graph.increment_version(gemm1_out)
        dx, dw, d_gate_up, d_down = bwd(dy_TH.contiguous(), x_TH, w_TK, gate_up_E2IH, down_EHI, *saved, *ctx.options,
                                        overwrite_saved=overwrite)
        return (dx, None, dw, d_gate_up, d_down, *(None for _ in ctx.options))

    fwd.register_autograd(backward, setup_context=setup_context)
    refuse_double_backward(bwd, "moe_experts")
