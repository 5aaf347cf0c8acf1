"""moe_ep.training.TrainStep in one process: what it refuses before any work, and the forward
options the example's single-process runs use (autocast, no key/value cache). The losses of
every layout against float64 are in test_pipeline.py."""

from __future__ import annotations

import pytest
import torch

from hf_models import tiny_batch, tiny_config, tiny_model

TINY = dict(num_hidden_layers=2, num_local_experts=4, intermediate_size=24)


def _model():
    from moe_ep.hf import patch

    return patch(tiny_model("mixtral", **TINY), fused_router=True).train()


@pytest.mark.parametrize("aux_loss_coef", [0.0, 0.1])
def test_a_batch_that_micro_batches_do_not_divide_is_refused_before_any_work(aux_loss_coef):
    """5 sequences in 4 micro-batches: ``chunk`` would give 3 of 2, 2 and 1, scaled as 4."""
    from moe_ep.training import TrainStep

    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = TrainStep(model, opt, microbatches=4, aux_loss_coef=aux_loss_coef)
    batch = tiny_batch(tiny_config("mixtral", **TINY), batch=5, seq=6)
    message = (r"batch of 5 sequences cannot be cut into 4 micro-batches: microbatches=4 must divide input_ids' "
               r"first dimension, got shape \(5, 6\)")
    with pytest.raises(ValueError, match=message):
        step(batch)
    assert all(p.grad is None for p in model.parameters()) and not opt.state
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    if step.aux is not None:
        assert step.aux.record == []
    # The same step takes a batch that divides.
    batch = tiny_batch(tiny_config("mixtral", **TINY), batch=8, seq=6)
    assert torch.isfinite(step(batch))


def test_autocast_forward_without_cache():
    """``autocast_dtype``: the forward runs in bf16 (a lone process; FSDP's policy casts parallel
    runs), the loss is fp32 cross-entropy of the bf16 logits, and no key/value cache is built."""
    from moe_ep.training import TrainStep

    model = _model()
    batch = tiny_batch(tiny_config("mixtral", **TINY), batch=4, seq=6)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=batch["input_ids"], use_cache=False).logits
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten())

    seen = []
    model.register_forward_hook(lambda m, args, kwargs, out: seen.append((kwargs.get("use_cache"), out.logits.dtype,
                                                                          out.past_key_values)), with_kwargs=True)
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.0), microbatches=2,
                     autocast_dtype=torch.bfloat16)
    loss = step(batch)
    assert seen == [(False, torch.bfloat16, None)] * 2
    assert loss.dtype == torch.float32
    # The micro-batches' sums over the batch's tokens: the batch's mean, up to fp32 rounding.
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with pytest.raises(TypeError, match="autocast_dtype must be a floating torch.dtype or None, got 'bf16'"):
        TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.0), autocast_dtype="bf16")
