"""The transformers versions this integration is written against, checked before anything touches
transformers: the routers' return values and the experts registry changed shape before 5.17
(e.g. Mixtral's router returned probabilities as its logits), so an older version is refused
rather than patched with the wrong semantics. Newer versions are not refused by number: the fused
routers were read from 5.17-5.23, and ``patch(fused_router=True)`` checks each router class
against the installed version's own forward on a probe input before patching it
(``moe_ep.hf.routers.verify_fused_router``), so a release whose router semantics changed is
refused with an error naming the class and the version."""

from __future__ import annotations

MIN_TRANSFORMERS_VERSION = "5.17.0"


def require_transformers():
    """Import and return ``transformers``, or raise ImportError saying which version is needed."""
    try:
        import transformers
    except ImportError as err:
        raise ImportError(
            f"moe_ep's Hugging Face integration needs transformers>={MIN_TRANSFORMERS_VERSION}, "
            "which is not installed (pip install 'transformers>=5.17')"
        ) from err
    from packaging.version import Version

    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS_VERSION):
        raise ImportError(
            f"moe_ep's Hugging Face integration needs transformers>={MIN_TRANSFORMERS_VERSION}, "
            f"found transformers=={transformers.__version__}"
        )
    return transformers
