"""Full and incremental backups of the persistent (NVMe) tier, and restore into a fresh engine.

A backup directory holds:
- `data.bin`: each backed-up chunk's blocks as stored (ciphertext, XTS tweak = its LBA), in
  record order;
- `records.npz`: those records' columns, their parents' keys and the tenant names;
- `keys.npz`: every live persistent (tenant, key) at backup time (the next incremental diffs
  against it to find deletions);
- `deleted.npz`: (tenant, key) deleted since the previous backup (incrementals only);
- `manifest.json`, written last: a directory without it is an unfinished backup.

Chunks keep their LBAs, so the ciphertext is restored byte for byte and decrypts with the same
key file; an incremental holds records whose sequence number is above the previous backup's.

A restore writes `restore.json` in the data dir (fsynced) before it changes anything and
removes it after its checkpoint: a restore killed half-way leaves the marker, which the engine
reports at start (`stats()["restore_interrupted"]`), and which `restore(mode="resume")` (start
over from the marker's backups: what the restore had placed is dropped first) or
`mode="rollback"` (drop every record: the engine held none when the restore began) clears.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dpu_agent.blockdev import BLOCK_SIZE, BlockDevice
from dpu_agent.engine.alloc import AllocError
from dpu_agent.engine.errors import ChecksumMismatch, EngineError
from dpu_agent.engine.index import NO_ROW, STATE_LIVE
from dpu_agent.engine.journal import CHECKPOINT_COLUMNS, fsync_dir, replace_file
from dpu_agent.engine.tiers import NVME
from dpu_agent.engine.types import Lease, PendingReservation, TenantState
from dpu_agent.log import get_logger
from kvproto.checksum import chunk_checksum

if TYPE_CHECKING:
    from dpu_agent.engine.engine import Engine, EngineState

__all__ = [
    "BACKUP_FORMAT",
    "RESTORE_MODES",
    "backup",
    "backup_tenants",
    "check_no_interrupted_restore",
    "interrupted_restore",
    "restore",
]

log = get_logger(__name__)

BACKUP_FORMAT = 1
MANIFEST = "manifest.json"
STATE_FILE = "backup_state.json"  # in data_dir: the last backup this engine took
RESTORE_MARKER = "restore.json"  # in data_dir while a restore runs (or was interrupted)
RESTORE_MODES = ("start", "resume", "rollback")
COPY_BYTES_MAX = 8 << 20  # read/write buffer for copying chunk blocks


def _state_path(engine: Engine) -> Path:
    return engine.config.data_dir / STATE_FILE


def _private(path: str, flags: int) -> int:
    """open() opener: files holding records or ciphertext are 0600, even if they existed."""
    fd = os.open(path, flags, 0o600)
    os.fchmod(fd, 0o600)
    return fd


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    replace_file(path, json.dumps(doc, indent=1).encode())


def interrupted_restore(data_dir: Path) -> dict[str, Any] | None:
    """The marker of a restore that did not finish (killed, failed), or None. A marker that
    cannot be read still says a restore was interrupted (without its backups)."""
    path = data_dir / RESTORE_MARKER
    try:
        doc = json.loads(path.read_text())
        dirs = doc.get("dirs") if isinstance(doc, dict) else None
        if not isinstance(dirs, list) or not all(isinstance(d, str) for d in dirs):
            raise ValueError("not a restore marker")
        return doc
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.error("engine.restore_marker_unreadable", path=str(path), error=str(e))
        return {"dirs": [], "error": f"{path} unreadable: {e}"}


def _save_arrays(path: Path, arrays: dict[str, Any]) -> None:
    with open(path, "wb", opener=_private) as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())


def _check_destination(engine: Engine, dest: Path) -> None:
    """A backup goes to a new or empty directory, not the agent's journal or NVMe directory:
    into any existing one it replaced the files of the backup's names and made the directory
    0700 (a shared /tmp included), and into the data directory it wrote beside, and over, the
    agent's own files."""
    if dest.exists() and not dest.is_dir():
        raise EngineError(f"{dest} is not a directory; give an empty or new directory")
    if dest.is_dir() and any(dest.iterdir()):
        raise EngineError(f"{dest} is not empty; give an empty or new directory")
    target = dest.resolve()
    if target == engine.config.data_dir.resolve():
        raise EngineError(f"{dest} is the agent's data directory; give another directory")
    owns = [engine.config.journal_path]  # what it lists and deletes in
    owns += [engine.config.nvme_path / tenant for tenant in engine.tenants()]
    for own in owns:
        own = own.resolve()
        if target == own or own in target.parents:
            raise EngineError(f"{dest} is inside the agent's own {own}; give a directory outside")


