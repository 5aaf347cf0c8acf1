"""A parallel layout: the degrees of the device mesh, the micro-batching, the pipeline schedule
and activation recomputation (``moe_ep.planner.recompute``).

Ranks are numbered ``(pp, dp_replicate, dp_shard)`` row-major, as ``moe_ep.parallel`` builds its
mesh; expert parallelism splits ``dp_shard`` into ``(edp, ep)`` with ``ep`` innermost, so an
expert group is ``ep`` consecutive ranks."""

from __future__ import annotations

from dataclasses import dataclass

from .recompute import recompute_passes, recompute_policy
from .schedules import NO_PIPELINE, SCHEDULES, ScheduleInfo, schedule_info


@dataclass(frozen=True)
class Layout:
    pp: int
    dp_replicate: int
    dp_shard: int
    ep: int
    microbatch_size: int  # sequences per micro-batch
    microbatches: int  # micro-batches per optimizer step on one data-parallel replica
    schedule: str  # NO_PIPELINE when pp == 1
    checkpointing: str  # a recompute policy; True and False are given as "full" and "none"
    virtual_stages: int | None = None  # interleaved 1F1B's stages per rank (None: the schedule's 2)

    def __post_init__(self):
        object.__setattr__(self, "checkpointing", recompute_policy("checkpointing", self.checkpointing))
        for name in ("pp", "dp_replicate", "dp_shard", "ep", "microbatch_size", "microbatches"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.dp_shard % self.ep:
            raise ValueError(
                f"ep={self.ep} must divide dp_shard={self.dp_shard}: experts are sharded over a sub-mesh of dp_shard"
            )
        if (self.pp == 1) != (self.schedule == NO_PIPELINE):
            raise ValueError(
                f"schedule must be {NO_PIPELINE!r} exactly when pp == 1, got schedule={self.schedule!r} with pp={self.pp}"
            )
        if self.pp > 1 and self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {tuple(SCHEDULES)}, got {self.schedule!r}")
        if self.virtual_stages is not None:
            if self.pp == 1:
                raise ValueError(f"virtual_stages={self.virtual_stages!r} needs pipeline stages (pp > 1), got pp=1")
            schedule_info(self.schedule, self.virtual_stages)

    @property
    def info(self) -> ScheduleInfo | None:
        """The pipeline schedule with this layout's stages per rank (None without a pipeline)."""
        return schedule_info(self.schedule, self.virtual_stages) if self.pp > 1 else None

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard

    @property
    def dp(self) -> int:
        """Data-parallel replicas of the batch: every rank of a pipeline stage sees its own data."""
        return self.dp_replicate * self.dp_shard

    @property
    def edp(self) -> int:
        return self.dp_shard // self.ep

    @property
    def stages_per_rank(self) -> int:
        return self.info.stages_per_rank if self.pp > 1 else 1

    @property
    def recomputes(self) -> int:
        """How often a layer's backward recomputes what the recompute policy dropped
        (``recompute_passes``)."""
        return recompute_passes(self.checkpointing, self.pp > 1 and self.info.splits_backward)

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def placement(self) -> str:
        return self.info.placement if self.pp > 1 else "loop"

    def inflight(self) -> list[float]:
        if self.pp == 1:
            return [1.0]
        return self.info.inflight(self.pp, self.microbatches)

    def bubble(self) -> float:
        return self.info.bubble(self.pp) if self.pp > 1 else 0.0

    def degrees(self) -> str:
        return f"pp={self.pp} dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} ep={self.ep}"

    def short(self) -> str:
        sched = f" {self.schedule}" if self.pp > 1 else ""
        if self.virtual_stages is not None:
            sched += f" v={self.virtual_stages}"
        ckpt = {"none": "", "full": " ckpt"}.get(self.checkpointing, f" ckpt={self.checkpointing}")
        return f"{self.degrees()} mb={self.microbatch_size}x{self.microbatches}{sched}{ckpt}"
