"""moe_ep.training.AdamW: torch.optim.AdamW with its moments stored in bf16. Against an
independent float64 AdamW that rounds its stored moments the same way, against torch's own with
float32 moments (bitwise), through a state dict, under FSDP2 on 2 gloo ranks against one process,
and its refusals."""

from __future__ import annotations

import io

import pytest
import torch

from dist_utils import run_ranks
from moe_ep.training import AdamW
from numerics import TOLERANCE, rel_err

SHAPES = [(13, 5), (7,), (1,), (64, 3)]
HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _params(dtype=torch.float32, seed=0):
    """Weights near zero: the updates, not the weights' own rounding, decide the comparisons."""
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 1e-3).to(dtype)) for s in SHAPES]


def _grads(steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    # Scales far apart, as layers' gradients are: the second moment spans orders of magnitude.
    return [[torch.randn(s, generator=g) * 10.0 ** -(i % 4) for i, s in enumerate(SHAPES)] for _ in range(steps)]


def _run(optimizer, params, grads):
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.to(p.dtype)
        optimizer.step()


def _reference(params, grads, moments_dtype, lr, betas, eps, weight_decay):
    """float64 AdamW (decoupled decay, bias-corrected, eps after the root); each step's update
    uses its moments at full precision, which are then stored rounded to ``moments_dtype``, and
    the weights are stored in their own dtype, as the optimizer stores them."""
    (b1, b2), out = betas, []
    for i, p in enumerate(params):
        w = p.detach().double()
        m, v = torch.zeros_like(w), torch.zeros_like(w)
        for t, step_grads in enumerate(grads, 1):
            g = step_grads[i].to(p.dtype).double()
            m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
            w = w * (1 - lr * weight_decay) - lr / (1 - b1**t) * m / (v.sqrt() / (1 - b2**t) ** 0.5 + eps)
            w, m, v = w.to(p.dtype).double(), m.to(moments_dtype).double(), v.to(moments_dtype).double()
        out.append(w)
    return out


@pytest.mark.parametrize("moments_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_updates_match_float64_adamw_with_the_same_stored_moments(dtype, moments_dtype):
    params, grads = _params(dtype), _grads(6)
    start = [p.detach().clone() for p in params]
    optimizer = AdamW(params, **HYPER, moments_dtype=moments_dtype)
    _run(optimizer, params, grads)
    expected = _reference(start, grads, moments_dtype, **HYPER)
    for p, p0, want in zip(params, start, expected):
        # The change of each weight: its size, not the weight's, sets the tolerance.
        assert rel_err(p.double() - p0.double(), want - p0.double()) <= TOLERANCE[dtype]
    for state in optimizer.state.values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == moments_dtype
        assert state["step"].item() == len(grads)


def test_float32_moments_are_torch_adamw_bit_for_bit():
    ours, theirs, grads = _params(), _params(), _grads(5)
    _run(AdamW(ours, **HYPER, moments_dtype=torch.float32), ours, grads)
    _run(torch.optim.AdamW(theirs, **HYPER), theirs, grads)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_bf16_moments_hold_half_the_bytes_and_skip_parameters_without_gradients():
    params = _params()
    frozen = torch.nn.Parameter(torch.ones(3))
    optimizer = AdamW([*params, frozen], **HYPER)
    _run(optimizer, params, _grads(1))
    assert frozen not in optimizer.state and torch.equal(frozen, torch.ones(3))
    moment_bytes = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in
                       (s["exp_avg"], s["exp_avg_sq"]))
    assert moment_bytes == 2 * 2 * sum(p.numel() for p in params)


def test_a_state_dict_round_trip_continues_bit_for_bit_and_keeps_the_moments_dtype():
    grads = _grads(5)
    straight = _params()
    _run(AdamW(straight, **HYPER), straight, grads)

    resumed = _params()
    first = AdamW(resumed, **HYPER)
    _run(first, resumed, grads[:3])
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    second = AdamW(resumed, **HYPER)
    second.load_state_dict(torch.load(buffer))
    assert {s["exp_avg"].dtype for s in second.state.values()} == {torch.bfloat16}
    _run(second, resumed, grads[3:])
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))


