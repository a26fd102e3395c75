"""The credentials file a GPU server gets from `dpuctl hosts enrol` on the DPU.

One JSON object, 0600, read by the vLLM connector (``kv_connector_extra_config.credentials_file``)
and the LMCache connector (``extra_config: dpukv.credentials_file``) instead of separate
control/tenant/token/salt settings (docs/DEPLOY.md):

    {"version": 1, "control": ["tcp://192.0.2.10:7400"], "tenant": "acme",
     "token": "...", "salt": "<32-128 hex digits>",
     "control_ca": "<PEM, when the control listener has TLS>", "nvmf": "192.0.2.10:4420",
     "hostnqn": "...", "subnqn": "...", "dhchap_key": "DHHC-1:...", "psk": "NVMeTLSkey-1:..."}

The last four are there when the host was enrolled with its NQN (a kernel initiator's keys).
"""

from __future__ import annotations

import json
import re
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from host_shim.control import client_tls_context, parse_client_url
from kvproto.files import read_small_file

__all__ = ["CREDENTIALS_VERSION", "SALT_HEX_RE", "Credentials", "load_credentials", "parse_salt"]

CREDENTIALS_VERSION = 1
# 16 to 64 bytes: BLAKE2b's key limit is 64; under 16 the per-tenant key space is guessable.
SALT_HEX_RE = re.compile(r"[0-9a-fA-F]{32,128}")
_KERNEL_KEYS = ("hostnqn", "subnqn", "dhchap_key", "psk")
CREDENTIALS_BYTES_MAX = 64 << 10  # a token, a salt, a CA certificate and keys: a few KiB


def parse_salt(text: str) -> bytes:
    """A salt file's or setting's text: 32 to 128 hex digits (even count), whitespace around."""
    s = text.strip()
    if not SALT_HEX_RE.fullmatch(s) or len(s) % 2:
        raise ValueError("the salt must be an even number of 32 to 128 hex digits")
    return bytes.fromhex(s)


@dataclass(frozen=True, slots=True, kw_only=True)
class Credentials:
    control: tuple[str, ...]
    tenant: str
    token: str
    salt: bytes
    control_ca: str = ""
    nvmf: str = ""  # HOST:PORT of the tenant's NVMe/TCP listener (a kernel initiator's)
    hostnqn: str = ""
    subnqn: str = ""
    dhchap_key: str = ""
    psk: str = ""

    @property
    def client_url(self) -> str:
        """KVClient's URL: the one agent, or (several URLs) the seeds of a cluster."""
        return self.control[0] if len(self.control) == 1 else ",".join(self.control)

    def tls_context(self) -> ssl.SSLContext | None:
        """The context that verifies the agents against `control_ca` (None without one)."""
        return client_tls_context(self.control_ca) if self.control_ca else None


def load_credentials(path: str | Path) -> Credentials:
    """The credentials in `path`; ValueError naming the file and what is wrong."""
    p = Path(path)
    try:
        raw = read_small_file(p, CREDENTIALS_BYTES_MAX)  # a FIFO in its place blocked open()
    except OSError as e:
        raise ValueError(f"credentials file {p}: {e.strerror}") from None
    if len(raw) > CREDENTIALS_BYTES_MAX:
        raise ValueError(f"credentials file {p}: over {CREDENTIALS_BYTES_MAX} bytes")
    try:
        data: Any = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        msg = f"credentials file {p}: not JSON (write it with dpuctl hosts enrol)"
        raise ValueError(msg) from None
    if not isinstance(data, dict) or data.get("version") != CREDENTIALS_VERSION:
        raise ValueError(f'credentials file {p}: needs "version": {CREDENTIALS_VERSION}')
    control = data.get("control")
    if isinstance(control, str):
        control = [control]
    if not isinstance(control, list) or not control or not all(isinstance(c, str) for c in control):
        raise ValueError(f'credentials file {p}: "control" must be a list of control URLs')
    out: dict[str, str] = {}
    for key in ("tenant", "token", "salt", "control_ca", "nvmf", *_KERNEL_KEYS):
        value = data.get(key, "")
        if not isinstance(value, str):
            raise ValueError(f"credentials file {p}: {key!r} must be a string")
        if key in ("tenant", "token", "salt") and not value:
            raise ValueError(f"credentials file {p}: {key!r} is missing")
        out[key] = value
    try:
        salt = parse_salt(out.pop("salt"))
    except ValueError as e:
        raise ValueError(f"credentials file {p}: {e}") from None
    creds = Credentials(control=tuple(control), salt=salt, **out)
    try:
        parse_client_url(creds.client_url)  # a garbage URL fails here, not at the first call
    except ValueError as e:
        raise ValueError(f"credentials file {p}: {e}") from None
    try:
        creds.tls_context()  # a CA that does not load fails here, naming the file, not mid-connect
    except ssl.SSLError as e:
        msg = f"credentials file {p}: control_ca is not a PEM certificate ({e.reason or e})"
        raise ValueError(msg) from None
    return creds
