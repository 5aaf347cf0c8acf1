"""moe_ep.hf.register / patch: the fused routers return exactly what each family's router returns,
patching is idempotent and reversible, nothing is patched by importing, and every unsupported
layout, router or transformers version is refused with an error that names it."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch
import transformers

import moe_ep.hf as hf
from moe_ep.ops.experts import moe_experts
from moe_ep.hf import routers
from moe_ep.hf.routers import FUSED_ROUTER_FORWARDS
from numerics import TOLERANCE, rel_err
from hf_models import FAMILIES, tiny_batch, tiny_config, tiny_model


def _router(model):
    return model.model.layers[-1].mlp.gate


def _experts(model):
    return model.model.layers[-1].mlp.experts


def _state(model):
    """Everything patch may touch, to compare two patch calls."""
    return (
        model.config._experts_implementation,
        [(n, m.__dict__.get("forward"), hf.binding_of(m)) for n, m in model.named_modules()],
    )


# --- fused routers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_router_returns_what_the_family_router_returns(family, dtype):
    model = tiny_model(family, dtype=dtype)
    router = _router(model)
    x = torch.randn(3, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    want = type(router).forward(router, x)
    hf.patch(model, backend="torch")
    assert type(_router(model)) is type(router) and _router(model) is router
    got = router(x)
    assert len(got) == len(want) == 3
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
    logits, weights, idx = got
    w_logits, w_weights, w_idx = want
    # DeepSeek-V3 takes its top-k unsorted: compare the chosen experts as sets, slot by expert id.
    order, w_order = idx.sort(-1).indices, w_idx.sort(-1).indices
    assert torch.equal(idx.gather(1, order), w_idx.gather(1, w_order))
    tol = TOLERANCE[dtype]
    assert rel_err(logits, w_logits) <= tol
    assert rel_err(weights.gather(1, order), w_weights.gather(1, w_order)) <= tol


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_router_returns_the_family_routers_dtypes_under_autocast(family):
    """Under autocast a family's router returns what its autocast matmul gives: DeepSeek-V3's
    weights too come back in bfloat16 (they came back in float32)."""
    model = tiny_model(family)
    router = _router(model)
    x = torch.randn(3, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = type(router).forward(router, x)
        hf.patch(model, backend="torch")
        got = router(x)
    assert [g.dtype for g in got] == [w.dtype for w in want]
    order, w_order = got[2].sort(-1).indices, want[2].sort(-1).indices
    assert rel_err(got[1].gather(1, order).float(), want[1].gather(1, w_order).float()) <= TOLERANCE[torch.bfloat16]


# Router forwards of a hypothetical transformers release whose semantics moved away from the ones
# moe_ep's fused routers implement; each must be refused, not patched.
def _mixtral_without_renormalisation(self, hidden_states):
    logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
    weights, idx = logits.float().softmax(-1).topk(self.top_k, dim=-1)
    return logits, weights, idx


def _mixtral_probabilities_as_logits(self, hidden_states):
    """What Mixtral's router returned before 5.17."""
    logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
    probs = logits.float().softmax(-1)
    weights, idx = probs.topk(self.top_k, dim=-1)
    return probs, weights / weights.sum(-1, keepdim=True), idx


def _qwen_weights_left_in_float32(self, hidden_states):
    """Right in float32; in bf16 the weights would no longer come back in the logits' dtype."""
    logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
    weights, idx = logits.softmax(-1, dtype=torch.float).topk(self.top_k, dim=-1)
    if self.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return logits, weights, idx


def _deepseek_without_scaling(self, hidden_states):
    """transformers' DeepSeek-V3 router with routed_scaling_factor dropped."""
    logits, weights, idx = _DEEPSEEK_FORWARD(self, hidden_states)
    return logits, weights / self.routed_scaling_factor, idx


_DEEPSEEK_FORWARD = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter.forward


