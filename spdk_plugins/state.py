"""The live SPDK state, read back through the typed client and indexed for comparison.

Key material is never kept: `accel_crypto_keys_get` answers it in clear and the client drops
it before it reaches this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from spdk_plugins.rpc import SpdkClient

__all__ = ["DISCOVERY_NQN", "LiveState", "read_live"]

DISCOVERY_NQN = "nqn.2014-08.org.nvmexpress.discovery"


@dataclass(frozen=True, slots=True, kw_only=True)
class LiveState:
    started: bool  # framework_start_init done (a target started with --wait-for-rpc is not)
    methods: frozenset[str]  # everything this build serves (rpc_get_methods)
    accel_modules: tuple[str, ...] = ()
    bdevs: dict[str, dict[str, Any]] = field(default_factory=dict)  # by bdev name
    keys: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> cipher, tweak_mode
    lvstores: dict[str, dict[str, Any]] = field(default_factory=dict)  # by lvs_name
    transports: dict[str, dict[str, Any]] = field(default_factory=dict)  # by trtype
    subsystems: dict[str, dict[str, Any]] = field(default_factory=dict)  # by NQN, no discovery
    # bdev_crypto_create configs by name, including vbdevs still waiting for their base bdev
    crypto_configs: dict[str, dict[str, Any]] = field(default_factory=dict)

    def resolve(self, name: str) -> dict[str, Any] | None:
        """A bdev by name or alias (`lvs/lvol`, a UUID), as SPDK resolves bdev names."""
        if name in self.bdevs:
            return self.bdevs[name]
        for b in self.bdevs.values():
            if name in b.get("aliases", ()):
                return b
        return None

    def bdevs_of(self, product_name: str) -> list[dict[str, Any]]:
        return [b for b in self.bdevs.values() if b.get("product_name") == product_name]

    def lvol_alias(self, bdev: dict[str, Any]) -> str | None:
        lvol = bdev.get("driver_specific", {}).get("lvol")
        if lvol is None:
            return None
        aliases = [a for a in bdev.get("aliases", ()) if "/" in a]
        return aliases[0] if aliases else None


def read_live(client: SpdkClient) -> LiveState:
    """Read what the plan compares: accel modules, bdevs, keys, lvstores, nvmf."""
    methods = frozenset(client.rpc_get_methods())
    current = frozenset(client.rpc_get_methods(current=True))
    if "bdev_get_bdevs" not in current:
        return LiveState(started=False, methods=methods)
    return LiveState(
        started=True,
        methods=methods,
        accel_modules=tuple(m["module"] for m in client.accel_get_module_info()),
        bdevs={b["name"]: b for b in client.bdev_get_bdevs()},
        keys={k["name"]: k for k in client.accel_crypto_keys_get()},
        lvstores={s["name"]: s for s in client.bdev_lvol_get_lvstores()},
        transports={t["trtype"].upper(): t for t in client.nvmf_get_transports()},
        subsystems={s["nqn"]: s for s in client.nvmf_get_subsystems() if s["nqn"] != DISCOVERY_NQN},
        crypto_configs={
            e["params"]["name"]: e["params"]
            for e in client.framework_get_config(name="bdev") or []
            if e.get("method") == "bdev_crypto_create"
        },
    )