def test_torch_adamw_state_loads_with_its_moments_narrowed():
    params, grads = _params(), _grads(2)
    theirs = torch.optim.AdamW(params, **HYPER)
    _run(theirs, params, grads)
    ours = AdamW(params, **HYPER)
    ours.load_state_dict(theirs.state_dict())
    for p in params:
        assert ours.state[p]["exp_avg"].dtype == torch.bfloat16
        assert torch.equal(ours.state[p]["exp_avg"], theirs.state[p]["exp_avg"].bfloat16())


@pytest.mark.parametrize("kwargs, message", [
    (dict(moments_dtype=torch.int8), "moments_dtype must be one of torch.bfloat16, torch.float32, torch.float64"),
    (dict(moments_dtype="bf16"), "moments_dtype must be one of"),
    (dict(moments_dtype=torch.float16), r"got torch.float16 \(float16 and float8 lose small second moments"),
    (dict(lr=-1.0), "lr must be a finite real number >= 0"),
    (dict(lr=torch.tensor(1e-3)), "lr must be a finite real number >= 0, got tensor"),
    (dict(betas=(1.0, 0.9)), r"betas must be two real numbers in \[0, 1\)"),
    (dict(eps=-1e-8), "eps must be a finite real number >= 0"),
    (dict(weight_decay=float("inf")), "weight_decay must be a finite real number >= 0"),
    (dict(betas=(0.9, 0.999)), r"betas=\(0.9, 0.999\) with moments_dtype=torch.bfloat16: a moment whose decay "
                               r"1 - beta is below 2\^-7 stops moving in bf16"),
])
def test_bad_arguments_name_what_is_expected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AdamW(_params(), **kwargs)


