"""Planner check: the planner's figures against measurements, on the CPU.

- activations: the bytes autograd saves for the backward (``saved_tensors_hooks``; parameters
  excluded, each storage once), per unit of the planner's chain (``embed+layers.0``, ...,
  ``layers.L-1+head``), for small real Hugging Face models with moe_ep's router and experts in
  bfloat16, with and without activation checkpointing, at several sequence lengths and
  micro-batch sizes; for expert parallelism on torch's fake process group, whose all-to-all is made
  to hand every rank back its own rows (each rank then receives what it sends: the mean load);
  and for a 2-layer model with Mixtral-8x7B's shapes under ``FakeTensorMode`` (no memory, no
  compute), with both backends' autograd bookkeeping.
- collectives: every collective one rank issues in one training step of the planner's chosen
  Mixtral-8x7B layouts at world size 128 on the fake process group, against the planner's bytes
  (``moe_ep.planner.comm``).

Each row gives the measured and the modelled bytes and their ratio; tests/test_plan_activations.py
and tests/test_plan_fake_pg.py assert every ratio within ``TOLERANCE`` (2%)."""

from __future__ import annotations

import argparse
import contextlib
import types
from dataclasses import dataclass

import torch

from ..planner.activations import MicroBatch, Routed
from ..planner.recompute import RERUN_DISPATCH, recompute_policy
from ..planner.spec import ModelSpec
from .report import Column, Report, environment

# #22 item 4: the activation figures within 2% of what autograd saves, on any family and shape.
TOLERANCE = 0.02


def _storage_key(t: torch.Tensor):
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return local.untyped_storage()._cdata


def _unit_names(num_layers: int) -> list[str]:
    """The planner's chain: the embedding rides with the first layer, the head with the last."""
    names = [f"layers.{i}" for i in range(num_layers)]
    names[0] = "embed+" + names[0]
    names[-1] = names[-1] + "+head"
    return names


@dataclass
class SavedBytes:
    """Storages autograd saves during a forward, each counted once, attributed to the chain unit
    that was running when it was first saved; parameters (local shards included) excluded."""

    by_unit: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.by_unit.values())


