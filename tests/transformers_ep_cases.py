"""transformers' own expert parallelism with moe_ep's experts, as transformers'
``test_fsdp2_expert_parallel_bf16_grads`` runs it, in float32: the configurations of the installed
transformers and the function every rank runs (test_transformers_ep.py on 2 ranks,
test_hf_loops_4_ranks.py on 4)."""

from __future__ import annotations

import pytest
import torch

from markers import EP_REGISTRY_MODULE, HAS_EP_REGISTRY
from numerics import rel_err

FAMILIES = ("mixtral", "qwen3_moe")
BATCH = 2  # sequences per data-parallel rank


def save_tiny_checkpoints(folder) -> dict[str, str]:
    """A tiny model of each family saved under ``folder``, for the ranks to load."""
    from hf_models import tiny_model

    checkpoints = {}
    for family in FAMILIES:
        checkpoints[family] = str(folder / family)
        tiny_model(family).save_pretrained(checkpoints[family])
    return checkpoints


def distributed_configs(world: int, family: str) -> list[tuple[str, dict, int]]:
    """(name, DistributedConfig keywords, data-parallel size) for the installed transformers."""
    if not HAS_EP_REGISTRY:
        # 5.17: expert parallelism is tensor parallelism's; every rank holds the whole batch and
        # the router sends sentinels, with no flag on the experts. Over 2 ranks only: the tiny
        # Mixtral's 6 experts do not split over 4.
        return [("tp_enable_expert_parallel", {"tp_size": world, "enable_expert_parallel": True}, 1)] if world == 2 else []
    implementations = ("auto", "moe_ep")
    cases = [(f"fsdp_ep_{impl}", {"fsdp_size": world, "ep_size": 2, "ep_implementation": impl}, world)
             for impl in implementations]
    # Expert parallelism over a tensor-parallel group, whose ranks share their batch (transformers'
    # test_fsdp2_expert_parallel_2d_vs_ddp on 4 ranks): the all-to-alls take a slice each.
    cases += [(f"fsdp_tp_ep_{impl}", {"fsdp_size": world // 2, "tp_size": 2, "ep_size": 2, "ep_implementation": impl},
               world // 2) for impl in implementations]
    if family == "mixtral" and world == 2:
        # The whole batch on both ranks, off-rank slots sent as sentinels.
        cases.append(("tp_ep_all_reduce", {"tp_size": 2, "ep_size": 2, "ep_implementation": "all_reduce"}, 1))
    return cases


def transformers_ep_vs_one_process(rank: int, world: int, checkpoints: dict[str, str]) -> dict:
    """Per family and configuration: the mean loss over the data-parallel ranks and every
    parameter's whole gradient against one float64 process on the whole batch."""
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import moe_ep  # noqa: F401  (registers the "moe_ep" experts and ep_implementation)
    from hf_models import tiny_batch

    results = {}
    for family, checkpoint in checkpoints.items():
        reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64, experts_implementation="eager")
        for name, kwargs, dp in distributed_configs(world, family):
            batch = tiny_batch(reference.config, batch=BATCH * dp, seq=16)
            reference.zero_grad()
            ref_loss = reference(**batch).loss
            ref_loss.backward()
            model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, experts_implementation="moe_ep",
                                                         distributed_config=DistributedConfig(**kwargs))
            # transformers' mesh is (pp, fsdp, tp), tp fastest: the ranks of a TP group share a batch.
            dp_rank = rank // (world // dp)
            mine = slice(BATCH * dp_rank, BATCH * (dp_rank + 1))
            loss = model(**{k: v[mine] for k, v in batch.items()}).loss
            loss.backward()
            mean_loss = loss.detach().clone()
            torch.distributed.all_reduce(mean_loss)
            grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
                     for n, p in model.named_parameters()}
            want = dict(reference.named_parameters())
            experts = model.model.layers[0].mlp.experts
            results[f"{family} {name}"] = {
                "loss_err": rel_err(mean_loss / world, ref_loss),
                "grad_err": max(rel_err(g, want[n].grad) for n, g in grads.items() if g is not None),
                "missing": sorted(n for n, g in grads.items() if g is None),
                "compared": len(grads),
                "implementation": model.config._experts_implementation,
                "local_experts": experts.gate_up_proj.to_local().shape[0]
                if isinstance(experts.gate_up_proj, DTensor) else experts.gate_up_proj.shape[0],
            }
            del model
    return results


def expected_cases(world: int) -> list[str]:
    return [f"{family} {name}" for family in FAMILIES for name, _, _ in distributed_configs(world, family)]


def case_params(world: int) -> list:
    """``expected_cases(world)`` as pytest parameters, and where transformers has no expert-parallel
    registry (5.17) one skipped parameter saying that ``ep_implementation`` (transformers' default
    and "moe_ep") cannot be tested there."""
    params = list(expected_cases(world))
    if not HAS_EP_REGISTRY:
        import transformers

        params.append(pytest.param("ep_implementation", marks=pytest.mark.skip(
            reason=f"transformers {transformers.__version__} has no {EP_REGISTRY_MODULE}: no DistributedConfig("
                   "ep_implementation=...), so neither its default nor 'moe_ep' exists there")))
    return params


def check_case(per_rank: list[dict], case: str) -> None:
    """Every rank ran ``case`` on moe_ep's experts, compared every gradient, and matched the float64
    process to the float32 tolerance."""
    from numerics import TOLERANCE

    for rank, results in enumerate(per_rank):
        found = results[case]
        assert found["implementation"] == "moe_ep", (rank, found)
        assert found["missing"] == [] and found["compared"] > 0, (rank, found)
        assert found["loss_err"] <= TOLERANCE[torch.float32], (rank, found)
        assert found["grad_err"] <= TOLERANCE[torch.float32], (rank, found)
