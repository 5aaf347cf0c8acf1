"""moe_ep: Mixture-of-Experts kernels and expert parallelism for PyTorch.

Importing it registers, when a recent enough transformers is installed, the ``"moe_ep"`` experts
implementation (``experts_implementation="moe_ep"``) and transformers' expert-parallel entry
``ep_implementation="moe_ep"``. It patches no model or class: ``patch(model)`` does that, on
request."""

from .dispatch import register_transformers_ep as _register_transformers_ep
from .experts import moe_experts
from .hf import patch
from .hf import register_if_installed as _register_experts_implementation
from .parallel import parallelize
from .planner import plan
from .routing import route_topk
from .training import NonFiniteStepsError

__all__ = ["NonFiniteStepsError", "moe_experts", "parallelize", "patch", "plan", "route_topk"]
__version__ = "0.1.0"

if _register_experts_implementation():
    _register_transformers_ep()
