"""Cross-entropy of a linear head (the LM head) that never holds the full logits: the tokens go
through the head in chunks, and each chunk's float32 logits give its loss and, in the same pass,
their gradient, which is turned at once into the chunk's hidden-state gradient and added to the
head weight's float32 gradient. Only those gradients are kept for backward, which scales them by
the incoming gradient; the logits of one chunk are the largest temporary, so the head's memory is
``O(chunk x V)`` instead of the ``O(T x V)`` of the logits, their float32 copy, the log-softmax
autograd saves and the logits' gradient (the technique of Liger-Kernel's fused linear
cross-entropy and of Apple's cut-cross-entropy, in plain PyTorch: the portable path, on any
device).

The cost: the head's two gradient GEMMs run in forward even when the caller never calls backward
(the forward asks autograd which inputs need a gradient and computes only those), and the head
weight's float32 gradient ([V, H]) lives from forward to backward. Sums run in a fixed order
(chunk after chunk), so two runs give the same bits. Differentiable once: the stored gradients
are constants to autograd, so double backward raises.

The GEMMs run in the head's compute dtype (autocast's, else the inputs' common one: bfloat16
under mixed precision, as transformers' lm_head), the logits, the softmax and the sums over
chunks (the weight's gradient included) in float32.

Liger-Kernel's Triton version is not called on CUDA: its forward reads the count of non-ignored
targets back to the host (``.item()``, a host sync per call on the step path) and, unless asked
otherwise (``accum_dtype``, a recent argument), accumulates the weight's gradient in the weight's
dtype (bf16 under mixed precision); and with no Liger installed here it could not be checked
against this path. This path runs there as on the CPU, its GEMMs on cuBLAS."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .validate import (check_count, check_float, check_index, check_number, check_same_device, check_targets_in_range,
                       check_tensor)

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``labels [batch, seq]`` -> the target of every position ``[batch * seq]`` (int64): each
    position predicts the next label of its own sequence and the last one predicts nothing
    (``ignore_index``), as transformers' ``ForCausalLMLoss`` shifts them."""
    check_tensor("labels", labels, ndim=2)
    check_index("labels", labels)
    return F.pad(labels[:, 1:].long(), (0, 1), value=ignore_index).reshape(-1)


