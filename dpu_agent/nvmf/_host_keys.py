"""What a host must prove on a subsystem (`HostKeys`), the key file's format, and the hash that
logs print instead of a host NQN. The queue's authentication is nvmf/_auth.py; the keys the
agent issues are nvmf/_keys.py; TLS is nvmf/_tls.py: all of them need these.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

from kvproto.nvme import DhchapSecret, TlsPsk

__all__ = ["HostKeys", "host_keys_from_dict", "host_keys_to_dict", "load_host_keys", "nqn_hash"]


@dataclass(frozen=True, slots=True, kw_only=True)
class HostKeys:
    """What a host must prove on a subsystem: DH-HMAC-CHAP key, optional controller key
    (bidirectional authentication), optional TLS PSK (secure channel)."""

    dhchap_key: DhchapSecret | None = None
    dhchap_ctrlr_key: DhchapSecret | None = None
    psk: TlsPsk | None = None

    def __post_init__(self) -> None:
        if self.dhchap_ctrlr_key is not None and self.dhchap_key is None:
            raise ValueError("a controller key needs a host key (bidirectional authentication)")

    def __repr__(self) -> str:
        return (
            f"HostKeys(dhchap={self.dhchap_key is not None}, "
            f"ctrlr={self.dhchap_ctrlr_key is not None}, psk={self.psk is not None})"
        )


def load_host_keys(path: str | os.PathLike[str]) -> dict[str, HostKeys]:
    """`{hostnqn: {"dhchap_key": "DHHC-1:..", "dhchap_ctrlr_key": .., "psk": "NVMeTLSkey-1:.."}}`
    from a JSON file only its owner may read (the file holds secrets)."""
    st = os.stat(path)
    if st.st_mode & 0o077:
        raise ValueError(f"{path}: key file must not be readable by others (chmod 600)")
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    return {host: host_keys_from_dict(v) for host, v in raw.items()}


def host_keys_from_dict(v: dict[str, str]) -> HostKeys:
    def get(name: str) -> str | None:
        return v.get(name) or None

    key, ckey, psk = get("dhchap_key"), get("dhchap_ctrlr_key"), get("psk")
    return HostKeys(
        dhchap_key=DhchapSecret.parse(key) if key else None,
        dhchap_ctrlr_key=DhchapSecret.parse(ckey) if ckey else None,
        psk=TlsPsk.parse(psk) if psk else None,
    )


def host_keys_to_dict(k: HostKeys) -> dict[str, str]:
    out = {}
    if k.dhchap_key is not None:
        out["dhchap_key"] = k.dhchap_key.format()
    if k.dhchap_ctrlr_key is not None:
        out["dhchap_ctrlr_key"] = k.dhchap_ctrlr_key.format()
    if k.psk is not None:
        out["psk"] = k.psk.format()
    return out


def nqn_hash(nqn: str) -> str:
    """What logs say instead of a host NQN (stable, not reversible)."""
    return hashlib.sha256(nqn.encode()).hexdigest()[:16]
