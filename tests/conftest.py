import os

import torch

# Without a GPU the Triton kernels run under the interpreter. Triton reads this variable when a
# kernel is decorated, so it must be set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _no_tf32():
    # tf32 would break the 1e-5 float32 tolerance on Ampere and Hopper.
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    yield
