"""Load balancing inside TrainStep. Every MoE layer's load-balancing loss (transformers' formula,
on that layer's router output for that micro-batch; a sigmoid router's scores normalised over the
experts, as DeepSeek-V3 and Megatron-Core take them) and router z-loss (ST-MoE) enter the
objective as ``coef x`` their mean over layers and micro-batches; with a global aux loss each
layer's statistics are first summed over the data-parallel ranks (Megatron-Core's: the balance
of the whole global micro-batch); with a sequence-wise one each sequence is balanced on its own
and the losses of a micro-batch's sequences averaged (DeepSeek-V3's, Megatron-Core's
``seq_aux_loss``). transformers' own ``output_router_logits`` loss pools all
layers before the product; a pipeline cannot (the layers live on different ranks), so the mean
is per layer, as Megatron-Core's. DeepSeek-V3's aux-loss-free expert bias moves after each step
taken by ``rate x sign(mean load - load)``, with the loads summed over the data-parallel ranks so
every rank applies the same update.

Both are injected where they arise: a forward hook on each MoE block passes its output through
an identity whose backward also gives the layer's aux terms their gradient and records their
values and the routed counts (Megatron-Core's technique). It works unchanged on any pipeline
stage, under any schedule and with activation checkpointing, and a micro-batch counts once
however often its forward runs (recompute; torch's pipelining runs an extra shape-inference pass
before its first step, whose records are dropped). The hooks act only during their own
TrainStep's step, so several TrainSteps may share a model."""

from __future__ import annotations

import collections
import contextlib
import functools
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..dispatch.lanes import lane_group
from ..hf.routers import router_score
from ..ops.losses import expert_counts, load_balancing_loss, router_z_loss, update_expert_bias_
from .executors import Executor


class _Record(NamedTuple):
    """What one MoE block's backward of one micro-batch leaves (see ``_AttachAuxLoss``)."""

    block: int  # index into AuxLossHooks.blocks
    terms: torch.Tensor | None  # (aux loss, z-loss) values; None when neither is weighted
    counts_E: torch.Tensor | None  # routed (token, slot) pairs per expert; None unless counting


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``hidden``; in backward it also gives the layer's ``terms`` (aux loss, z-loss)
    the gradients ``weights`` and records their values and ``counts_E`` for ``block``. Recording in
    backward counts each micro-batch and layer once: activation checkpointing recomputes the
    forward, never this backward."""

    @staticmethod
    def forward(ctx, hidden, terms, counts_E, weights, record, block):
        ctx.weights, ctx.record, ctx.block = weights, record, block
        ctx.save_for_backward(None if terms is None else terms.detach(), counts_E)
        return hidden

    @staticmethod
    def backward(ctx, grad_hidden):
        terms, counts_E = ctx.saved_tensors
        ctx.record.append(_Record(ctx.block, terms, counts_E))
        grad_terms = None if terms is None else torch.tensor(ctx.weights, dtype=terms.dtype, device=terms.device)
        return grad_hidden, grad_terms, None, None, None, None


def moe_blocks(modules) -> list[tuple[str, torch.nn.Module]]:
    """The MoE blocks of ``modules`` by name: modules with a ``gate`` router and ``experts``."""
    return [(name, m) for root in modules for name, m in root.named_modules()
            if hasattr(m, "gate") and hasattr(m, "experts")]


class AuxLossHooks:
    """Forward hooks on every MoE block of ``modules`` (a block is a module with a ``gate``
    router returning ``(logits [T, E], weights, indices [T, K])`` and an ``experts`` module); a
    pipeline rank may have none. ``losses``: attach the aux loss and z-loss; ``counts``: record the
    routed pairs per expert. ``per_sequence``: the aux loss of each sequence of the block's input
    ``[batch, seq, H]``, averaged (DeepSeek-V3's sequence-wise balance loss). ``group``: sum the aux
    loss statistics over it (global aux loss; collective, every rank of it runs the same blocks in
    the same order).

    The hooks act only while ``active`` (TrainStep sets it for its own step): a forward outside
    the step, or inside another TrainStep's step on the same model, is left alone, so TrainSteps
    sharing a model never feed each other's losses or records. ``close()`` removes the hooks."""

    def __init__(self, modules, *, losses: bool, counts: bool, group: dist.ProcessGroup | None = None,
                 scores: list[str] | None = None, per_sequence: bool = False):
        found = moe_blocks(modules)
        self.names = [name for name, _ in found]
        self.blocks = [m for _, m in found]
        # How each block's router scores its experts, for the aux loss (``router_scores``).
        self.scores = scores if scores is not None else ["softmax"] * len(self.blocks)
        self.losses, self.counts, self.group, self.per_sequence = losses, counts, group, per_sequence
        self.weights = (0.0, 0.0)  # gradient weights of (aux loss, z-loss)
        self.record: list[_Record] = []
        self.active = False
        self._routing: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # by id(router), router to block hook
        self.handles = []
        for i, block in enumerate(self.blocks):
            self.handles.append(block.gate.register_forward_hook(self._router_hook))
            self.handles.append(block.register_forward_hook(functools.partial(self._block_hook, i), with_kwargs=True))

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _router_hook(self, router, args, output):
        if not self.active:
            return
        if not (isinstance(output, tuple) and len(output) == 3 and output[0].dim() == 2 and output[2].dim() == 2):
            raise TypeError(
                f"{type(router).__name__} must return (logits [T, E], weights, indices [T, K]) for the aux loss"
            )
        self._routing[id(router)] = (output[0], output[2])

    def _block_hook(self, index, block, args, kwargs, output):
        if not self.active:
            return output
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"{type(block).__name__} must return a tensor for the aux loss, got {type(output).__name__}")
        logits_TE, idx_TK = self._routing.pop(id(block.gate))
        if not torch.is_grad_enabled():
            return output
        terms = counts_E = None
        if self.losses:
            # Recomputed inside a backward pass: over the group's backward twin, if it has one.
            sequence_length = _sequence_length(block, args, kwargs) if self.per_sequence else None
            aux = load_balancing_loss(logits_TE, idx_TK.shape[1], top_k_index=idx_TK, group=lane_group(self.group),
                                      score=self.scores[index], sequence_length=sequence_length)
            terms = torch.stack([aux, router_z_loss(logits_TE).to(aux.dtype)])
        if self.counts:
            counts_E = expert_counts(idx_TK, logits_TE.shape[1])
        return _AttachAuxLoss.apply(output, terms, counts_E, self.weights, self.record, index)


