"""accelerate's ``Accelerator`` on a model that ``moe_ep.parallelize`` prepared:
``configure_accelerator(accelerator, model)``, one call after ``Accelerator(...)`` and before
``accelerator.prepare``. ``hf_trainer.py`` makes the same call for ``transformers.Trainer``.

Why it is needed. ``prepare`` wraps a model it did not shard itself in DistributedDataParallel,
whose start-up broadcast fails on the DTensor parameters of an expert-parallel model (on the CPU:
"Cannot flatten unevenly sharded tensor"; on GPUs: "contains DTensor parameters, which is
incompatible with DDP"), unless accelerate is in its FSDP2 mode. There it passes a model that is
already ``fully_shard``-ed through untouched, swaps the optimizer's parameters for the same ones,
accumulates with ``set_requires_gradient_sync``, clips each mesh's gradients and combines the
norms, and saves and loads model and optimizer with DCP. So the call checks that accelerate's
configuration agrees with what ``parallelize`` did, puts accelerate in FSDP2 mode where it is not,
and registers the model (autocast for ``mixed_precision``, as accelerate does for any model).

What accelerate's configuration must say (each disagreement stops with one line, before any work):

- FSDP plugin (``Accelerator(fsdp_plugin=...)``, an FSDP accelerate config, or Trainer's ``fsdp``
  and ``fsdp_config``), if any: ``fsdp_version: 2``; ``auto_wrap_policy: NO_WRAP`` (parallelize
  wrapped every decoder layer and experts module already; a class-name policy no longer finds its
  classes, which FSDP2 renamed); no ``cpu_offload``; no ``activation_checkpointing`` (give
  ``parallelize(activation_checkpointing=True)``); no ``ignored_modules``;
  ``reshard_after_forward`` as parallelize's; ``state_dict_type`` SHARDED_STATE_DICT (checkpoints
  are DCP shards) or FULL_STATE_DICT. Without a plugin this one is used:
  ``fsdp2_plugin_arguments``.
- ``ParallelismConfig``, if any: ``dp_replicate_size`` and ``dp_shard_size`` equal to
  parallelize's ``dp_replicate`` and ``dp_shard``, ``tp_size``, ``cp_size`` and ``sp_size`` 1.
  It adds nothing (the model keeps moe_ep's meshes); accelerate 1.15 refuses any ParallelismConfig
  of more than one process on the CPU itself, before this call.
- ``mixed_precision``: ``"no"``, ``"bf16"`` or ``"fp16"`` (fp16 needs a GPU in accelerate); with
  ``parallelize(mixed_precision=MixedPrecisionPolicy(param_dtype=...))`` the same dtype or
  ``"no"``. bf16/fp16 compute under autocast with float32 weights, as accelerate runs any model
  it does not shard; parallelize's policy is FSDP's casting instead.
- no ``torch.compile`` through accelerate (``dynamo_backend``): ``prepare`` compiles the whole model
  whenever its dynamo plugin names a backend (regional compilation too compiles whole decoder
  layers, around the experts' FSDP2 hooks and the dispatcher's host syncs), and only rewriting its
  state's plugin would stop it; ``parallelize(compile_blocks=...)`` compiles the dense blocks
  instead (the Trainer's ``torch_compile`` does it too: the Trainer builds its Accelerator, so
  moe_ep hands it a plugin without a backend). No DeepSpeed, Megatron-LM or XLA.
- ``pp == 1``: pipeline stages run only under ``moe_ep.TrainStep``'s schedule.
- a distributed type accelerate drives as FSDP or as data parallel, or ``NO`` for one process
  (plain ``python`` or ``accelerate launch --num_processes 1``, where the script gave
  ``parallelize`` a process group of one rank itself).

Private accelerate state. accelerate 1.15 enters FSDP mode only for GPU-like distributed types:
on the CPU (``MULTI_CPU``, gloo) it drops the FSDP plugin, and launched with a DDP config it has
none. ``_enter_fsdp2_mode`` then does what ``AcceleratorState.__init__`` does on a GPU with a
plugin: three assignments to accelerate's shared state. It is the one place that touches
accelerate's private attributes, checks the accelerate version it was verified against and
verifies the result through accelerate's public properties;
``tests/test_hf_accelerate.py`` fails when a new accelerate release changes either."""