@pytest.mark.parametrize(
    "family, altered, what",
    [
        ("mixtral", _mixtral_without_renormalisation, "float32 probe input: its routing weights differ"),
        ("mixtral", _mixtral_probabilities_as_logits, "float32 probe input: its router logits differ"),
        ("qwen2_moe", _qwen_weights_left_in_float32, r"bfloat16 probe input: it returns .* the fused router"),
        ("deepseek_v3", _deepseek_without_scaling, "float32 probe input: its routing weights differ"),
    ],
)
def test_router_with_other_semantics_is_refused(family, altered, what, monkeypatch):
    """The fused router is checked against the installed class's own forward, once per class,
    class forward and configuration: a router class whose forward changed is probed again even
    after the original passed, and refused with its class and the transformers version named."""
    hf.patch(tiny_model(family), backend="torch")  # the original forward passes, and is cached
    model = tiny_model(family)
    router_class = type(_router(model))
    monkeypatch.setattr(router_class, "forward", altered)
    message = (
        rf"fused router for .*\.{router_class.__name__} \(semantics read from transformers 5\.17-5\.23\) does "
        rf"not return what {router_class.__name__}\.forward returns under the installed "
        rf"transformers=={transformers.__version__} on a torch\.{what}"
    )
    with pytest.raises(ValueError, match=message):
        hf.patch(model, backend="torch")
    _assert_untouched(model)
    hf.patch(model, fused_router=False)  # the model's own (altered) router is still usable
    assert hf.is_patched(model) and hf.fused_routers(model) == []


def test_router_probe_runs_once_per_class_and_configuration(monkeypatch):
    probes = []
    run_probe = routers._run_probe
    monkeypatch.setattr(routers, "_VERIFIED", set())
    monkeypatch.setattr(routers, "_run_probe", lambda router, *args: probes.append(router) or run_probe(router, *args))
    hf.patch(tiny_model("qwen3_moe"), backend="torch")
    assert len(probes) == 2  # float32 and bfloat16 probes of the first router; the second is cached
    hf.patch(tiny_model("qwen3_moe"), backend="torch")
    assert len(probes) == 2
    hf.patch(tiny_model("qwen3_moe", norm_topk_prob=False), backend="torch")  # another branch
    assert len(probes) == 4


@pytest.mark.parametrize("overrides, message", [
    # top-3 of 8 experts in 4 groups of 2 with one group kept: transformers' router picks masked experts.
    (dict(num_experts_per_tok=3, n_group=4, topk_group=1),
     r"moe_ep's fused router for .*DeepseekV3TopkRouter refuses the model's routing configuration: top_k=3 "
     r"exceeds the 2 experts left by topk_group=1 of n_group=4"),
    # One expert per group: the family's own group score (its two best experts) cannot be taken.
    (dict(n_group=8, topk_group=4),
     r"DeepseekV3TopkRouter.forward itself fails on a probe input of the router's shapes \(RuntimeError: .*\); "
     r"check the model's routing configuration"),
])
def test_a_routing_configuration_that_cannot_route_is_refused_naming_the_router(overrides, message, monkeypatch):
    monkeypatch.setattr(routers, "_VERIFIED", set())
    model = tiny_model("deepseek_v3", **overrides)
    with pytest.raises(ValueError, match=rf"^fused_router=True: {message}"):
        hf.patch(model, backend="torch")
    _assert_untouched(model)


def test_router_probe_needs_no_router_values(monkeypatch):
    """The probe uses random tensors of the router's shapes: a router on the meta device (a model
    built before its checkpoint is loaded) is verified all the same, and keeps its tensors."""
    router = _router(tiny_model("deepseek_v3")).to("meta")
    monkeypatch.setattr(routers, "_VERIFIED", set())
    routers.verify_fused_router(router)
    assert routers._VERIFIED and router.weight.is_meta and router.e_score_correction_bias.is_meta


def test_router_hooks_still_record_logits_and_aux_loss():
    """output_router_logits=True goes through transformers' OutputRecorder hooks on the router
    class: the patched model's recorded logits are the fused router's outputs."""
    model = hf.patch(tiny_model("mixtral"), backend="torch")
    seen = []
    router = _router(model)
    handle = router.register_forward_hook(lambda mod, args, out: seen.append(out[0]))
    out = model(**tiny_batch(model.config), output_router_logits=True)
    handle.remove()
    assert len(seen) == 1 and out.router_logits[-1] is seen[0]
    assert out.aux_loss is not None and out.aux_loss.item() > 0


