"""Parameters shared between pipeline stages of one rank (an LM head tied to the embedding under
ZB-V, which puts the first and the last stage on pipeline rank 0): FSDP2 shards such a parameter
once, with the stage that holds it first, and the schedule must reduce it after the last stage
that uses it."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

from torch import nn


@dataclass(frozen=True)
class _Borrowed:
    """A submodule of stage ``user`` (``parent.<name>``) whose parameters stage ``owner`` (an
    earlier stage of the same rank) holds too: an LM head tied to the embedding under ZB-V."""

    owner: int
    user: int
    parent: nn.Module
    name: str
    module: nn.Module


def _borrowed_modules(stages: list[nn.Module]) -> list[_Borrowed]:
    """The submodules of this rank's stages that hold parameters of an earlier stage, by index
    into ``stages``."""
    owner_of: dict[int, int] = {}
    found = []
    for s, stage in enumerate(stages):
        for parent in stage.modules():
            for name, child in parent.named_children():
                owners = {owner_of.get(id(p)) for p in child.parameters(recurse=False)}
                if owners in (set(), {None}):
                    continue
                if len(owners) != 1 or None in owners:
                    raise ValueError(
                        f"{type(child).__name__} {name!r} of pipeline stage {s} mixes parameters of other stages of "
                        f"this rank ({sorted(o for o in owners if o is not None)}) with its own; FSDP2 can keep a "
                        "parameter tied across stages only when the module using it holds nothing else"
                    )
                found.append(_Borrowed(owners.pop(), s, parent, name, child))
        for p in stage.parameters():
            owner_of.setdefault(id(p), s)
    return found


@contextlib.contextmanager
def _swapped(parent: nn.Module, name: str, module: nn.Module):
    """``parent.<name>`` replaced by ``module`` (or attached, if absent) for the block, then restored."""
    had, old = name in parent._modules, parent._modules.get(name)
    parent._modules[name] = module
    try:
        yield
    finally:
        if had:
            parent._modules[name] = old
        else:
            del parent._modules[name]


def shard_tied_stages(stages: list[nn.Module], shard: Callable[[nn.Module], None]) -> list[tuple[int, int]]:
    """Run ``shard`` (FSDP2) on each stage so that parameters shared between stages of this rank
    stay one parameter. FSDP2 ties only what one ``fully_shard`` call sees, and each stage is its
    own FSDP root (a root must be one module, and the pipeline drives each stage's gradient
    reduction itself). So the stage that holds a shared parameter first is sharded with the
    modules of the later stages that use it attached for the call: FSDP records them as sharing
    the parameter and sets its sharded and gathered tensors on them too. The later stage is
    sharded with those modules set aside, so it leaves the parameter alone. Returns the
    (owner, user) pairs, by index into ``stages``."""
    borrowed = _borrowed_modules(stages)
    for s, stage in enumerate(stages):
        with contextlib.ExitStack() as stack:
            for i, b in enumerate(x for x in borrowed if x.owner == s):
                stack.enter_context(_swapped(stage, f"_moe_ep_tied_{i}", b.module))
            for b in (x for x in borrowed if x.user == s):
                stack.enter_context(_swapped(b.parent, b.name, nn.Identity()))
            shard(stage)
    return sorted({(b.owner, b.user) for b in borrowed})


def check_tied_order(schedule, rank: int, tied_stages) -> None:
    """A tied parameter is gathered, reduced and resharded with the stage that shards it
    (``shard_tied_stages``), so that stage's gradient reduction and reshard must come after
    every computation of the later stage that uses it too, or the later stage's last gradient
    contributions would miss the reduction. torch's ZB-V ends each rank's step with stage 0; this
    checks the schedule actually built rather than assuming it."""
    if not tied_stages:
        return
    order = getattr(schedule, "pipeline_order_with_comms", None)
    if order is None:
        raise RuntimeError(
            f"{type(schedule).__name__} exposes no per-rank action list to check that stages {list(tied_stages)} "
            "sharing a parameter reduce it after both have run"
        )
    # DualPipeV's overlapped actions hold a forward and a backward of two stages.
    actions = [sub for a in order[rank] if a is not None for sub in (getattr(a, "sub_actions", None) or (a,))]
    compute = {"FORWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT", "FULL_BACKWARD"}
    for owner, user in tied_stages:
        last_use = max(i for i, a in enumerate(actions) if a.stage_index == user and a.computation_type.name in compute)
        early = [str(a) for i, a in enumerate(actions)
                 if a.stage_index == owner and a.computation_type.name in ("REDUCE_GRAD", "RESHARD") and i < last_use]
        if early:
            raise RuntimeError(
                f"schedule {type(schedule).__name__} runs {early} of stage {owner}, which shards the parameter it "
                f"shares with stage {user}, before stage {user}'s last computation: the shared gradient would be "
                "reduced incomplete"
            )
