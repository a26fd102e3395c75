"""NVMe secrets in their interchange formats: DH-HMAC-CHAP secrets and TLS PSKs.

- `DHHC-1:hh:<base64(secret || crc32(secret))>:` (NVMe Base 2.x, DH-HMAC-CHAP secret
  representation; Linux `nvme_auth_extract_key`, nvme-cli `gen-dhchap-key`): `hh` says how the
  secret is transformed before use: 00 none, 01/02/03 HMAC-SHA-256/384/512 of the NQN followed
  by "NVMe-over-Fabrics", keyed with the secret. The secret is 32, 48 or 64 bytes; with a hash
  it must be that hash's length.
- `NVMeTLSkey-1:hh:<base64(psk || crc32(psk))>:` (NVMe/TCP TP 8011 PSK interchange format;
  nvme-cli `gen-tls-key`): the configured PSK (32 or 48 bytes). `hh` 01/02 derives the retained
  PSK with HKDF-SHA-256/384 (label "HostNQN", context the host NQN); 00 uses it as is. The TLS
  PSK is then HKDF-Expand-Label(retained, "nvme-tls-psk", identity) with the hash of the cipher
  suite (TLS_AES_128_GCM_SHA256 for 32-byte keys, TLS_AES_256_GCM_SHA384 for 48), and the PSK
  identity is `NVMe0R0<1|2> <hostnqn> <subnqn>`, as SPDK's `nvme_tcp_derive_tls_psk` does.

CRC32 is the IEEE one (zlib), appended little-endian. No I/O here; `cryptography` does the
hashing.
"""

from __future__ import annotations

import base64
import binascii
import enum
import hmac
import os
import struct
import zlib
from dataclasses import dataclass

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

__all__ = [
    "DHCHAP_PREFIX",
    "TLS_PSK_PREFIX",
    "DhchapHash",
    "DhchapSecret",
    "SecretFormatError",
    "TlsPsk",
    "hkdf_expand_label_info",
]

DHCHAP_PREFIX = "DHHC-1"
TLS_PSK_PREFIX = "NVMeTLSkey-1"
DHCHAP_SECRET_LENGTHS = (32, 48, 64)
TLS_PSK_LENGTHS = (32, 48)
SECRET_TEXT_CHARS_MAX = 256  # a 64-byte secret is 92 base64 characters; anything longer is junk
_TRANSFORM_LABEL = b"NVMe-over-Fabrics"


class SecretFormatError(ValueError):
    """A secret string is not in the interchange format (the message says what is wrong)."""


class DhchapHash(enum.IntEnum):
    """DH-HMAC-CHAP hash identifiers (the `hh` of DHHC-1 and the HashID of the protocol)."""

    NONE = 0
    SHA256 = 1
    SHA384 = 2
    SHA512 = 3

    @property
    def algorithm(self) -> hashes.HashAlgorithm:
        assert self is not DhchapHash.NONE
        return {1: hashes.SHA256(), 2: hashes.SHA384(), 3: hashes.SHA512()}[self.value]

    @property
    def digest_name(self) -> str:
        assert self is not DhchapHash.NONE
        return f"sha{(256, 384, 512)[self.value - 1]}"

    @property
    def length(self) -> int:
        """Digest length in bytes (0 for NONE)."""
        return (0, 32, 48, 64)[self.value]


def _crc(secret: bytes) -> bytes:
    return struct.pack("<I", zlib.crc32(secret) & 0xFFFFFFFF)


def _parse(text: str, prefix: str, ids: range, lengths: tuple[int, ...]) -> tuple[int, bytes]:
    """(hash id, secret) of `prefix:hh:<base64>:`, with the CRC checked."""
    text = text.strip()
    if len(text) > SECRET_TEXT_CHARS_MAX:
        raise SecretFormatError(f"{prefix} secret is longer than {SECRET_TEXT_CHARS_MAX} chars")
    parts = text.split(":")
    if len(parts) != 4 or parts[0] != prefix or parts[3] != "":
        raise SecretFormatError(f"not a {prefix}:hh:<base64>: secret")
    hh, b64 = parts[1], parts[2]
    if len(hh) != 2 or not all(c in "0123456789abcdefABCDEF" for c in hh):
        raise SecretFormatError(f"{prefix} hash id {hh!r} is not two hex digits")
    hash_id = int(hh, 16)
    if hash_id not in ids:
        raise SecretFormatError(f"{prefix} hash id {hh} is not one of {[f'{i:02}' for i in ids]}")
    try:
        raw = base64.b64decode(b64, validate=True)
    except binascii.Error as e:
        raise SecretFormatError(f"{prefix} secret is not base64: {e}") from None
    secret, crc = raw[:-4], raw[-4:]
    if len(secret) not in lengths:
        raise SecretFormatError(f"{prefix} secret is {len(secret)} bytes, not one of {lengths}")
    if _crc(secret) != crc:
        raise SecretFormatError(f"{prefix} secret fails its CRC-32 check")
    return hash_id, secret