# --- registration, import, idempotence -----------------------------------------------------------


def test_register_is_idempotent_and_visible_to_transformers():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    hf.register()
    hf.register()
    assert hf.is_registered()
    assert ALL_EXPERTS_FUNCTIONS["moe_ep"] is hf.moe_ep_experts_forward
    model = tiny_model("qwen3_moe")
    model.set_experts_implementation("moe_ep")
    assert hf.is_patched(model) and hf.fused_routers(model) == []
    model.set_experts_implementation("eager")
    assert not hf.is_patched(model)


IMPORT_CHECK = """
import importlib.util, json, sys
import transformers
from transformers.models.mixtral import modeling_mixtral as mm
classes = (mm.MixtralSparseMoeBlock, mm.MixtralExperts, mm.MixtralTopKRouter)
before = {c.__name__: c.forward for c in classes}
import moe_ep
# transformers' expert-parallel registry is recent: 5.23 has it, 5.17 does not.
ep_registry = importlib.util.find_spec("transformers.distributed.expert_parallel") is not None
if ep_registry:
    from transformers.distributed.expert_parallel import EPImplementationInterface
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
sys.path.insert(0, "tests")
from hf_models import tiny_config
plain = transformers.AutoModelForCausalLM.from_config(tiny_config("mixtral"))
fast = transformers.AutoModelForCausalLM.from_config(tiny_config("mixtral"), experts_implementation="moe_ep")
print(json.dumps({
    "experts_registered": ALL_EXPERTS_FUNCTIONS.get("moe_ep") is moe_ep.hf.moe_ep_experts_forward,
    "ep_registered": ep_registry and "moe_ep" in EPImplementationInterface(),
    "ep_registry": ep_registry,
    "classes_untouched": all(c.forward is before[c.__name__] for c in classes),
    "default_model_untouched": plain.config._experts_implementation != "moe_ep" and not moe_ep.hf.is_patched(plain),
    "from_config_patched": moe_ep.hf.is_patched(fast),
    "api": [name for name in ("moe_experts", "route_topk", "patch", "parallelize", "plan") if hasattr(moe_ep, name)],
}))
"""


