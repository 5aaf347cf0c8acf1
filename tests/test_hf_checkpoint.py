"""Checkpoints and inference of patched transformers models: save_pretrained writes the same bytes
as the unpatched model and plain transformers loads them; legacy per-expert checkpoints load into
a model created with experts_implementation="moe_ep" through transformers' own conversion; greedy
generate() with a KV cache (one-token decode steps included) gives the unpatched model's tokens."""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import save_file

from moe_ep.hf import fused_routers, is_patched, patch
from numerics import TOLERANCE, rel_err
from hf_models import FAMILIES, tiny_batch, tiny_model

FP32 = TOLERANCE[torch.float32]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_writes_identical_safetensors(family, tmp_path):
    unpatched = tiny_model(family)
    model = patch(tiny_model(family), backend="torch")
    unpatched.save_pretrained(tmp_path / "plain")
    model.save_pretrained(tmp_path / "patched")
    plain, patched = (tmp_path / d / "model.safetensors" for d in ("plain", "patched"))
    assert patched.read_bytes() == plain.read_bytes()
    # Plain transformers (no moe_ep) loads it and computes what the patched model computes.
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "patched", experts_implementation="eager")
    batch = tiny_batch(model.config)
    assert rel_err(reloaded(**batch).logits, model(**batch).logits) <= FP32


def _legacy_state_dict(model, family: str) -> dict[str, torch.Tensor]:
    """The model's weights in the pre-5.x per-expert layout: Mixtral's
    ``block_sparse_moe.experts.N.w1/w3/w2`` (gate/up/down), the other families'
    ``mlp.experts.N.gate_proj/up_proj/down_proj`` (as their published checkpoints hold them)."""
    out = {}
    for key, value in model.state_dict().items():
        if family == "mixtral":
            key = key.replace(".mlp.", ".block_sparse_moe.")
        prefix, _, leaf = key.rpartition(".")
        if leaf == "gate_up_proj":
            I = value.shape[1] // 2
            names = ("w1", "w3") if family == "mixtral" else ("gate_proj", "up_proj")
            for e in range(value.shape[0]):
                out[f"{prefix}.{e}.{names[0]}.weight"] = value[e, :I].clone()
                out[f"{prefix}.{e}.{names[1]}.weight"] = value[e, I:].clone()
        elif leaf == "down_proj" and prefix.endswith(".experts"):
            name = "w2" if family == "mixtral" else "down_proj"
            for e in range(value.shape[0]):
                out[f"{prefix}.{e}.{name}.weight"] = value[e].clone()
        else:
            out[key] = value.clone()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_legacy_per_expert_checkpoint_loads(family, tmp_path):
    unpatched = tiny_model(family)
    legacy = _legacy_state_dict(unpatched, family)
    if family == "mixtral":
        assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in legacy
    assert not any(k.endswith("gate_up_proj") for k in legacy)
    save_file(legacy, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    unpatched.config.save_pretrained(tmp_path)

    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="moe_ep")
    assert is_patched(model)
    loaded, want = model.state_dict(), unpatched.state_dict()
    assert list(loaded) == list(want)
    assert all(torch.equal(loaded[k], want[k]) for k in want)

    reference = tiny_model(family, dtype=torch.float64)
    batch = tiny_batch(model.config)
    assert rel_err(model(**batch).logits, reference(**batch).logits) <= FP32
    patch(model, backend="torch")
    assert fused_routers(model)
    assert rel_err(model(**batch).logits, reference(**batch).logits) <= FP32


def test_patched_checkpoint_roundtrips_into_moe_ep_model(tmp_path):
    """What transformers writes for a patched model (whatever layout it chooses) loads back into a
    moe_ep model unchanged."""
    model = patch(tiny_model("mixtral"), backend="torch")
    model.save_pretrained(tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="moe_ep")
    sd, ref = back.state_dict(), model.state_dict()
    assert list(sd) == list(ref) and all(torch.equal(sd[k], ref[k]) for k in ref)


# Both backends (Triton under the interpreter without a GPU), experts and fused router.
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_matches_unpatched(family, backend):
    unpatched = tiny_model(family)
    model = patch(tiny_model(family), backend=backend)
    tokens_seen = []
    experts = model.model.layers[-1].mlp.experts
    handle = experts.register_forward_pre_hook(lambda mod, args: tokens_seen.append(args[0].shape[0]))
    prompt = tiny_batch(model.config, batch=1, seq=5)["input_ids"]
    kwargs = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, use_cache=True)
    got = model.generate(prompt, **kwargs)
    handle.remove()
    want = unpatched.generate(prompt, **kwargs)
    assert got.shape == (1, 11)
    assert torch.equal(got, want)
    # The prompt step routes 5 tokens, every cached decode step routes exactly one.
    assert tokens_seen == [5] + [1] * 5