def _format(prefix: str, hash_id: int, secret: bytes) -> str:
    return f"{prefix}:{hash_id:02x}:{base64.b64encode(secret + _crc(secret)).decode()}:"


@dataclass(frozen=True, slots=True, kw_only=True)
class DhchapSecret:
    """A DH-HMAC-CHAP secret and how it is transformed (`DHHC-1:hh:...:`)."""

    secret: bytes
    hash: DhchapHash = DhchapHash.NONE

    def __post_init__(self) -> None:
        if len(self.secret) not in DHCHAP_SECRET_LENGTHS:
            raise SecretFormatError("DH-HMAC-CHAP secret must be 32, 48 or 64 bytes")
        if self.hash is not DhchapHash.NONE and len(self.secret) != self.hash.length:
            raise SecretFormatError(
                f"a DHHC-1:{self.hash.value:02}: secret must be {self.hash.length} bytes"
            )

    @classmethod
    def parse(cls, text: str) -> DhchapSecret:
        hash_id, secret = _parse(text, DHCHAP_PREFIX, range(4), DHCHAP_SECRET_LENGTHS)
        return cls(secret=secret, hash=DhchapHash(hash_id))

    @classmethod
    def generate(cls, hash: DhchapHash = DhchapHash.NONE, length: int = 32) -> DhchapSecret:
        """A fresh random secret (os.urandom); with a hash, its length is the hash's."""
        n = hash.length if hash is not DhchapHash.NONE else length
        return cls(secret=os.urandom(n), hash=hash)

    def format(self) -> str:
        return _format(DHCHAP_PREFIX, self.hash.value, self.secret)

    def __str__(self) -> str:
        return self.format()

    def __repr__(self) -> str:  # never print the secret
        return f"DhchapSecret(hash={self.hash.name}, length={len(self.secret)})"

    def transformed(self, nqn: str) -> bytes:
        """The key used by the protocol: the secret, or HMAC(secret, nqn || "NVMe-over-Fabrics")."""
        if self.hash is DhchapHash.NONE:
            return self.secret
        data = nqn.encode() + _TRANSFORM_LABEL
        return hmac.new(self.secret, data, self.hash.digest_name).digest()


def hkdf_expand_label_info(length: int, label: str, context: bytes) -> bytes:
    """The HkdfLabel of RFC 8446 7.1 (uint16 length, "tls13 "+label, context), as SPDK builds it."""
    full = b"tls13 " + label.encode()
    assert len(full) < 256 and len(context) < 256, (label, len(context))
    return struct.pack(">HB", length, len(full)) + full + bytes([len(context)]) + context


def _hkdf(algorithm: hashes.HashAlgorithm, key: bytes, info: bytes) -> bytes:
    """HKDF-Extract (empty salt) then HKDF-Expand to the hash's length (OpenSSL's EVP HKDF
    in its default mode, which SPDK uses)."""
    return HKDF(algorithm=algorithm, length=algorithm.digest_size, salt=None, info=info).derive(key)