def _kept_outputs_recorder(record, recording: list[bool]):
    """A dispatch mode that records the outputs the ``"selective"`` policy keeps (PyTorch's
    selective checkpoint holds them until the backward) while ``recording[0]``: inside a
    checkpointed layer's forward. It sits below the checkpoint's own caching mode, which calls
    each op through it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from ..parallel.recompute import keeps_output

    class _Kept(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if recording[0] and keeps_output(func):
                torch.utils._pytree.tree_map(record, out)
            return out

    return _Kept()


@contextlib.contextmanager
def count_saved_bytes(model: torch.nn.Module, policy: str = "none"):
    """Count what ``model``'s forward (and a loss computed inside the block) saves for the
    backward, under the recompute ``policy`` its layers were given. A checkpointed region keeps
    its call's tensor arguments for the recompute (counted; the checkpoint's own saved tensors
    hooks hide the rest, which is not kept); under ``"selective"`` it also keeps the outputs of
    the ops the policy saves (counted as they are made)."""
    base = model.model
    names = _unit_names(len(base.layers))
    params = {_storage_key(p) for p in model.parameters()}
    seen: dict[int, tuple[str, int]] = {}
    unit = [names[0]]
    inside = [False]

    def record(t):
        if isinstance(t, torch.Tensor):
            key = _storage_key(t)
            if key not in params and key not in seen:
                seen[key] = (unit[0], t.untyped_storage().nbytes())
        return t

    def record_call(args, kwargs):
        torch.utils._pytree.tree_map(record, (list(args), dict(kwargs)))

    def enter(name):
        def hook(module, args):
            unit[0] = name

        return hook

    handles = [layer.register_forward_pre_hook(enter(name)) for layer, name in zip(base.layers, names)]
    handles.append(base.norm.register_forward_pre_hook(enter(names[-1])))
    if policy == "attention":
        handles += [layer.self_attn.register_forward_pre_hook(lambda m, a, k: record_call(a, k), with_kwargs=True)
                    for layer in base.layers]
    wrapped = []
    for layer in base.layers:
        inner = getattr(layer, "_gradient_checkpointing_func", None)
        if getattr(layer, "gradient_checkpointing", False) and inner is not None:
            def keeping(fn, *args, _inner=inner, **kwargs):
                record_call(args, getattr(fn, "keywords", {}))
                inside[0] = True
                try:
                    return _inner(fn, *args, **kwargs)
                finally:
                    inside[0] = False

            layer._gradient_checkpointing_func = keeping
            wrapped.append((layer, inner))
    kept = _kept_outputs_recorder(record, inside) if policy == "selective" else contextlib.nullcontext()
    result = SavedBytes({name: 0.0 for name in names})
    try:
        with torch.autograd.graph.saved_tensors_hooks(record, lambda t: t), kept:
            yield result
    finally:
        for handle in handles:
            handle.remove()
        for layer, inner in wrapped:
            layer._gradient_checkpointing_func = inner
        for name, nbytes in seen.values():
            result.by_unit[name] += nbytes


# ---------------------------------------------------------------- activations


def _config(setup, **extra):
    from transformers import AutoConfig

    config = AutoConfig.for_model(setup.model_type, **setup.config, max_position_embeddings=32768, **extra)
    config._attn_implementation = "sdpa"  # flash attention's saved tensors, as on a GPU
    return config


def _causal_lm(config, *, meta: bool = False):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_config(config)
    return model.to(torch.bfloat16).train()


def _enable_checkpointing(model, policy: str) -> None:
    from ..parallel.recompute import enable_activation_checkpointing

    enable_activation_checkpointing(model, policy)


def _forward_with_loss(model, batch: int, seq: int, policy: str = "none") -> SavedBytes:
    """What a training forward (TrainStep's loss included) saves; labels are their own tensor,
    as a data loader hands them over."""
    from ..training import CausalLMLoss

    ids = torch.randint(3, 1000, (batch, seq))
    with count_saved_bytes(model, policy) as saved:
        logits = model(ids).logits
        CausalLMLoss()(logits, ids.clone())
    return saved


def _modelled(config, batch, seq, *, backend, policy, ep=1, routed=None) -> dict[str, float]:
    from ..planner.activations import chain_saved

    return chain_saved(ModelSpec.from_config(config), MicroBatch(batch, seq), backend=backend,
                       checkpointing=policy, ep=ep, routed=routed)


def small_model_saved(name: str, batch: int, seq: int, checkpointing: str | bool) -> tuple[dict, dict]:
    """(measured, modelled) saved bytes per unit of a small real model of ``moe_ep.bench.model``
    on the CPU, patched with moe_ep's router and experts (torch backend), under the recompute
    policy ``checkpointing`` (a bool: ``"full"`` or ``"none"``)."""
    from .model import MODELS

    return config_saved(_config(MODELS[name]), batch, seq, checkpointing)


def config_saved(config, batch: int, seq: int, checkpointing: str | bool) -> tuple[dict, dict]:
    """``small_model_saved`` for any Hugging Face MoE ``config`` (its attention set to sdpa)."""
    policy = recompute_policy("checkpointing", checkpointing)
    from ..hf import patch

    config._attn_implementation = "sdpa"  # flash attention's saved tensors, as on a GPU
    model = _causal_lm(config)
    patch(model, backend="torch")
    _enable_checkpointing(model, policy)
    saved = _forward_with_loss(model, batch, seq, policy)
    return saved.by_unit, _modelled(config, batch, seq, backend="torch", policy=policy)


@contextlib.contextmanager
def fake_rank(rank: int, world_size: int):
    """This process as ``rank`` of torch's fake process group: collectives return at once and move
    nothing, so layouts of any world size can be applied in one process."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


_KINDS = {
    "_allgather_base_": "all-gather",
    "_reduce_scatter_base_": "reduce-scatter",
    "allreduce_": "all-reduce",
    "alltoall_base_": "all-to-all",
}


class CollectiveRecorder:
    """Records the collectives issued while active (``with recorder:``), by (kind, group size): calls
    and bytes as ``moe_ep.planner.comm.Collective`` counts them (an all-gather's output, a
    reduce-scatter's input, an all-reduce's tensors, what an all-to-all sends to the other ranks).
    Any other c10d op is recorded under its own name, so nothing goes unseen; ``group_bytes`` has
    the bytes by (kind, process group name), for groups of one size. With ``mirror``, an
    all-to-all hands every rank back its own input: on the fake process group each rank then
    receives what it sends, the mean load of uniform routing."""

    def __init__(self, mirror: bool = False):
        from torch.utils._python_dispatch import TorchDispatchMode

        recorder = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if func.namespace == "c10d":
                    recorder._record(func, args)
                return out

        self.mirror = mirror
        self.calls: dict[tuple[str, int], int] = {}
        self.bytes: dict[tuple[str, int], float] = {}
        self.group_bytes: dict[tuple[str, str], float] = {}
        self._mode = _Mode()

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)

    @staticmethod
    def _nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def _record(self, func, args) -> None:
        import torch.distributed as dist

        name = func._schema.name.split("::")[1]
        args = [dist.ProcessGroup.unbox(a) if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type())
                else a for a in args]
        kind = _KINDS.get(name, name)
        if kind in ("all-gather", "reduce-scatter"):
            group = args[2]
            nbytes = self._nbytes(args[0] if kind == "all-gather" else args[1])
        elif kind == "all-reduce":
            group, nbytes = args[1], sum(self._nbytes(t) for t in args[0])
        elif kind == "all-to-all":
            output, source, group, _, in_splits = args[:5]
            rows = source.shape[0] if source.dim() else 1
            own = in_splits[group.rank()] if in_splits else rows // group.size()
            nbytes = self._nbytes(source) * (rows - own) / max(rows, 1)
            if self.mirror:
                output.copy_(source)
        else:
            group, nbytes = None, 0
        key = (kind, group.size() if group is not None else 0)
        self.calls[key] = self.calls.get(key, 0) + 1
        self.bytes[key] = self.bytes.get(key, 0.0) + nbytes
        if group is not None:
            named = (kind, group.group_name)
            self.group_bytes[named] = self.group_bytes.get(named, 0.0) + nbytes


