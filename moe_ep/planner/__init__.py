"""Layout planner: which (pp, dp_replicate, dp_shard, ep), micro-batching, pipeline schedule and
activation checkpointing fit a model on a cluster, with a per-GPU memory table, a step-time
estimate whose MFU follows from stated per-kernel efficiencies, and why the alternatives lost."""

from .cluster import Cluster
from .layout import Layout
from .presets import CLUSTERS, Efficiencies, cluster_preset
from .schedules import NO_PIPELINE, SCHEDULES, schedule_info
from .search import Assumptions, Plan, PlanError, evaluate, plan
from .spec import MODEL_NAMES, ModelSpec, config_from_name

__all__ = [
    "Assumptions", "CLUSTERS", "Cluster", "Efficiencies", "Layout", "MODEL_NAMES", "ModelSpec", "NO_PIPELINE", "Plan",
    "PlanError", "SCHEDULES", "cluster_preset", "config_from_name", "evaluate", "plan", "schedule_info",
]
