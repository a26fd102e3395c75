"""Loading NIXL: the one place that knows the package names and what a failed load means.

NIXL ships as ``nixl`` (a meta package that pulls CUDA torch) or ``nixl-cu12`` / ``nixl-cu13``
(the wheels themselves, importable as ``nixl_cu12``); ``pip install --no-deps nixl-cu12`` is
enough for host memory over UCX (TCP or shared memory without an RDMA device, verbs with one).
A missing or broken install is an operating condition, not a bug: `load_nixl` raises
NixlUnavailable with the reason, which callers log once and then use NVMe/TCP.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

from host_shim.rdma._select import ROCE_PRIORITY_DEFAULT, RdmaRefused, select_rdma

__all__ = [
    "NIXL_MODULES",
    "PROGRESS_DELAY_US",
    "UCX_MODULES_DEFAULT",
    "NixlUnavailable",
    "load_nixl",
    "new_agent",
    "nixl_status",
]

# Tried in order: the CUDA 12 wheel (what the `nixl` extra installs), CUDA 13, the meta package.
NIXL_MODULES = ("nixl_cu12", "nixl_cu13", "nixl._api")

# NIXL's progress thread waits this long between polls. The Python API fixes it at 0, which
# spins: ~0.45 of a core on an idle host (measured); 10-100 us all cost ~0.02 core idle, and
# 10 us kept gets and puts faster than 100 us in the same benchmark run.
PROGRESS_DELAY_US = 10
# UCX modules left out unless the environment says otherwise: nixl-cu12's EFA module (AWS
# only) links the system libnl-route-3 beside the wheel's own copy; with rdma-core installed
# both register the same handlers and the process segfaults in libnl's destructor at exit.
UCX_MODULES_DEFAULT = "^efa"
# The address whose RDMA port UCX must use (the RoCE netdev's address) and its PFC priority:
# set, NIXL starts only on a port fit for RDMA, with UCX_NET_DEVICES and UCX_IB_GID_INDEX
# chosen for it (host_shim.rdma.select_rdma); unset, UCX picks devices itself (TCP here).
RDMA_ADDRESS_ENV, ROCE_PRIORITY_ENV = "DPUKV_RDMA_ADDRESS", "DPUKV_ROCE_PRIORITY"

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
                _route_nixl_logs()
                _loaded = mod
                return mod
            problems.append(f"{name}: no nixl_agent in the module")
        _failure = (
            "NIXL is not installed or failed to load ("
            + "; ".join(problems)
            + "); install it with `pip install --no-deps nixl-cu12` (the `nixl` extra)"
        )
        raise NixlUnavailable(_failure)


def _route_nixl_logs() -> None:
    """NIXL's import configures its `nixl` logger with its own handler on stdout, at INFO
    (nixl_cu12/logging.py), so "Backend UCX was instantiated" lines landed in the middle of
    `dpuctl bench datapath --json` output. Its records go through the root logger instead:
    stderr, at the level the process configured (NIXL_LOG_LEVEL still sets NIXL's own)."""
    logger = logging.getLogger("nixl")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    logger.propagate = True
    if not os.environ.get("NIXL_LOG_LEVEL"):
        logger.setLevel(logging.NOTSET)


def select_ucx_rdma(sysfs: Path = Path("/sys")) -> dict[str, str]:
    """With DPUKV_RDMA_ADDRESS set: the device, port and RoCE v2 GID index for it, put into
    UCX's environment (read when UCX starts; an operator's own UCX_NET_DEVICES or
    UCX_IB_GID_INDEX wins); NixlUnavailable when the port is down, not Ethernet or without PFC
    on the RoCE priority, so callers fall back instead of running RDMA on a lossy port."""
    address = os.environ.get(RDMA_ADDRESS_ENV, "").strip()
    if not address:
        return {}
    try:
        prio = int(os.environ.get(ROCE_PRIORITY_ENV, str(ROCE_PRIORITY_DEFAULT)))
        sel = select_rdma(address, roce_priority=prio, sysfs=sysfs)
    except (ValueError, RdmaRefused) as e:
        raise NixlUnavailable(f"RDMA transport refused for {address}: {e}") from None
    env = sel.ucx_env()
    for key, value in env.items():
        os.environ.setdefault(key, value)
    logging.getLogger("host_shim.transport").info(
        "nixl: UCX on %s:%d GID index %d (%s)", sel.device, sel.port, sel.gid_index, address
    )
    return env


def new_agent(name: str, *, progress_thread: bool) -> Any:
    """A NIXL agent on UCX; with `progress_thread`, the thread polls every PROGRESS_DELAY_US.

    nixl_agent's constructor sets the delay to 0 with no parameter for it, so the binding's
    agent constructor is wrapped for the duration of this call (under a lock) to set it.
    """
    nixl = load_nixl()
    os.environ.setdefault("UCX_MODULES", UCX_MODULES_DEFAULT)  # read when UCX starts
    select_ucx_rdma()
    config = nixl.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
    api = sys.modules[nixl.nixl_agent.__module__]
    bind = getattr(api, "nixlBind", None)
    if not progress_thread or bind is None or not hasattr(bind, "nixlAgent"):
        return nixl.nixl_agent(name, config)
    real = bind.nixlAgent

    def with_delay(agent_name: str, cfg: Any) -> Any:
        cfg.pthrDelay = PROGRESS_DELAY_US
        return real(agent_name, cfg)

    with _lock:
        bind.nixlAgent = with_delay
        try:
            return nixl.nixl_agent(name, config)
        finally:
            bind.nixlAgent = real


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
