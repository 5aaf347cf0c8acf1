"""Memory model: what one rank holds, unit by unit (embedding, decoder layers, head), for a layout.

Assumptions (printed with every plan):
- mixed precision as FSDP2 does it: fp32 master weights sharded over ``dp_shard`` (dense
  parameters) or ``ep x edp`` (experts; the same count per rank), bf16 compute copies gathered
  on use, fp32 gradients reduce-scattered back to the shards, AdamW with two fp32 moments:
  16 bytes per sharded parameter;
- without pipeline stages FSDP gathers a layer's bf16 weights just before use (one layer
  prefetched) and reduce-scatters its fp32 gradient right after its backward, every micro-batch;
- with pipeline stages torch.distributed.pipelining turns gradient sync off until the last
  micro-batch, so a stage holds its unsharded bf16 weights and fp32 gradients for the step;
- activations in bf16 with fp32 norms and loss, SDPA/flash attention (no seq x seq matrix);
  full checkpointing keeps each decoder layer's input and recomputes one layer at a time;
- expert-side buffers sized for ``imbalance`` times the mean routed load.
"""

from __future__ import annotations

from dataclasses import dataclass

from .partition import Partition, UnitCost
from .layout import Layout
from .spec import BF16, FP32, ModelSpec

# The busiest expert rank's routed load over the mean that buffers and all-to-all are sized for.
DEFAULT_IMBALANCE = 1.2
STATE_BYTES_PER_PARAM = {"params": FP32, "grads": FP32, "optim": 2 * FP32}
# Transient bytes per unsharded parameter of the layer that runs: bf16 weights of it and of the
# prefetched next layer, plus its fp32 gradient before the reduce-scatter.
FSDP_WORK_BYTES = 2 * BF16 + FP32
# Held through the step under pipeline stages: bf16 weights and fp32 gradient accumulation.
PP_UNSHARDED_BYTES = BF16 + FP32


@dataclass(frozen=True)
class Unit:
    """One unit of the chain for one micro-batch of ``tokens`` tokens, as one rank sees it."""

    name: str
    dense_params: int  # global counts
    expert_params: int
    fwd_flops: float
    train_flops: float
    moe: bool  # has an all-to-all when ep > 1
    params: float  # bytes on one rank
    grads: float
    optim: float
    act: float  # kept for the backward, per micro-batch in flight
    act_work: float  # transient: one layer recomputed
    comm_persist: float  # held for the whole step
    comm_work: float  # transient while the unit runs
    shared: frozenset = frozenset()


def build_units(spec: ModelSpec, layout: Layout, seq_len: int, imbalance: float) -> list[Unit]:
    tokens = layout.microbatch_size * seq_len
    ds, ep = layout.dp_shard, layout.ep
    pipelined = layout.pp > 1

    def unit(name, dense, expert, fwd_per_token, act, act_work=0.0, a2a=0.0, recompute=False, moe=False, shared=()):
        sharded = (dense + expert) / ds
        gathered = dense + expert / ep
        fwd = fwd_per_token * tokens
        return Unit(
            name=name, dense_params=dense, expert_params=expert, fwd_flops=fwd,
            train_flops=fwd * (4 if recompute else 3), moe=moe,
            params=sharded * STATE_BYTES_PER_PARAM["params"], grads=sharded * STATE_BYTES_PER_PARAM["grads"],
            optim=sharded * STATE_BYTES_PER_PARAM["optim"], act=act, act_work=act_work,
            comm_persist=PP_UNSHARDED_BYTES * gathered if pipelined else 0.0,
            comm_work=(0.0 if pipelined else FSDP_WORK_BYTES * gathered) + a2a,
            shared=frozenset(shared),
        )

    tied = ("model.embed_tokens.weight",) if spec.tie_word_embeddings else ()
    units = [unit("embed", spec.embed_params, 0, 0.0, spec.embed_act_bytes * tokens, shared=tied)]
    ckpt = layout.checkpointing
    for i in range(spec.num_layers):
        moe = spec.is_moe_layer(i)
        full_act = spec.layer_act_bytes(i) * tokens
        if ep > 1:
            full_act += (imbalance - 1.0) * spec.layer_expert_act_bytes(i) * tokens
        # Send and receive buffers of one dispatch: a token row per chosen expert, at most.
        a2a = 2 * tokens * spec.top_k * spec.hidden_size * BF16 * imbalance if ep > 1 and moe else 0.0
        units.append(
            unit(
                f"layers.{i}", spec.layer_dense_params(i), spec.layer_expert_params(i), spec.layer_flops(i, seq_len),
                act=spec.layer_input_bytes * tokens if ckpt else full_act, act_work=full_act if ckpt else 0.0,
                a2a=a2a, recompute=ckpt, moe=moe,
            )
        )
    units.append(
        unit("head", spec.head_params, 0, spec.head_flops, spec.head_act_bytes * tokens, shared=tied)
    )
    return units


