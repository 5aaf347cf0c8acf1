"""Recompute policies on one process (``moe_ep.parallel.recompute``): every policy gives the loss
and gradients of the path that recomputes nothing (float32, 1e-5), on families with and without
shared experts, a dense first layer and latent attention, on both expert backends; what the
selective policy keeps, op by op (moe_ep's custom ops and the GEMMs kept, collectives and
elementwise ops recomputed); the attention policy's KV cache; bad policy names refused wherever a
policy is taken. With expert parallelism and pipeline stages: tests/test_parallel.py and
tests/test_pipeline.py; saved bytes against the planner: tests/test_plan_activations.py."""

import pytest
import torch

from hf_models import tiny_batch, tiny_model
from numerics import TOLERANCE, rel_err

POLICIES = ("full", "selective", "attention")


def _loss_and_grads(family: str, policy: str, backend: str):
    from moe_ep.hf import patch
    from moe_ep.parallel.recompute import enable_activation_checkpointing

    model = patch(tiny_model(family), backend=backend).train()
    enable_activation_checkpointing(model, policy)
    loss = model(**tiny_batch(model.config)).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("family, backend", [
    ("mixtral", "torch"), ("qwen2_moe", "torch"), ("deepseek_v3", "torch"), ("olmoe", "triton"),
])
def test_every_policy_gives_the_gradients_of_no_recompute(family, backend):
    tol = TOLERANCE[torch.float32]
    ref_loss, ref_grads = _loss_and_grads(family, "none", backend)
    for policy in POLICIES:
        loss, grads = _loss_and_grads(family, policy, backend)
        assert rel_err(loss, ref_loss) <= tol, policy
        assert grads.keys() == ref_grads.keys()
        missing = [n for n, g in grads.items() if (g is None) != (ref_grads[n] is None)]
        assert not missing, f"{policy}: gradients present in one run only: {missing}"
        bad = {n: rel_err(g, ref_grads[n]) for n, g in grads.items() if g is not None
               and not rel_err(g, ref_grads[n]) <= tol}
        assert not bad, f"{policy}: gradients off by more than {tol}: {bad}"


def test_selective_policy_keeps_gemms_and_moe_ep_ops_and_recomputes_the_rest():
    import moe_ep.ops.experts_torch  # noqa: F401  (registers the ops)
    import moe_ep.ops.experts_triton  # noqa: F401
    import moe_ep.ops.routing_triton  # noqa: F401
    from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

    from moe_ep.parallel.recompute import selective_policy

    ctx = SelectiveCheckpointContext(is_recompute=False)
    ops, aten = torch.ops.moe_ep, torch.ops.aten
    kept = [ops.experts_torch_fwd.default, ops.experts_triton_fwd.default, ops.route_topk.default, aten.mm.default,
            aten.addmm.default, aten._scaled_dot_product_flash_attention_for_cpu.default]
    recomputed = [aten.mul.Tensor, aten.add.Tensor, aten.rsqrt.default, aten._to_copy.default, aten.silu.default,
                  aten.topk.default, aten.index_select.default, torch.ops.c10d.alltoall_base_.default]
    for op in kept:
        assert selective_policy(ctx, op) is CheckpointPolicy.MUST_SAVE, op
    for op in recomputed:
        assert selective_policy(ctx, op) is CheckpointPolicy.PREFER_RECOMPUTE, op


