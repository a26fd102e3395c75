"""The agent's run-time tenant file (tenants.json) and the tenants' token files.

The config file names the tenants an operator wrote down; `dpuctl tenants add|remove` and the
cluster's tenant source change that set while the agent runs. tenants.json keeps those changes
across a restart: tenants added at run time (their token in its own 0600 file, never in
tenants.json), config tenants removed at run time, and the incarnation of each cluster tenant
held here (so a tenant removed and re-added in etcd while this node was down is erased, not
served with the old one's data).

    store = TenantStore(cfg.path(TENANTS_FILE))
    saved = store.load()                  # what to apply over the config file's tenants
    store.save(added=..., present=cfg.tenants, cluster=known, removed="old")
    write_secret(cfg.path("tenant-a.token"), token)
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpu_agent.config import TenantConfig
from dpu_agent.engine.journal import replace_file
from dpu_agent.files import read_small_file
from dpu_agent.log import get_logger
from kvproto.control import valid_tenant_name

__all__ = [
    "DAMAGED_SUFFIX",
    "TENANTS_FILE",
    "SavedTenants",
    "TenantStore",
    "apply_saved",
    "write_secret",
]

log = get_logger("dpu_agent.tenant_store")

TENANTS_FILE = "tenants.json"  # tenants added or removed at run time (tokens in their own files)
# A damaged tenants.json is kept beside it under this suffix: while it is there the agent erases
# no tenant the config does not name (they may be the ones the damaged file named).
DAMAGED_SUFFIX = ".damaged"
# Its entries are the run-time tenants (TENANTS_MAX at most) and the config's removed ones:
# kilobytes. Far more is not a file this agent wrote.
TENANTS_FILE_BYTES_MAX = 16 << 20


@dataclass(slots=True)
class SavedTenants:
    """What tenants.json says to apply over the config file's tenants."""

    added: dict[str, TenantConfig] = field(default_factory=dict)  # token_file and quota only
    removed: list[str] = field(default_factory=list)
    cluster: dict[str, str] = field(default_factory=dict)  # cluster tenant -> incarnation
    damaged: bool = False  # the file was there and unreadable (kept as DAMAGED_SUFFIX)


def apply_saved(tenants: dict[str, TenantConfig], saved: SavedTenants) -> None:
    """The configuration's tenants with tenants.json's run-time changes applied (in place):
    the added ones the configuration lacks, less the removed ones. Tokens are the caller's
    (AgentConfig.prepare reads them)."""
    for name, t in saved.added.items():
        tenants.setdefault(name, t)
    for name in saved.removed:
        tenants.pop(name, None)


class TenantStore:
    """tenants.json: read at start, rewritten (atomically, 0600) after each change."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def damaged_path(self) -> Path:
        return self.path.with_name(self.path.name + DAMAGED_SUFFIX)

    @property
    def damaged(self) -> bool:
        """A damaged tenants.json was set aside and nobody has cleared it (deleted the file)."""
        return self.damaged_path.exists()

    def load(self, *, set_aside: bool = True) -> SavedTenants:
        """The saved changes; none when there is no file. A damaged file (not JSON, not an
        object) is logged and set aside (`damaged_path`), so the agent starts with its
        configured tenants and erases none it does not name; an entry that is not a tenant
        name or not an object is skipped, the others are kept. `set_aside=False`: a reader
        beside the agent (dpuctl) that must move nothing."""
        doc = self._read()
        out = SavedTenants()
        if doc is None:
            if self.path.exists() and set_aside:
                out.damaged = True
                try:
                    os.replace(self.path, self.damaged_path)
                except OSError as e:
                    log.error("runtime_tenants_not_set_aside", path=str(self.path), error=str(e))
            out.damaged = out.damaged or self.damaged
            return out
        out.damaged = self.damaged
        added = doc.get("added")
        for name, entry in (added if isinstance(added, dict) else {}).items():
            if valid_tenant_name(name) and isinstance(entry, dict):
                out.added[name] = TenantConfig(
                    name=name,
                    token_file=str(entry.get("token_file", "")),
                    quota_bytes=_int(entry.get("quota_bytes", 0)),
                )
        out.removed = _names(doc.get("removed"))
        cluster = doc.get("cluster")
        for name, entry in (cluster if isinstance(cluster, dict) else {}).items():
            if valid_tenant_name(name) and isinstance(entry, dict):
                out.cluster[name] = str(entry.get("incarnation", ""))
        return out

    def save(
        self,
        *,
        added: Mapping[str, TenantConfig],
        present: Collection[str],
        cluster: Mapping[str, str],
        configured: Collection[str],
        removed: str | None = None,
    ) -> None:
        """Write the run-time tenants: `added` (not in the config file), the config tenants
        removed so far plus `removed`, less those `present` again, and each cluster tenant's
        incarnation. Only names the config file has (`configured`) are kept as removed: a
        tenant added at run time needs no record once gone (every one was kept, and the file,
        rewritten at each change, grew without bound: 6.8 MB and 150 ms an add after 100k
        removals, found by an attack pass). Written durably (fsync, rename, directory fsync):
        a lost file costs the tenants added at run time their service. Raises OSError when the
        file cannot be written."""
        doc = self._read() or {}
        gone = set(_names(doc.get("removed")))
        if removed:
            gone.add(removed)
        gone &= set(configured)
        out = {
            "added": {
                name: {"token_file": t.token_file, "quota_bytes": t.quota_bytes}
                for name, t in added.items()
            },
            "removed": sorted(n for n in gone if n not in present),
            "cluster": {n: {"incarnation": inc} for n, inc in sorted(cluster.items())},
        }
        replace_file(self.path, (json.dumps(out, indent=1) + "\n").encode())

    def _read(self) -> dict[str, Any] | None:
        try:
            raw = read_small_file(self.path, TENANTS_FILE_BYTES_MAX)
            if len(raw) > TENANTS_FILE_BYTES_MAX:
                raise ValueError(f"over {TENANTS_FILE_BYTES_MAX} bytes")
            doc = json.loads(raw)
            if not isinstance(doc, dict):
                raise ValueError(f"not a JSON object: {type(doc).__name__}")
        except FileNotFoundError:
            return None
        except (ValueError, OSError, RecursionError) as e:  # damaged: the configured tenants
            log.error("runtime_tenants_unreadable", path=str(self.path), error=str(e),
                      dropped="tenants added or removed at run time",
                      kept=str(self.damaged_path),
                      fix="re-add the run-time tenants (dpuctl tenants add NAME --token-file "
                          "tenant-NAME.token), then delete the kept file")  # fmt: skip
            return None
        return doc


def _names(value: Any) -> list[str]:
    """The tenant names of a saved list (anything else in it is skipped)."""
    if not isinstance(value, list):
        return []
    return [n for n in value if isinstance(n, str) and valid_tenant_name(n)]


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def write_secret(path: Path, value: str) -> None:
    """`value` in `path`, mode 0600 from creation, replacing what was there atomically."""
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    os.replace(tmp, path)
