"""The weight-gradient pass of a split backward (ZB-V, DualPipeV) under full recompute, with one
recompute of each checkpointed layer instead of one per parameter group.

torch's ``stage_backward_weight`` runs one autograd pass per group of parameters, and a
non-reentrant checkpoint recomputes its layer once per autograd pass that reads it: under
``activation_checkpointing="full"`` a stage's layers ran their forward again for every group
(nine times per micro-batch on a Mixtral layer), and each of those recomputes kept what its pass
did not read until the micro-batch's graph was freed. Inside one ``GraphExecGroup`` (torch 2.10
and later) the passes of the weight-gradient step share one recompute: the groups' passes cover
disjoint parts of the graph, as that context requires. The input-gradient pass keeps its own
recompute: it reads the nodes where the weight pass starts (the context would refuse the two in
one group). A split backward under full recompute therefore runs each layer's forward twice in
its backward (the planner charges that: ``moe_ep.planner.recompute.recompute_passes``); on torch
2.9, which lacks the context, once per parameter group."""

from __future__ import annotations

from torch.distributed.pipelining import PipelineStage

try:
    from torch.utils.checkpoint import GraphExecGroup
except ImportError:  # torch 2.9
    GraphExecGroup = None


class WeightPassRecomputedOnce(PipelineStage):
    """A ``PipelineStage`` whose weight-gradient step recomputes each checkpointed layer once."""

    def backward_weight_one_chunk(self, *args, **kwargs):
        with GraphExecGroup():
            return super().backward_weight_one_chunk(*args, **kwargs)


def stage_class(splits_backward: bool) -> type[PipelineStage]:
    """The stage wrapper for a schedule (``splits_backward``: ZB-V, DualPipeV)."""
    return WeightPassRecomputedOnce if splits_backward and GraphExecGroup is not None else PipelineStage
