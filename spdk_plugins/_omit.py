"""SPDK's "None means omit", in one place for the RPC client and the plan/boot-config calls."""

from __future__ import annotations

from typing import Any

__all__ = ["omit_none"]


def omit_none(**params: Any) -> dict[str, Any]:
    """Request params with every None left out (SPDK then applies its own default); 0, False
    and "" are values and are sent."""
    return {k: v for k, v in params.items() if v is not None}
