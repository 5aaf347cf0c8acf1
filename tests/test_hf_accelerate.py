"""What accelerate's configuration must say to drive a model moe_ep.parallelize prepared, checked
before any work (moe_ep.training.hf_accelerate, hf_trainer): every disagreement stops with one
line naming what to change, raised by ``configure_accelerator`` or while ``ExpertParallelTrainer``
is built, before anything is written. The private accelerate state that moe_ep switches on the CPU
is checked against the installed accelerate, so that a release that moves it fails here first.
The training itself is tested through the examples (test_hf_loops*.py)."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from dist_utils import run_ranks
from numerics import TOLERANCE

WORLD = 2


def _accelerate_env(rank: int, world: int) -> None:
    """What ``accelerate launch`` would set, for accelerate to join the ranks' process group."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1")
    for name in ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_USE_FSDP"):
        os.environ.pop(name, None)


def _fresh_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _model(**layout):
    import moe_ep
    from hf_models import tiny_model

    model = tiny_model("mixtral", experts_implementation="moe_ep").train()
    return moe_ep.parallelize(model, **layout) if layout else model


def _refusal(attempt) -> str:
    """The one-line message of the ValueError ``attempt`` raises, from a fresh accelerate state
    and the environment as it was (TrainingArguments(fsdp=...) exports FSDP_* variables)."""
    _fresh_accelerate()
    environment = dict(os.environ)
    try:
        attempt()
    except ValueError as err:
        message = str(err)
        assert "\n" not in message, message
        return message
    finally:
        os.environ.clear()
        os.environ.update(environment)
    return "no error"


def _configurations(rank: int, world: int, out: str) -> dict:
    from accelerate import Accelerator
    from accelerate.parallelism_config import ParallelismConfig
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers import TrainingArguments

    import moe_ep

    _accelerate_env(rank, world)
    ep_model = _model(ep=2)
    fp16_model = _model(ep=2, mixed_precision=MixedPrecisionPolicy(param_dtype=torch.float16))
    stages = _model(pp=2, microbatches=2)
    compiled_model = _model(ep=2, compile_blocks=True)

    def trainer(model, **arguments):
        args = TrainingArguments(output_dir=os.path.join(out, f"rank{rank}"), report_to=[], use_cpu=True, **arguments)
        return moe_ep.ExpertParallelTrainer(model=model, args=args)

    def launched_with(**variables):  # what accelerate launch writes for an FSDP config
        os.environ.update(variables)
        moe_ep.configure_accelerator(Accelerator(), ep_model)

    messages = {
        "launched_fsdp1_config": _refusal(lambda: launched_with(ACCELERATE_USE_FSDP="true", FSDP_VERSION="1")),
        # ACCELERATE_USE_FSDP alone: what a first Trainer's Accelerator(fsdp_plugin=...) leaves set
        # in the process, not a configuration (it was read as FSDP1's).
        "use_fsdp_alone": _refusal(lambda: launched_with(ACCELERATE_USE_FSDP="true")),
        "not_parallelized": _refusal(lambda: moe_ep.configure_accelerator(Accelerator(), _model())),
        "pipeline_stages": _refusal(lambda: moe_ep.configure_accelerator(Accelerator(), stages)),
        "trainer_pipeline_stages": _refusal(lambda: trainer(stages)),
        # FSDP1's sync_module_states needs a GPU in accelerate (its own check, before ours).
        "trainer_fsdp1": _refusal(lambda: trainer(ep_model, fsdp=True, fsdp_config={
            "version": 1, "sync_module_states": "false"})),
        "trainer_class_wrap": _refusal(lambda: trainer(ep_model, fsdp=True, fsdp_config={
            "version": 2, "transformer_layer_cls_to_wrap": ["MixtralDecoderLayer"]})),
        "trainer_parallelism_config": _refusal(lambda: trainer(ep_model, parallelism_config=ParallelismConfig(
            dp_replicate_size=2, dp_shard_size=1))),
        "trainer_torch_compile": _refusal(lambda: trainer(compiled_model, torch_compile=True)),
        "trainer_gradient_checkpointing": _refusal(lambda: trainer(ep_model, gradient_checkpointing=True)),
        "trainer_mixed_precision": _refusal(lambda: trainer(fp16_model, bf16=True)),
        "trainer_save_only_model": _refusal(lambda: trainer(ep_model, save_only_model=True)),
        "mixed_precision": _refusal(lambda: moe_ep.configure_accelerator(Accelerator(mixed_precision="bf16"),
                                                                         fp16_model)),
        "compile": _refusal(lambda: moe_ep.configure_accelerator(Accelerator(dynamo_backend="inductor"), ep_model)),
    }
    written = sorted(os.listdir(out)) if os.path.exists(out) else []
    return {"messages": messages, "written": written}


