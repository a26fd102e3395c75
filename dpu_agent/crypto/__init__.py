"""Encryption at rest: AES-XTS as SPDK's crypto vbdev does it, per-tenant keys, and a block
device wrapper that keeps only ciphertext on the tier below.

The names below load on first use (PEP 562) rather than at package import: the build command
`python -m dpu_agent.crypto._build` runs inside this package before the compiled sector loop
exists. `XtsCipher` and `CryptoBlockDevice` need that loop and raise an ImportError naming the
build command when it is missing or stale; `KeyStore` does not need it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dpu_agent.crypto.blockdev import SCRATCH_BYTES_MAX, CryptoBlockDevice
    from dpu_agent.crypto.keystore import KeyStore, KeyStoreError, env_var_name
    from dpu_agent.crypto.xts import XTS_KEY_BYTES, XtsCipher, available_implementations

__all__ = [
    "SCRATCH_BYTES_MAX",
    "XTS_KEY_BYTES",
    "CryptoBlockDevice",
    "KeyStore",
    "KeyStoreError",
    "XtsCipher",
    "available_implementations",
    "env_var_name",
]

_MODULE_OF = {
    "SCRATCH_BYTES_MAX": "blockdev",
    "CryptoBlockDevice": "blockdev",
    "KeyStore": "keystore",
    "KeyStoreError": "keystore",
    "env_var_name": "keystore",
    "XTS_KEY_BYTES": "xts",
    "XtsCipher": "xts",
    "available_implementations": "xts",
}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'dpu_agent.crypto' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"dpu_agent.crypto.{module}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
