"""Compiled dense blocks (``parallelize(compile_blocks=...)``, ``moe_ep.parallel.compile``): 5
optimizer steps of the tiny Mixtral in float32 give the eager losses, in one process (aot_eager,
with and without full recompute; inductor once) and on 2 gloo ranks (experts over 2 ranks, 2
pipeline stages, and 4 stages under ZB-V and DualPipeV, whose input-gradient passes keep the
graph) against one eager process; the dense regions compile without a graph break and
the model keeps its parameter names; ``TrainingArguments(torch_compile=True)`` gives the Trainer's
losses without it; bad values are refused naming the argument."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_ranks
from hf_models import tiny_batch, tiny_config, tiny_model
from numerics import TOLERANCE

TINY = dict(num_hidden_layers=2, num_local_experts=4, intermediate_size=24)
STEPS = 5
LR = 1e-2
AOT_EAGER = {"backend": "aot_eager"}


def _model(**config):
    from moe_ep.hf import patch

    return patch(tiny_model("mixtral", **{**TINY, **config}), fused_router=True).train()


def _batch() -> dict:
    return tiny_batch(tiny_config("mixtral", **TINY), batch=4, seq=6)


def _losses(target, batch: dict) -> list[float]:
    from moe_ep.training import TrainStep

    step = TrainStep(target, torch.optim.AdamW(target.parameters(), lr=LR))
    return [step(batch).item() for _ in range(STEPS)]


def _eager_losses() -> list[float]:
    return _losses(_model(), _batch())


def _assert_close(found: list[float], want: list[float]) -> None:
    assert len(found) == len(want) == STEPS
    for f, w in zip(found, want):
        assert abs(f - w) <= TOLERANCE[torch.float32] * abs(w), (found, want)


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def graph_breaks():
    """torch._dynamo's graph-break counter, from a fresh dynamo state."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield counters["graph_break"]
    torch._dynamo.reset()


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_compiled_blocks_give_the_eager_losses_without_a_graph_break(one_rank, graph_breaks, checkpointing):
    import moe_ep
    from moe_ep.parallel.compile import compiled_regions

    model = moe_ep.parallelize(_model(), compile_blocks=AOT_EAGER, activation_checkpointing=checkpointing)
    names = [name for name, _ in _model().named_parameters()]
    assert [name for name, _ in model.named_parameters()] == names
    # Every dense region of each layer, the MoE block's router among them; never the experts.
    assert compiled_regions(model) == [
        f"model.layers.{i}.{part}" for i in range(2)
        for part in ("self_attn", "mlp.gate", "input_layernorm", "post_attention_layernorm")
    ]
    _assert_close(_losses(model, _batch()), _eager_losses())
    assert dict(graph_breaks) == {}


def test_more_layers_than_the_recompile_limit_run_with_a_kv_cache_and_generate(one_rank, graph_breaks):
    """With a KV cache (transformers' default use_cache=True in a hand-written loop's forward, and
    generate) each layer's attention compiles a graph of its own: past torch's recompile limit (8
    graphs; 2 here, so that 3 layers pass it), fullgraph=True failed the next layer
    (FailOnRecompileLimitHit). The forward and backward with the cache give the eager loss and
    gradients; greedy generation gives the eager tokens."""
    import moe_ep

    # torch's own patch: pytest's monkeypatch deletes a dynamo config entry when it undoes.
    with torch._dynamo.config.patch(recompile_limit=2, accumulated_recompile_limit=256):
        eager = _model(num_hidden_layers=3)
        compiled = moe_ep.parallelize(copy.deepcopy(eager), compile_blocks=AOT_EAGER)
        batch = tiny_batch(eager.config, batch=2, seq=6)
        want, found = eager(**batch, use_cache=True), compiled(**batch, use_cache=True)
        want.loss.backward()
        found.loss.backward()
        assert abs(found.loss.item() - want.loss.item()) <= TOLERANCE[torch.float32] * abs(want.loss.item())
        for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
            grad = q.grad.full_tensor() if hasattr(q.grad, "full_tensor") else q.grad
            scale = p.grad.abs().max().clamp_min(1e-30)
            assert (grad - p.grad).abs().max() <= TOLERANCE[torch.float32] * scale, name
        eager.eval(), compiled.eval()
        prompt = batch["input_ids"][:, :4]
        assert torch.equal(compiled.generate(prompt, max_new_tokens=4, do_sample=False),
                           eager.generate(prompt, max_new_tokens=4, do_sample=False))
        assert dict(graph_breaks) == {}