def _plugin_checks(rank: int, world: int) -> dict:
    """``check_fsdp_plugin`` and ``check_parallelism_config`` on objects accelerate would build
    from a configuration (on the CPU it builds no Accelerator with either)."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import FullyShardedDataParallelPlugin

    from moe_ep.parallel import parallel_context
    from moe_ep.training.hf_accelerate import check_fsdp_plugin, check_parallelism_config, fsdp2_plugin_arguments

    context = parallel_context(_model(ep=2))
    agreeing = fsdp2_plugin_arguments(context)
    plugins = {
        "fsdp1": {"fsdp_version": 1, "reshard_after_forward": "FULL_SHARD"},
        "class_wrap": {**agreeing, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP"},
        "size_wrap": {**agreeing, "auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 10},
        "cpu_offload": {**agreeing, "cpu_offload": True},
        "activation_checkpointing": {**agreeing, "activation_checkpointing": True},
        "reshard_after_forward": {**agreeing, "reshard_after_forward": False},
        "full_state_dict": {**agreeing, "state_dict_type": "FULL_STATE_DICT"},
        "agreeing": agreeing,
    }
    found = {name: _refusal(lambda p=p: check_fsdp_plugin(FullyShardedDataParallelPlugin(**p), context))
             for name, p in plugins.items()}
    configs = {"tp": {"tp_size": 2}, "dp_shard": {"dp_shard_size": 1, "dp_replicate_size": 2},
               "agreeing_pc": {"dp_shard_size": 2}}
    found.update({name: _refusal(lambda c=c: check_parallelism_config(ParallelismConfig(**c), context))
                  for name, c in configs.items()})
    return found


def _switch(rank: int, world: int) -> dict:
    """configure_accelerator on the CPU, where accelerate dropped FSDP: accelerate's public view
    afterwards, and what ``prepare`` makes of the model and the optimizer."""
    import accelerate
    from accelerate import Accelerator, PartialState
    from accelerate.state import AcceleratorState
    from packaging.specifiers import SpecifierSet

    import moe_ep
    from moe_ep.training.hf_accelerate import VERIFIED_ACCELERATE

    _accelerate_env(rank, world)
    _fresh_accelerate()
    model = _model(ep=2)
    accelerator = Accelerator()
    before = accelerator.distributed_type.value
    moe_ep.configure_accelerator(accelerator, model)
    moe_ep.configure_accelerator(accelerator, model)  # idempotent
    optimizer = torch.optim.AdamW(model.parameters())
    prepared, prepared_optimizer = accelerator.prepare(model, optimizer)
    params = {id(p) for p in model.parameters()}
    return {
        "verified": accelerate.__version__ in SpecifierSet(VERIFIED_ACCELERATE),
        "version": accelerate.__version__,
        "before": before,
        "accelerator": accelerator.distributed_type.value,
        "is_fsdp2": accelerator.is_fsdp2,
        "state": AcceleratorState().distributed_type.value,
        "partial_state": PartialState().distributed_type.value,
        "plugin": {"version": accelerator.state.fsdp_plugin.fsdp_version,
                   "state_dict_type": accelerator.state.fsdp_plugin.state_dict_type.name},
        "same_model": prepared is model,
        "optimizer_holds_the_model_parameters": all(
            id(p) in params for group in prepared_optimizer.optimizer.param_groups for p in group["params"]),
        "models_registered": len(accelerator._models),
    }


def _evaluate_then_train(rank: int, world: int, out: str) -> dict:
    """``evaluate()`` before ``train()`` (accelerate's FSDP2 mode prepares a model only together
    with its optimizer): the evaluation loss against one float64 process, then a training step."""
    import copy

    from transformers import TrainingArguments

    import moe_ep
    from hf_models import tiny_batch, tiny_model

    _accelerate_env(rank, world)
    _fresh_accelerate()
    model = tiny_model("mixtral", experts_implementation="moe_ep")
    reference = copy.deepcopy(model).double()
    reference.set_experts_implementation("eager")  # moe_ep's kernels take no float64
    batch = tiny_batch(model.config, batch=4, seq=9)
    data = [{k: v[i] for k, v in batch.items()} for i in range(4)]
    with torch.no_grad():
        want = sum(reference(**{k: v[None] for k, v in row.items()}).loss for row in data) / len(data)
    args = TrainingArguments(output_dir=os.path.join(out, f"eval{rank}"), report_to=[], use_cpu=True, max_steps=1,
                             per_device_train_batch_size=1, per_device_eval_batch_size=1, save_strategy="no")
    trainer = moe_ep.ExpertParallelTrainer(model=moe_ep.parallelize(model, ep=2), args=args, train_dataset=data,
                                           eval_dataset=data)
    metrics = trainer.evaluate()
    trained = trainer.train()
    uploaded = []

    class Hub:  # what push_to_hub would upload: the output folder's files, no network
        def upload_folder(self, folder_path, **_):
            uploaded.extend(sorted(os.listdir(folder_path)))

    import transformers.trainer

    real_hub, transformers.trainer.hf_api = transformers.trainer.hf_api, Hub
    trainer.hub_model_id = "user/model"  # as init_hf_repo sets it
    try:
        trainer.push_to_hub()
    finally:
        transformers.trainer.hf_api = real_hub
    # A second Trainer in the process: the first one's Accelerator(fsdp_plugin=...) set
    # ACCELERATE_USE_FSDP, which was read as an FSDP1 configuration and refused.
    left_set = os.environ.get("ACCELERATE_USE_FSDP")
    _fresh_accelerate()
    second = _refusal(lambda: moe_ep.ExpertParallelTrainer(model=_model(ep=2), args=args, train_dataset=data))
    return {"eval_loss_err": abs(metrics["eval_loss"] - want.item()) / want.item(),
            "train_loss": trained.training_loss, "steps": trained.global_step, "uploaded": uploaded,
            "second_trainer": (left_set, second)}


def _chunked_loss(rank: int, world: int, out: str) -> dict:
    """The chunked loss against the logits' loss on the same parallelized model (experts over 2
    ranks, the load-balancing loss on, a third of the labels ignored): a hand-written step's loss
    and gradients through ``chunked_causal_lm_loss``, and ``ExpertParallelTrainer(chunked_loss=True)``'s
    losses over 3 steps of 2 accumulated micro-batches against the Trainer's own."""
    import copy

    from transformers import TrainingArguments

    import moe_ep
    from hf_models import tiny_batch, tiny_model

    _accelerate_env(rank, world)
    model = tiny_model("mixtral", experts_implementation="moe_ep", output_router_logits=True,
                       router_aux_loss_coef=0.05).train()
    batch = tiny_batch(model.config, batch=12, seq=9, seed=rank)
    batch["labels"][:, ::3] = -100
    found = {}

    hand = moe_ep.parallelize(copy.deepcopy(model), ep=2)
    want = hand(**batch).loss
    want.backward()
    notices = []
    redistribute_log = logging.getLogger("torch.distributed.tensor._redistribute")
    handler = logging.Handler()
    handler.emit = notices.append
    redistribute_log.addHandler(handler)
    want_grads = {n: p.grad.full_tensor().clone() if hasattr(p.grad, "full_tensor") else p.grad.clone()
                  for n, p in hand.named_parameters()}
    redistribute_log.removeHandler(handler)
    found["dtensor_notices"] = [r.getMessage() for r in notices]
    hand.zero_grad()
    loss, outputs = moe_ep.chunked_causal_lm_loss(hand, batch["labels"], input_ids=batch["input_ids"])
    loss.backward()
    found["hand_loss_err"] = (abs(loss - want) / want).item()
    found["hand_grad_err"] = max(
        ((p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad) - want_grads[n]).abs().max().item()
        / want_grads[n].abs().max().clamp_min(1e-30).item() for n, p in hand.named_parameters())
    found["no_logits"] = outputs.logits.numel() == 0

    data = [{k: v[i] for k, v in batch.items()} for i in range(len(batch["input_ids"]))]
    losses = {}
    environment = dict(os.environ)  # a Trainer exports its FSDP plugin's settings
    for chunked in (False, True):
        os.environ.clear()
        os.environ.update(environment)
        _fresh_accelerate()
        args = TrainingArguments(output_dir=os.path.join(out, f"chunked{chunked}{rank}"), report_to=[], use_cpu=True,
                                 max_steps=3, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                 logging_steps=1, save_strategy="no", learning_rate=1e-3, seed=0)
        trainer = moe_ep.ExpertParallelTrainer(model=moe_ep.parallelize(copy.deepcopy(model), ep=2), args=args,
                                               train_dataset=data, chunked_loss=chunked)
        trainer.train()
        losses[chunked] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    found["trainer_losses"] = losses
    found["refusals"] = [_refusal(lambda: moe_ep.ExpertParallelTrainer(
        model=moe_ep.parallelize(copy.deepcopy(model), ep=2), args=args, chunked_loss=True,
        compute_loss_func=lambda *a, **k: None)), _refusal(lambda: moe_ep.ExpertParallelTrainer(
            model=moe_ep.parallelize(copy.deepcopy(model), ep=2), chunked_loss=True, args=TrainingArguments(
                output_dir=os.path.join(out, f"smoothing{rank}"), report_to=[], use_cpu=True,
                label_smoothing_factor=0.1)))]
    return found