def backup(engine: Engine, dest: Path, *, incremental: bool) -> dict[str, Any]:
    state_path = _state_path(engine)
    prev = json.loads(state_path.read_text()) if state_path.exists() else None
    if incremental and prev is None:
        raise EngineError("no earlier backup is recorded for this engine; take a full backup first")
    if (dest / MANIFEST).exists():
        raise EngineError(f"{dest} already holds a backup; give an empty or new directory")
    _check_destination(engine, dest)
    dest.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(dest, 0o700)  # records and ciphertext: the owner only
    prev_seq = int(prev["seq"]) if incremental and prev else 0
    with engine.locked() as st:
        sel, live_keys, deleted, seq = _select(st, prev, prev_seq, incremental)
        columns, leases = _columns_and_lease(st, sel)
        names = {str(tid): name for tid, name in st.tenants.names_by_id().items()}
        quotas = {name: st.tenants[name].quota_bytes for name in names.values()}
        raws = {
            tid: st.tenants.by_id(tid).tiers[NVME].devices.raw
            for tid in set(columns["tenant"].tolist())
        }
    try:
        data_bytes = _copy_out(raws, columns, dest / "data.bin")
    finally:
        with engine.locked(check_open=False) as st:
            for lease in leases:
                st.leases.unlease(lease)
    for name, arrays in (("records", columns), ("keys", live_keys), ("deleted", deleted)):
        _save_arrays(dest / f"{name}.npz", arrays)
    manifest = {
        "format": BACKUP_FORMAT,
        "kind": "incremental" if incremental else "full",
        "backup_id": uuid.uuid4().hex,
        "prev_id": prev["backup_id"] if incremental and prev else None,
        "seq": seq,
        "prev_seq": prev_seq,
        "created_unix": time.time(),
        "tenants": names,
        "quotas": quotas,  # bytes per tenant name, 0 = none: a restore re-adds them with these
        "records": len(columns["k0"]),
        "deleted": len(deleted["k0"]),
        "data_bytes": data_bytes,
        "live_records": len(live_keys["k0"]),
    }
    _write_json(dest / MANIFEST, manifest)
    _write_json(
        state_path, {"seq": seq, "dir": str(dest.absolute()), "backup_id": manifest["backup_id"]}
    )
    log.info("engine.backup", dir=str(dest), kind=manifest["kind"], records=manifest["records"])
    return manifest


def _select(
    st: EngineState, prev: dict[str, Any] | None, prev_seq: int, incremental: bool
) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray], int]:
    """Rows to back up, all live persistent keys, and the keys deleted since `prev`."""
    index = st.index
    cols = index.cols
    live = index.live_rows()
    persistent = live[cols["tier"][live] == NVME]
    # `seq` in a manifest is the engine's next sequence number at backup time: every record with
    # seq >= it came later
    sel = persistent[cols["seq"][persistent] >= prev_seq] if incremental else persistent
    live_keys = {
        "tenant": cols["tenant"][persistent].copy(),
        "k0": cols["k0"][persistent].copy(),
        "k1": cols["k1"][persistent].copy(),
    }
    deleted = {"tenant": np.zeros(0, "<u2"), "k0": np.zeros(0, "<u8"), "k1": np.zeros(0, "<u8")}
    if incremental and prev is not None:
        keys_path = Path(prev["dir"]) / "keys.npz"
        if not keys_path.exists():
            raise EngineError(
                f"the previous backup {prev['dir']} is gone (an incremental diffs against its "
                "key list); take a full backup"
            )
        with np.load(keys_path) as old:
            before = {name: old[name] for name in ("tenant", "k0", "k1")}
        rows = index.find_many(before["tenant"], before["k0"], before["k1"])
        safe = np.where(rows >= 0, rows, 0)
        gone = (rows == NO_ROW) | (cols["tier"][safe] != NVME)
        deleted = {name: col[gone] for name, col in before.items()}
    return sel, live_keys, deleted, st.commit.seq