def ep_saved(name: str, ep: int, batch: int, seq: int, checkpointing: str | bool) -> tuple[dict, dict]:
    """(measured, modelled) saved bytes per unit of a small model whose experts are spread over
    ``ep`` ranks of the fake process group (this process is rank 0) through moe_ep's dispatcher,
    its all-to-alls mirrored; modelled at the dispatcher's counts for the routing it got."""
    policy = recompute_policy("checkpointing", checkpointing)
    from torch.distributed.device_mesh import init_device_mesh

    from ..dispatch.wire_bytes import wire_bytes
    from ..hf import patch
    from ..parallel.expert_sharding import shard_experts
    from .model import MODELS

    config = _config(MODELS[name])
    config._experts_implementation = "moe_ep"
    spec = ModelSpec.from_config(config)
    L = spec.num_experts // ep
    with fake_rank(0, ep):
        model = _causal_lm(config)
        patch(model, backend="torch")
        shard_experts(model, init_device_mesh("cpu", (ep,)))
        _enable_checkpointing(model, policy)
        routing = []
        hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out: routing.append(out[2]))
                 for layer in model.model.layers]
        try:
            with CollectiveRecorder(mirror=True):
                saved = _forward_with_loss(model, batch, seq, policy)
        finally:
            for hook in hooks:
                hook.remove()
    routed = []
    for idx_TK in routing[: spec.num_layers]:
        wire = wire_bytes(idx_TK, L, spec.hidden_size)
        # Mirrored: the rank receives the rows it sends and computes all of its tokens' pairs.
        routed.append(Routed(wire.moe_ep_rows, wire.moe_ep_rows, idx_TK.numel()))
    return saved.by_unit, _modelled(config, batch, seq, backend="torch", policy=policy, ep=ep, routed=routed)


@contextlib.contextmanager
def _values_unread():
    """What the fake run cannot evaluate, told as a real run finds it: moe_ep's index-range check
    reads the routing (a host sync) and transformers cannot see that fake position ids hold one
    unpacked sequence per row, so it would build a causal mask a real run does not."""
    import transformers.masking_utils as masking

    from ..ops import experts

    saved = experts.check_experts_args, masking.find_packed_sequence_indices
    experts.check_experts_args = lambda *args: None
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        experts.check_experts_args, masking.find_packed_sequence_indices = saved