@dataclass(frozen=True, slots=True, kw_only=True)
class TlsPsk:
    """A configured TLS PSK in the interchange format (`NVMeTLSkey-1:hh:...:`)."""

    psk: bytes
    hash: DhchapHash = DhchapHash.SHA256  # 1: retained PSK by HKDF-SHA-256, 2: SHA-384, 0: none

    def __post_init__(self) -> None:
        if self.hash not in (DhchapHash.NONE, DhchapHash.SHA256, DhchapHash.SHA384):
            raise SecretFormatError("a TLS PSK's hash is 00, 01 (SHA-256) or 02 (SHA-384)")
        if len(self.psk) not in TLS_PSK_LENGTHS:
            raise SecretFormatError("a TLS PSK is 32 or 48 bytes")
        if self.hash is not DhchapHash.NONE and len(self.psk) != self.hash.length:
            raise SecretFormatError(
                f"a NVMeTLSkey-1:{self.hash.value:02}: PSK must be {self.hash.length} bytes"
            )

    @classmethod
    def parse(cls, text: str) -> TlsPsk:
        hash_id, psk = _parse(text, TLS_PSK_PREFIX, range(3), TLS_PSK_LENGTHS)
        return cls(psk=psk, hash=DhchapHash(hash_id))

    @classmethod
    def generate(cls, hostnqn: str, subnqn: str, hash: DhchapHash = DhchapHash.SHA256) -> TlsPsk:
        """A fresh random PSK for this host on this subsystem, drawn again while its derived
        TLS PSK begins with a zero byte (`spdk_takes_for_none`): 1 draw in 256."""
        n = hash.length if hash is not DhchapHash.NONE else 32
        while True:
            psk = cls(psk=os.urandom(n), hash=hash)
            if not psk.spdk_takes_for_none(hostnqn, subnqn):
                return psk

    def spdk_takes_for_none(self, hostnqn: str, subnqn: str) -> bool:
        """Whether SPDK's initiator would connect without TLS with this key: its nvme_tcp.c
        picks the ssl socket by `psk[0]` of the derived TLS PSK, so one whose first byte is
        0x00 (1 key in 256 for a given host and subsystem) is taken for no key and the host
        sends a plaintext ICReq, which a secure-channel target refuses (measured with SPDK
        v26.05's bdevperf; docs/NVME_AUTH.md)."""
        return self.tls_psk(hostnqn, subnqn)[0] == 0

    def format(self) -> str:
        return _format(TLS_PSK_PREFIX, self.hash.value, self.psk)

    def __str__(self) -> str:
        return self.format()

    def __repr__(self) -> str:
        return f"TlsPsk(hash={self.hash.name}, length={len(self.psk)})"

    @property
    def cipher_hash(self) -> DhchapHash:
        """SHA256 (TLS_AES_128_GCM_SHA256) for 32-byte PSKs, SHA384 (TLS_AES_256_GCM_SHA384)."""
        return DhchapHash.SHA256 if len(self.psk) == 32 else DhchapHash.SHA384

    @property
    def cipher_suite(self) -> str:
        return "TLS_AES_128_GCM_SHA256" if len(self.psk) == 32 else "TLS_AES_256_GCM_SHA384"

    def identity(self, hostnqn: str, subnqn: str) -> str:
        """The TLS PSK identity (TP 8011, version 0): `NVMe0R0h <hostnqn> <subnqn>`."""
        return f"NVMe0R0{self.cipher_hash.value} {hostnqn} {subnqn}"

    def retained(self, hostnqn: str) -> bytes:
        """The retained PSK: HKDF-Expand-Label(HKDF-Extract(0, psk), "HostNQN", hostnqn)."""
        if self.hash is DhchapHash.NONE:
            return self.psk
        info = hkdf_expand_label_info(len(self.psk), "HostNQN", hostnqn.encode())
        return _hkdf(self.hash.algorithm, self.psk, info)

    def tls_psk(self, hostnqn: str, subnqn: str) -> bytes:
        """The PSK TLS 1.3 uses for this host and subsystem (the "derived" PSK)."""
        retained = self.retained(hostnqn)
        ident = self.identity(hostnqn, subnqn).encode()
        info = hkdf_expand_label_info(len(retained), "nvme-tls-psk", ident)
        return _hkdf(self.cipher_hash.algorithm, retained, info)


def parse_identity(identity: str) -> tuple[int, str, str]:
    """(cipher hash id, hostnqn, subnqn) of a `NVMe0R0h <hostnqn> <subnqn>` PSK identity."""
    parts = identity.split(" ")
    if len(parts) != 3 or not parts[0].startswith("NVMe0R0") or parts[0][-1] not in "12":
        raise SecretFormatError(f"PSK identity {identity[:64]!r} is not NVMe0R0h <host> <subsys>")
    return int(parts[0][-1]), parts[1], parts[2]
