"""Load-balancing losses against transformers' own ``load_balancing_loss_func`` in float64, on
one process and on 2 gloo ranks (global counts: each rank's value must be the loss of the whole
batch, and the gradient averaged over ranks the whole batch's gradient), plus the z-loss and the
expert-bias update (identical on every rank, equal to the one-process update; several layers in
one call, each balanced on its own)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from numerics import TOLERANCE, rel_err
from dist_utils import run_ranks
from moe_ep.ops.losses import expert_counts, load_balancing_loss, router_z_loss, update_expert_bias_

TOL = TOLERANCE[torch.float32]
E, K, LAYERS = 6, 2, 3


def _logits(T: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, E, generator=g, dtype=torch.float64) * 2 for _ in range(LAYERS)]


def _hf_loss_and_grad(logits, mask=None):
    leaves = [t.clone().requires_grad_() for t in logits]
    loss = load_balancing_loss_func(tuple(leaves), E, K, mask)
    loss.backward()
    return loss.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("masked", [False, True])
def test_matches_transformers_one_process(masked):
    logits = _logits(12, 0)
    attention_mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2]) if masked else None
    ref, ref_grads = _hf_loss_and_grad(logits, attention_mask)
    leaves = [t.clone().requires_grad_() for t in logits]
    loss = load_balancing_loss(leaves, K, token_mask=None if attention_mask is None else attention_mask.reshape(-1))
    loss.backward()
    assert rel_err(loss.detach(), ref) <= TOL
    assert all(rel_err(t.grad, r) <= TOL for t, r in zip(leaves, ref_grads))


def test_a_strided_float_mask_is_taken_as_a_contiguous_one():
    """A [batch, seq] slice of a wider padded mask, already float32: its values, not its strides."""
    logits = _logits(12, 4)
    wide = torch.ones(3, 5)
    wide[0, 3:] = 0
    mask = wide[:, :4]
    for sequence_length in (None, 4):
        assert torch.equal(load_balancing_loss(logits, K, token_mask=mask, sequence_length=sequence_length),
                           load_balancing_loss(logits, K, token_mask=mask.contiguous(), sequence_length=sequence_length))


def test_given_choice_replaces_softmax_top_k():
    logits = _logits(8, 1)
    chosen = [t.topk(K, dim=-1).indices for t in logits]
    assert torch.equal(load_balancing_loss(logits, K, top_k_index=chosen), load_balancing_loss(logits, K))
    skewed = [torch.tensor([[0, 1]]).expand_as(c) for c in chosen]  # other counts, other loss
    assert not torch.equal(load_balancing_loss(logits, K, top_k_index=skewed), load_balancing_loss(logits, K))


def _deepseek_balance_loss(logits_TE, idx_TK, mask_T):
    """DeepSeek-V3's balance loss (its paper's eqs. 17-20) over the counted tokens of one layer,
    written out token by token in float64: alpha = 1, f_e = E / (K T') * tokens choosing e, P_e
    the mean of s'_e = sigmoid(logit_e) / sum of the token's sigmoid scores."""
    T, E_ = logits_TE.shape
    K_ = idx_TK.shape[1]
    counted = [t for t in range(T) if mask_T[t]]
    loss = logits_TE.new_zeros(())
    for e in range(E_):
        chose = sum(1.0 for t in counted if e in idx_TK[t].tolist())
        f = E_ / (K_ * len(counted)) * chose
        P = sum(logits_TE[t, e].sigmoid() / logits_TE[t].sigmoid().sum() for t in counted) / len(counted)
        loss = loss + f * P
    return loss


@pytest.mark.parametrize("masked", [False, True])
def test_a_sigmoid_routers_loss_is_deepseek_v3s_balance_loss_times_top_k(masked):
    """``score="sigmoid"``: one layer's value and gradient are top_k times DeepSeek-V3's balance
    loss (its f_e carries the 1/K that transformers' formula does not), the choice given."""
    logits = _logits(10, 5)[0]
    idx = (logits + torch.linspace(0, 1, E, dtype=torch.float64)).topk(K, dim=-1).indices  # a biased choice
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 0, 1, 1, 1]) if masked else torch.ones(10, dtype=torch.long)
    ref_leaf, leaf = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    ref = K * _deepseek_balance_loss(ref_leaf, idx, mask)
    ref.backward()
    loss = load_balancing_loss(leaf, K, top_k_index=idx, token_mask=mask if masked else None, score="sigmoid")
    loss.backward()
    assert rel_err(loss.detach(), ref.detach()) <= TOL and rel_err(leaf.grad, ref_leaf.grad) <= TOL
    softmax = load_balancing_loss(logits, K, top_k_index=idx, token_mask=mask if masked else None)
    assert rel_err(softmax, ref.detach()) > 1e-3  # the two scores give other losses
    with pytest.raises(ValueError, match=r"score must be one of \('softmax', 'sigmoid'\), got 'tanh'"):
        load_balancing_loss(logits, K, score="tanh")