# The regions of one decoder layer per family beyond Mixtral: Qwen2-MoE's bare nn.Linear shared
# expert gate is left eager (torch's own module), DeepSeek-V3's dense first layer keeps its MLP
# whole, and a shared expert is a region of its own.
FAMILY_REGIONS = {
    "qwen2_moe": [["self_attn", "mlp.gate", "mlp.shared_expert", "input_layernorm", "post_attention_layernorm"]] * 2,
    "deepseek_v3": [["self_attn", "mlp", "input_layernorm", "post_attention_layernorm"],
                    ["self_attn", "mlp.gate", "mlp.shared_experts", "input_layernorm", "post_attention_layernorm"]],
}


# DeepSeek-V3's attention takes about half a minute to compile on a CPU.
@pytest.mark.parametrize("family", ["qwen2_moe", pytest.param("deepseek_v3", marks=pytest.mark.slow)])
def test_other_families_compile_their_dense_regions_and_give_the_eager_losses(one_rank, graph_breaks, family):
    import moe_ep
    from moe_ep.hf import patch
    from moe_ep.parallel.compile import compiled_regions

    def model():
        return patch(tiny_model(family), fused_router=True).train()

    batch = tiny_batch(model().config, batch=2, seq=7)
    compiled = moe_ep.parallelize(model(), compile_blocks=AOT_EAGER)
    assert compiled_regions(compiled) == [f"model.layers.{i}.{part}" for i, parts in enumerate(FAMILY_REGIONS[family])
                                          for part in parts]
    _assert_close(_losses(compiled, batch), _losses(model(), batch))
    assert dict(graph_breaks) == {}


@pytest.mark.slow
def test_inductor_compiled_blocks_give_the_eager_losses(one_rank, graph_breaks):
    import moe_ep

    model = moe_ep.parallelize(_model(), compile_blocks=True)
    _assert_close(_losses(model, _batch()), _eager_losses())
    assert dict(graph_breaks) == {}


def _two_ranks(rank, world):
    """This rank's losses with compiled blocks: experts over 2 ranks with half the batch each, then
    2 pipeline stages on the whole batch."""
    import moe_ep

    half = {k: v.chunk(world)[rank] for k, v in _batch().items()}
    expert_parallel = _losses(moe_ep.parallelize(_model(), ep=world, compile_blocks=AOT_EAGER), half)
    stages = moe_ep.parallelize(_model(), pp=world, microbatches=2, split_points=[1], compile_blocks=AOT_EAGER)
    return expert_parallel, _losses(stages, _batch())


@pytest.mark.slow
def test_compiled_blocks_on_two_ranks_equal_one_eager_process():
    ranks = run_ranks(_two_ranks, 2, timeout=300)
    want = _eager_losses()
    for expert_parallel, pipeline in ranks:
        _assert_close(expert_parallel, want)
        _assert_close(pipeline, want)


FOUR_LAYERS = dict(TINY, num_hidden_layers=4)


def _split_backward_schedules(rank, world):
    """Compiled blocks under the schedules that run input-gradient passes keeping the graph: 4
    stages of one layer on 2 ranks, ZB-V with 2 micro-batches and DualPipeV with 4."""
    import moe_ep
    from moe_ep.hf import patch

    batch = tiny_batch(tiny_config("mixtral", **FOUR_LAYERS), batch=4, seq=6)
    found = {}
    for schedule, microbatches in (("zbv", 2), ("dualpipev", 4)):
        model = patch(tiny_model("mixtral", **FOUR_LAYERS), fused_router=True).train()
        stages = moe_ep.parallelize(model, pp=world, schedule=schedule, microbatches=microbatches,
                                    compile_blocks=AOT_EAGER)
        found[schedule] = _losses(stages, batch)
    return found


@pytest.mark.slow
def test_compiled_blocks_under_schedules_that_split_the_backward_equal_one_eager_process():
    ranks = run_ranks(_split_backward_schedules, 2, timeout=300)
    batch = tiny_batch(tiny_config("mixtral", **FOUR_LAYERS), batch=4, seq=6)
    from moe_ep.hf import patch

    want = _losses(patch(tiny_model("mixtral", **FOUR_LAYERS), fused_router=True).train(), batch)
    for found in ranks:
        for schedule in ("zbv", "dualpipev"):
            _assert_close(found[schedule], want)