@pytest.mark.slow
def test_import_registers_and_patches_nothing():
    """In a fresh process: ``import moe_ep`` registers both transformers entries and the public
    API, and leaves every class and every model built without asking for moe_ep as it was."""
    repo = pathlib.Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", IMPORT_CHECK], cwd=repo, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    ep_registry = found.pop("ep_registry")
    assert found == {
        "experts_registered": True, "ep_registered": ep_registry, "classes_untouched": True,
        "default_model_untouched": True, "from_config_patched": True,
        "api": ["moe_experts", "route_topk", "patch", "parallelize", "plan"],
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_patch_is_idempotent_and_reversible(family):
    unpatched = tiny_model(family)
    model = tiny_model(family)
    assert hf.patch(model, backend="torch") is model
    first = _state(model)
    hf.patch(model, backend="torch")
    assert _state(model) == first
    first_moe_layer = 1 if family == "deepseek_v3" else 0
    assert hf.fused_routers(model) == [f"model.layers.{i}.mlp.gate" for i in range(first_moe_layer, 2)]
    # Names, shapes and values of parameters and buffers are the unpatched model's.
    sd, ref = model.state_dict(), unpatched.state_dict()
    assert list(sd) == list(ref)
    assert all(torch.equal(sd[k], ref[k]) for k in ref)
    hf.patch(model, backend="torch", fused_router=False)
    assert hf.fused_routers(model) == [] and "forward" not in _router(model).__dict__
    assert hf.is_patched(model)


def test_a_subclass_of_a_family_defined_in_the_users_script_runs_its_experts_on_moe_ep(monkeypatch):
    """transformers sets the experts implementation only where the source of the model class's
    module holds its experts decorator (this file must not name it): a subclass defined elsewhere
    (a training script, a notebook) kept its eager experts behind a patch that said nothing."""
    from transformers import MixtralForCausalLM

    import moe_ep.hf.registry as registry

    class ScriptMixtral(MixtralForCausalLM):
        # transformers' verdict for this file in a fresh process; cached on the class, the parent's
        # verdict is inherited once a Mixtral model was patched in this process.
        _can_set_experts_implementation_cached_value = False

    model = ScriptMixtral(tiny_config("mixtral")).eval()
    eager = tiny_model("mixtral").eval()
    model.load_state_dict(eager.state_dict())
    hf.patch(model, backend="torch")
    assert hf.is_patched(model) and model.config._experts_implementation == "moe_ep"
    calls = []
    monkeypatch.setattr(registry, "moe_experts", lambda *a, **k: (calls.append(1), moe_experts(*a, **k))[1])
    batch = tiny_batch(model.config)
    with torch.no_grad():
        got, want = model(**batch).logits, eager(**batch).logits
    assert len(calls) == model.config.num_hidden_layers
    assert rel_err(got, want) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("fused_router", [False, True])
def test_a_patched_model_runs_on_the_meta_device(fused_router):
    """Shapes only, as a model is traced before it is materialised: autocast knows no meta
    device, so asking it raised."""
    config = tiny_model("mixtral").config
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    hf.patch(model, backend="torch", fused_router=fused_router)
    ids = torch.zeros(2, 7, dtype=torch.long, device="meta")
    assert model(input_ids=ids).logits.shape == (2, 7, config.vocab_size)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_patched_model_pickles_and_loads_with_its_fused_routers(family):
    """``torch.save`` of the whole patched model (and ``copy.deepcopy``): the copy's routers run the
    fused forward bound to the copy's own router, and give the original's logits."""
    import copy
    import io

    model = hf.patch(tiny_model(family), backend="torch")
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    batch = tiny_batch(tiny_config(family), batch=2, seq=5, seed=3)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits
    for twin in (torch.load(buffer, weights_only=False), copy.deepcopy(model)):
        assert hf.fused_routers(twin) == hf.fused_routers(model)
        assert _router(twin).__dict__["forward"].__self__ is _router(twin)
        with torch.no_grad():
            assert torch.equal(twin(input_ids=batch["input_ids"]).logits, logits)


def test_experts_whose_activation_is_torchs_functional_silu_are_patched():
    """LFM2-MoE's experts hold ``torch.nn.functional.silu`` itself as ``act_fn`` (not a module):
    SwiGLU, run by moe_ep (its own router kept) with the unpatched model's logits."""
    pytest.importorskip("transformers.models.lfm2_moe")
    config = transformers.Lfm2MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_dense_layers=1, num_attention_heads=4, num_key_value_heads=2,
        layer_types=["full_attention", "conv"])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        hf.patch(model, backend="torch", fused_router=False)
        assert hf.is_patched(model)
        assert rel_err(model(input_ids=ids).logits, expected) <= TOLERANCE[torch.float32]


