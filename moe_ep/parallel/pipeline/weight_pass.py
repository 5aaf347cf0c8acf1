"""The weight-gradient pass of a split backward (ZB-V, DualPipeV): one recompute of each
checkpointed layer instead of one per parameter group, and its gradients folded into FSDP2's
float32 accumulator at once.

Recompute. torch's ``stage_backward_weight`` runs one autograd pass per group of parameters, and a
non-reentrant checkpoint recomputes its layer once per autograd pass that reads it: under
``activation_checkpointing="full"`` a stage's layers ran their forward again for every group
(nine times per micro-batch on a Mixtral layer), and each of those recomputes kept what its pass
did not read until the micro-batch's graph was freed. Inside one ``GraphExecGroup`` (torch 2.10
and later) the passes of the weight-gradient step share one recompute: the groups' passes cover
disjoint parts of the graph, as that context requires. The input-gradient pass keeps its own
recompute: it reads the nodes where the weight pass starts (the context would refuse the two in
one group). A split backward under full recompute therefore runs each layer's forward twice in
its backward (the planner charges that: ``moe_ep.planner.recompute.recompute_passes``); on torch
2.9, which lacks the context, once per parameter group.

Accumulation. Under a bf16 ``MixedPrecisionPolicy`` the schedule keeps each stage's gradients
unsharded until its last backward, FSDP2 moving each backward's bf16 ``.grad`` into a float32
accumulator in its post-backward hook. That hook fires once a module's input gradients exist:
in a split backward, at the end of the input pass, before the weight pass writes ``.grad``. The
weight pass's bf16 gradients then waited in ``.grad``, and where the stage's next backward is a
full one (DualPipeV mixes them on a stage) autograd added that one into them in bf16: a 1e-3
relative error on the last stage's gradients against the same run without pipeline stages. The
stage moves them into the float32 accumulator right after its weight pass, as the hook would."""

from __future__ import annotations

from contextlib import nullcontext

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage

try:
    from torch.utils.checkpoint import GraphExecGroup
except ImportError:  # torch 2.9
    GraphExecGroup = None


def _fsdp_params(module: nn.Module):
    """The FSDPParams of every FSDP2 module under ``module`` (torch 2.13 keeps a list of
    parameter groups per module, earlier releases one)."""
    for m in module.modules():
        if not isinstance(m, FSDPModule):
            continue
        state = m._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            groups = [state._fsdp_param_group]
        for group in groups:
            if group is not None:
                yield from group.fsdp_params


def fold_into_accumulated_grads(module: nn.Module) -> None:
    """What FSDP2's post-backward hook does to gradients it does not reduce yet: each unsharded
    parameter's ``.grad`` added to its float32 accumulator (or made it), the ``.grad`` cleared."""
    for fsdp_param in _fsdp_params(module):
        fsdp_param.accumulate_unsharded_grad_if_needed()
        fsdp_param.to_accumulated_grad_if_needed()


class SplitBackwardStage(PipelineStage):
    """A ``PipelineStage`` whose weight-gradient step recomputes each checkpointed layer once and
    leaves its gradients in FSDP2's float32 accumulator."""

    def backward_weight_one_chunk(self, *args, **kwargs):
        with GraphExecGroup() if GraphExecGroup is not None else nullcontext():
            result = super().backward_weight_one_chunk(*args, **kwargs)
        fold_into_accumulated_grads(self.submod)
        return result


def stage_class(splits_backward: bool) -> type[PipelineStage]:
    """The stage wrapper for a schedule (``splits_backward``: ZB-V, DualPipeV)."""
    return SplitBackwardStage if splits_backward else PipelineStage