def _columns_and_lease(
    st: EngineState, sel: np.ndarray
) -> tuple[dict[str, np.ndarray], list[Lease]]:
    """Copy the rows' columns and lease their extents so they stay put while being copied."""
    cols = st.index.cols
    columns = {name: cols[name][sel].copy() for name in CHECKPOINT_COLUMNS}
    parent = cols["parent"][sel].astype(np.int64)
    safe = np.where(parent >= 0, parent, 0)
    has = (parent >= 0) & (cols["state"][safe] == STATE_LIVE)
    has &= cols["tenant"][safe] == cols["tenant"][sel]
    columns["pk0"] = np.where(has, cols["k0"][safe], 0).astype("<u8")
    columns["pk1"] = np.where(has, cols["k1"][safe], 0).astype("<u8")
    columns["hp"] = has.astype("u1")
    leases: dict[int, Lease] = {}
    for row in sel.tolist():
        tid, lba = int(cols["tenant"][row]), int(cols["lba"][row])
        lease = leases.setdefault(
            tid, Lease(lease_id=0, tenant_id=tid, extents=[], expires=float("inf"))
        )
        lease.extents.append((NVME, lba, int(cols["block_count"][row]), row))
        st.leases.lease_extent(tid, NVME, lba, row)
    return columns, list(leases.values())


def _copy_out(raws: dict[int, BlockDevice], columns: dict[str, np.ndarray], path: Path) -> int:
    """Outside the engine lock: the extents are leased, so they stay put while copied."""
    total = 0
    with open(path, "wb", opener=_private) as f:
        for i in range(len(columns["k0"])):
            raw = raws[int(columns["tenant"][i])]
            buf = bytearray(int(columns["block_count"][i]) * BLOCK_SIZE)
            raw.read_into(int(columns["lba"][i]), memoryview(buf))
            f.write(buf)
            total += len(buf)
        f.flush()
        os.fsync(f.fileno())
    return total


def read_manifests(dirs: list[Path]) -> list[dict[str, Any]]:
    """Each backup's manifest; EngineError names a directory that is not a finished backup."""
    manifests = []
    for d in dirs:
        path = d / MANIFEST
        try:
            manifests.append(json.loads(path.read_text()))
        except FileNotFoundError:
            why = f"{d} has no {MANIFEST}: not a backup, or an unfinished one"
            raise EngineError(why) from None
        except (OSError, ValueError) as e:
            raise EngineError(f"{path} cannot be read as a backup manifest: {e}") from None
    return manifests


def backup_tenants(dirs: list[Path]) -> dict[str, int]:
    """The tenants the backups hold chunks of (what a restore needs to exist), each with its
    quota at the latest backup (0, none, for backups written before quotas were recorded)."""
    out: dict[str, int] = {}
    for m in read_manifests(dirs):
        quotas = m.get("quotas", {})
        for name in m["tenants"].values():
            out[name] = int(quotas.get(name, out.get(name, 0)))
    return dict(sorted(out.items()))


def check_no_interrupted_restore(data_dir: Path) -> None:
    """EngineError naming the way out when an interrupted restore's marker is there."""
    marker = interrupted_restore(data_dir)
    if marker is not None:
        raise EngineError(
            f"a restore of {marker['dirs']} was interrupted; finish it first: dpuctl backup "
            "restore --resume (start it over) or --rollback (drop what it placed)"
        )


