"""Key material for SPDK keys, from the agent's key store (dpu_agent.crypto.KeyStore).

The store keeps one 64-byte AES-256-XTS key per tenant (key || key2); SPDK's
accel_crypto_key_create takes the halves as hex. Nothing here logs or keeps the material.
"""

from __future__ import annotations

from typing import Protocol

from spdk_plugins.desired import KeyProvider, SpdkDesired

__all__ = ["keystore_provider"]


class _Store(Protocol):
    def key_for(self, tenant: str, generation: int | None = None) -> bytes: ...


def keystore_provider(desired: SpdkDesired, store: _Store) -> KeyProvider:
    """key name -> (key hex, key2 hex) from the tenant named by `[[spdk.keys]] tenant`."""
    tenants = {k.name: k.tenant or k.name for k in desired.keys}

    def provide(name: str) -> tuple[str, str]:
        if name not in tenants:
            raise KeyError(name)
        material = store.key_for(tenants[name])
        half = len(material) // 2
        return material[:half].hex(), material[half:].hex()

    return provide