def _trainer_losses(rank, world, out: str) -> dict:
    """The Trainer's logged losses over 5 steps, with and without ``torch_compile``, and the
    dynamo backend accelerate was left with."""
    from accelerate.state import AcceleratorState, GradientState
    from transformers import TrainingArguments

    import moe_ep
    from moe_ep.parallel.compile import compiled_regions

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1")
    model = tiny_model("mixtral", experts_implementation="moe_ep", **TINY).train()
    batch = tiny_batch(model.config, batch=8, seq=9)
    data = [{k: v[i] for k, v in batch.items()} for i in range(8)]
    environment = dict(os.environ)  # a Trainer exports its FSDP plugin's settings
    found = {}
    for compiled in (False, True):
        os.environ.clear()
        os.environ.update(environment)
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        compile_arguments = dict(torch_compile=True, torch_compile_backend="aot_eager") if compiled else {}
        args = TrainingArguments(output_dir=os.path.join(out, str(compiled)), report_to=[], use_cpu=True,
                                 max_steps=STEPS, per_device_train_batch_size=2, logging_steps=1, save_strategy="no",
                                 learning_rate=LR, seed=0, **compile_arguments)
        trainer = moe_ep.ExpertParallelTrainer(model=moe_ep.parallelize(copy.deepcopy(model)), args=args,
                                               train_dataset=data)
        trainer.train()
        found[compiled] = {
            "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
            "dynamo_backend": trainer.accelerator.state.dynamo_plugin.backend.name,
            "wrapped": type(trainer.model_wrapped).__name__,
            "compiled": len(compiled_regions(trainer.model)),
        }
    return found


@pytest.mark.slow
def test_the_trainers_torch_compile_compiles_the_blocks_and_gives_its_losses(tmp_path):
    (found,) = run_ranks(_trainer_losses, 1, str(tmp_path), timeout=300)
    eager, compiled = found[False], found[True]
    _assert_close(compiled["losses"], eager["losses"])
    # The blocks are compiled in place; accelerate compiled nothing around the model.
    assert compiled["dynamo_backend"] == "NO" and compiled["wrapped"] == eager["wrapped"] == "FSDPMixtralForCausalLM"
    assert (eager["compiled"], compiled["compiled"]) == (0, 8)


@pytest.mark.parametrize("value, error, message", [
    (3, TypeError, "compile_blocks must be a bool or a dict of torch.compile keywords ('backend', 'mode', 'options', "
                   "'dynamic'), got int"),
    ({"fullgraph": False}, ValueError, "compile_blocks takes the torch.compile keywords ('backend', 'mode', "
                                       "'options', 'dynamic') (fullgraph is always True), got ['fullgraph']"),
    ({"backend": 3}, TypeError, "compile_blocks['backend'] must be a backend name or a callable, got int"),
    ({"mode": "max-autotune", "options": {}}, ValueError, "compile_blocks gives both 'mode' and 'options'"),
])
def test_a_bad_compile_blocks_is_refused_naming_it(value, error, message):
    from moe_ep.parallel import ParallelConfig

    with pytest.raises(error) as raised:
        ParallelConfig.from_arguments(compile_blocks=value)
    assert message in str(raised.value)


@pytest.mark.parametrize("policy", ["selective", "attention"])
def test_compiled_blocks_under_a_recompute_policy_they_cannot_run_under_are_refused(policy):
    from moe_ep.parallel import ParallelConfig

    with pytest.raises(ValueError, match=f"compile_blocks with activation_checkpointing='{policy}': .*; compiled "
                                         "dense blocks run with 'full' or 'none'"):
        ParallelConfig.from_arguments(compile_blocks=True, activation_checkpointing=policy)


def test_a_model_recording_its_router_logits_is_refused_and_left_as_it_was(one_rank):
    # output_router_logits=True (the Trainer's load-balancing loss): transformers' recording hooks
    # read a ContextVar, which dynamo cannot trace in a fullgraph region; the first step failed.
    import moe_ep

    model = _model(output_router_logits=True)
    with pytest.raises(ValueError, match=r"records its router logits \(config.output_router_logits=True\), whose "
                                         r"hooks compiled blocks cannot trace"):
        moe_ep.parallelize(model, compile_blocks=AOT_EAGER)
    assert moe_ep.parallel_context(model) is None


def test_a_model_compiled_already_is_refused_and_left_as_it_was(one_rank):
    import moe_ep

    model = _model()
    model.model.layers[0].self_attn.compile(backend="aot_eager")
    with pytest.raises(ValueError, match=r"has submodules compiled already \('model.layers.0.self_attn', ...\)"):
        moe_ep.parallelize(model, compile_blocks=True)
    assert moe_ep.parallel_context(model) is None
