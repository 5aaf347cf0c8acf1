"""The planner under compiled dense blocks (``plan(compiled_blocks=True)``, ``--compile-blocks``).

The bytes per element its compiled regions move (``moe_ep.planner.compute.COMPILED_*``) are
counted again here the way they were found: transformers' own modules (RMSNorm, attention with and
without q/k norms, the SwiGLU MLP) compiled by Inductor on the CPU, their fused kernels' reads and
writes summed by Inductor's ``GraphLowering.count_bytes`` (GEMMs and the attention kernel left
out), forward and backward, at a shape none of the constants was fitted on. The search then keeps
to the recompute policies compiled blocks run with, and says so when another is asked for."""

from __future__ import annotations

import contextlib

import pytest
import torch

from moe_ep.planner import compute, plan
from moe_ep.planner.activations import MicroBatch
from moe_ep.planner.recompute import COMPILED_BLOCKS_POLICIES, RECOMPUTE_POLICIES
from moe_ep.planner.spec import ModelSpec

T = 384  # tokens of the counted shapes
TOLERANCE = 0.12  # the constants are fitted over three shapes each; a new one lands within this


def inductor_bytes(fn, x: torch.Tensor) -> tuple[int, int, int]:
    """(forward, backward) bytes the fused (non-extern) kernels of ``fn``'s compiled graphs move,
    and the bytes autograd saves in the compiled forward (:func:`saving`)."""
    import torch._inductor.graph as graph
    from torch._inductor.scheduler import ExternKernelSchedulerNode

    counted = []
    count_bytes = graph.GraphLowering.count_bytes

    def fused_bytes(self):
        counted.append(sum(node.get_read_write_buffers_sizes() for node in self.scheduler.nodes
                           if not isinstance(node, ExternKernelSchedulerNode)))
        return count_bytes(self)

    torch._dynamo.reset()
    graph.GraphLowering.count_bytes = fused_bytes
    torch._logging.set_logs(inductor_metrics=True)  # Inductor counts only while its metrics log is on
    try:
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            with saving(x) as saved:
                out = torch.compile(fn, fullgraph=True)(x)
            out.backward(torch.ones_like(out))
    finally:
        graph.GraphLowering.count_bytes = count_bytes
        torch._logging.set_logs()
        torch._dynamo.reset()
    forward, backward = counted
    return forward, backward, sum(saved.values())


def hidden(H: int) -> torch.Tensor:
    return torch.randn(1, T, H, dtype=torch.bfloat16, requires_grad=True)


def attention(family: str, H: int, heads: int, kv_heads: int, head_dim: int):
    import importlib

    from transformers import AutoConfig

    config = AutoConfig.for_model(family, hidden_size=H, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                  head_dim=head_dim, num_hidden_layers=1)
    config._attn_implementation = "sdpa"
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    prefix = {"qwen3_moe": "Qwen3Moe", "mixtral": "Mixtral"}[family]
    module = getattr(modeling, f"{prefix}Attention")(config, 0).to(torch.bfloat16)
    cos, sin = getattr(modeling, f"{prefix}RotaryEmbedding")(config)(hidden(H), torch.arange(T)[None])
    return lambda x: module(x, (cos, sin), None)[0]


def close(counted: float, planned: float) -> bool:
    return abs(counted - planned) <= TOLERANCE * counted


H = 768  # hidden size of the counted regions
HEADS, KV_HEADS, HEAD_DIM = 6, 2, 128
MLP_WIDTH = 1536


