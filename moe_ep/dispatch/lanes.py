"""Two lanes of collectives for a rank that runs one micro-batch's forward beside another's
backward (the DualPipeV schedule, ``moe_ep.parallel.pipeline.overlap``): the dispatcher's
exchanges inside an autograd backward pass go over a second process group of the same ranks (the
group's backward twin), the others over the group itself. Each group then sees the collectives
of one lane only, which every rank of the group issues in the same order, so the two lanes
cannot interleave differently on different ranks. A backward pass is recognised by autograd's
current graph task, which is set on whatever thread autograd runs the pass (CUDA's device threads
included), so the choice needs no thread-local state of ours; recomputation inside a backward
(activation checkpointing) runs on the backward lane too."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

# group_name of a group -> its backward twin; empty unless a schedule overlaps micro-batches.
_TWINS: dict[str, dist.ProcessGroup] = {}


def lane_group(group):
    """The group to issue a collective of ``group`` on: its backward twin inside a backward pass
    when one is registered, else ``group``."""
    if not _TWINS or group is None:
        return group
    twin = _TWINS.get(group.group_name)
    if twin is not None and torch._C._current_graph_task_id() != -1:
        return twin
    return group


def register_twin(group: dist.ProcessGroup, twin: dist.ProcessGroup) -> None:
    """Issue ``group``'s collectives inside a backward pass on ``twin`` (the same ranks)."""
    if dist.get_process_group_ranks(twin) != dist.get_process_group_ranks(group):
        raise ValueError(f"a backward twin must have its group's ranks {dist.get_process_group_ranks(group)}, got "
                         f"{dist.get_process_group_ranks(twin)}")
    _TWINS[group.group_name] = twin


def create_twins(groups_ranks: Sequence[Sequence[int]], mine: dist.ProcessGroup) -> None:
    """Create a twin of every group in ``groups_ranks`` (global ranks in group order, the same list
    on every rank) and register the one of ``mine``, this rank's group among them. A collective:
    every rank of the default group calls it with the same ``groups_ranks`` (``dist.new_group``'s
    rule)."""
    rank = dist.get_rank()
    for ranks in groups_ranks:
        twin = dist.new_group(list(ranks))
        if rank in ranks:
            register_twin(mine, twin)
