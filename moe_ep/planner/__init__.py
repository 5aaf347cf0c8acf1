"""Layout planner: which (pp, dp_replicate, dp_shard, ep), micro-batching, pipeline schedule and
activation checkpointing fit a model on a cluster, with a per-GPU memory table, a step-time
estimate and why the alternatives lost."""

from .cluster import Cluster
from .layout import Layout
from .schedules import NO_PIPELINE, SCHEDULES, schedule_info
from .search import Plan, PlanError, evaluate, plan
from .spec import MODEL_NAMES, ModelSpec, config_from_name

__all__ = [
    "Cluster", "Layout", "MODEL_NAMES", "ModelSpec", "NO_PIPELINE", "Plan", "PlanError", "SCHEDULES",
    "config_from_name", "evaluate", "plan", "schedule_info",
]