def regions() -> dict:
    """transformers' modules as compiled blocks hold them: RMSNorm, attention with q/k norms
    (Qwen3-MoE) and without (Mixtral), the SwiGLU MLP."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeMLP, Qwen3MoeRMSNorm
    from transformers import Qwen3MoeConfig

    return {"norm": Qwen3MoeRMSNorm(H).to(torch.bfloat16),
            "attention, q/k norms": attention("qwen3_moe", H, HEADS, KV_HEADS, HEAD_DIM),
            "attention": attention("mixtral", H, HEADS, KV_HEADS, HEAD_DIM),
            "mlp": Qwen3MoeMLP(Qwen3MoeConfig(hidden_size=H), intermediate_size=MLP_WIDTH).to(torch.bfloat16)}


@pytest.fixture(scope="module")
def compiled_regions() -> dict:
    """Each region compiled by Inductor once, for both tests below (a compile is seconds on the
    CPU): (forward bytes, backward bytes, bytes saved for the backward)."""
    return {name: inductor_bytes(fn, hidden(H)) for name, fn in regions().items()}


@pytest.mark.slow
def test_the_compiled_regions_move_what_inductor_counts(compiled_regions):
    forward, backward, _ = compiled_regions["norm"]
    planned = compute.COMPILED_NORM
    assert close(forward, planned[0] * T * H) and close(backward, planned[1] * T * H), (forward, backward)

    for family, qk_norm in (("qwen3_moe", True), ("mixtral", False)):
        forward, backward, _ = compiled_regions["attention, q/k norms" if qk_norm else "attention"]
        width = (HEADS + KV_HEADS) * HEAD_DIM
        f, b = compute.COMPILED_ATTENTION[qk_norm]
        assert close(forward, f * T * width), (family, forward / T / width)
        assert close(backward, b * T * width + compute.COMPILED_INPUT_GRADIENT * T * H), (family, backward / T)

    width = MLP_WIDTH
    forward, backward, _ = compiled_regions["mlp"]
    f, b = compute.COMPILED_SWIGLU
    assert close(forward, f * T * width), forward / T / width
    assert close(backward, b * T * width + compute.COMPILED_INPUT_GRADIENT * T * H), backward / T


@pytest.mark.parametrize("model", ["mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3"])
def test_compiled_layers_move_fewer_bytes_and_keep_the_eager_rest(model):
    spec = ModelSpec.resolve(model)
    mb = MicroBatch(2, 4096)
    for layer in sorted({0, spec.num_layers - 1}):  # a dense first layer where the model has one
        eager = compute.layer_traffic(spec, layer, mb, 1, None)
        compiled = compute.layer_traffic(spec, layer, mb, 1, None, compiled=True)
        assert eager[1] == compute.MEMORY_BACKWARD * eager[0]
        assert compiled[0] < eager[0] and compiled[1] < eager[1]
        # What stays eager (the residual adds, the router's softmax and top-k, the combine) is
        # still counted: more than the residual adds alone.
        assert compiled[0] > 2 * compute.RESIDUAL * spec.hidden_size * mb.tokens


def test_the_planner_keeps_to_the_policies_compiled_blocks_run_with():
    from moe_ep.parallel.compile import _UNCOMPILABLE_RECOMPUTE

    assert set(COMPILED_BLOCKS_POLICIES) == set(RECOMPUTE_POLICIES) - set(_UNCOMPILABLE_RECOMPUTE)
    kwargs = dict(nodes=1, cluster="dgx-h100", seq_len=4096, global_batch_tokens=8 * 16 * 4 * 4096, ep=8,
                  dp_shard=8, pp=1, microbatch_size=4, chunked_loss=True)
    eager, compiled = plan("qwen3-30b-a3b", **kwargs), plan("qwen3-30b-a3b", compiled_blocks=True, **kwargs)
    assert compiled.layout.checkpointing in COMPILED_BLOCKS_POLICIES
    assert all(c.layout.checkpointing in COMPILED_BLOCKS_POLICIES for c, _ in compiled.alternatives)
    assert eager.layout.checkpointing == compiled.layout.checkpointing == "full"  # the only one that fits
    memory_bound = "memory-bound kernels (incl. optimizer)"
    assert dict(compiled.best.time.rows())[memory_bound] < 0.6 * dict(eager.best.time.rows())[memory_bound]
    assert compiled.best.memory.total == eager.best.memory.total  # activations planned as eager's
    assert compiled.to_dict()["assumptions"]["compiled_blocks"] is True
    assert "dense blocks compiled" in compiled.report()
    with pytest.raises(ValueError, match=r"checkpointing='selective' does not run with compiled_blocks=True"):
        plan("qwen3-30b-a3b", compiled_blocks=True, checkpointing="selective", **kwargs)
    with pytest.raises(TypeError, match="compiled_blocks must be True or False"):
        plan("qwen3-30b-a3b", compiled_blocks=1, **kwargs)


@contextlib.contextmanager
def saving(x: torch.Tensor):
    """The distinct storages autograd saves inside the block (storage -> bytes), ``x``'s own left
    out, filled in as the block ends."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield storages
    storages.pop(x.untyped_storage().data_ptr(), None)


def saved_bytes(fn, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves in ``fn(x)``, ``x``'s own left out."""
    with saving(x) as storages:
        fn(x)
    return sum(storages.values())


@pytest.mark.slow
def test_compiled_regions_save_no_more_than_eager_so_eager_activations_bound_them(compiled_regions):
    for name, fn in regions().items():
        eager = saved_bytes(fn, hidden(H))
        compiled = compiled_regions[name][2]  # saved by the forward of the compile counted above
        assert 0 < eager and compiled <= eager, (name, compiled, eager)