def test_a_group_added_or_loaded_with_options_it_cannot_apply_is_refused():
    """torch's AdamW options this one does not implement (amsgrad, maximize, ...) are refused where
    they appear, an added group is checked like the first, and a refused state dict leaves the
    optimizer as it was."""
    params = _params()
    optimizer = AdamW(params[:2], **HYPER)
    for group, message in ((dict(params=params[2:3], amsgrad=True), r"does not implement amsgrad=True of parameter "
                                                                     r"group 1 \(torch.optim.AdamW does\)"),
                           (dict(params=params[2:3], lr=-1.0), "lr of parameter group 1 must be a finite real"),
                           (dict(params=[torch.nn.Parameter(torch.ones(2, dtype=torch.int64), requires_grad=False)]),
                            "real floating-point parameters, got one of torch.int64 of parameter group 1")):
        with pytest.raises(ValueError, match=message):
            optimizer.add_param_group(group)
        assert len(optimizer.param_groups) == 1
    theirs = torch.optim.AdamW(params[:2], **HYPER, maximize=True)
    _run(theirs, params[:2], _grads(1))
    _run(optimizer, params[:2], _grads(1))
    kept = {p: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    with pytest.raises(ValueError, match="does not implement maximize=True of saved parameter group 0"):
        optimizer.load_state_dict(theirs.state_dict())
    sgd = torch.optim.SGD(params[:2], lr=0.1)
    with pytest.raises(ValueError, match=r"the options of saved parameter group 0 lack betas, eps: not an AdamW's "
                                         r"\(a state dict of another optimizer\?\)"):
        optimizer.load_state_dict(sgd.state_dict())
    assert not optimizer.param_groups[0].get("maximize")
    assert all(torch.equal(optimizer.state[p][k], v) for p, s in kept.items() for k, v in s.items())


def test_float64_weights_and_moments_are_torch_adamw_in_float64_bit_for_bit():
    ours, theirs, grads = _params(torch.float64), _params(torch.float64), _grads(5)
    _run(AdamW(ours, **HYPER, moments_dtype=torch.float64), ours, grads)
    _run(torch.optim.AdamW(theirs, **HYPER), theirs, grads)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_bf16_moments_follow_a_shrinking_gradient_as_float32_moments_do():
    """After a burst, gradients 100x smaller: the bf16 second moment decays with float32's (at
    torch's beta2 = 0.999 it stayed put and the updates were 25x too small)."""
    finals = {}
    for moments_dtype in (torch.bfloat16, torch.float32):
        p = torch.nn.Parameter(torch.zeros(512))
        optimizer = AdamW([p], lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0, moments_dtype=moments_dtype)
        g = torch.Generator().manual_seed(0)
        for t in range(1500):
            p.grad = torch.randn(512, generator=g) * (1.0 if t < 100 else 0.01)
            optimizer.step()
        finals[moments_dtype] = optimizer.state[p]["exp_avg_sq"].double().mean()
    assert rel_err(finals[torch.bfloat16], finals[torch.float32]) <= 0.02, finals


def test_a_float16_weights_bf16_moments_survive_a_state_dict_round_trip():
    """torch's own loading passes a state through its parameter's dtype: small bf16 second moments
    of a float16 weight underflowed to 0 there (the next update 3,000x too large)."""
    p = torch.nn.Parameter(torch.zeros(64, dtype=torch.float16))
    optimizer = AdamW([p], **HYPER)
    p.grad = torch.full((64,), 1e-3, dtype=torch.float16)
    optimizer.step()
    state = optimizer.state_dict()
    state["state"][0]["step"] = 1.0  # a plain number, as older torch state dicts hold: loaded as a tensor
    loaded = AdamW([p], **HYPER)
    loaded.load_state_dict(state)
    for name in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(loaded.state[p][name], optimizer.state[p][name]) and loaded.state[p][name].any()
    assert isinstance(loaded.state[p]["step"], torch.Tensor) and loaded.state[p]["step"].item() == 1.0


def test_a_copy_of_the_optimizer_steps_as_the_original():
    import copy

    params, grads = _params(), _grads(3)
    optimizer = AdamW(params, **HYPER, moments_dtype=torch.float32)
    _run(optimizer, params, grads[:1])
    twin_params = [p.detach().clone().requires_grad_() for p in params]
    twin = copy.deepcopy(optimizer)
    twin.param_groups[0]["params"] = twin_params
    twin.state = {q: twin.state[p] for p, q in zip(twin.state, twin_params)}
    _run(optimizer, params, grads[1:])
    _run(twin, twin_params, grads[1:])
    assert twin.moments_dtype == torch.float32 and all(torch.equal(a, b) for a, b in zip(params, twin_params))


def test_integer_parameters_are_refused():
    with pytest.raises(ValueError, match="floating-point parameters, got one of torch.int64"):
        AdamW([torch.nn.Parameter(torch.ones(2, dtype=torch.int64), requires_grad=False)])


def _sharded(rank, world_size, steps):
    from torch.distributed.fsdp import fully_shard

    model = _model()
    fully_shard(model)
    optimizer = AdamW(model.parameters(), **HYPER)
    _train(model, optimizer, steps)
    # Lists, not tensors: a tensor would cross to the parent through shared memory the rank frees on exit.
    return {name: p.full_tensor().detach().tolist() for name, p in model.named_parameters()}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 33), torch.nn.GELU(), torch.nn.Linear(33, 5))


def _train(model, optimizer, steps):
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x = torch.randn(8, 12, generator=g)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


@pytest.mark.slow
def test_fsdp2_shards_on_two_ranks_step_as_one_process():
    """Every rank sees the same batch, so FSDP2's averaged gradient is one process's: the shards
    each rank steps make up the weights one process steps."""
    model = _model()
    _train(model, AdamW(model.parameters(), **HYPER), 3)
    for weights in run_ranks(_sharded, 2, 3):
        for name, p in model.named_parameters():
            assert rel_err(torch.tensor(weights[name]), p.detach()) <= 1e-6, name


