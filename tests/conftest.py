import importlib.metadata
import importlib.util
import os

import torch

# Without a GPU the Triton kernels run under the interpreter. Triton reads this variable when a
# kernel is decorated, so it must be set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# ||out - ref|| / ||ref|| against a float64 reference (DESIGN.md, Conventions).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# transformers' expert-parallel registry (DistributedConfig's ep_implementation, and AllToAllEP, the
# dispatch benchmark's baseline) is recent: 5.24 has it, setup.py's floor, 5.17, has not. Looked up
# here independently of moe_ep, whose registration the tests check against it.
EP_REGISTRY_MODULE = "transformers.distributed.expert_parallel"
HAS_EP_REGISTRY = (importlib.util.find_spec("transformers.distributed") is not None
                   and importlib.util.find_spec(EP_REGISTRY_MODULE) is not None)
requires_ep_registry = pytest.mark.skipif(
    not HAS_EP_REGISTRY, reason=f"{EP_REGISTRY_MODULE} not found in transformers {importlib.metadata.version('transformers')}"
)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    denom = ref.norm()
    if denom == 0:
        return out.norm().item()
    return ((out - ref).norm() / denom).item()


@pytest.fixture(autouse=True)
def _no_tf32():
    # tf32 would break the 1e-5 float32 tolerance on Ampere and Hopper.
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    yield