def restore(engine: Engine, dirs: list[Path], mode: str = "start") -> dict[str, Any]:
    """Apply a full backup and then each incremental, in order, to a fresh engine (one that
    holds no chunk: a restore never merges into a cache in use). `mode` "resume" starts an
    interrupted restore over from its marker's backups (`dirs` empty, or the same), "rollback"
    drops what it placed; both remove the marker when done."""
    if mode not in RESTORE_MODES:
        raise EngineError(f"restore mode {mode!r}: give one of {', '.join(RESTORE_MODES)}")
    if mode == "start":
        check_no_interrupted_restore(engine.config.data_dir)
        return _restore(engine, dirs)
    marker = interrupted_restore(engine.config.data_dir)
    if marker is None:
        raise EngineError(f"no interrupted restore to {mode} (no {RESTORE_MARKER} in the data dir)")
    if mode == "rollback":
        dropped = _drop_everything(engine)
        engine.checkpoint()
        _remove_marker(engine)
        log.warning("engine.restore_rolled_back", records_dropped=dropped)
        return {"rolled_back": True, "records_dropped": dropped}
    recorded = [Path(d) for d in marker["dirs"]]
    if not recorded:
        raise EngineError(f"{RESTORE_MARKER} names no backups ({marker.get('error')}); roll back")
    if dirs and [d.absolute() for d in dirs] != recorded:
        raise EngineError(f"the interrupted restore was of {marker['dirs']}; resume those")
    read_manifests(recorded)  # the backups are still there, before anything is dropped
    dropped = _drop_everything(engine)
    result = _restore(engine, recorded, resuming=True)
    return {**result, "resumed": True, "records_dropped": dropped}


def _drop_everything(engine: Engine) -> int:
    """Drop every record (journaled): what an interrupted restore placed, in an engine that
    held nothing when it began."""
    with engine.locked(writable=True) as st:
        cols = st.index.cols
        rows = st.index.live_rows().tolist()
        for row in rows:
            ts = st.tenants.by_id(int(cols["tenant"][row]))
            st.records.drop(ts, row)
    return len(rows)


def _remove_marker(engine: Engine) -> None:
    path = engine.config.data_dir / RESTORE_MARKER
    path.unlink(missing_ok=True)
    fsync_dir(path.parent)


def _restore(engine: Engine, dirs: list[Path], *, resuming: bool = False) -> dict[str, Any]:
    if not dirs:
        raise EngineError("restore needs at least one backup directory (a full backup first)")
    manifests = read_manifests(dirs)
    with engine.locked() as st:
        held = len(st.index)
    if held:
        raise EngineError(
            f"restore needs an agent that holds no chunks; this one holds {held}. Start a "
            "fresh agent on an empty data dir (with the old key file) and restore there"
        )
    if manifests[0]["kind"] != "full":
        raise EngineError(f"{dirs[0]} is an incremental backup; restore starts from a full one")
    for before, (d, m) in zip(manifests, zip(dirs[1:], manifests[1:], strict=True), strict=False):
        if m["kind"] != "incremental" or m["prev_id"] != before["backup_id"]:
            raise EngineError(
                f"{d} does not follow the backup before it (it follows {m['prev_id']}, not "
                f"{before['backup_id']}); give the backups of one chain, oldest first"
            )
    if not resuming:  # before anything changes: a kill from here on is reported at start
        _write_json(
            engine.config.data_dir / RESTORE_MARKER,
            {
                "dirs": [str(d.absolute()) for d in dirs],
                "backup_ids": [m["backup_id"] for m in manifests],
                "started_unix": time.time(),
            },
        )
    restored = deleted = 0
    for d, m in zip(dirs, manifests, strict=True):
        for name in m["tenants"].values():
            if name not in engine.tenants():  # one served already keeps the quota it has
                engine.add_tenant(name, quota_bytes=engine.config.tenants.get(name, 0))
        with engine.locked() as st:
            deleted += _apply_deletes(st, d, m)
            restored += _apply_records(st, d, m)
    engine.checkpoint()
    with engine.locked() as st:
        state = {
            "seq": st.commit.seq,
            "dir": str(dirs[-1].absolute()),
            "backup_id": manifests[-1]["backup_id"],
        }
        _write_json(_state_path(engine), state)
    _remove_marker(engine)
    log.info("engine.restored", backups=len(dirs), records=restored, deleted=deleted)
    return {"backups": len(dirs), "records": restored, "deleted": deleted}


