"""Pipeline stages of a Hugging Face decoder-only causal LM: the stage module, the cut, this rank's
stages at run time and the handling of parameters tied across stages."""

from .build import build_pipeline, build_stages, plan_stages
from .costs import pipeline_unit_costs
from .stage import CausalLMStage
from .stages import PipelineStages

__all__ = ["CausalLMStage", "PipelineStages", "build_pipeline", "build_stages", "pipeline_unit_costs", "plan_stages"]