def test_dcp_state_dict_functions_keep_the_moments_dtype():
    """What moe_ep.runs checkpoints go through: DCP's get/set_optimizer_state_dict (the first
    initialises an empty state with a zero-rate step)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model = _model()
    optimizer = AdamW(model.parameters(), **HYPER)
    before = [p.detach().clone() for p in model.parameters()]
    assert {v.dtype for s in get_optimizer_state_dict(model, optimizer)["state"].values()
            for k, v in s.items() if k != "step"} == {torch.bfloat16}
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    _train(model, optimizer, 2)
    saved = get_optimizer_state_dict(model, optimizer)
    loaded = AdamW(model.parameters(), **HYPER)
    set_optimizer_state_dict(model, loaded, saved)
    for p in model.parameters():
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded.state[p][name], optimizer.state[p][name])
            assert loaded.state[p][name].dtype == torch.bfloat16


def _saved_and_loaded(tmp_path, saving, loading):
    """A checkpoint of moe_ep.runs written with the optimizer ``saving`` makes (after 2 steps),
    loaded into a copy of the model with the one ``loading`` makes. Returns both (model, optimizer)."""
    import moe_ep

    model = _model()
    optimizer = saving(model.parameters())
    _train(model, optimizer, 2)
    path = moe_ep.save_checkpoint(tmp_path, 2, model, optimizer, {"step": 2, "world_size": 1, "data": {}}, rank=0,
                                  barrier=lambda: None, keep=1)
    other = _model()
    loaded = loading(other.parameters())
    moe_ep.load_checkpoint(path, other, loaded, rank=0, world_size=1)
    return (model, optimizer), (other, loaded)


TORCH_ADAMW = lambda **options: lambda params: torch.optim.AdamW(params, **HYPER, **options)  # noqa: E731
OURS = lambda dtype: lambda params: AdamW(params, **HYPER, moments_dtype=dtype)  # noqa: E731


@pytest.mark.parametrize("saving, loading", [
    (OURS(torch.bfloat16), TORCH_ADAMW()), (OURS(torch.float32), TORCH_ADAMW()), (TORCH_ADAMW(), OURS(torch.float32)),
    (TORCH_ADAMW(foreach=True), OURS(torch.float32))], ids=["bf16_to_torch", "fp32_to_torch", "torch_to_fp32",
                                                             "torch_foreach_to_fp32"])
def test_a_dcp_checkpoint_moves_between_this_adamw_and_torchs(tmp_path, saving, loading):
    """moe_ep.runs' checkpoints key optimizer options by name, and torch's AdamW groups carry
    options (amsgrad, maximize, ...) this one has none of: its checkpoints did not load into
    torch's ("Missing key ... amsgrad"). Both ways now, the same moments, and the next step the same
    (float32 moments both sides bit for bit; bf16 moments widen exactly)."""
    (model, optimizer), (other, loaded) = _saved_and_loaded(tmp_path, saving, loading)
    for p, q in zip(model.parameters(), other.parameters()):
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[p][name].float(), loaded.state[q][name].float())
    _train(model, optimizer, 1)
    _train(other, loaded, 1)
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("saving, said", [
    (TORCH_ADAMW(amsgrad=True), "amsgrad=True"), (TORCH_ADAMW(maximize=True), "maximize=True"),
    (lambda params: torch.optim.Adam(params, **HYPER), "decoupled_weight_decay=False")],
    ids=["amsgrad", "maximize", "adam_l2"])
def test_a_dcp_checkpoint_of_options_this_adamw_cannot_apply_is_refused(tmp_path, saving, said):
    """As its load_state_dict refuses them: DCP loaded only the options this optimizer's groups
    name, so torch's amsgrad, maximize or Adam's L2 decay were dropped silently (maximize=True then
    descended where the saved run ascended)."""
    from moe_ep.runs import UsageError

    with pytest.raises(UsageError, match=said):
        _saved_and_loaded(tmp_path, saving, OURS(torch.bfloat16))
