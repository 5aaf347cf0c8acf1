"""transformers' ``Trainer`` on a model that ``moe_ep.parallelize`` prepared: build
``moe_ep.ExpertParallelTrainer`` where the script built ``Trainer``, with the same arguments, and
change nothing else::

    model = moe_ep.parallelize(model, ep=2)          # every rank, before the Trainer
    trainer = moe_ep.ExpertParallelTrainer(model=model, args=training_args, train_dataset=data)
    trainer.train()                                   # or train(resume_from_checkpoint=...)
    trainer.save_model(folder)                        # loads with plain from_pretrained

A Trainer subclass (TRL's ``SFTTrainer``, one's own) takes ``ExpertParallelTrainerMixin`` first:
``class MyTrainer(moe_ep.ExpertParallelTrainerMixin, SFTTrainer)``.

What it changes: the Trainer's ``Accelerator`` gets an FSDP2 plugin that wraps nothing
(``hf_accelerate.fsdp2_plugin_arguments``) unless the user configured FSDP, and is then configured
by ``configure_accelerator`` (``hf_accelerate.py`` says what accelerate's configuration must say;
every disagreement stops in one line before the Trainer exists). From there the Trainer runs its
own FSDP2 code: gradient accumulation without reduction until the last micro-batch, clipping over
both meshes, ``save_steps`` checkpoints as DCP shards of model and optimizer (with the RNG,
scheduler and trainer state files), ``resume_from_checkpoint`` from them, and ``evaluate``. The one
change of behaviour: ``save_model(folder)`` called by the user writes the full model
(``model.safetensors`` and ``config.json``, Hugging Face names and shapes), which plain
``from_pretrained`` loads, whatever ``state_dict_type`` checkpoints use. The load-balancing loss is
the model's own (``output_router_logits``), each rank's micro-batch balanced on its own as
transformers computes it.

``ExpertParallelTrainer(..., chunked_loss=True)`` computes the training loss without the logits
(``loss.chunked_causal_lm_loss``: the same loss, the same ``num_items_in_batch`` normalisation and
scaling as the Trainer's own, the model's load-balancing loss included); evaluation computes the
logits as usual, since ``compute_metrics`` and ``predict`` need them.

``TrainingArguments(torch_compile=True)`` compiles the dense parts of each decoder layer in place
with ``torch_compile_backend`` and ``torch_compile_mode``, as ``parallelize(compile_blocks=...)``
does (``moe_ep.parallel.compile``), and keeps accelerate from compiling the whole model; refused
where parallelize compiled them already, where the model records its router logits (the Trainer's
load-balancing loss: ``output_router_logits``, whose hooks dynamo cannot trace), or under the
``"selective"`` and ``"attention"`` recompute policies.

Arguments refused before any work, each in one line: ``gradient_checkpointing``
(give ``parallelize(activation_checkpointing=True)``), a ``parallelism_config`` or FSDP
configuration that disagrees with parallelize, and a model cut into pipeline stages (``pp > 1``:
Trainer drives one module; pipeline stages train under ``moe_ep.TrainStep``)."""

from __future__ import annotations

import contextlib

from transformers import Trainer

from ..parallel.compile import check_compilable, check_compilable_recompute, compile_dense_blocks, compile_options
from .hf_accelerate import (
    check_fsdp_plugin,
    check_parallelism_config,
    configure_accelerator,
    expert_parallel_context,
    fsdp2_plugin_arguments,
    fsdp_config_launched,
)
from .loss import chunked_causal_lm_loss, chunked_loss_parts


def block_compile_options(args, context) -> dict | None:
    """``TrainingArguments(torch_compile=True)`` as torch.compile's keywords for the dense blocks
    (``moe_ep.parallel.compile``), checked against what parallelize did; None without it."""
    if not args.torch_compile:
        return None
    if context.config.compile_options is not None:
        raise ValueError("TrainingArguments(torch_compile=True): moe_ep.parallelize(compile_blocks=...) compiled the "
                         "model's dense blocks already; leave torch_compile False")
    name = "TrainingArguments(torch_compile=True)"
    check_compilable_recompute(name, context.config.activation_checkpointing)
    return compile_options(f"{name}'s torch_compile_backend and torch_compile_mode",
                           {"backend": args.torch_compile_backend, "mode": args.torch_compile_mode})


def check_training_arguments(args, context) -> None:
    """The ``TrainingArguments`` that cannot apply to a model parallelize already prepared."""
    for name in ("gradient_checkpointing", "activation_checkpointing"):
        if getattr(args, name, False):
            raise ValueError(f"TrainingArguments({name}=True) would change a model moe_ep.parallelize sharded "
                             "already: pass activation_checkpointing=True to moe_ep.parallelize instead")
    check_parallelism_config(getattr(args, "parallelism_config", None), context)


