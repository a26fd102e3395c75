"""Loading NIXL: the one place that knows the package names and what a failed load means.

NIXL ships as ``nixl`` (a meta package that pulls CUDA torch) or ``nixl-cu12`` / ``nixl-cu13``
(the wheels themselves, importable as ``nixl_cu12``); ``pip install --no-deps nixl-cu12`` is
enough for host memory over UCX (TCP or shared memory without an RDMA device, verbs with one).
A missing or broken install is an operating condition, not a bug: `load_nixl` raises
NixlUnavailable with the reason, which callers log once and then use NVMe/TCP.
"""

from __future__ import annotations

import importlib
import threading
from types import ModuleType
from typing import Any

__all__ = ["NIXL_MODULES", "NixlUnavailable", "load_nixl", "nixl_status"]

# Tried in order: the CUDA 12 wheel (what the `nixl` extra installs), CUDA 13, the meta package.
NIXL_MODULES = ("nixl_cu12", "nixl_cu13", "nixl._api")

_lock = threading.Lock()
_loaded: ModuleType | None = None
_failure: str | None = None


class NixlUnavailable(Exception):
    """NIXL cannot be used here; the message says why and what to install."""


def load_nixl() -> ModuleType:
    """The NIXL module (``nixl_agent``, ``nixl_agent_config``), or NixlUnavailable.

    Tried once per process: a failure is remembered so the data path never retries an import
    per call.
    """
    global _loaded, _failure
    with _lock:
        if _loaded is not None:
            return _loaded
        if _failure is not None:
            raise NixlUnavailable(_failure)
        problems = []
        for name in NIXL_MODULES:
            try:
                mod = importlib.import_module(name)
            except ImportError as e:  # not installed, or a shared library missing
                problems.append(f"{name}: {e}")
                continue
            except Exception as e:  # a broken install (bad wheel, ABI mismatch)
                problems.append(f"{name}: {type(e).__name__}: {e}")
                continue
            if hasattr(mod, "nixl_agent") and hasattr(mod, "nixl_agent_config"):
                _loaded = mod
                return mod
            problems.append(f"{name}: no nixl_agent in the module")
        _failure = (
            "NIXL is not installed or failed to load ("
            + "; ".join(problems)
            + "); install it with `pip install --no-deps nixl-cu12` (the `nixl` extra)"
        )
        raise NixlUnavailable(_failure)


def nixl_status() -> dict[str, Any]:
    """{available, module, reason} for hello replies and `dpuctl doctor`."""
    try:
        mod = load_nixl()
    except NixlUnavailable as e:
        return {"available": False, "module": "", "reason": str(e)}
    return {"available": True, "module": mod.__name__, "reason": ""}


def _forget_for_tests() -> None:
    """Reset the remembered outcome (tests that hide the package)."""
    global _loaded, _failure
    with _lock:
        _loaded, _failure = None, None