@pytest.mark.parametrize("masked", [False, True])
def test_the_sequence_wise_loss_is_deepseek_v3s_per_sequence_mean(masked):
    """``sequence_length``: one layer's value and gradient are top_k times the mean over the
    sequences (of S consecutive rows) of DeepSeek-V3's balance loss of each; a fully padded
    sequence is left out of the mean. Several layers pool within each sequence."""
    S, B = 5, 4
    logits = _logits(B * S, 7)
    idx = [(t + torch.linspace(0, 1, E, dtype=torch.float64)).topk(K, dim=-1).indices for t in logits]
    mask = torch.tensor([1, 1, 0, 1, 1] + [0] * 5 + [1] * 5 + [0, 1, 1, 1, 0]) if masked else torch.ones(B * S,
                                                                                                        dtype=torch.long)
    ref_leaf, leaf = logits[0].clone().requires_grad_(), logits[0].clone().requires_grad_()
    kept = [b for b in range(B) if mask[b * S:(b + 1) * S].any()]
    ref = K * sum(_deepseek_balance_loss(ref_leaf[b * S:(b + 1) * S], idx[0][b * S:(b + 1) * S],
                                         mask[b * S:(b + 1) * S]) for b in kept) / len(kept)
    ref.backward()
    loss = load_balancing_loss(leaf, K, top_k_index=idx[0], token_mask=mask if masked else None, score="sigmoid",
                               sequence_length=S)
    loss.backward()
    assert rel_err(loss.detach(), ref.detach()) <= TOL and rel_err(leaf.grad, ref_leaf.grad) <= TOL
    # Several layers: each sequence's counts and probabilities pooled over the layers, as the
    # batch loss pools them, then the mean over the sequences; one sequence is the batch loss.
    pooled = [load_balancing_loss([t[b * S:(b + 1) * S] for t in logits], K,
                                  top_k_index=[i[b * S:(b + 1) * S] for i in idx],
                                  token_mask=mask[b * S:(b + 1) * S] if masked else None) for b in kept]
    per_sequence = load_balancing_loss(logits, K, top_k_index=idx, token_mask=mask if masked else None,
                                       sequence_length=S)
    assert rel_err(per_sequence, sum(pooled) / len(kept)) <= TOL
    assert torch.equal(load_balancing_loss(logits, K, sequence_length=B * S), load_balancing_loss(logits, K))
    assert rel_err(per_sequence, load_balancing_loss(logits, K, top_k_index=idx)) > 1e-3


def test_z_loss_formula():
    logits = _logits(9, 2)
    ref = sum(torch.log(torch.exp(t).sum(-1)).pow(2).mean() for t in logits)
    assert rel_err(router_z_loss(logits), ref) <= TOL
    assert router_z_loss(logits[0].float()).dtype == torch.float32


def test_no_counted_token_gives_zero_losses_and_zero_gradients():
    # An empty batch (a pipeline micro-batch or a rank with nothing) and a fully padded one.
    empty = [torch.zeros(0, E, dtype=torch.float64, requires_grad=True) for _ in range(LAYERS)]
    padded = [t.clone().requires_grad_() for t in _logits(4, 3)]
    for leaves, mask in ((empty, None), (empty, torch.zeros(0)), (padded, torch.zeros(4))):
        loss = load_balancing_loss(leaves, K, token_mask=mask) + router_z_loss(leaves) * (mask is None)
        loss.backward()
        assert loss.item() == 0
        assert all(t.grad is not None and not t.grad.any() for t in leaves)


def test_expert_counts_and_bias_update_one_process():
    idx = torch.tensor([[0, 1], [0, 2], [0, 1]])
    counts = expert_counts(idx, 4)
    assert counts.tolist() == [3, 2, 1, 0]
    bias = torch.zeros(4)
    update_expert_bias_(bias, counts, rate=0.1)  # mean load 1.5: experts 0, 1 above, 2, 3 below
    assert torch.allclose(bias, torch.tensor([-0.1, -0.1, 0.1, 0.1]))
    masked = expert_counts(idx, 4, token_mask=torch.tensor([1, 0, 1]))
    assert masked.tolist() == [2, 2, 0, 0]