def default_chunk_tokens(tokens: int, hidden: int, vocab: int) -> int:
    """Tokens per chunk: Liger-Kernel's rule (a chunk's float32 logits hold about as many numbers
    as the hidden states) or, where that is more, two thirds of the hidden size, and never more
    than ``tokens``. Every chunk rereads and rewrites the weight's float32 gradient ([V, H], 12
    bytes per weight with its half product), so Liger's ceil(V / H) chunks cost more traffic than
    the head's GEMMs at a large vocabulary (Qwen3's 151,936 over H=2048: 75 chunks). Two thirds of
    H tokens is the largest chunk whose forward temporaries (its float32 logits and their half
    copy, 6 bytes per logit, beside the half product, 2 per weight) stay within what the backward
    holds anyway (the scaled float32 weight gradient and its half copy, 6 per weight): at most
    1.5 T / H chunks (13 there at 16k tokens) for no more peak memory."""
    return max(1, min(tokens, max(math.ceil(tokens / math.ceil(vocab / hidden)), 2 * hidden // 3)))


def linear_cross_entropy(hidden_TH: torch.Tensor, weight_VH: torch.Tensor, target_T: torch.Tensor,
                         bias_V: torch.Tensor | None = None, *, ignore_index: int = IGNORE_INDEX,
                         z_loss_coef: float = 0.0, chunk_tokens: int | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_sum, z_sum)`` of the logits ``hidden_TH @ weight_VH.T + bias_V`` (float32) against
    ``target_T`` without holding them: ``loss_sum`` (differentiable) is the sum over the tokens
    whose target is not ``ignore_index`` of ``logsumexp - logit[target]`` plus ``z_loss_coef``
    times ``logsumexp**2`` (PaLM's z-loss); ``z_sum`` (detached) is that sum of ``logsumexp**2``.
    Both are float32 scalars, 0 when every target is ignored. Reductions other than a sum are the
    caller's division (TrainStep divides by the global batch's predicted tokens).

    ``hidden_TH`` and ``weight_VH`` (float32, float16 or bfloat16; they may differ, as under
    autocast) are multiplied in autocast's dtype where it is on, else in their common dtype (as
    ``F.linear`` would), the logits taken in float32 and the gradients summed in float32, returned
    in the inputs' own dtypes; ``target_T`` is int64 or int32 in ``[0, V)`` or ``ignore_index`` (labels
    shifted already: ``shift_labels``); ``chunk_tokens`` tokens per chunk (default:
    ``default_chunk_tokens``). A tied head passes the embedding's weight: its gradient goes to
    that tensor like any other input's."""
    check_tensor("hidden_TH", hidden_TH, ndim=2)
    check_tensor("weight_VH", weight_VH, ndim=2)
    check_tensor("target_T", target_T, ndim=1)
    check_float("hidden_TH", hidden_TH)
    check_float("weight_VH", weight_VH)
    check_index("target_T", target_T)
    tokens, hidden = hidden_TH.shape
    vocab = weight_VH.shape[0]
    if weight_VH.shape[1] != hidden or target_T.shape[0] != tokens:
        raise ValueError(
            f"hidden_TH [T, H], weight_VH [V, H] and target_T [T] must agree, got shapes {tuple(hidden_TH.shape)}, "
            f"{tuple(weight_VH.shape)} and {tuple(target_T.shape)}"
        )
    if vocab == 0 or hidden == 0:
        raise ValueError(f"weight_VH [V, H] must have V >= 1 and H >= 1, got shape {tuple(weight_VH.shape)}")
    if bias_V is not None:
        check_tensor("bias_V", bias_V, ndim=1)
        check_float("bias_V", bias_V)
        if bias_V.shape[0] != vocab:
            raise ValueError(f"bias_V must have V={vocab} entries (weight_VH's rows), got shape {tuple(bias_V.shape)}")
        check_same_device(hidden_TH=hidden_TH, weight_VH=weight_VH, target_T=target_T, bias_V=bias_V)
    else:
        check_same_device(hidden_TH=hidden_TH, weight_VH=weight_VH, target_T=target_T)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    check_targets_in_range("target_T", target_T, vocab, ignore_index)
    check_number("z_loss_coef", z_loss_coef, at_least=0)
    check_count("chunk_tokens", chunk_tokens, at_least=1, or_none=True)
    chunk = default_chunk_tokens(tokens, hidden, vocab) if chunk_tokens is None else chunk_tokens
    # Under no_grad (evaluation) autograd still reports which inputs require a gradient: the
    # forward is told to compute none.
    return _LinearCrossEntropy.apply(hidden_TH, weight_VH, bias_V, target_T, ignore_index, float(z_loss_coef), chunk,
                                     torch.is_grad_enabled())


class _LinearCrossEntropy(torch.autograd.Function):
    """Takes what ``linear_cross_entropy`` validated."""

    @staticmethod
    def forward(ctx, hidden_TH, weight_VH, bias_V, target_T, ignore_index, z_loss_coef, chunk, grad_enabled):
        need_dh, need_dw, need_db = (grad_enabled and need for need in ctx.needs_input_grad[:3])
        device_type = hidden_TH.device.type
        # The GEMMs in the head's compute dtype, as transformers' lm_head runs them (autocast's
        # dtype, else the inputs' common one): float32 GEMMs of a half-precision model ran the
        # two-layer Mixtral step at 2.5x its time on an H200 (2026-11-27).
        mm_dtype = (torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type)
                    else torch.promote_types(hidden_TH.dtype, weight_VH.dtype))
        # The logits, the softmax and every sum in float32; autocast would make them half.
        with torch.autocast(device_type, enabled=False):
            w_VH = weight_VH.to(mm_dtype)
            b32_V = None if bias_V is None else bias_V.float()
            loss = torch.zeros((), dtype=torch.float32, device=hidden_TH.device)
            z_sum = torch.zeros((), dtype=torch.float32, device=hidden_TH.device)
            dh_TH = torch.empty_like(hidden_TH) if need_dh else None
            dw32_VH = torch.zeros(weight_VH.shape, dtype=torch.float32, device=weight_VH.device) if need_dw else None
            db32_V = torch.zeros(bias_V.shape, dtype=torch.float32, device=bias_V.device) if need_db else None
            for start in range(0, hidden_TH.shape[0], chunk):
                h_CH = hidden_TH[start:start + chunk].to(mm_dtype)
                tgt_C = target_T[start:start + chunk]
                logits_CV = (h_CH @ w_VH.T).float()
                if b32_V is not None:
                    logits_CV += b32_V
                lse_C = torch.logsumexp(logits_CV, dim=1)
                kept_C = tgt_C != ignore_index
                valid_C = kept_C.float()
                # Ignored tokens read column 0 and are masked out, whatever their logits (a NaN
                # included, as F.cross_entropy leaves it out): no host check, no branch.
                safe_C1 = torch.where(kept_C, tgt_C, 0).long().unsqueeze(1)
                target_logit_C = logits_CV.gather(1, safe_C1).squeeze(1)
                lse_sq_C = lse_C.square()
                loss += torch.where(kept_C, lse_C - target_logit_C + z_loss_coef * lse_sq_C, 0).sum()
                z_sum += torch.where(kept_C, lse_sq_C, 0).sum()
                if not (need_dh or need_dw or need_db):
                    continue
                # d(lse - logit[t] + c lse^2)/d logits = softmax * (1 + 2 c lse) - onehot(t), zero
                # on ignored tokens; computed in the logits' buffer, the chunk's one [C, V].
                g_CV = logits_CV.sub_(lse_C.unsqueeze(1)).exp_()
                g_CV.mul_((valid_C * (1 + 2 * z_loss_coef * lse_C)).unsqueeze(1))
                g_CV.scatter_add_(1, safe_C1, -valid_C.unsqueeze(1))
                if need_db:
                    db32_V += g_CV.sum(0)
                g_CV = g_CV.to(mm_dtype)
                if need_dh:
                    dh_TH[start:start + chunk] = g_CV @ w_VH
                if need_dw:
                    # Each chunk's product in the compute dtype, summed over the chunks in float32;
                    # in place where that is float32 itself, so no [V, H] temporary there.
                    if mm_dtype == torch.float32:
                        dw32_VH.addmm_(g_CV.T, h_CH)
                    else:
                        dw32_VH += g_CV.T @ h_CH
        ctx.dtypes = (weight_VH.dtype, None if bias_V is None else bias_V.dtype)
        ctx.save_for_backward(dh_TH, dw32_VH, db32_V)
        ctx.mark_non_differentiable(z_sum)
        return loss, z_sum

    @staticmethod
    def backward(ctx, grad_loss, grad_z_sum):
        dh_TH, dw32_VH, db32_V = ctx.saved_tensors
        w_dtype, b_dtype = ctx.dtypes
        with torch.no_grad():
            dh = None if dh_TH is None else dh_TH * grad_loss.to(dh_TH.dtype)
            dw = None if dw32_VH is None else (dw32_VH * grad_loss).to(w_dtype)
            db = None if db32_V is None else (db32_V * grad_loss).to(b_dtype)
        if torch.is_grad_enabled():
            # create_graph=True: the gradients are constants computed in forward. torch's
            # once_differentiable gives them a raising graph only where the incoming gradient
            # requires grad, so after loss.backward(create_graph=True) or autograd.grad(loss, ...,
            # create_graph=True) a term built on them (a gradient penalty) was silently constant.
            dh, dw, db = _refuse_second_derivative(dh, dw, db)
        return dh, dw, db, None, None, None, None, None


class _SecondDerivativeRefused(torch.autograd.Function):
    """The gradients as they are, in a graph whose backward raises (``anchor``, a fresh leaf that
    requires grad, puts them in one)."""

    @staticmethod
    def forward(ctx, anchor, *grads):
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(
            "linear_cross_entropy is differentiable once: its gradients are computed in forward and are "
            "constants to autograd, so a derivative of them (a gradient penalty, a Hessian-vector product) "
            "is not supported; use the full logits' cross-entropy for that")


def _refuse_second_derivative(*grads):
    present = [g for g in grads if g is not None]
    if not present:
        return grads
    anchor = torch.zeros((), device=present[0].device, requires_grad=True)
    refused = iter(_SecondDerivativeRefused.apply(anchor, *present))
    return tuple(None if g is None else next(refused) for g in grads)
