"""Pipeline schedules: where each stage lives, how long the pipeline idles and how many
micro-batches each stage keeps alive. One table, read by the planner's cost model and by
``moe_ep.parallel.pipeline`` when it builds the schedule."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ScheduleInfo:
    name: str
    torch_class: str  # in torch.distributed.pipelining.schedules
    stages_per_rank: int
    placement: str  # see moe_ep.planner.partition.stage_to_rank
    description: str

    def bubble(self, pp: int) -> float:
        """Idle time of a rank per step, in units of one micro-batch's forward + backward through
        all its stages."""
        if pp == 1:
            return 0.0
        if self.name in ("gpipe", "1f1b"):
            return pp - 1.0
        if self.name == "interleaved-1f1b":
            return (pp - 1.0) / self.stages_per_rank
        # ZB-V fills the bubble with weight-gradient work; with forward, input-gradient and
        # weight-gradient passes of equal length what remains is taken as a third of the
        # interleaved bubble (the ZB-H1 figure, halved by the two chunks).
        return (pp - 1.0) / (3 * self.stages_per_rank)

    def inflight(self, pp: int, microbatches: int) -> list[float]:
        """Micro-batches whose activations each stage (in stage order) holds at its peak."""
        num_stages = pp * self.stages_per_rank
        m = microbatches
        if self.name == "gpipe":
            return [float(m)] * num_stages
        if self.name == "1f1b":
            return [float(min(m, pp - s)) for s in range(num_stages)]
        if self.name == "interleaved-1f1b":
            # Megatron's warm-up: rank r runs 2 (pp - r - 1) + (V - 1) pp chunk forwards before
            # its first backward; spread over its V stages.
            v = self.stages_per_rank
            return [min(float(m), (2 * (pp - s % pp - 1) + (v - 1) * pp + 1) / v) for s in range(num_stages)]
        # ZB-V keeps the peak of 1F1B's first stage on every rank.
        return [float(min(m, pp))] * num_stages

    def check_microbatches(self, pp: int, microbatches: int) -> str | None:
        """Why this many micro-batches cannot run, or None."""
        if microbatches < pp:
            return f"schedule {self.name!r} needs at least pp={pp} micro-batches, got {microbatches}"
        if self.name == "interleaved-1f1b" and microbatches % pp:
            return f"schedule {self.name!r} needs a multiple of pp={pp} micro-batches, got {microbatches}"
        return None


SCHEDULES = {
    s.name: s
    for s in (
        ScheduleInfo("gpipe", "ScheduleGPipe", 1, "loop", "all forwards, then all backwards"),
        ScheduleInfo("1f1b", "Schedule1F1B", 1, "loop", "one forward, one backward in steady state"),
        ScheduleInfo("interleaved-1f1b", "ScheduleInterleaved1F1B", 2, "loop", "1F1B over 2 chunks per rank"),
        ScheduleInfo("zbv", "ScheduleZBVZeroBubble", 2, "v", "zero-bubble V: 2 chunks per rank, weight grads fill idle slots"),
    )
}
NO_PIPELINE = "none"


INTERLEAVED = "interleaved-1f1b"


def schedule_info(name: str, virtual_stages: int | None = None) -> ScheduleInfo:
    """The schedule ``name``; ``virtual_stages`` (interleaved 1F1B only) sets its stages per rank,
    any V >= 2 (Megatron-Core's virtual pipeline size; None: 2)."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {tuple(SCHEDULES)}, got {name!r}")
    info = SCHEDULES[name]
    if virtual_stages is None:
        return info
    if name != INTERLEAVED:
        raise ValueError(f"virtual_stages applies to schedule {INTERLEAVED!r} only; {name!r} runs "
                         f"{info.stages_per_rank} stage(s) per rank, got virtual_stages={virtual_stages!r}")
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 2:
        raise ValueError(f"virtual_stages must be an int >= 2 (stages per pipeline rank), got {virtual_stages!r}")
    return replace(info, stages_per_rank=virtual_stages, description=f"1F1B over {virtual_stages} chunks per rank")