def test_patch_under_accelerate_hook_keeps_the_hook():
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    class Count(ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            Count.calls += 1
            return args, kwargs

    model = tiny_model("mixtral")
    router = _router(model)
    add_hook_to_module(router, Count())
    hf.patch(model, backend="torch")
    assert "model.layers.1.mlp.gate" in hf.fused_routers(model)
    model(**tiny_batch(model.config))
    assert Count.calls == 1
    remove_hook_from_module(router)
    assert router.forward.__func__ in FUSED_ROUTER_FORWARDS.values()


def test_experts_dispatcher_takes_the_call():
    model = hf.patch(tiny_model("qwen2_moe"), backend="torch")
    experts = _experts(model)
    calls = []

    def dispatcher(module, hidden_states, top_k_index, top_k_weights):
        calls.append((module, hidden_states.shape, top_k_index.shape))
        return moe_experts(hidden_states, top_k_index, top_k_weights, module.gate_up_proj, module.down_proj)

    batch = tiny_batch(model.config)
    want = model(**batch).logits
    hf.bind(experts, dispatcher=dispatcher)
    got = model(**batch).logits
    assert len(calls) == 1 and calls[0][0] is experts
    assert calls[0][1] == (14, model.config.hidden_size) and calls[0][2] == (14, model.config.num_experts_per_tok)
    assert torch.equal(got, want)


def test_gelu_experts_match_fp64_eager():
    ref = tiny_model("mixtral", dtype=torch.float64, hidden_act="gelu")
    model = hf.patch(tiny_model("mixtral", hidden_act="gelu"), backend="torch")
    assert hf.experts_activation(_experts(model)) == "gelu"
    batch = tiny_batch(model.config)
    assert rel_err(model(**batch).logits, ref(**batch).logits) <= TOLERANCE[torch.float32]


def test_autocast_matches_eager_under_autocast():
    """Under autocast the experts run in the autocast dtype, as transformers' eager experts do."""
    eager = tiny_model("olmoe")
    model = hf.patch(tiny_model("olmoe"), backend="torch")
    batch = tiny_batch(model.config)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = model(**batch), eager(**batch)
    assert got.logits.dtype == want.logits.dtype
    assert rel_err(got.logits, want.logits) <= TOLERANCE[torch.bfloat16]
    assert rel_err(got.loss, want.loss) <= TOLERANCE[torch.bfloat16]


def test_autocast_reaches_the_expert_parallel_dispatcher():
    """An installed dispatcher gets what the local op gets under autocast: activations and both
    weights in the autocast dtype (differentiable casts of the float32 parameters), so the two
    paths compute alike; the output comes back in the activations' dtype."""
    model = hf.patch(tiny_model("qwen2_moe"), backend="torch")
    experts = _experts(model)
    batch = tiny_batch(model.config)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(**batch).logits
    seen = []

    def dispatcher(module, hidden_states, top_k_index, top_k_weights):
        seen.append((hidden_states.dtype, module.gate_up_proj.dtype, module.down_proj.dtype))
        return moe_experts(hidden_states, top_k_index, top_k_weights, module.gate_up_proj, module.down_proj)

    hf.bind(experts, dispatcher=dispatcher)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(**batch)
    assert seen == [(torch.bfloat16,) * 3]
    assert torch.equal(out.logits, want)
    out.loss.backward()
    assert experts.gate_up_proj.grad.dtype == torch.float32 and experts.gate_up_proj.grad.norm() > 0


@pytest.mark.slow
def test_patched_moe_block_compiles_fullgraph():
    """No graph break in the fused router or the registered experts forward (aot_eager: the CPU
    has no compiler for inductor here); forward and gradients unchanged."""
    block = hf.patch(tiny_model("deepseek_v3"), backend="torch").model.layers[-1].mlp
    x = torch.randn(2, 5, block.gate.hidden_dim, generator=torch.Generator().manual_seed(0), requires_grad=True)
    want = block(x)
    want.square().sum().backward()
    want_grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    block.zero_grad(set_to_none=True)
    got = torch.compile(block, backend="aot_eager", fullgraph=True)(x)
    got.square().sum().backward()
    assert rel_err(got, want) <= TOLERANCE[torch.float32]
    for name, p in block.named_parameters():
        assert rel_err(p.grad, want_grads[name]) <= TOLERANCE[torch.float32], name


# --- errors ----------------------------------------------------------------------------------------


def _assert_untouched(model):
    assert model.config._experts_implementation == "eager"
    assert hf.fused_routers(model) == []


@pytest.mark.parametrize(
    "flag, value",
    [
        ("has_gate", False),
        ("is_concatenated", False),
        ("is_transposed", True),
        ("has_bias", True),
        ("has_post_expert_norm", True),
    ],
)
def test_unsupported_layout_flag_is_named(flag, value):
    model = tiny_model("mixtral")
    setattr(_experts(model), flag, value)
    with pytest.raises(ValueError, match=rf"MixtralExperts\.{flag}={value!r} is not supported"):
        hf.patch(model)
    _assert_untouched(model)
    # The registered forward refuses it too when the model was switched without patch().
    model.set_experts_implementation("moe_ep")
    with pytest.raises(ValueError, match=rf"{flag}={value!r}"):
        model(**tiny_batch(model.config))


def test_custom_apply_gate_is_refused():
    model = tiny_model("mixtral")
    experts = _experts(model)
    experts.__class__ = type("ClampedExperts", (type(experts),), {"_apply_gate": lambda self, x: x})
    with pytest.raises(ValueError, match="overrides _apply_gate"):
        hf.patch(model)
    _assert_untouched(model)


def test_gpt_oss_is_refused_with_all_its_flags():
    config = transformers.GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="eager")
    with pytest.raises(ValueError, match=r"GptOssExperts\.is_concatenated=False is not supported") as refused:
        hf.patch(model)
    assert "GptOssExperts.is_transposed=True" in str(refused.value)
    assert "GptOssExperts.has_bias=True" in str(refused.value)