def full_shape_saved(backend: str, batch: int, seq: int, checkpointing: str | bool) -> tuple[dict, dict]:
    """(measured, modelled) saved bytes of a 2-layer model with Mixtral-8x7B's shapes under
    ``FakeTensorMode`` (shapes and dtypes, no storage): ``backend`` "triton" runs the Triton ops'
    fake implementations, so their autograd bookkeeping is the GPU's."""
    policy = recompute_policy("checkpointing", checkpointing)
    import os

    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..hf import patch
    from .model import MODELS

    config = _config(MODELS["mixtral-8x7b-2layer"])
    model = _causal_lm(config, meta=True)
    interpret = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # lets the Triton backend take CPU tensors; fake ones run no kernel
    try:
        patch(model, backend=backend)
        _enable_checkpointing(model, policy)
        with _values_unread(), FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            saved = _forward_with_loss(model, batch, seq, policy)
    finally:
        if interpret is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = interpret
    return saved.by_unit, _modelled(config, batch, seq, backend=backend, policy=policy)


# ---------------------------------------------------------------- collectives at world size 128


def apply_plan(best):
    """Full-size Mixtral-8x7B on the meta device laid out as ``best`` on this rank of the fake
    process group, with the mixed precision the planner assumes (bf16 compute, float32 master
    weights and reduction): (modules to run, pipeline rank)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers import MixtralForCausalLM

    from ..hf import patch
    from ..parallel import parallelize
    from ..planner import config_from_name

    lay = best.layout
    with torch.device("meta"):
        model = MixtralForCausalLM(config_from_name("mixtral-8x7b"))
    patch(model, fused_router=False)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    common = dict(ep=lay.ep, dp_replicate=lay.dp_replicate, dp_shard=lay.dp_shard, mixed_precision=policy,
                  activation_checkpointing=lay.checkpointing)
    if lay.pp == 1:
        parallelize(model, **common)
        return [model], 0
    stages = parallelize(model, pp=lay.pp, schedule=lay.schedule, microbatches=lay.microbatches,
                         split_points=best.split_points, **common)
    return stages.modules, stages.pp_rank


def every_local_expert(self, x_TH, idx_TK, w_TK):
    """Stand-in for the experts' forward under fake tensors, whose dropless dispatch would size its
    exchange from token counts (fake tensors hold no values): this rank's experts on every token,
    scaled by the token's routing weights. Static shapes, the same parameters, so the same
    gradients' shapes and the same FSDP traffic; the all-to-all is measured apart
    (:func:`dispatcher_collectives`)."""
    from torch.distributed.tensor import DTensor

    gate_up_E2IH, down_EHI = (
        w.to_local() if isinstance(w, DTensor) else w for w in (self.gate_up_proj, self.down_proj)
    )
    gate_ETI, up_ETI = torch.einsum("th,eih->eti", x_TH, gate_up_E2IH).chunk(2, dim=-1)
    y_TH = torch.einsum("eti,ehi->th", torch.nn.functional.silu(gate_ETI) * up_ETI, down_EHI)
    return y_TH * w_TK.sum(-1, keepdim=True).to(y_TH.dtype)


@dataclass
class FakeStep:
    """One rank's training step at full size on the fake process group."""

    pp_rank: int
    params: list  # this rank's parameters (fake tensors)
    optimizer: object
    collectives: CollectiveRecorder
    sent: float  # bytes its stages sent to stages on other ranks, one micro-batch