from __future__ import annotations

import os
import warnings

from ..parallel.context import ParallelContext, parallel_context

# The accelerate releases whose AcceleratorState _enter_fsdp2_mode was read and tested against.
VERIFIED_ACCELERATE = ">=1.15,<1.16"
STATE_DICT_TYPES = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")
_MIXED_PRECISION_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
# Distributed types that accelerate handles like DDP and from which FSDP2 mode is reached.
_DATA_PARALLEL_TYPES = ("MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_MUSA", "MULTI_SDAA",
                        "MULTI_HPU", "MULTI_NEURON")


def expert_parallel_context(model) -> ParallelContext:
    """What ``moe_ep.parallelize`` made of ``model``, refused in one line when it is not something
    accelerate or Trainer can drive: a model parallelize did not prepare, or pipeline stages."""
    context = parallel_context(model)
    if context is not None and context.stages is not None:
        raise ValueError(
            f"moe_ep.parallelize(pp={context.config.pp}) cut the model into pipeline stages, which run only under "
            "moe_ep.TrainStep's schedule; accelerate and transformers' Trainer drive one nn.Module: use pp=1 "
            "(expert parallel with FSDP2/HSDP) with them, or moe_ep.TrainStep for pipeline stages"
        )
    if context is None:
        raise ValueError(
            f"{type(model).__name__} was not prepared by moe_ep.parallelize: call "
            "moe_ep.parallelize(model, ep=...) on every rank before handing it to accelerate or the Trainer"
        )
    return context


def fsdp2_plugin_arguments(context: ParallelContext) -> dict:
    """``FullyShardedDataParallelPlugin``'s keywords for a model parallelize prepared: accelerate's
    FSDP2 mode, nothing for it to wrap, cast or offload, DCP-sharded checkpoints."""
    return {
        "fsdp_version": 2,
        "auto_wrap_policy": "NO_WRAP",
        "state_dict_type": "SHARDED_STATE_DICT",
        "reshard_after_forward": context.config.fsdp_reshard_after_forward,
        "cpu_offload": False,
        "activation_checkpointing": False,
        "cpu_ram_efficient_loading": False,
    }


def _fsdp_problem(plugin, context: ParallelContext) -> str | None:
    from torch.distributed.fsdp import CPUOffloadPolicy

    if plugin.fsdp_version != 2:
        return f"fsdp_version={plugin.fsdp_version}: set fsdp_version: 2 (parallelize shards with FSDP2)"
    if plugin.auto_wrap_policy is not None:
        return ("an auto_wrap_policy is set: set fsdp_auto_wrap_policy: NO_WRAP (parallelize wrapped every decoder "
                "layer and experts module already)")
    if isinstance(plugin.cpu_offload, CPUOffloadPolicy):
        return "cpu_offload is on: turn it off (parallelize does not offload)"
    if plugin.activation_checkpointing:
        return ("activation_checkpointing is on: turn it off and pass activation_checkpointing=True to "
                "moe_ep.parallelize instead")
    if plugin.ignored_modules is not None:
        return "ignored_modules is set: remove it (parallelize shards every module)"
    wanted = context.config.fsdp_reshard_after_forward
    if plugin.reshard_after_forward != wanted:
        return (f"reshard_after_forward={plugin.reshard_after_forward}, parallelize's is {wanted}: set "
                f"fsdp_reshard_after_forward: {wanted} (or pass reshard_after_forward= to moe_ep.parallelize)")
    state_dict_type = getattr(plugin.state_dict_type, "name", str(plugin.state_dict_type))
    if state_dict_type not in STATE_DICT_TYPES:
        return f"state_dict_type={state_dict_type}: use SHARDED_STATE_DICT (DCP checkpoints) or FULL_STATE_DICT"
    return None