def test_bias_update_of_several_layers_balances_each_on_its_own():
    biases = [torch.zeros(4), torch.ones(4, dtype=torch.float64)]
    counts = [torch.tensor([3.0, 2, 1, 0]), torch.tensor([0.0, 0, 0, 8])]
    kept = [c.clone() for c in counts]
    returned = update_expert_bias_(biases, counts, rate=0.1)
    assert len(returned) == 2 and all(r is b for r, b in zip(returned, biases))
    assert torch.allclose(biases[0], torch.tensor([-0.1, -0.1, 0.1, 0.1]))
    assert torch.equal(biases[1], torch.tensor([1.1, 1.1, 1.1, 0.9], dtype=torch.float64))
    assert all(torch.equal(c, k) for c, k in zip(counts, kept))


@pytest.mark.parametrize(
    "call, error, pattern",
    [
        (lambda: load_balancing_loss(_logits(4, 0), 0), ValueError, r"top_k must be an int in \[1, E=6\], got 0"),
        (lambda: load_balancing_loss([], 2), ValueError, "router_logits must be a tensor or a non-empty sequence"),
        (lambda: load_balancing_loss(None, 2), TypeError,
         "router_logits must be a tensor or a sequence of tensors \\(one per layer\\), got NoneType"),
        (lambda: load_balancing_loss(_logits(4, 0), 2, group="world"), TypeError,
         "group must be a torch.distributed.ProcessGroup or None, got str"),
        (lambda: load_balancing_loss(_logits(3, 0), 2, token_mask=torch.tensor([1, -1, 1])), ValueError,
         "token_mask must hold 0 \\(padding\\) or 1 \\(a token that counts\\) for every token"),
        (lambda: expert_counts(torch.zeros(2, 1, dtype=torch.long), 2, token_mask=torch.tensor([1.0, float("nan")])),
         ValueError, "token_mask must hold 0 \\(padding\\) or 1"),
        (lambda: load_balancing_loss(_logits(4, 0), 2, top_k_index=[torch.zeros(4, 2, dtype=torch.long)]),
         ValueError, r"top_k_index must give one tensor per layer \(3\), got 1"),
        (lambda: load_balancing_loss([torch.zeros(4, 6), torch.zeros(5, 6)], 2), ValueError,
         r"router_logits\[1\] must have the shape of router_logits\[0\]"),
        (lambda: load_balancing_loss([torch.zeros(4, 6, dtype=torch.long)], 2), TypeError, "must be a float tensor"),
        (lambda: load_balancing_loss(torch.zeros(6, 4), 2, top_k_index=torch.zeros(5, 2, dtype=torch.long)),
         ValueError,
         r"top_k_index\[0\] must have shape \[T, top_k\] = \[6, 2\] to match router_logits\[0\], got \(5, 2\)"),
        (lambda: load_balancing_loss(_logits(6, 0), 2, sequence_length=4), ValueError,
         r"sequence_length=4 must divide the T=6 rows of router_logits"),
        (lambda: load_balancing_loss(_logits(6, 0), 2, sequence_length=0), ValueError,
         "sequence_length must be a positive int or None, got 0"),
        (lambda: load_balancing_loss(torch.zeros(6, 4), 2, top_k_index=torch.full((6, 2), 4)), ValueError,
         r"top_k_index must hold expert ids in \[0, 4\), got values in \[4, 4\]"),
        (lambda: expert_counts(torch.tensor([[0, -1]]), 4), ValueError,
         r"top_k_index must hold expert ids in \[0, 4\), got values in \[-1, 0\]"),
        (lambda: update_expert_bias_(torch.zeros(4), torch.zeros(3), rate=0.1), ValueError, "counts must have the shape of bias"),
        (lambda: update_expert_bias_(torch.zeros(4), torch.zeros(4), rate=-1), ValueError, "rate must be a finite number >= 0, got -1"),
        (lambda: update_expert_bias_([torch.zeros(4)] * 2, [torch.zeros(4)], rate=0.1), ValueError,
         r"counts must give one tensor per bias \(2\), got 1"),
        (lambda: update_expert_bias_([torch.zeros(4), torch.zeros(4)], [torch.zeros(4), torch.zeros(3)], rate=0.1),
         ValueError, r"counts\[1\] must have the shape of bias\[1\] \(4,\), got \(3,\)"),
        (lambda: update_expert_bias_([], [], rate=0.1), ValueError, "bias must be a tensor or a non-empty sequence"),
    ],
)
def test_errors(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


TOKENS = (5, 9)  # uneven on purpose: the global statistics do not assume equal shares


def _global(rank: int, world: int) -> dict:
    logits = [_logits(T, 10 + r) for r, T in enumerate(TOKENS)]
    masks = [torch.ones(T) for T in TOKENS]
    masks[1][-3:] = 0
    out = {}
    for masked in (False, True):
        leaves = [t.clone().requires_grad_() for t in logits[rank]]
        loss = load_balancing_loss(leaves, K, token_mask=masks[rank] if masked else None, group=dist.group.WORLD)
        loss.backward()
        everything = [torch.cat([logits[r][layer] for r in range(world)]) for layer in range(LAYERS)]
        mask = torch.cat(masks) if masked else None
        ref, ref_grads = _hf_loss_and_grad(everything, None if mask is None else mask[None, :])
        rows = slice(sum(TOKENS[:rank]), sum(TOKENS[: rank + 1]))
        out[masked] = {
            "value": rel_err(loss.detach(), ref),
            # Data parallelism averages the ranks' gradients: each carries world x its share.
            "grad": max(rel_err(t.grad / world, g[rows]) for t, g in zip(leaves, ref_grads)),
        }
    # Rank 0 with no token: the loss of rank 1's tokens alone, on both ranks.
    leaves = [t[: 0 if rank == 0 else None].clone().requires_grad_() for t in logits[rank]]
    loss = load_balancing_loss(leaves, K, group=dist.group.WORLD)
    loss.backward()
    ref, ref_grads = _hf_loss_and_grad(logits[1])
    out["rank_without_tokens"] = {
        "value": rel_err(loss.detach(), ref),
        "grad": 0.0 if rank == 0 else max(rel_err(t.grad / world, g) for t, g in zip(leaves, ref_grads)),
    }
    g = torch.Generator().manual_seed(rank)
    counts = expert_counts(torch.randint(0, E, (7 + rank, K), generator=g), E)
    bias = torch.linspace(-0.2, 0.2, E)
    update_expert_bias_(bias, counts, rate=0.01, group=dist.group.WORLD)
    everyone = [torch.empty(E) for _ in range(world)]
    dist.all_gather(everyone, bias)
    all_counts = [torch.empty(E) for _ in range(world)]
    dist.all_gather(all_counts, counts)
    one_process = update_expert_bias_(torch.linspace(-0.2, 0.2, E), sum(all_counts), rate=0.01)
    out["bias_identical"] = all(torch.equal(b, everyone[0]) for b in everyone)
    out["bias_matches_one_process"] = torch.equal(bias, one_process)
    out["bias_moved"] = not torch.equal(bias, torch.linspace(-0.2, 0.2, E))
    # Several layers in one all-reduce: each as if updated alone on the whole batch.
    layers = [torch.linspace(-0.2, 0.2, E), torch.zeros(E)]
    layer_counts = [counts, counts.flip(0) * (1 + rank)]
    update_expert_bias_(layers, layer_counts, rate=0.01, group=dist.group.WORLD)
    flipped = [c.flip(0) * (1 + r) for r, c in enumerate(all_counts)]
    alone = [update_expert_bias_(torch.linspace(-0.2, 0.2, E), sum(all_counts), rate=0.01),
             update_expert_bias_(torch.zeros(E), sum(flipped), rate=0.01)]
    out["layers_match_one_process"] = all(torch.equal(b, a) for b, a in zip(layers, alone))
    try:
        load_balancing_loss(logits[rank], K, sequence_length=TOKENS[rank], group=dist.group.WORLD)
        out["sequences_with_group"] = "accepted"
    except ValueError as e:
        out["sequences_with_group"] = str(e)
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_global, 2)


@pytest.mark.slow
@pytest.mark.parametrize("masked", [False, True, "rank_without_tokens"])
def test_global_aux_loss_is_the_whole_batch_loss(two_ranks, masked):
    for result in two_ranks:
        assert result[masked]["value"] <= TOL and result[masked]["grad"] <= TOL, result[masked]


@pytest.mark.slow
def test_expert_bias_identical_on_every_rank(two_ranks):
    for result in two_ranks:
        assert result["bias_identical"] and result["bias_matches_one_process"] and result["bias_moved"]
        assert result["layers_match_one_process"]


@pytest.mark.slow
def test_the_sequence_wise_loss_refuses_a_group(two_ranks):
    for result in two_ranks:
        assert result["sequences_with_group"].startswith("sequence_length and group exclude each other")