def fake_train_step(modules, partition=None, *, microbatches: int, tokens: int, hidden_size: int = 4096) -> FakeStep:
    """``microbatches`` forwards and backwards of ``tokens`` tokens through each of this rank's
    modules, then an AdamW step, under ``FakeTensorMode`` with every collective recorded. A
    pipeline's schedule exchanges activations through the fake group, which moves no data, so
    each stage runs on its own here, and what the schedule would send is read off the stages: a
    stage's output goes to the next stage, its input's gradient back to the previous one, when
    that stage is on another rank. Gradients synchronise once per step under a pipeline (FSDP2
    reduces each stage's once, as the schedule ends) and every micro-batch without one.
    ``partition``: the pipeline's cut (None without stages)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..hf import experts_modules

    part = partition
    recorder = CollectiveRecorder()
    for module in modules:
        for _, experts in experts_modules(module):
            experts.forward = types.MethodType(every_local_expert, experts)
    sent = 0.0
    with FakeTensorMode(allow_non_fake_inputs=True), recorder:
        for module in modules:
            module.to_empty(device="cpu")
        for _ in range(microbatches):
            for module in modules:
                first = getattr(module, "first", True)  # the whole model, or a pipeline's first stage
                last = getattr(module, "last", True)
                if first:
                    inputs = torch.randint(0, 100, (1, tokens))
                else:
                    inputs = torch.randn(1, tokens, hidden_size, dtype=torch.bfloat16, requires_grad=True)
                out = module(inputs)
                logits = out.logits if hasattr(out, "logits") else out
                logits.float().sum().backward()
                if part is not None:
                    stage = next(s for s in range(part.num_stages)
                                 if layer_ids_of(part, s) == list(module.layer_ids))
                    rank = part.rank_of_stage(stage)
                    if not last and part.rank_of_stage(stage + 1) != rank:
                        sent += out.numel() * out.element_size()
                    if not first and part.rank_of_stage(stage - 1) != rank:
                        sent += inputs.grad.numel() * inputs.grad.element_size()
        params = list({id(p): p for module in modules for p in module.parameters()}.values())
        optimizer = torch.optim.AdamW(params, lr=1e-4)
        optimizer.step()
    return FakeStep(0, params, optimizer, recorder, sent)


def held_bytes(step: FakeStep) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer state) bytes the rank holds after the step."""
    from torch.distributed.tensor import DTensor

    def local_bytes(t):
        local = t.to_local() if isinstance(t, DTensor) else t
        return local.numel() * local.element_size()

    params = step.params
    missing = [i for i, p in enumerate(params) if p.grad is None]
    if missing:
        raise AssertionError(f"{len(missing)} parameters got no gradient from the backward")
    state = [v for s in step.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    if len(state) != 2 * len(params):
        raise AssertionError(f"AdamW holds {len(state)} moment tensors for {len(params)} parameters, expected two each")
    return (sum(local_bytes(p) for p in params), sum(local_bytes(p.grad) for p in params),
            sum(local_bytes(v) for v in state))


def layer_ids_of(part, stage: int) -> list[int]:
    from ..planner.memory import layer_ids

    return layer_ids(part.stage_names(stage))


@dataclass(frozen=True)
class Check:
    """One measured-versus-modelled figure."""

    check: str
    case: str
    measured: float
    modelled: float

    @property
    def ratio(self) -> float:
        return self.measured / self.modelled if self.modelled else float("inf") if self.measured else 1.0

    @property
    def ok(self) -> bool:
        return abs(self.ratio - 1) <= TOLERANCE


def rank_units(best, pp_rank: int) -> list[str]:
    """The planner units (embed, layers.i, head) a pipeline rank holds."""
    part = best.partition
    return [piece for s in part.stages_of_rank(pp_rank) for name in part.stage_names(s) for piece in name.split("+")]


def fsdp_checks(spec, best, step: FakeStep, rank: int, seq_len: int, microbatches_run: int) -> list[Check]:
    """The FSDP/HSDP collectives the fake step recorded, scaled to a whole step (every micro-batch
    of a step without pipeline stages repeats them), against the planner's."""
    from ..planner.comm import fsdp_collectives

    lay = best.layout
    scale = lay.microbatches / microbatches_run if lay.pp == 1 else 1.0
    modelled: dict[tuple[str, int], float] = {}
    for c in fsdp_collectives(spec, lay, rank_units(best, step.pp_rank)):
        if c.size > 1 or c.kind == "all-gather":
            modelled[(c.kind, c.size)] = modelled.get((c.kind, c.size), 0.0) + c.bytes
    measured = {k: v * scale for k, v in step.collectives.bytes.items() if k[0] != "all-to-all"}
    keys = sorted(set(modelled) | {k for k in measured if k[1] > 1})
    return [Check(f"{kind} over {size} ranks, one step", f"{lay.short()}, rank {rank}", measured.get((kind, size), 0.0),
                  modelled.get((kind, size), 0.0)) for kind, size in keys]


def fake_step_checks(best, ranks: list[int], *, world_size: int = 128, seq_len: int = 4096,
                     collectives_on: tuple[int, ...] = (0,)) -> tuple[list[tuple[int, FakeStep]], list[Check]]:
    """Run one fake step on each of ``ranks`` (one micro-batch; the pipeline's sends counted per
    micro-batch) and compare the collectives of the ranks in ``collectives_on`` and the pipeline
    sends of every rank with the planner's figures."""
    from ..planner.comm import p2p_collective

    spec = ModelSpec.resolve("mixtral-8x7b")
    lay = best.layout
    steps, checks = [], []
    for rank in ranks:
        with fake_rank(rank, world_size):
            modules, pp_rank = apply_plan(best)
            step = fake_train_step(modules, best.partition if lay.pp > 1 else None, microbatches=1,
                                   tokens=lay.microbatch_size * seq_len)
        step.pp_rank = pp_rank
        steps.append((rank, step))
        if rank in collectives_on:
            checks += fsdp_checks(spec, best, step, rank, seq_len, 1)
        p2p = p2p_collective(spec, lay, best.partition, pp_rank, seq_len)
        if p2p is not None:
            checks.append(Check("pipeline send, one step", f"{lay.short()}, rank {rank}",
                                step.sent * lay.microbatches, p2p.bytes))
    return steps, checks


def dispatcher_checks(layout, *, seq_len: int = 4096, world_size: int = 128, seed: int = 0) -> list[Check]:
    """The all-to-alls of one MoE layer of Mixtral-8x7B (H=4096, E=8, top-2) through moe_ep's
    dispatcher, forward and backward (run again by a policy that recomputes it), on rank 0 of the fake
    group with the layout's ep group, its exchanges mirrored (each rank receives what it sends);
    the experts are an identity (they move no bytes). Routing: ``route_topk`` of random
    activations through a random router. Against the planner's bytes for one layer-pass,
    times the MoE layers and micro-batches of a step on both sides."""
    import torch.distributed as dist

    from ..dispatch import combine, dispatch
    from ..dispatch.dispatcher import join_to_dispatch
    from ..planner.comm import all_to_all_collective
    from ..ops import route_topk

    if layout.ep == 1:
        return []  # the experts are local: no dispatcher
    spec = ModelSpec.resolve("mixtral-8x7b")
    ep, H = layout.ep, spec.hidden_size
    tokens = layout.microbatch_size * seq_len
    g = torch.Generator().manual_seed(seed)
    x_TH = torch.randn(tokens, H, generator=g).to(torch.bfloat16).requires_grad_()
    router_EH = torch.randn(spec.num_experts, H, generator=g).to(torch.bfloat16) * H**-0.5
    _, w_TK, idx_TK = route_topk(x_TH.detach(), router_EH, spec.top_k, backend="torch")
    w_TK = w_TK.requires_grad_()

    def layer(x_TH, w_TK):
        tokens_ = dispatch(x_TH, idx_TK, w_TK, group=group, num_experts=spec.num_experts)
        out_PH = tokens_.hidden_states * tokens_.weights.to(tokens_.hidden_states.dtype)
        return combine(join_to_dispatch(out_PH, tokens_), tokens_.layout)

    with fake_rank(0, world_size):
        group = dist.new_group(list(range(ep)))
        with CollectiveRecorder(mirror=True) as recorder:
            if layout.checkpointing in RERUN_DISPATCH:
                y_TH = torch.utils.checkpoint.checkpoint(layer, x_TH, w_TK, use_reentrant=False)
            else:
                y_TH = layer(x_TH, w_TK)
            y_TH.float().sum().backward()
    measured = recorder.bytes.get(("all-to-all", ep), 0.0)
    modelled = all_to_all_collective(spec, layout, seq_len, 1).bytes
    per_step = layout.microbatches * spec.num_moe_layers
    return [Check("all-to-all over the ep group, one step", layout.short(), per_step * measured, per_step * modelled)]


def node_dispatch_bytes(spec: ModelSpec, group, nodes, *, tokens: int, seed: int, mirror: bool) -> tuple[dict, dict]:
    """This rank's all-to-all bytes over each group of the node-aware dispatch (``nodes``) of one
    MoE layer of ``spec`` (its E, top-k and H), forward and backward, identity experts, uniform
    routing of ``tokens`` tokens drawn from ``seed``; ``mirror``: exchanges hand every rank back its
    own rows (the fake group). Returns ({"ep-inter": bytes, "ep-intra": bytes, "other": keys of any
    other collective}, this rank's routing as {"idx_TK": ...})."""
    from ..dispatch import combine, dispatch, join_to_dispatch

    E, K, H = spec.num_experts, spec.top_k, spec.hidden_size
    g = torch.Generator().manual_seed(seed)
    x_TH = torch.randn(tokens, H, generator=g).to(torch.bfloat16).requires_grad_()
    idx_TK = torch.rand(tokens, E, generator=g).topk(K, -1).indices
    w_TK = torch.rand(tokens, K, generator=g).requires_grad_()
    with CollectiveRecorder(mirror=mirror) as recorder:
        tokens_ = dispatch(x_TH, idx_TK, w_TK, group=group, num_experts=E, node_groups=nodes)
        out_QH = tokens_.hidden_states * tokens_.weights.to(tokens_.hidden_states.dtype)
        y_TH = combine(join_to_dispatch(out_QH, tokens_), tokens_.layout)
        y_TH.float().sum().backward()
    names = {("all-to-all", pg.group_name): name for name, pg in (("ep-inter", nodes.inter), ("ep-intra", nodes.intra))}
    measured = {name: recorder.group_bytes.get(key, 0.0) for key, name in names.items()}
    measured["other"] = sorted(recorder.group_bytes.keys() - names.keys())
    return measured, {"idx_TK": idx_TK}


def node_planner_bytes(spec: ModelSpec, ep: int, node_size: int, tokens: int) -> dict:
    """The planner's bytes of one layer-pass of the node-aware dispatch per group, for a rank."""
    from ..planner.comm import node_all_to_all_collectives
    from ..planner.layout import Layout

    layout = Layout(1, 1, ep, ep, 1, 1, "none", False)
    return {c.group: c.bytes for c in node_all_to_all_collectives(spec, layout, tokens, 1, node_size)}


def node_dispatcher_checks(model, ep: int, node_size: int, *, world_size: int, tokens: int = 4096,
                           hidden_size: int | None = None, seed: int = 0) -> tuple[list[Check], dict]:
    """``node_dispatch_bytes`` of ``model`` (anything ``ModelSpec.resolve`` takes; ``hidden_size``
    overrides H, which only scales the rows) on rank 0 of the fake group of ``world_size``, its ep
    group split into nodes of ``node_size``, exchanges mirrored (each rank receives what it sends:
    the mean load), against the planner's (``node_all_to_all_collectives``). Also returns the
    copies per token over the network, node-aware and single-stage (distinct other nodes,
    distinct ranks on other nodes)."""
    import dataclasses

    import torch.distributed as dist

    from ..dispatch import split_by_node

    spec = ModelSpec.resolve(model)
    if hidden_size is not None:
        spec = dataclasses.replace(spec, hidden_size=hidden_size)
    with fake_rank(0, world_size):
        group = dist.new_group(list(range(ep)))
        nodes = split_by_node([list(range(ep))], node_size)
        measured, routing = node_dispatch_bytes(spec, group, nodes, tokens=tokens, seed=seed, mirror=True)
    modelled = node_planner_bytes(spec, ep, node_size, tokens)
    case = (f"{spec.name} E={spec.num_experts} K={spec.top_k} H={spec.hidden_size}, ep={ep} over nodes of "
            f"{node_size}, world {world_size}")
    checks = [Check(f"all-to-all over {name}, one layer", case, measured[name], modelled[name])
              for name in ("ep-inter", "ep-intra")]
    dest_TK = routing["idx_TK"] // (spec.num_experts // ep)
    node_TK, home = dest_TK // node_size, 0
    copies = {
        "node-aware": sum(len(set(row) - {home}) for row in node_TK.tolist()) / tokens,
        "single-stage": sum(len({r for r in row if r // node_size != home}) for row in dest_TK.tolist()) / tokens,
        "other collectives": measured["other"],
    }
    return checks, copies


# ---------------------------------------------------------------- the benchmark mode

COLUMNS = [
    Column("check", "check"),
    Column("case", "case"),
    Column("measured_mib", "measured MiB", "{:,.2f}"),
    Column("modelled_mib", "planner MiB", "{:,.2f}"),
    Column("ratio", "measured / planner", "{:.4f}"),
    Column("status", "status"),
]

# The recompute policy of each case: False and True are "none" and "full".
SMALL_CASES = [
    ("tiny-mixtral", False, 1, 256), ("tiny-mixtral", True, 2, 128), ("tiny-qwen2-moe", False, 2, 128),
    ("tiny-qwen3-moe", True, 1, 256), ("tiny-olmoe", False, 4, 64), ("tiny-mixtral", "selective", 2, 128),
    ("tiny-qwen2-moe", "attention", 1, 256),
]
EP_CASES = [("tiny-mixtral", 8, False, 2, 128), ("tiny-mixtral", 4, False, 2, 128), ("tiny-qwen2-moe", 4, True, 1, 256),
            ("tiny-mixtral", 4, "selective", 2, 128)]
FULL_CASES = [("triton", False, 1, 4096), ("triton", True, 1, 4096), ("triton", False, 2, 4096), ("torch", False, 1, 8192),
              ("triton", "selective", 1, 4096), ("triton", "attention", 1, 4096)]


def _label(checkpointing) -> str:
    policy = recompute_policy("checkpointing", checkpointing)
    return {"none": "", "full": " ckpt"}.get(policy, f" {policy}")


def _activation_checks() -> list[Check]:
    checks = []

    def add(what, measured, modelled):
        for unit in modelled:
            checks.append(Check("activations saved for backward", f"{what}, {unit}", measured[unit], modelled[unit]))

    for name, ckpt, batch, seq in SMALL_CASES:
        print(f"[planner] activations: {name} B={batch} S={seq} checkpointing={ckpt}", flush=True)
        add(f"{name} B={batch} S={seq}{_label(ckpt)}", *small_model_saved(name, batch, seq, ckpt))
    for name, ep, ckpt, batch, seq in EP_CASES:
        print(f"[planner] activations: {name} ep={ep} B={batch} S={seq} checkpointing={ckpt}", flush=True)
        add(f"{name} ep={ep} B={batch} S={seq}{_label(ckpt)}", *ep_saved(name, ep, batch, seq, ckpt))
    for backend, ckpt, batch, seq in FULL_CASES:
        print(f"[planner] activations: Mixtral-8x7B shapes, {backend}, B={batch} S={seq} checkpointing={ckpt}",
              flush=True)
        add(f"Mixtral-8x7B shapes (fake) {backend} B={batch} S={seq}{_label(ckpt)}",
            *full_shape_saved(backend, batch, seq, ckpt))
    return checks


def _collective_checks() -> tuple[list[Check], list[str]]:
    from ..planner import Layout, plan

    cluster = dict(nodes=16, cluster="dgx-a100-80gb")
    chosen = plan("mixtral-8x7b", **cluster).best
    layouts = [chosen] + [plan("mixtral-8x7b", pp=4, schedule=s, ep=8, dp_shard=32, checkpointing=True, **cluster).best
                          for s in ("1f1b", "zbv")]
    checks, notes = [], [f"chosen layout for Mixtral-8x7B on 16 x dgx-a100-80gb: {chosen.layout.short()}"]
    for best in layouts:
        ranks = [0, 127]
        print(f"[planner] collectives at world size 128: {best.layout.short()}, ranks {ranks}", flush=True)
        checks += fake_step_checks(best, ranks, collectives_on=tuple(ranks))[1]
    for layout in (chosen.layout, Layout(1, 1, 128, 4, 1, 8, "none", True)):
        print(f"[planner] all-to-all through the dispatcher: {layout.short()}", flush=True)
        checks += dispatcher_checks(layout)
    return checks, notes


# Counts bytes, times nothing: the command line offers no --warmup, --reps or --seed.
TIMED = False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--skip-collectives", action="store_true",
                        help="only the activation checks (the world-size-128 steps take a few minutes on 2 cores)")


DEFAULT_DEVICE = "cpu"


def check_arguments(args, device: torch.device) -> None:
    if device.type != "cpu":
        raise ValueError(f"--device must be cpu for the planner check (it measures on the CPU), got {device.type!r}")


def run(args, device: torch.device) -> Report:
    report = Report("planner", device, COLUMNS)
    report.meta = dict(environment(device), tolerance=TOLERANCE)
    checks = _activation_checks()
    if not args.skip_collectives:
        more, notes = _collective_checks()
        checks += more
        report.notes += notes
    for c in checks:
        report.rows.append(dict(check=c.check, case=c.case, measured_mib=c.measured / 2**20,
                                modelled_mib=c.modelled / 2**20, measured_bytes=c.measured,
                                modelled_bytes=c.modelled, ratio=c.ratio, status="ok" if c.ok else "OFF"))
    worst = max(checks, key=lambda c: abs(c.ratio - 1))
    # A figure off by more than the tolerance fails the check (exit status 1), as the tests do.
    report.failed += [f"{c.check}, {c.case}: {c.ratio:.4f}" for c in checks if not c.ok]
    report.notes.append(f"{sum(c.ok for c in checks)} of {len(checks)} figures within {TOLERANCE:.0%}; the furthest: "
                        f"{worst.check}, {worst.case}: {worst.ratio:.4f}")
    return report
