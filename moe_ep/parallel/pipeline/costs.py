"""The planner's per-layer costs of a model, as the automatic pipeline cut reads them, so that the
cut and the planner agree; and the parameters that units share, which pin them to one stage."""

from __future__ import annotations

from torch import nn

from ...planner.layout import Layout
from ...planner.memory import DEFAULT_IMBALANCE, build_units, layer_chain, unit_costs
from ...planner.partition import UnitCost
from ...planner.spec import ModelSpec
from ..config import PipelineConfig
from .stage import decoder_parts

DEFAULT_COST_SEQ_LEN = 4096


def pipeline_unit_costs(
    model: nn.Module, pp: int, pipeline: PipelineConfig, *, dp_shard: int = 1, ep: int = 1,
    checkpointing: str | bool = "none",
) -> list[UnitCost]:
    """Per-unit costs of ``model`` for one micro-batch of ``pipeline``'s shape, one unit per
    decoder layer (embedding and head ride with the first and last), from the planner's cost
    model, so that the automatic cut and the planner agree. ``pipeline.seq_len`` defaults to the
    model's context, at most ``DEFAULT_COST_SEQ_LEN``; ``dp_shard``, ``ep`` and ``checkpointing``
    are the sharding and recompute policy the costs assume."""
    spec = ModelSpec.from_config(model.config)
    context = getattr(model.config, "max_position_embeddings", DEFAULT_COST_SEQ_LEN)
    seq = pipeline.seq_len or min(DEFAULT_COST_SEQ_LEN, context)
    layout = Layout(pp, 1, dp_shard, ep, pipeline.microbatch_size or 1, pipeline.microbatches, pipeline.schedule,
                    checkpointing, pipeline.virtual_stages)
    return _with_tie(model, unit_costs(build_units(spec, layout, seq, DEFAULT_IMBALANCE)))


def layer_units(model: nn.Module, num_layers: int) -> list[UnitCost]:
    """The chain of ``pipeline_unit_costs`` with names and ties only: what explicit split points
    need, so cutting a model by hand never depends on the planner modelling its family."""
    names = ["embed", *(f"layers.{i}" for i in range(num_layers)), "head"]
    return _with_tie(model, layer_chain([UnitCost(name, 0.0) for name in names]))


def _with_tie(model: nn.Module, costs: list[UnitCost]) -> list[UnitCost]:
    """Each unit marked with the parameters it shares with another unit, under the first name the
    model gives them, so that the cut keeps the units between them on one stage (an LM head tied
    to the embedding ties the two end units, which only the V placement puts on one rank). The
    planner reads a tie from the config; the modules are what count."""
    base, head = decoder_parts(model)
    last = len(base.layers) - 1
    if len(costs) != len(base.layers):
        raise ValueError(f"costs must hold one unit per decoder layer ({len(base.layers)}), got {len(costs)}")
    parts = [("embed_tokens", base.embed_tokens, 0), *((f"layers.{i}", layer, i) for i, layer in enumerate(base.layers)),
             ("norm", base.norm, last), ("lm_head", head, last)]
    units_of: dict[int, set[int]] = {}
    name_of: dict[int, str] = {}
    for prefix, module, unit in parts:
        for name, param in module.named_parameters(remove_duplicate=False):
            units_of.setdefault(id(param), set()).add(unit)
            name_of.setdefault(id(param), f"{prefix}.{name}")
    shared: list[set[str]] = [set() for _ in costs]
    for key, units in units_of.items():
        if len(units) > 1:
            for unit in units:
                shared[unit].add(name_of[key])
    return [UnitCost(**{**cost.__dict__, "shared": frozenset(keys)}) for cost, keys in zip(costs, shared)]
