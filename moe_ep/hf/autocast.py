"""The dtype autocast gives a matmul, for the code that must reproduce ``F.linear``'s behaviour
under autocast by hand: our custom ops and fused routers get no autocast of their own."""

from __future__ import annotations

import torch


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The autocast dtype on ``device``'s type, None outside autocast (and on a device type
    autocast does not know, such as meta: a model traced there for its shapes)."""
    if device.type == "meta":
        return None
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None