def _world(rank: int, world: int, out: str) -> dict:
    return {"configurations": _configurations(rank, world, out), "plugins": _plugin_checks(rank, world),
            "switch": _switch(rank, world), "evaluate": _evaluate_then_train(rank, world, out),
            "chunked": _chunked_loss(rank, world, out)}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_ranks(_world, WORLD, str(tmp_path_factory.mktemp("hf_accelerate") / "out"), timeout=300)


EXPECTED = {
    "launched_fsdp1_config": "FSDP plugin disagrees with moe_ep.parallelize, which sharded the model with FSDP2 "
                             "already: fsdp_version=1: set fsdp_version: 2",
    "use_fsdp_alone": "no error",
    "not_parallelized": "MixtralForCausalLM was not prepared by moe_ep.parallelize: call moe_ep.parallelize(model, ep=...)",
    "pipeline_stages": "moe_ep.parallelize(pp=2) cut the model into pipeline stages, which run only under moe_ep.TrainStep",
    "trainer_pipeline_stages": "moe_ep.parallelize(pp=2) cut the model into pipeline stages",
    "trainer_fsdp1": "FSDP plugin disagrees with moe_ep.parallelize, which sharded the model with FSDP2 already: "
                     "fsdp_version=1: set fsdp_version: 2",
    "trainer_class_wrap": "an auto_wrap_policy is set: set fsdp_auto_wrap_policy: NO_WRAP",
    "trainer_parallelism_config": "ParallelismConfig(dp_replicate_size=2, dp_shard_size=1, tp_size=1, cp_size=1, "
                                  "sp_size=1) disagrees with moe_ep.parallelize's layout (dp_replicate=1, dp_shard=2, "
                                  "ep=2): set dp_replicate_size=1, dp_shard_size=2",
    "trainer_torch_compile": "TrainingArguments(torch_compile=True): moe_ep.parallelize(compile_blocks=...) compiled "
                             "the model's dense blocks already; leave torch_compile False",
    "trainer_gradient_checkpointing": "gradient_checkpointing=True) would change a model moe_ep.parallelize sharded "
                                      "already: pass activation_checkpointing=True to moe_ep.parallelize instead",
    "trainer_mixed_precision": "mixed_precision='bf16' disagrees with moe_ep.parallelize's "
                               "MixedPrecisionPolicy(param_dtype=torch.float16)",
    "trainer_save_only_model": "TrainingArguments(save_only_model=True) writes no checkpoint of a model "
                               "moe_ep.parallelize sharded, whose checkpoints are DCP shards of model and optimizer "
                               "(SHARDED_STATE_DICT): set save_only_model=False",
    "mixed_precision": "mixed_precision='bf16' disagrees with moe_ep.parallelize's",
    "compile": "dynamo_backend=INDUCTOR (torch.compile) is not supported with a model moe_ep.parallelize prepared: "
               "leave it out and compile the dense blocks with moe_ep.parallelize(compile_blocks=...)",
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_a_disagreeing_configuration_stops_in_one_line(world2, case):
    for results in world2:
        assert EXPECTED[case] in results["configurations"]["messages"][case]


@pytest.mark.slow
def test_a_refused_trainer_wrote_nothing(world2):
    assert [r["configurations"]["written"] for r in world2] == [[], []]


PLUGINS = {
    "fsdp1": "fsdp_version=1: set fsdp_version: 2",
    "class_wrap": "set fsdp_auto_wrap_policy: NO_WRAP",
    "size_wrap": "set fsdp_auto_wrap_policy: NO_WRAP",
    "cpu_offload": "cpu_offload is on: turn it off",
    "activation_checkpointing": "pass activation_checkpointing=True to moe_ep.parallelize instead",
    "reshard_after_forward": "reshard_after_forward=False, parallelize's is True",
    "full_state_dict": "no error",
    "agreeing": "no error",
    "tp": "tp_size=2",
    "dp_shard": "set dp_replicate_size=1, dp_shard_size=2, tp_size=1, cp_size=1, sp_size=1",
    "agreeing_pc": "no error",
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(PLUGINS))
def test_what_the_fsdp_plugin_and_parallelism_config_must_say(world2, case):
    for results in world2:
        assert PLUGINS[case] in results["plugins"][case]


@pytest.mark.slow
def test_the_private_accelerate_state_is_where_moe_ep_switches_it(world2):
    """Fails when accelerate moves the state moe_ep switches (or a release outside the range it was
    verified against is installed): then ``_enter_fsdp2_mode`` must be read again."""
    for found in world2:
        assert found["switch"]["verified"], f"accelerate {found['switch']['version']} was not verified"
        assert {k: found["switch"][k] for k in ("before", "accelerator", "is_fsdp2", "state", "partial_state")} == {
            "before": "MULTI_CPU", "accelerator": "FSDP", "is_fsdp2": True, "state": "FSDP", "partial_state": "FSDP"}


@pytest.mark.slow
def test_prepare_passes_the_sharded_model_through(world2):
    for found in world2:
        switch = found["switch"]
        assert switch["plugin"] == {"version": 2, "state_dict_type": "SHARDED_STATE_DICT"}
        assert switch["same_model"] and switch["optimizer_holds_the_model_parameters"]
        assert switch["models_registered"] == 1


@pytest.mark.slow
def test_evaluate_before_train_and_push_to_hub_after(world2):
    for found in world2:
        assert found["evaluate"]["eval_loss_err"] <= TOLERANCE[torch.float32], found["evaluate"]
        assert found["evaluate"]["steps"] == 1 and found["evaluate"]["train_loss"] > 0
    # push_to_hub saves the model as an internal call, as a checkpoint is saved: it uploaded no weights.
    assert {"config.json", "model.safetensors"} <= set(world2[0]["evaluate"]["uploaded"]), world2[0]["evaluate"]
    assert world2[1]["evaluate"]["uploaded"] == []  # only rank 0 pushes
    for found in world2:
        assert found["evaluate"]["second_trainer"] == ("true", "no error")


@pytest.mark.slow
def test_the_chunked_loss_in_a_hand_written_loop_and_in_the_trainer_equals_the_logits_loss(world2):
    for found in world2:
        chunked = found["chunked"]
        assert chunked["no_logits"]
        assert chunked["dtensor_notices"] == []  # gathering the strided expert gradients stays quiet
        assert chunked["hand_loss_err"] <= TOLERANCE[torch.float32], chunked
        assert chunked["hand_grad_err"] <= TOLERANCE[torch.float32], chunked
        plain, mine = chunked["trainer_losses"][False], chunked["trainer_losses"][True]
        assert len(plain) == len(mine) == 3
        for a, b in zip(plain, mine):
            assert abs(a - b) <= 1e-4 * abs(a), (plain, mine)  # the Trainer logs 4 significant digits
        assert chunked["refusals"] == [
            "chunked_loss=True computes the training loss itself: pass compute_loss_func=None or chunked_loss=False",
            "chunked_loss=True computes the plain cross-entropy, but TrainingArguments has label_smoothing_factor=0.1: "
            "set it to 0 or use chunked_loss=False"]


def test_only_the_strided_gather_notice_is_dropped():
    from moe_ep.parallel.fsdp import _StridedGatherNotice

    def record(message):
        return logging.LogRecord("torch.distributed.tensor._redistribute", logging.WARNING, __file__, 1, message,
                                 None, None)

    notice = _StridedGatherNotice()
    assert not notice.filter(record("While redistributing from (_StridedShard(dim=0, sf=2), Shard(dim=0)) to "
                                    "(Replicate(), Replicate()), 2 sequential all_gather operations will be performed."))
    assert notice.filter(record("While redistributing from (Shard(dim=0), Shard(dim=1)) to (Replicate(), Replicate()), "
                                "2 sequential all_gather operations will be performed."))
    assert notice.filter(record("some other DTensor warning about _StridedShard"))