def _sequence_length(block, args, kwargs) -> int:
    """The sequence length of a MoE block's input ``[batch, seq, H]``, whose rows its router's
    logits hold in that order (transformers flattens the batch and sequence dims)."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not (isinstance(hidden, torch.Tensor) and hidden.dim() == 3):
        got = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
        raise TypeError(f"the sequence-wise aux loss needs {type(block).__name__}'s input as hidden_states "
                        f"[batch, seq, H], got {got}")
    return hidden.shape[1]


def router_scores(modules, given: str | None) -> tuple[list[str], str | None]:
    """How the router of each MoE block of ``modules`` (AuxLossHooks' order) scores its experts:
    ``given``, else what its class computes (``moe_ep.hf.routers.router_score``). The aux loss takes
    those probabilities: a sigmoid router's scores normalised over the experts, as DeepSeek-V3's
    balance loss and Megatron-Core's aux loss take them, not a softmax of its logits. Returns them,
    and what to refuse (the first router whose scoring cannot be told, and the way to state it) or
    None; raised by the caller on every pipeline stage alike."""
    blocks = [(name, block.gate) for name, block in moe_blocks(modules)]
    scores = [given or router_score(gate) for _, gate in blocks]
    unknown = [(name, gate) for (name, gate), score in zip(blocks, scores) if score is None]
    if not unknown:
        return scores, None
    name, gate = unknown[0]
    return scores, (f"aux_loss_coef > 0 needs to know how each router scores its experts (softmax or sigmoid); the "
                    f"gate of {name!r} ({type(gate).__name__}) computes both or neither in its forward: pass "
                    "router_score='softmax' or 'sigmoid'")


class Balancing:
    """TrainStep's load-balancing terms on ``executor``'s modules: the aux loss and z-loss with
    weights ``aux_loss_coef`` and ``z_loss_coef`` (0: none), the expert bias with step
    ``expert_bias_rate`` (0: none), the aux-loss statistics summed over ``group`` when given, or
    taken per sequence with ``per_sequence``.
    Refuses (leaving no hook behind) a model without MoE blocks, and for the expert bias a router
    without a float32 ``e_score_correction_bias``, on every pipeline stage alike."""

    def __init__(self, executor: Executor, *, aux_loss_coef: float, z_loss_coef: float, expert_bias_rate: float,
                 group: dist.ProcessGroup | None, router_score: str | None = None, per_sequence: bool = False):
        self.executor = executor
        self.aux_loss_coef, self.z_loss_coef, self.expert_bias_rate = aux_loss_coef, z_loss_coef, expert_bias_rate
        self.losses = bool(aux_loss_coef or z_loss_coef)
        scores, unscored = router_scores(executor.modules, router_score) if aux_loss_coef else (None, None)
        self.hooks = AuxLossHooks(executor.modules, losses=self.losses, counts=bool(expert_bias_rate), group=group,
                                  scores=scores, per_sequence=per_sequence)
        try:
            # The MoE layers, and the stages that cannot tell a router's scoring, over every stage:
            # a stage without MoE blocks would otherwise wait for its refusing peers.
            count = executor.sum_over_stages(torch.tensor([float(len(self.hooks.blocks)), float(unscored is not None)],
                                                          device=executor.device))
            # host sync: once, at construction.
            layers, refusing = count.tolist()
            self.num_layers = int(layers)
            if refusing:
                raise ValueError(unscored or "aux_loss_coef > 0 was refused by another pipeline stage (its error names "
                                 "the router)")
            if not self.num_layers:
                needs = "aux_loss_coef or z_loss_coef" if self.losses else "expert_bias_rate"
                raise ValueError(f"{needs} > 0 needs MoE blocks (modules with a 'gate' router and 'experts')")
            if expert_bias_rate:
                self._check_expert_bias()
        except BaseException:
            self.hooks.close()  # a refused TrainStep leaves no hooks on the model
            raise

    @property
    def record(self) -> list[_Record]:
        return self.hooks.record

    @contextlib.contextmanager
    def armed(self, loss_scale: float):
        """The hooks act inside the block (one step): each layer's terms get the gradient of
        ``coef x`` their share of the mean, times the loss scale."""
        per_term = loss_scale / (self.num_layers * self.executor.microbatches)
        self.hooks.weights = (self.aux_loss_coef * per_term, self.z_loss_coef * per_term)
        self.hooks.record.clear()
        self.hooks.active = True
        try:
            yield
        finally:
            self.hooks.active = False

    def step_records(self) -> list[_Record]:
        """The step's records: one per local MoE layer and micro-batch. torch's pipelining (2.12+)
        also runs one forward and backward before the first step to infer the stages' shapes,
        whose records come first and are not the step's, so the last ones are kept."""
        record, microbatches = self.hooks.record, self.executor.microbatches
        blocks = len(self.hooks.blocks)
        expected = blocks * microbatches
        records = record[max(len(record) - expected, 0):]
        per_block = collections.Counter(r.block for r in records)
        if len(records) < expected or any(per_block[i] != microbatches for i in range(blocks)):
            raise RuntimeError(
                f"the MoE layers were recorded {len(record)} times this step, expected {expected} ({blocks} MoE "
                f"layers x {microbatches} micro-batches), the last {expected} of them once per layer and micro-batch"
            )
        return records

    def means(self, records: list[_Record], device) -> torch.Tensor:
        """The step's (aux loss, z-loss): means over layers and micro-batches of the whole model."""
        terms = [r.terms for r in records]
        total = torch.stack(terms).sum(0).to(device) if terms else torch.zeros(2, device=device)
        return self.executor.sum_over_stages(total) / (self.num_layers * self.executor.microbatches)

    def update_expert_bias(self, records: list[_Record], group: dist.ProcessGroup | None) -> None:
        """Every local block's bias moved by its step's load: the routed pairs of all its
        micro-batches, summed over ``group`` (the data-parallel ranks; one all-reduce for all
        layers), so that every rank applies the same update. A pipeline rank updates its own
        stages' blocks; the data-parallel peers of a stage hold the same blocks, so the collective
        matches."""
        blocks = self.hooks.blocks
        if not blocks:
            return
        counts = [[] for _ in blocks]
        for r in records:
            counts[r.block].append(r.counts_E)
        # float64: integer counts stay exact however many tokens a step routes.
        load = [torch.stack(c).to(torch.float64).sum(0) for c in counts]
        biases = [block.gate.e_score_correction_bias for block in blocks]
        update_expert_bias_(biases, load, rate=self.expert_bias_rate, group=group)

    def close(self) -> None:
        self.hooks.close()

    def _check_expert_bias(self) -> None:
        """Every local router must hold a 1-D bias of at least float32 precision. Every pipeline
        stage learns whether any refused: a stage without MoE blocks passes, and would otherwise
        go on to wait in a collective that its refusing peers never enter."""
        problem = self._expert_bias_problem()
        refused = self.executor.sum_over_stages(
            torch.tensor([float(problem is not None)], device=self.executor.device)
        )
        # host sync: once, at construction.
        if problem is None and refused.item():
            problem = (f"expert_bias_rate={self.expert_bias_rate} was refused by another pipeline stage (its error "
                       "names the router)")
        if problem is not None:
            raise ValueError(problem)

    def _expert_bias_problem(self) -> str | None:
        for name, block in zip(self.hooks.names, self.hooks.blocks):
            bias = getattr(block.gate, "e_score_correction_bias", None)
            if not isinstance(bias, torch.Tensor) or bias.dim() != 1:
                found = "none" if bias is None else (
                    f"one of shape {tuple(bias.shape)}" if isinstance(bias, torch.Tensor) else type(bias).__name__
                )
                return (
                    f"expert_bias_rate={self.expert_bias_rate} needs every MoE block's router to hold a 1-D "
                    f"'e_score_correction_bias' (DeepSeek-V3's aux-loss-free bias); the gate of {name!r} "
                    f"({type(block.gate).__name__}) has {found}"
                )
            if not bias.is_floating_point() or torch.finfo(bias.dtype).bits < 32:
                # In bfloat16 a step of 1e-3 rounds away once |bias| >= 0.5: the bias would stop
                # moving. transformers keeps it in float32 when it loads a model in low precision.
                return (
                    f"expert_bias_rate={self.expert_bias_rate} needs e_score_correction_bias in float32 or "
                    f"float64; the gate of {name!r} holds it in {bias.dtype} (cast the model's parameters, not "
                    "its buffers, to low precision)"
                )
        return None