def _tenant_of(st: EngineState, manifest: dict[str, Any], tid: int) -> TenantState:
    return st.tenants[manifest["tenants"][str(tid)]]


def _apply_deletes(st: EngineState, d: Path, m: dict[str, Any]) -> int:
    count = 0
    with np.load(d / "deleted.npz") as dz:
        tenants, k0s, k1s = dz["tenant"], dz["k0"], dz["k1"]
    for tid, k0, k1 in zip(tenants.tolist(), k0s.tolist(), k1s.tolist(), strict=True):
        ts = _tenant_of(st, m, tid)
        key = k0.to_bytes(8, "little") + k1.to_bytes(8, "little")
        row = st.index.find(ts.tenant_id, key)
        if row != NO_ROW:
            st.records.drop(ts, row)
            count += 1
    return count


def _apply_records(st: EngineState, d: Path, m: dict[str, Any]) -> int:
    """Drop every older version of the backup's keys first (their extents may be where the new
    versions go), then put each chunk back at its LBA."""
    with np.load(d / "records.npz") as rz:
        rec = {name: rz[name] for name in rz.files}
    keys = []
    for i in range(len(rec["k0"])):
        ts = _tenant_of(st, m, int(rec["tenant"][i]))
        key = int(rec["k0"][i]).to_bytes(8, "little") + int(rec["k1"][i]).to_bytes(8, "little")
        old = st.index.find(ts.tenant_id, key)
        if old != NO_ROW:
            st.records.drop(ts, old)
        keys.append((ts, key))
    with open(d / "data.bin", "rb") as f:
        for i, (ts, key) in enumerate(keys):
            data = f.read(int(rec["block_count"][i]) * BLOCK_SIZE)
            _place_chunk(st, ts, key, rec, i, data)
    return len(keys)


def _place_chunk(
    st: EngineState, ts: TenantState, key: bytes, rec: dict[str, np.ndarray], i: int, data: bytes
) -> None:
    tier = ts.tiers[NVME]
    n, lba, length = int(rec["block_count"][i]), int(rec["lba"][i]), int(rec["length"][i])
    try:
        tier.alloc.alloc_at(lba, n)
    except AllocError as e:
        raise EngineError(
            f"cannot restore chunk {key.hex()} of tenant {ts.name!r} at LBA {lba}: {e}; "
            "restore into a fresh data directory"
        ) from e
    tier.devices.raw.write(lba, data)
    plain = bytearray(n * BLOCK_SIZE)
    tier.device.read_into(lba, memoryview(plain))
    checksum = int(rec["c0"][i]).to_bytes(8, "little") + int(rec["c1"][i]).to_bytes(8, "little")
    if chunk_checksum(key, memoryview(plain)[:length]) != checksum:
        tier.alloc.free(lba, n)
        raise ChecksumMismatch(
            f"restored chunk {key.hex()} of tenant {ts.name!r} does not verify: restore with the "
            "key file of the agent that took the backup"
        )
    parent = None
    if rec["hp"][i]:
        parent = int(rec["pk0"][i]).to_bytes(8, "little") + int(rec["pk1"][i]).to_bytes(8, "little")
    res = PendingReservation(
        reservation_id=0,
        tenant_id=ts.tenant_id,
        key=key,
        length=length,
        parent=parent,
        tier=NVME,
        lba=lba,
        block_count=n,
        expires=0.0,
    )
    st.records.insert(ts, res, checksum, st.clock())