@contextlib.contextmanager
def _full_state_dict(plugin):
    """accelerate's FSDP plugin saving full state dicts for a while (Trainer.save_model writes
    ``model.safetensors`` only with FULL_STATE_DICT)."""
    before = plugin.state_dict_type
    plugin.set_state_dict_type("FULL_STATE_DICT")
    try:
        yield
    finally:
        plugin.set_state_dict_type(before)


class ExpertParallelTrainerMixin:
    """Put in front of ``transformers.Trainer`` or any subclass of it; the module docstring says
    what it does."""

    def __init__(self, *args, chunked_loss: bool = False, **kwargs):
        if not isinstance(chunked_loss, bool):
            raise TypeError(f"chunked_loss must be a bool, got {chunked_loss!r}")
        if chunked_loss:
            if kwargs.get("compute_loss_func") is not None:
                raise ValueError("chunked_loss=True computes the training loss itself: pass compute_loss_func=None "
                                 "or chunked_loss=False")
            chunked_loss_parts(kwargs.get("model", args[0] if args else None))  # refused before any work
            training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
            smoothing = getattr(training_args, "label_smoothing_factor", 0)
            if smoothing:
                # Trainer.compute_loss would smooth the model's logits, which the chunked loss never makes.
                raise ValueError(f"chunked_loss=True computes the plain cross-entropy, but TrainingArguments has "
                                 f"label_smoothing_factor={smoothing}: set it to 0 or use chunked_loss=False")
        self.chunked_loss = chunked_loss
        super().__init__(*args, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not (self.chunked_loss and model.training and "labels" in inputs):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        loss, outputs = chunked_causal_lm_loss(model, labels, num_items_in_batch=num_items_in_batch, **inputs)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            # As Trainer.compute_loss scales a loss its model normalised by num_items_in_batch: that
            # count is over every process, and the gradients are averaged over them.
            tp_size = self.get_tp_size() if hasattr(self, "get_tp_size") else 1
            loss = loss * (self.accelerator.num_processes // tp_size)
        return (loss, outputs) if return_outputs else loss

    def _build_accelerator_args(self, **kwargs):
        context = expert_parallel_context(self.model)
        check_training_arguments(self.args, context)
        self._moe_ep_block_compile = block_compile_options(self.args, context)
        if self._moe_ep_block_compile is not None:
            check_compilable(self.model)
        plugin = kwargs.get("fsdp_plugin")  # from TrainingArguments' fsdp and fsdp_config
        if plugin is not None:
            check_fsdp_plugin(plugin, context)
        elif not fsdp_config_launched():
            from accelerate.utils import FullyShardedDataParallelPlugin

            plugin = FullyShardedDataParallelPlugin(**fsdp2_plugin_arguments(context))
        # On GPUs accelerate enters FSDP2 mode with it by itself; on the CPU it drops it, and
        # configure_accelerator switches with it.
        self._moe_ep_fsdp_plugin = kwargs["fsdp_plugin"] = plugin
        arguments = super()._build_accelerator_args(**kwargs)
        if self._moe_ep_block_compile is not None:
            from accelerate.utils import TorchDynamoPlugin

            # The dense blocks are compiled instead (create_accelerator_and_postprocess): accelerate
            # would compile the whole model, FSDP2's hooks and the dispatcher's host syncs included.
            arguments["dynamo_plugin"] = TorchDynamoPlugin(backend="no")
        return arguments

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        configure_accelerator(self.accelerator, self.model, fsdp_plugin=self._moe_ep_fsdp_plugin)
        state_dict_type = self.accelerator.state.fsdp_plugin.state_dict_type
        if self.args.save_only_model and "SHARDED" in str(state_dict_type):
            # transformers refuses the pair on GPUs; on the CPU its check ran before FSDP2 mode
            # was switched on, and every checkpoint was written empty.
            raise ValueError("TrainingArguments(save_only_model=True) writes no checkpoint of a model moe_ep.parallelize "
                             "sharded, whose checkpoints are DCP shards of model and optimizer (SHARDED_STATE_DICT): "
                             "set save_only_model=False")
        if self._moe_ep_block_compile is not None:
            compile_dense_blocks(self.model, self._moe_ep_block_compile)
        # Set by Trainer from accelerate's state before configure_accelerator could change it.
        self.is_fsdp_enabled = True

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if _internal_call:  # a checkpoint: model and optimizer as the plugin's state_dict_type says
            return super().save_model(output_dir, _internal_call=True)
        with _full_state_dict(self.accelerator.state.fsdp_plugin):
            return super().save_model(output_dir, _internal_call=False)

    def push_to_hub(self, *args, **kwargs):
        # Its save_model is an internal call, as a checkpoint's: the full weights, or the upload
        # holds no model file.
        with _full_state_dict(self.accelerator.state.fsdp_plugin):
            return super().push_to_hub(*args, **kwargs)


class ExpertParallelTrainer(ExpertParallelTrainerMixin, Trainer):
    """``transformers.Trainer`` for a model that ``moe_ep.parallelize`` prepared."""