def unit_costs(units: list[Unit]) -> list[UnitCost]:
    """The partition's view of ``units``, one unit per decoder layer (see :func:`layer_chain`).
    A stage's transient term is its largest unit's (recompute set plus communication buffers),
    as in the memory table (``rank_memory``)."""
    return layer_chain([
        UnitCost(
            name=u.name, flops=u.train_flops, param_bytes=u.params, grad_bytes=u.grads,
            optim_bytes=u.optim + u.comm_persist, act_bytes=u.act, work_bytes=u.act_work + u.comm_work,
            shared=u.shared,
        )
        for u in units
    ])


def layer_chain(costs: list[UnitCost]) -> list[UnitCost]:
    """``[embed, layers.0, ..., layers.L-1, head]`` as one unit per decoder layer: the embedding
    rides with the first layer and the head with the last (``embed+layers.0``,
    ``layers.L-1+head``), so every stage passes hidden states of one shape."""
    if len(costs) < 3:
        raise ValueError(f"a chain needs an embedding, at least one decoder layer and a head, got {len(costs)} units")
    embed, layers, head = costs[0], list(costs[1:-1]), costs[-1]
    layers[0] = _merge(embed, layers[0])
    layers[-1] = _merge(layers[-1], head)
    return layers


def _merge(a: UnitCost, b: UnitCost) -> UnitCost:
    return UnitCost(
        name=f"{a.name}+{b.name}", flops=a.flops + b.flops, param_bytes=a.param_bytes + b.param_bytes,
        grad_bytes=a.grad_bytes + b.grad_bytes, optim_bytes=a.optim_bytes + b.optim_bytes,
        act_bytes=a.act_bytes + b.act_bytes, work_bytes=max(a.work_bytes, b.work_bytes), shared=a.shared | b.shared,
    )


def layer_ids(names: list[str]) -> list[int]:
    """Decoder-layer indices in a stage's unit names (``embed+layers.0``, ``layers.5``, ...)."""
    return [int(part.split(".")[1]) for name in names for part in name.split("+") if part.startswith("layers.")]


@dataclass(frozen=True)
class MemoryTable:
    """Bytes on the fullest rank."""

    rank: int  # pipeline rank it describes
    params: float
    grads: float
    optim: float
    activations: float
    comm: float
    reserved: float
    capacity: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optim + self.activations + self.comm + self.reserved

    @property
    def headroom(self) -> float:
        return self.capacity - self.total

    @property
    def fits(self) -> bool:
        return self.headroom >= 0

    def rows(self) -> list[tuple[str, float]]:
        return [
            ("parameters (fp32 master shards)", self.params),
            ("gradients (fp32 shards)", self.grads),
            ("optimizer state (AdamW, 2 x fp32)", self.optim),
            ("activations", self.activations),
            ("communication buffers", self.comm),
            ("reserved (CUDA context, NCCL, fragmentation)", self.reserved),
            ("total", self.total),
            ("headroom", self.headroom),
        ]


def p2p_bytes(layout: Layout, spec: ModelSpec, seq_len: int) -> float:
    """Pipeline send and receive buffers of one rank: an activation and its gradient per stage."""
    if layout.pp == 1:
        return 0.0
    return 2 * layout.stages_per_rank * layout.microbatch_size * seq_len * spec.hidden_size * BF16


def rank_memory(units: list[Unit], part: Partition, rank: int, p2p: float, reserved: float, capacity: float) -> MemoryTable:
    """The memory table of pipeline rank ``rank``; ``part`` cuts ``unit_costs(units)``."""
    mine = [(s, u) for s in range(part.num_stages) if part.rank_of_stage(s) == rank for u in stage_units(units, part, s)]
    # One unit runs at a time: its recompute set and its communication buffers are the transient
    # peak (the partition's work term), split between the two rows.
    _, running = max(mine, key=lambda su: su[1].act_work + su[1].comm_work)
    return MemoryTable(
        rank=rank,
        params=sum(u.params for _, u in mine),
        grads=sum(u.grads for _, u in mine),
        optim=sum(u.optim for _, u in mine),
        activations=sum(part.inflight[s] * u.act for s, u in mine) + running.act_work,
        comm=sum(u.comm_persist for _, u in mine) + running.comm_work + p2p,
        reserved=reserved,
        capacity=capacity,
    )


def stage_units(units: list[Unit], part: Partition, stage: int) -> list[Unit]:
    """The planner units (embedding, layers, head) of one stage of a cut of ``unit_costs(units)``."""
    by_name = {u.name: u for u in units}
    return [by_name[piece] for name in part.stage_names(stage) for piece in name.split("+")]
