"""What a test needs from the machine or the installed packages, as pytest skip markers."""

import importlib.metadata
import importlib.util

import pytest
import torch

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