def test_attention_policy_runs_without_the_kv_cache_only_when_training():
    from transformers import DynamicCache

    from moe_ep.parallel.recompute import enable_activation_checkpointing

    model = tiny_model("mixtral")
    enable_activation_checkpointing(model, "attention")
    batch = tiny_batch(model.config)
    model.train()
    cache = DynamicCache(config=model.config)
    model(**batch, past_key_values=cache, use_cache=True).loss.backward()
    assert cache.get_seq_length() == 0  # the recompute would have written it a second time
    model.eval()
    with torch.no_grad():
        model(**batch, past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == batch["input_ids"].shape[1]


def test_bad_policy_names_are_refused_wherever_a_policy_is_taken():
    from moe_ep.parallel import ParallelConfig
    from moe_ep.parallel.recompute import enable_activation_checkpointing
    from moe_ep.planner import Layout, plan

    expected = r"must be a bool or one of \('none', 'full', 'selective', 'attention'\), got 'layers'"
    with pytest.raises(ValueError, match="activation_checkpointing " + expected):
        ParallelConfig(activation_checkpointing="layers")
    with pytest.raises(ValueError, match="policy " + expected):
        enable_activation_checkpointing(tiny_model("mixtral"), "layers")
    with pytest.raises(ValueError, match="checkpointing " + expected):
        plan("mixtral-8x7b", nodes=1, checkpointing="layers")
    with pytest.raises(ValueError, match="checkpointing " + expected):
        Layout(1, 1, 8, 1, 1, 1, "none", "layers")
    with pytest.raises(TypeError, match=r"activation_checkpointing must be a bool or one of .*, got NoneType"):
        ParallelConfig(activation_checkpointing=None)
    # The bools keep their meaning: True recomputes whole layers.
    assert ParallelConfig(activation_checkpointing=True).activation_checkpointing == "full"
    assert ParallelConfig().activation_checkpointing == "none"


@pytest.mark.slow
def test_selective_recompute_runs_no_kept_op_again():
    # The backward of a selectively checkpointed model runs no GEMM forward, attention kernel or
    # moe_ep forward op again (only the backward's own GEMMs), where full recompute runs them all.
    from torch.utils._python_dispatch import TorchDispatchMode

    from moe_ep.hf import patch
    from moe_ep.parallel.recompute import enable_activation_checkpointing

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls[str(func)] = self.calls.get(str(func), 0) + 1
            return func(*args, **(kwargs or {}))

    forward_ops = ("moe_ep.experts_torch_fwd.default", "aten._scaled_dot_product_flash_attention_for_cpu.default")
    counted = {}
    for policy in ("full", "selective"):
        model = patch(tiny_model("mixtral"), backend="torch").train()
        model.config._attn_implementation = "sdpa"
        enable_activation_checkpointing(model, policy)
        loss = model(**tiny_batch(model.config)).loss
        with Count() as count:
            loss.backward()
        counted[policy] = {op: count.calls.get(op, 0) for op in forward_ops}
    layers = model.config.num_hidden_layers
    assert counted["full"] == {op: layers for op in forward_ops}
    assert counted["selective"] == {op: 0 for op in forward_ops}


def _split_backward_recomputes(rank, world, schedule):
    """Per checkpointing policy: each layer's forwards in the second of two steps (every one after
    the first step's shape inference), and the two steps' losses."""
    import moe_ep
    from moe_ep.training import TrainStep
    from hf_models import tiny_config

    out = {}
    for policy in ("none", "full"):
        torch.manual_seed(0)
        model = tiny_model("mixtral", num_hidden_layers=4).train()
        stages = moe_ep.parallelize(model, pp=2, schedule=schedule, microbatches=4, activation_checkpointing=policy)
        runs = {}
        for module in stages.modules:
            for name, sub in module.named_modules():
                if name.endswith("self_attn"):
                    sub.register_forward_hook(lambda *a, name=name: runs.__setitem__(name, runs.get(name, 0) + 1))
        step = TrainStep(stages, torch.optim.AdamW(stages.parameters(), lr=1e-3))
        batch = tiny_batch(tiny_config("mixtral"), batch=8, seq=6, seed=1)
        losses = [step(batch).item()]
        first = dict(runs)
        losses.append(step(batch).item())
        out[policy] = ({name: runs[name] - first[name] for name in runs}, losses)
    return out


@pytest.mark.slow
def test_a_split_backward_recomputes_a_layer_once_per_pass_not_once_per_parameter_group():
    """ZB-V under full recompute, 2 gloo ranks, 4 micro-batches: the weight-gradient pass runs under
    one ``GraphExecGroup`` (``moe_ep.parallel.pipeline.weight_pass``), so each layer runs 4
    forwards and 4 recomputes per pass that reads it: the input-gradient pass (none on the first
    stage, whose input needs no gradient) and the weight-gradient pass. torch's own weight pass
    recomputed it for each parameter group (8 times per micro-batch on this layer). The losses
    are those of no recompute."""
    from dist_utils import run_ranks
    from moe_ep.parallel.pipeline.weight_pass import GraphExecGroup

    if GraphExecGroup is None:
        pytest.skip("torch 2.9 has no GraphExecGroup: its weight pass recomputes once per parameter group")
    for result in run_ranks(_split_backward_recomputes, 2, "zbv", timeout=240):
        runs, losses = result["full"]
        # ZB-V places stages 0 and 3 on rank 0, 1 and 2 on rank 1; layer i is stage i here.
        assert runs == {name: 4 + 4 * (1 if name.startswith("model.layers.0.") else 2) for name in runs}, runs
        assert len(runs) == 2
        assert max(rel_err(torch.tensor(a), torch.tensor(b)) for a, b in zip(losses, result["none"][1])) <= (
            TOLERANCE[torch.float32])


def test_the_attention_policy_needs_only_each_layers_attention_block():
    """A model without the rotary embedding a pipeline stage needs (Jamba) is refused for what the
    policy itself needs, its layers' attention blocks, naming the policy (it was refused as not a
    decoder-only causal LM, naming neither); of a model with all of them, those blocks are the
    ones recomputed."""
    from transformers import AutoModelForCausalLM, JambaConfig

    from moe_ep.parallel.recompute import attention_blocks, check_recompute_support

    config = JambaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                         attn_layer_period=2, attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0,
                         mamba_d_state=4, mamba_d_conv=2, mamba_expand=2, use_mamba_kernels=False)
    with torch.device("meta"):
        jamba = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"activation_checkpointing='attention': decoder layers \[0\] of "
                                         r"JambaForCausalLM have no self_attn module"):
        check_recompute_support(jamba, "attention")
    with pytest.raises(ValueError, match=r"activation_checkpointing='attention': Linear has no decoder layers at "
                                         r"model.layers"):
        check_recompute_support(torch.nn.Linear(2, 2), "attention")
    model = tiny_model("olmoe")
    assert attention_blocks(model) == [layer.self_attn for layer in model.model.layers]
