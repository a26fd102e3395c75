"""Per-tenant AES-XTS keys from a key file or the environment, with rotation by generation.

Key file (JSON, mode 0600, refused when group- or world-accessible):
`{"tenant": [{"generation": 1, "key": "<128 hex chars>", "check": "<16 hex>"}, ...], ...}`
(`check`: the key's check value, verified at load; files without it are accepted). A new
tenant gets a random key on first use; `rotate` appends a generation and keeps the old ones,
so data written under them stays readable until it is rewritten. Every change is written to a
temporary file in the same directory and renamed over the old one (a crash leaves the old or
the new file, never half of one).

Environment: `DPUKV_XTS_KEY_<TENANT>` (tenant upper-cased, every non-alphanumeric character
turned into `_`) holds 128 hex characters and takes precedence over the file; its generation
is `DPUKV_XTS_GEN_<TENANT>` (default 1). Environment keys are rotated where they are set.

Key bytes are never logged, never in a repr and never in an exception message.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import stat
import tempfile
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from dpu_agent.files import open_regular
from dpu_agent.log import get_logger
from kvproto.control import TENANTS_MAX

__all__ = [
    "ENV_GENERATION_PREFIX",
    "ENV_KEY_PREFIX",
    "KeyStore",
    "KeyStoreError",
    "env_var_name",
]

XTS_KEY_BYTES = 64  # AES-256-XTS: two distinct 256-bit keys, key || key2 (owner of the size)
ENV_KEY_PREFIX = "DPUKV_XTS_KEY_"
ENV_GENERATION_PREFIX = "DPUKV_XTS_GEN_"
# Bounds that keep the key file small and a typo from growing it without end.
GENERATIONS_MAX = 256  # rotations kept per tenant; data older than that must be rewritten
TENANT_NAME_CHARS_MAX = 128
KEY_FILE_BYTES_MAX = 4 << 20  # TENANTS_MAX * a few generations of ~160-byte entries

_KEY_HEX_CHARS = XTS_KEY_BYTES * 2
_HEX_RE = re.compile(r"[0-9a-fA-F]+")

log = get_logger(__name__)


class KeyStoreError(Exception):
    """A key file or key variable that cannot be used, or an unknown tenant or generation."""


def env_var_name(tenant: str) -> str:
    """`DPUKV_XTS_KEY_<TENANT>`: upper case, each non-alphanumeric character replaced by `_`."""
    return ENV_KEY_PREFIX + _env_suffix(tenant)


def _env_suffix(tenant: str) -> str:
    return "".join(c if c.isascii() and c.isalnum() else "_" for c in tenant.upper())


def _check_tenant(tenant: str) -> None:
    if not isinstance(tenant, str) or not tenant or len(tenant) > TENANT_NAME_CHARS_MAX:
        raise KeyStoreError(
            f"tenant name must be 1..{TENANT_NAME_CHARS_MAX} characters, got {tenant!r:.140}"
        )
    if not tenant.isprintable():
        raise KeyStoreError(f"tenant name {tenant!r} has non-printable characters")


def _parse_key(text: object, where: str) -> bytes:
    """Hex key -> bytes; the error names `where` but never the text itself."""
    if not isinstance(text, str) or len(text) != _KEY_HEX_CHARS or not _HEX_RE.fullmatch(text):
        raise KeyStoreError(f"{where} is not {_KEY_HEX_CHARS} hex characters (key||key2)")
    key = bytes.fromhex(text)
    if key[: XTS_KEY_BYTES // 2] == key[XTS_KEY_BYTES // 2 :]:
        raise KeyStoreError(f"{where} has equal halves (key == key2), which XTS forbids")
    return key


def _check_value(key: bytes) -> str:
    """A key's check value (16 hex characters of a SHA-256 of it): kept beside the key in the
    file so a damaged key is refused at load instead of silently making every chunk written
    under it unreadable. It reveals nothing usable about the key."""
    return hashlib.sha256(b"dpukv-xts-key-check\0" + key).hexdigest()[:16]


def _new_key() -> bytes:
    while True:
        key = secrets.token_bytes(XTS_KEY_BYTES)
        if key[: XTS_KEY_BYTES // 2] != key[XTS_KEY_BYTES // 2 :]:
            return key


class KeyStore:
    """Per-tenant 64-byte XTS keys (key||key2) by generation; thread-safe within one process.

    `path=None` means environment only. One process owns a key file: two agents writing the
    same file would lose each other's new tenants.
    """

    def __init__(
        self, path: str | os.PathLike[str] | None = None, *, env: Mapping[str, str] | None = None
    ) -> None:
        self._path = Path(path) if path is not None else None
        self._env = os.environ if env is None else env
        self._lock = threading.Lock()
        self._keys: dict[str, dict[int, bytes]] = {}
        if self._path is not None:
            if self._path.exists():
                self._keys = self._load(self._path)
            else:
                self._save()
                log.info("keystore.created", path=str(self._path))

    def __repr__(self) -> str:
        path = str(self._path) if self._path is not None else None
        return f"KeyStore(path={path!r}, tenants={len(self._keys)})"

    @property
    def path(self) -> Path | None:
        return self._path

    # --- file ---

    @staticmethod
    def _load(path: Path) -> dict[str, dict[int, bytes]]:
        try:  # a directory there said "Is a directory: 6"; a FIFO held the start for good
            fd = open_regular(path)
        except OSError as e:
            if e.errno == errno.EINVAL:
                raise KeyStoreError(f"key file {path} is not a regular file") from None
            raise KeyStoreError(f"cannot open key file {path}: {e.strerror}") from None
        with os.fdopen(fd, "rb") as f:
            mode = os.fstat(fd).st_mode
            if mode & 0o077:
                raise KeyStoreError(
                    f"key file {path} has mode {stat.S_IMODE(mode):04o}, accessible beyond its "
                    f"owner; run `chmod 600 {path}` and check who has read it"
                )
            raw = f.read(KEY_FILE_BYTES_MAX + 1)
        if len(raw) > KEY_FILE_BYTES_MAX:
            raise KeyStoreError(f"key file {path} exceeds {KEY_FILE_BYTES_MAX} bytes")
        try:
            doc = json.loads(raw) if raw.strip() else {}
        except ValueError as e:
            # The position only, not json's message: that would quote key text.
            pos = getattr(e, "pos", "?")
            raise KeyStoreError(f"key file {path} is not valid JSON (at byte {pos})") from None
        return KeyStore._parse_doc(doc, path)

    @staticmethod
    def _parse_doc(doc: Any, path: Path) -> dict[str, dict[int, bytes]]:
        if not isinstance(doc, dict):
            raise KeyStoreError(f"key file {path} must hold a JSON object of tenants")
        if len(doc) > TENANTS_MAX:
            raise KeyStoreError(f"key file {path} has {len(doc)} tenants > {TENANTS_MAX}")
        keys: dict[str, dict[int, bytes]] = {}
        for tenant, entries in doc.items():
            _check_tenant(tenant)
            if not isinstance(entries, list) or not 1 <= len(entries) <= GENERATIONS_MAX:
                raise KeyStoreError(
                    f"key file {path}: tenant {tenant!r} needs a list of 1..{GENERATIONS_MAX} "
                    '{"generation": n, "key": hex} entries'
                )
            gens: dict[int, bytes] = {}
            for entry in entries:
                gen = entry.get("generation") if isinstance(entry, dict) else None
                if not isinstance(gen, int) or isinstance(gen, bool) or gen < 0 or gen in gens:
                    raise KeyStoreError(
                        f"key file {path}: tenant {tenant!r} has a missing, negative or repeated "
                        "generation number"
                    )
                where = f"key file {path}: key of tenant {tenant!r} generation {gen}"
                key = _parse_key(entry.get("key"), where)
                check = entry.get("check")
                if check is not None and check != _check_value(key):  # older files have none
                    raise KeyStoreError(
                        f"{where} does not match its check value: the file is damaged; restore "
                        "it from a backup (data written under a wrong key cannot be read)"
                    )
                gens[gen] = key
            keys[tenant] = gens
        return keys

    def _save(self) -> None:
        """Write all file-backed keys to a 0600 temp file, fsync, rename over the key file."""
        assert self._path is not None
        doc = {
            tenant: [
                {"generation": g, "key": k.hex(), "check": _check_value(k)}
                for g, k in sorted(gens.items())
            ]
            for tenant, gens in sorted(self._keys.items())
        }
        data = json.dumps(doc, indent=1).encode()
        directory = self._path.parent
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{self._path.name}.", suffix=".tmp", dir=directory)
        except OSError as e:
            raise KeyStoreError(
                f"cannot write key file {self._path}: {e.strerror}; create {directory} "
                "(mode 0700) and make it writable by the agent"
            ) from None
        try:
            os.fchmod(fd, 0o600)  # mkstemp already uses 0600; say it explicitly
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)  # the rename itself survives a crash
        finally:
            os.close(dir_fd)

    # --- environment ---

    def _env_key(self, tenant: str) -> tuple[int, bytes] | None:
        name = env_var_name(tenant)
        text = self._env.get(name)
        if text is None:
            return None
        key = _parse_key(text.strip(), f"environment variable {name}")
        gen_name = ENV_GENERATION_PREFIX + _env_suffix(tenant)
        gen_text = self._env.get(gen_name, "1")
        if not gen_text.isdigit():
            raise KeyStoreError(f"{gen_name}={gen_text!r} must be a non-negative integer")
        return int(gen_text), key

    # --- public API ---

    def tenants(self) -> list[str]:
        """Tenants with keys in the key file (environment-only tenants are not listed)."""
        with self._lock:
            return sorted(self._keys)

    def key_for(self, tenant: str, generation: int | None = None) -> bytes:
        """The tenant's key of `generation` (None = current); a new file-backed tenant gets one."""
        _check_tenant(tenant)
        env = self._env_key(tenant)
        if env is not None and generation in (None, env[0]):
            return env[1]
        with self._lock:
            gens = self._keys.get(tenant)
            if gens is None and generation is None and env is None:
                gens = self._create_locked(tenant)
            if gens is None:
                raise KeyStoreError(
                    f"no key for tenant {tenant!r}"
                    + (f" generation {generation}" if generation is not None else "")
                    + self._where()
                )
            if generation is None:
                return gens[max(gens)]
            if generation not in gens:
                raise KeyStoreError(
                    f"tenant {tenant!r} has no key generation {generation} "
                    f"(known: {sorted(gens)}); data written under it cannot be decrypted"
                )
            return gens[generation]

    def current_generation(self, tenant: str) -> int:
        """The generation new data is written under; creates a new file-backed tenant's key."""
        _check_tenant(tenant)
        env = self._env_key(tenant)
        if env is not None:
            return env[0]
        with self._lock:
            gens = self._keys.get(tenant)
            if gens is None:
                gens = self._create_locked(tenant)
            return max(gens)

    def rotate(self, tenant: str) -> int:
        """Add a new random key generation and make it current; old generations stay readable."""
        _check_tenant(tenant)
        if self._env_key(tenant) is not None:
            raise KeyStoreError(
                f"tenant {tenant!r} takes its key from {env_var_name(tenant)}; rotate it there "
                f"(new key, and {ENV_GENERATION_PREFIX}{_env_suffix(tenant)} one higher)"
            )
        with self._lock:
            gens = self._keys.get(tenant)
            if gens is None:
                return max(self._create_locked(tenant))
            if len(gens) >= GENERATIONS_MAX:
                raise KeyStoreError(
                    f"tenant {tenant!r} has {len(gens)} key generations (max {GENERATIONS_MAX}); "
                    "rewrite data under the current key, then retire() the oldest generations"
                )
            self._require_file(tenant)
            generation = max(gens) + 1
            gens[generation] = _new_key()
            self._save_or_undo(tenant, generation)
        log.info("keystore.rotated", tenant=tenant, generation=generation)
        return generation

    def retire(self, tenant: str, generation: int) -> None:
        """Forget one old generation once no data is stored under it; never the current one."""
        _check_tenant(tenant)
        with self._lock:
            gens = self._keys.get(tenant)
            if gens is None or generation not in gens:
                raise KeyStoreError(f"tenant {tenant!r} has no key generation {generation}")
            if generation == max(gens):
                raise KeyStoreError(
                    f"generation {generation} is tenant {tenant!r}'s current key; rotate() first"
                )
            key = gens.pop(generation)
            try:
                self._save()
            except BaseException:
                gens[generation] = key
                raise
        log.info("keystore.retired", tenant=tenant, generation=generation)

    def create_missing(self, tenants: Iterable[str]) -> list[str]:
        """Give every tenant that has no key (file or environment) its first one, in one write
        of the key file (a write per tenant rewrote the whole file each time: a start with
        thousands of new tenants took minutes); the tenants that got one."""
        wanted = list(dict.fromkeys(tenants))
        for tenant in wanted:
            _check_tenant(tenant)
        wanted = [t for t in wanted if self._env_key(t) is None]
        with self._lock:
            new = [t for t in wanted if t not in self._keys]
            if not new:
                return []
            self._require_file(new[0])
            if len(self._keys) + len(new) > TENANTS_MAX:
                raise KeyStoreError(f"key file would hold over {TENANTS_MAX} tenants; remove some")
            for tenant in new:
                self._keys[tenant] = {1: _new_key()}
            try:
                self._save()
            except BaseException:
                for tenant in new:
                    del self._keys[tenant]
                raise
        log.info("keystore.keys_created", tenants=len(new), generation=1)
        return new

    def has_key(self, tenant: str, generation: int) -> bool:
        """Whether the tenant's key of `generation` exists (environment or file), without
        creating one."""
        _check_tenant(tenant)
        env = self._env_key(tenant)
        if env is not None and env[0] == generation:
            return True
        with self._lock:
            return generation in self._keys.get(tenant, {})

    def has_env_key(self, tenant: str) -> bool:
        """Whether the tenant's key comes from the environment (not the key file)."""
        _check_tenant(tenant)
        return self._env_key(tenant) is not None

    def remove(self, tenant: str) -> None:
        """Forget every key generation of `tenant` in the key file (its data becomes unreadable)."""
        _check_tenant(tenant)
        with self._lock:
            gens = self._keys.pop(tenant, None)
            if gens is None:
                return
            if self._path is not None:
                try:
                    self._save()
                except BaseException:
                    self._keys[tenant] = gens
                    raise
        log.info("keystore.removed", tenant=tenant, generations=sorted(gens))

    # --- helpers (caller holds the lock) ---

    def _where(self) -> str:
        if self._path is None:
            return "; no key file is configured: set its environment variable"
        return f" in {self._path}"

    def _require_file(self, tenant: str) -> None:
        if self._path is None:
            raise KeyStoreError(
                f"no key for tenant {tenant!r}: no key file is configured; "
                f"set {env_var_name(tenant)} or give KeyStore a key file"
            )

    def _create_locked(self, tenant: str) -> dict[int, bytes]:
        self._require_file(tenant)
        if len(self._keys) >= TENANTS_MAX:
            raise KeyStoreError(f"key file holds {TENANTS_MAX} tenants already; remove some")
        gens = {1: _new_key()}
        self._keys[tenant] = gens
        self._save_or_undo(tenant, 1)
        log.info("keystore.key_created", tenant=tenant, generation=1)
        return gens

    def _save_or_undo(self, tenant: str, generation: int) -> None:
        try:
            self._save()
        except BaseException:
            gens = self._keys[tenant]
            del gens[generation]
            if not gens:
                del self._keys[tenant]
            raise