def check_fsdp_plugin(plugin, context: ParallelContext) -> None:
    """One line naming what accelerate's FSDP plugin must change to agree with parallelize."""
    problem = _fsdp_problem(plugin, context)
    if problem is not None:
        raise ValueError(f"accelerate's FSDP plugin disagrees with moe_ep.parallelize, which sharded the model with "
                         f"FSDP2 already: {problem}")


def check_parallelism_config(config, context: ParallelContext) -> None:
    """accelerate's ``ParallelismConfig`` (None: nothing to check) must describe parallelize's
    data-parallel layout and nothing else; one line saying what to set otherwise."""
    if config is None:
        return
    dims = context.meshes.dims
    wanted = {"dp_replicate_size": dims.dp_replicate, "dp_shard_size": dims.dp_shard, "tp_size": 1, "cp_size": 1,
              "sp_size": 1}
    found = {name: getattr(config, name, 1) for name in wanted}
    if found != wanted:
        given = ", ".join(f"{name}={value}" for name, value in found.items())
        needed = ", ".join(f"{name}={value}" for name, value in wanted.items())
        raise ValueError(
            f"accelerate's ParallelismConfig({given}) disagrees with moe_ep.parallelize's layout (dp_replicate="
            f"{dims.dp_replicate}, dp_shard={dims.dp_shard}, ep={dims.ep}): set {needed}, or leave parallelism_config "
            "out (the model keeps moe_ep's meshes)"
        )


def check_mixed_precision(mixed_precision: str, context: ParallelContext) -> None:
    """accelerate's ``mixed_precision`` against parallelize's ``MixedPrecisionPolicy``."""
    if mixed_precision not in ("no", *_MIXED_PRECISION_DTYPES):
        raise ValueError(f"accelerate's mixed_precision={mixed_precision!r} is not supported with a model "
                         "moe_ep.parallelize prepared: use 'no', 'bf16' or 'fp16'")
    policy = context.config.mixed_precision
    param_dtype = None if policy is None or policy.param_dtype is None else str(policy.param_dtype).split(".")[-1]
    if mixed_precision == "no" or param_dtype in (None, "float32"):
        return
    if param_dtype != _MIXED_PRECISION_DTYPES[mixed_precision]:
        raise ValueError(
            f"accelerate's mixed_precision={mixed_precision!r} disagrees with moe_ep.parallelize's "
            f"MixedPrecisionPolicy(param_dtype=torch.{param_dtype}): use the same dtype in both, or 'no' in accelerate"
        )


def fsdp_config_launched() -> bool:
    """Whether the launcher was given an FSDP accelerate config: ``ACCELERATE_USE_FSDP`` with the
    ``FSDP_*`` variables ``accelerate launch`` writes beside it (``FSDP_VERSION`` always). The
    first alone is also what accelerate's ``Accelerator(fsdp_plugin=...)`` sets in its process,
    as under an ``ExpertParallelTrainer``, which passes one: a second Trainer, or
    ``configure_accelerator``, then read it as an FSDP1 configuration nobody gave."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and "FSDP_VERSION" in os.environ


def requested_fsdp_plugin(accelerator, given=None):
    """The FSDP plugin accelerate was asked for: the one it keeps, else ``given``, else the one an
    FSDP accelerate config describes (``ACCELERATE_USE_FSDP`` and the ``FSDP_*`` variables), which
    accelerate drops on the CPU; None when none was asked for."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)  # unset where accelerate never considered FSDP
    if plugin is None:
        plugin = given
    if plugin is None and fsdp_config_launched():
        from accelerate.utils import FullyShardedDataParallelPlugin

        plugin = FullyShardedDataParallelPlugin()
    return plugin