def test_tanh_gelu_is_refused():
    model = tiny_model("qwen3_moe", hidden_act="gelu_pytorch_tanh")
    with pytest.raises(ValueError, match=r"Qwen3MoeExperts\.act_fn=.*SiLU \(SwiGLU\) and exact GELU"):
        hf.patch(model)
    _assert_untouched(model)


def test_unknown_router_class_is_refused_unless_fused_router_false():
    model = tiny_model("mixtral")
    router = _router(model)
    router.__class__ = type("MyRouter", (type(router),), {})
    with pytest.raises(ValueError, match=r"router 'model.layers.1.mlp.gate' of class .*MyRouter has no fused-router"):
        hf.patch(model)
    _assert_untouched(model)
    hf.patch(model, fused_router=False)
    assert hf.is_patched(model) and hf.fused_routers(model) == []


def test_foreign_router_forward_is_refused():
    model = tiny_model("olmoe")
    router = _router(model)
    router.forward = lambda hidden_states: type(router).forward(router, hidden_states)
    with pytest.raises(ValueError, match="already has an instance-level forward"):
        hf.patch(model)
    _assert_untouched(model)


def test_bad_arguments_are_named():
    model = tiny_model("olmoe")
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'triton', 'torch'\) or None, got 'cuda'"):
        hf.patch(model, backend="cuda")
    with pytest.raises(TypeError, match="fused_router must be a bool, got str"):
        hf.patch(model, fused_router="yes")
    with pytest.raises(TypeError, match="model must be a transformers PreTrainedModel, got Linear"):
        hf.patch(torch.nn.Linear(2, 2))
    _assert_untouched(model)


def test_dense_model_is_refused():
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=4
    )
    with pytest.raises(ValueError, match="LlamaForCausalLM has no experts module"):
        hf.patch(transformers.LlamaForCausalLM(config))


def test_old_or_missing_transformers_is_refused(monkeypatch):
    model = tiny_model("mixtral")
    # transformers' lazy module may swap the sys.modules entry while importing: patch the live one.
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.16.2")
    with pytest.raises(ImportError, match=r"needs transformers>=5\.17\.0, found transformers==5\.16\.2"):
        hf.register()
    with pytest.raises(ImportError, match=r"transformers>=5\.17\.0"):
        hf.patch(model)
    _assert_untouched(model)
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match="which is not installed"):
        hf.register()


def test_register_if_installed(monkeypatch):
    """The import-time entry point: registers, or does nothing without transformers, or warns (and
    leaves the rest of moe_ep importable) on a version that is too old."""
    assert hf.register_if_installed() is True and hf.is_registered()
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.0.0")
    with pytest.warns(UserWarning, match=r"transformers>=5\.17\.0, found transformers==5\.0\.0.*not registered"):
        assert hf.register_if_installed() is False
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    assert hf.register_if_installed() is False


def test_name_taken_by_another_function_is_refused(monkeypatch):
    from transformers.integrations.moe import ExpertsInterface

    def other_experts_forward(self, hidden_states, top_k_index, top_k_weights):
        return hidden_states

    monkeypatch.setitem(ExpertsInterface._global_mapping, "moe_ep", other_experts_forward)
    with pytest.raises(ValueError, match="'moe_ep' is already registered by .*other_experts_forward"):
        hf.register()


def test_tiny_config_rejects_unknown_family():
    with pytest.raises(ValueError, match="family must be one of"):
        tiny_config("llama")