def _check_accelerator(accelerator, plugin, context: ParallelContext) -> None:
    kind = accelerator.distributed_type.value
    # One process (plain `python`, `accelerate launch --num_processes 1`) is NO to accelerate,
    # whatever process group of one rank parallelize ran on.
    one_process = kind == "NO" and accelerator.num_processes == 1 == context.meshes.world.size()
    if kind not in ("FSDP", *_DATA_PARALLEL_TYPES) and not one_process:
        raise ValueError(f"accelerate's distributed_type={kind} cannot drive a model moe_ep.parallelize sharded with "
                         "FSDP2: launch with a multi-GPU (or FSDP2) accelerate config, or on the CPU")
    if accelerator.state.dynamo_plugin.backend.name != "NO":
        raise ValueError(f"accelerate's dynamo_backend={accelerator.state.dynamo_plugin.backend.name} (torch.compile) "
                         "is not supported with a model moe_ep.parallelize prepared: leave it out and compile the "
                         "dense blocks with moe_ep.parallelize(compile_blocks=...) (accelerate's prepare compiles the "
                         "whole model, FSDP2's hooks and the dispatcher included)")
    if plugin is not None:
        check_fsdp_plugin(plugin, context)
    check_parallelism_config(accelerator.parallelism_config, context)
    check_mixed_precision(accelerator.mixed_precision, context)


def configure_accelerator(accelerator, model, fsdp_plugin=None) -> None:
    """Make ``accelerator`` drive ``model``, which ``moe_ep.parallelize`` prepared (``pp=1``): call
    it after ``Accelerator(...)`` and before ``accelerator.prepare(model, optimizer, ...)``::

        model = moe_ep.parallelize(model, ep=2)
        accelerator = Accelerator(gradient_accumulation_steps=2)
        moe_ep.configure_accelerator(accelerator, model)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    Then ``backward``, ``accumulate``, ``clip_grad_norm_`` (the norm over both meshes),
    ``gather_for_metrics``, ``save_state``/``load_state`` (DCP shards of model and optimizer,
    exact resume) and ``get_state_dict`` (the full state dict, Hugging Face names, for
    ``save_pretrained``) work as for any FSDP2 model. The module docstring lists what accelerate's
    configuration must say; a disagreement raises ValueError in one line before anything changes.
    ``fsdp_plugin``: the plugin to use where accelerate did not keep the one it was given (it drops
    any on the CPU); by default an FSDP accelerate config's, else ``fsdp2_plugin_arguments``'.
    Idempotent."""
    context = expert_parallel_context(model)
    plugin = requested_fsdp_plugin(accelerator, fsdp_plugin)
    _check_accelerator(accelerator, plugin, context)
    if not accelerator.is_fsdp2:
        from accelerate.utils import FullyShardedDataParallelPlugin

        _enter_fsdp2_mode(accelerator, plugin or FullyShardedDataParallelPlugin(**fsdp2_plugin_arguments(context)))
    # accelerate's own preparation of a model it leaves unwrapped: autocast for bf16/fp16, and the
    # model registered, so that evaluating before training finds it prepared.
    accelerator.prepare_model(model, evaluation_mode=True)


def _enter_fsdp2_mode(accelerator, plugin) -> None:
    """Put accelerate in FSDP2 mode as ``AcceleratorState.__init__`` does on GPUs when given an
    FSDP plugin (accelerate 1.15, state.py): the plugin takes the accelerator's mixed precision,
    becomes the state's ``fsdp_plugin``, and the distributed type becomes FSDP in the shared state of
    both ``AcceleratorState`` and ``PartialState``. The only code of moe_ep that writes accelerate's
    private attributes."""
    import accelerate
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType
    from packaging.specifiers import SpecifierSet

    if accelerate.__version__ not in SpecifierSet(VERIFIED_ACCELERATE, prereleases=True):
        warnings.warn(
            f"moe_ep switches accelerate into FSDP2 mode the way accelerate{VERIFIED_ACCELERATE} does on GPUs; "
            f"accelerate {accelerate.__version__} is installed, so the switch is checked after it is made", stacklevel=3)
    state = accelerator.state
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    state.fsdp_plugin = plugin
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    if not (accelerator.is_fsdp2 and accelerator.state.fsdp_plugin is plugin
            and PartialState().distributed_type == DistributedType.FSDP):
        raise RuntimeError(
            f"accelerate {accelerate.__version__} keeps its distributed type elsewhere than accelerate"
            f"{VERIFIED_ACCELERATE}, so moe_ep could not put it in FSDP2 mode; launch with an FSDP2 accelerate config "
            "on GPUs (fsdp_version: 2, fsdp_auto_wrap_policy: NO_WRAP) or use an accelerate release in that range"
        )
