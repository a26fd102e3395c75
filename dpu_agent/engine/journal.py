"""Write-ahead journal and checkpoints of the persistent-tier records.

Files in the journal directory:
- `wal-<segment>.log`: append-only frames `[u32 body_len][u32 check][body]`, check = the low
  32 bits of xxh3-64(body), every body zero-padded to 85 bytes (a commit's size) so a segment
  parses as one numpy array. Frames are fixed-size, so a frame whose check does not match (a
  flipped bit, a bad sector) is skipped and counted, and every other frame still replays; bytes
  after the last whole frame are a torn tail (a crash mid-write). A failed or short append is
  cut back to the last frame boundary and raises JournalError, so frames never lose alignment.
  The engine checkpoints at once after replaying a damaged or torn segment.
- `checkpoint.bin` and `checkpoint.prev.bin`: the newest and the previous checkpoint: the
  persistent records as numpy columns (64-byte aligned, loaded as views of one read) plus a
  JSON header with tenants, quarantined extents, the next sequence number and the first WAL
  segment not contained in it; an xxh3-64 of the whole file at its end. Written to a temp file
  (0600), fsynced, the newest renamed to `.prev`, the temp file renamed to the newest,
  directory fsynced; segments the previous one still needs are kept. A checkpoint that fails
  its checksum is renamed `*.damaged` and the previous one (and the WAL after it) is used;
  without a good one the index is rebuilt from the WAL segments that are left. Every segment
  starts with the tenant (and quarantine) records, so the WAL alone names every tenant.
- `tenant-ids.json`: tenant id -> name, with its own checksum, replaced atomically whenever a
  tenant is added or removed. A record names its tenant by id; the id's name is in a WAL frame,
  in the checkpoint and here, so losing one of them (a flipped bit in the tenant frame, the
  live segment truncated) costs no record. Recovery uses the WAL and the checkpoint first and
  this file for an id neither names.

A live segment truncated or deleted underneath the agent no longer holds what was acknowledged:
every append checks first (JournalLost, nothing written) and every tick checks too (`lost()`,
also a segment replaced by another file); the engine fences writes, writes a checkpoint from
memory (which starts a new segment), then lifts the fence.

Durability: appends go to the page cache with one `write()` each, so a `kill -9` of the agent
loses nothing that was appended. `sync()` (called by the engine every `fsync_interval_s` and at
checkpoint and close: group commit) fsyncs the segment, so a power loss loses at most that
interval of commits.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from dpu_agent.log import get_logger

__all__ = [
    "CHECKPOINT_COLUMNS",
    "OP_COMMIT",
    "OP_DELETE",
    "OP_QUARANTINE",
    "OP_TENANT",
    "OP_TENANT_REMOVE",
    "OP_UNQUARANTINE",
    "Journal",
    "JournalError",
    "JournalLost",
    "Recovered",
]

log = get_logger(__name__)

OP_COMMIT = 1
OP_DELETE = 2
OP_TENANT = 3
OP_QUARANTINE = 4
OP_UNQUARANTINE = 5
OP_TENANT_REMOVE = 6  # the tenant's records written before this one are gone (crypto-erase)

_HDR = struct.Struct("<II")  # body_len, check: low 32 bits of xxh3-64(body)
# op, tenant, seq, key, checksum, tier, lba, block_count, length, generation, created,
# parent key, has_parent
_COMMIT = struct.Struct("<BHQ16s16sBQIIII16sB")
_DELETE = struct.Struct("<BHQ16s")  # op, tenant, seq, key
_TENANT = struct.Struct("<BHQ")  # op, tenant, seq; the UTF-8 name follows
_EXTENT = struct.Struct("<BHQBQI")  # op, tenant, seq, tier, lba, block_count
# The same layouts as numpy records, for parsing a whole segment's commits at once.
COMMIT_DTYPE = np.dtype(
    [
        ("op", "u1"),
        ("tenant", "<u2"),
        ("seq", "<u8"),
        ("k0", "<u8"),
        ("k1", "<u8"),
        ("c0", "<u8"),
        ("c1", "<u8"),
        ("tier", "u1"),
        ("lba", "<u8"),
        ("block_count", "<u4"),
        ("length", "<u4"),
        ("generation", "<u4"),
        ("created", "<u4"),
        ("pk0", "<u8"),
        ("pk1", "<u8"),
        ("hp", "u1"),
    ]
)
DELETE_DTYPE = np.dtype(
    [("op", "u1"), ("tenant", "<u2"), ("seq", "<u8"), ("k0", "<u8"), ("k1", "<u8")]
)
assert COMMIT_DTYPE.itemsize == _COMMIT.size and DELETE_DTYPE.itemsize == _DELETE.size
# Every frame has the same size: bodies are zero-padded to the largest (a commit), so replay
# parses a whole segment as one numpy array. A tenant name (<= 63 bytes) fits too.
BODY_BYTES = _COMMIT.size
FRAME_BYTES = _HDR.size + BODY_BYTES
SEGMENT_RE = re.compile(r"^wal-(\d{10})\.log$")
CHECKPOINT_NAME = "checkpoint.bin"
CHECKPOINT_PREV_NAME = "checkpoint.prev.bin"
DAMAGED_SUFFIX = ".damaged"
# Bytes a writability probe writes (then cuts back): room for this many frames proves the
# journal can take a burst of commits again before the engine lifts its write fence.
PROBE_FRAMES = 64
CHECKPOINT_MAGIC = b"DPUKVCK1"
LOCK_NAME = "LOCK"
TENANT_IDS_NAME = "tenant-ids.json"
# Columns of the record index a checkpoint keeps, plus the parent's key.
CHECKPOINT_COLUMNS = (
    "k0",
    "k1",
    "c0",
    "c1",
    "lba",
    "seq",
    "block_count",
    "length",
    "generation",
    "created",
    "tenant",
    "tier",
)


class JournalError(Exception):
    """The journal directory cannot be read or written; the message names the file. `errno`
    is the OS error behind it (ENOSPC: the disk is full), or None."""

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


class JournalLost(JournalError):
    """The live segment no longer holds what was appended to it (truncated, deleted or
    replaced underneath the agent): the engine must rewrite it from memory (a checkpoint)."""


@dataclass(slots=True)
class Recovered:
    """What load() found: the checkpoint's columns and everything the WAL adds after it."""

    columns: dict[str, np.ndarray] = field(default_factory=dict)  # checkpoint rows (+pk0/pk1/hp)
    tenants: dict[int, str] = field(default_factory=dict)
    quarantined: set[tuple[int, int, int, int]] = field(default_factory=set)  # tid,tier,lba,n
    # every COMMIT and DELETE of the WAL, in log order (COMMIT_DTYPE / DELETE_DTYPE rows)
    wal_commits: list[np.ndarray] = field(default_factory=list)
    wal_deletes: list[np.ndarray] = field(default_factory=list)
    next_seq: int = 1
    checkpoint_records: int = 0
    wal_records: int = 0
    torn_segments: int = 0
    damaged_frames: int = 0  # frames that failed their check, skipped
    missing_segments: int = 0  # segments of the replayed run that are gone (deleted, lost)
    checkpoint_used: str = "none"  # "current", "previous" or "none" (rebuilt from the WAL)
    checkpoints_damaged: int = 0  # checkpoint files that failed their checksum (kept *.damaged)
    removed_tenants: dict[int, int] = field(default_factory=dict)  # tenant id -> seq of removal
    tenant_ids: dict[int, str] = field(default_factory=dict)  # tenant-ids.json (may be empty)


def pack_commit(
    tenant: int,
    seq: int,
    key: bytes,
    checksum: bytes,
    tier: int,
    lba: int,
    block_count: int,
    length: int,
    generation: int,
    created: int,
    parent: bytes | None,
) -> bytes:
    return _COMMIT.pack(
        OP_COMMIT,
        tenant,
        seq,
        key,
        checksum,
        tier,
        lba,
        block_count,
        length,
        generation,
        created,
        parent or bytes(16),
        parent is not None,
    )


def pack_delete(tenant: int, seq: int, key: bytes) -> bytes:
    return _DELETE.pack(OP_DELETE, tenant, seq, key)


def pack_tenant(tenant: int, seq: int, name: str) -> bytes:
    return _TENANT.pack(OP_TENANT, tenant, seq) + name.encode()


def pack_tenant_remove(tenant: int, seq: int) -> bytes:
    return _TENANT.pack(OP_TENANT_REMOVE, tenant, seq)


def pack_extent(op: int, tenant: int, seq: int, tier: int, lba: int, block_count: int) -> bytes:
    assert op in (OP_QUARANTINE, OP_UNQUARANTINE), op
    return _EXTENT.pack(op, tenant, seq, tier, lba, block_count)


def _check(body: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(body) & 0xFFFFFFFF


def frame(body: bytes) -> bytes:
    assert 0 < len(body) <= BODY_BYTES, len(body)
    padded = body.ljust(BODY_BYTES, b"\0")
    return _HDR.pack(BODY_BYTES, _check(padded)) + padded


class Journal:
    """One engine's WAL segments and checkpoints. The engine's lock serialises appends and
    segment changes; `sync()` may run outside it (it fsyncs a duplicate of the descriptor)."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock_fd = _lock_dir(self.dir)  # one agent per journal; the kernel drops it on exit
        self._fd = -1
        self._fd_lock = threading.Lock()  # guards _fd against sync() from another thread
        self.segment = 0
        self.segment_bytes = 0
        self._appended = 0  # appends so far; sync() records how many it covered
        self._synced = 0
        self.checkpoint_segment = 0  # first segment the newest checkpoint does not contain

    @property
    def unsynced(self) -> bool:
        return self._appended != self._synced

    # --- appending ---

    def open_segment(self, segment: int) -> None:
        """Start appending to a new segment file (after load, or at a checkpoint)."""
        path = self._segment_path(segment)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise JournalError(f"cannot open journal segment {path}: {e.strerror}", e.errno) from e
        try:
            size = os.fstat(fd).st_size
            if size % FRAME_BYTES:  # a torn tail (replayed without it): appends stay aligned
                os.ftruncate(fd, size - size % FRAME_BYTES)
                size -= size % FRAME_BYTES
        except OSError as e:
            os.close(fd)
            raise JournalError(f"journal segment {path}: {e.strerror}", e.errno) from e
        try:
            self._close_segment()  # fsyncs the old one; a failure still moves on to the new
        finally:
            with self._fd_lock:
                self._fd = fd
            self.segment = segment
            self.segment_bytes = size
        try:
            fsync_dir(self.dir)
        except OSError as e:
            raise JournalError(f"fsync of {self.dir}: {e.strerror}", e.errno) from e

    def append(self, body: bytes) -> None:
        """One frame, or JournalError with the segment cut back to its last whole frame (so
        nothing half-written is ever followed by more frames). JournalLost, before anything
        is written, when the segment lost what was appended to it (truncated or deleted
        underneath the agent: one fstat, about a microsecond). Frames are written at their own
        offset (not O_APPEND), so a truncation racing an append leaves a hole of zero frames
        (skipped at replay) and never misaligns the frames after it."""
        data = frame(body)
        try:
            st = os.fstat(self._fd)
        except OSError as e:
            raise JournalError(f"journal segment {self.segment}: {e.strerror}", e.errno) from e
        if st.st_nlink == 0 or st.st_size < self.segment_bytes:
            raise JournalLost(self._lost_why(st))
        try:
            written = os.pwrite(self._fd, data, self.segment_bytes)
        except OSError as e:
            self._cut_back()
            raise JournalError(
                f"journal append to segment {self.segment} failed: {e.strerror}", e.errno
            ) from e
        if written != len(data):
            self._cut_back()
            raise JournalError(
                f"journal append to segment {self.segment}: short write ({written} of "
                f"{len(data)} bytes); the disk is full",
                errno.ENOSPC,
            )
        self.segment_bytes += written
        self._appended += 1

    def _cut_back(self) -> None:
        with contextlib.suppress(OSError):  # probe() retries it before any further append
            os.ftruncate(self._fd, self.segment_bytes)

    def probe(self) -> None:
        """Check the journal takes appends again: cut any partial frame off, write
        PROBE_FRAMES frames' worth of zeros, fsync, cut them off again. JournalError if not.
        A segment that could not be opened (a full disk at start) is opened first."""
        if self._fd < 0:
            self.open_segment(self.segment)
        fd = self._fd
        try:
            os.ftruncate(fd, self.segment_bytes)
            zeros = bytes(PROBE_FRAMES * FRAME_BYTES)
            written = os.pwrite(fd, zeros, self.segment_bytes)
            os.ftruncate(fd, self.segment_bytes)
            os.fsync(fd)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, self.segment_bytes)
            raise JournalError(f"journal segment {self.segment}: {e.strerror}", e.errno) from e
        if written != len(zeros):
            raise JournalError(f"journal segment {self.segment}: disk still full", errno.ENOSPC)

    def lost(self) -> str | None:
        """Why the live segment no longer holds what was appended to it (truncated, deleted
        or replaced underneath the agent), or None while it does. Two stat calls."""
        with self._fd_lock:
            if self._fd < 0:
                return None
            st = os.fstat(self._fd)
        path = self._segment_path(self.segment)
        if st.st_nlink == 0 or st.st_size < self.segment_bytes:
            return self._lost_why(st)
        try:
            on_disk = os.stat(path)
        except OSError:
            return f"journal segment {path} is gone"
        if (on_disk.st_ino, on_disk.st_dev) != (st.st_ino, st.st_dev):
            return f"journal segment {path} was replaced by another file"
        return None

    def _lost_why(self, st: os.stat_result) -> str:
        path = self._segment_path(self.segment)
        if st.st_nlink == 0:
            return f"journal segment {path} was deleted"
        return (f"journal segment {path} was truncated to {st.st_size} bytes (the agent "
                f"wrote {self.segment_bytes})")  # fmt: skip

    def sync(self) -> None:
        """fsync the segment (group commit). Safe to call without the engine lock."""
        with self._fd_lock:
            if self._fd < 0 or self._appended == self._synced:
                return
            fd, upto = os.dup(self._fd), self._appended
        try:
            os.fsync(fd)
        except OSError as e:
            raise JournalError(f"fsync of journal segment failed: {e.strerror}", e.errno) from e
        finally:
            os.close(fd)
        with self._fd_lock:
            self._synced = max(self._synced, upto)

    def close(self) -> None:
        """Close the segment and give up the directory lock."""
        try:
            self._close_segment()
        finally:
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1

    def _close_segment(self) -> None:
        with self._fd_lock:
            fd, self._fd = self._fd, -1
        if fd >= 0:
            try:
                os.fsync(fd)
                self._synced = self._appended
            except OSError as e:
                raise JournalError(f"fsync of journal segment failed: {e.strerror}", e.errno) from e
            finally:
                os.close(fd)

    # --- checkpoints ---

    def write_checkpoint(self, columns: dict[str, np.ndarray], meta: dict[str, Any]) -> int:
        """Atomically replace the checkpoint, keeping the previous one as `.prev`; then drop
        the segments neither needs. Returns bytes. JournalError (temp file removed) on failure."""
        tmp = self.dir / (CHECKPOINT_NAME + ".tmp")
        final = self.dir / CHECKPOINT_NAME
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as f:
                size = _write_checkpoint_file(f, columns, meta)
                f.flush()
                os.fsync(f.fileno())
            if final.exists():
                os.replace(final, self.dir / CHECKPOINT_PREV_NAME)
            os.replace(tmp, final)
            fsync_dir(self.dir)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise JournalError(f"checkpoint {final} not written: {e.strerror}", e.errno) from e
        keep_from = self.checkpoint_segment  # the previous checkpoint replays from here
        self.checkpoint_segment = int(meta["segment"])
        for seg in self._segments():
            if seg < keep_from:
                with contextlib.suppress(FileNotFoundError):
                    self._segment_path(seg).unlink()
        return size

    # --- the tenant id file ---

    def save_tenant_ids(self, names: dict[int, str]) -> None:
        """Replace tenant-ids.json (temp file 0600, fsync, rename, directory fsync)."""
        body = {str(tid): name for tid, name in sorted(names.items())}
        text = json.dumps({"tenants": body, "check": _ids_check(body)}, indent=1) + "\n"
        try:
            replace_file(self.dir / TENANT_IDS_NAME, text.encode())
        except OSError as e:
            raise JournalError(f"{self.dir / TENANT_IDS_NAME} not written: {e.strerror}",
                               e.errno) from e  # fmt: skip

    def _load_tenant_ids(self) -> dict[int, str]:
        """tenant-ids.json, or {} (missing; damaged: logged, the WAL and checkpoint still
        name the tenants)."""
        path = self.dir / TENANT_IDS_NAME
        try:
            doc = json.loads(path.read_text())
            body = doc["tenants"]
            if not isinstance(body, dict) or doc.get("check") != _ids_check(body):
                raise ValueError("checksum mismatch")
            return {int(tid): str(name) for tid, name in body.items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            log.error("journal.tenant_ids_damaged", path=str(path), error=str(e))
            return {}

    # --- recovery ---

    def load(self) -> Recovered:
        """The newest checkpoint that verifies (else none) and every later WAL segment, bad
        frames skipped and counted. Damaged checkpoints are renamed `*.damaged`."""
        rec = Recovered(tenant_ids=self._load_tenant_ids())
        first_segment = min(self._segments(), default=0)
        for name, used in ((CHECKPOINT_NAME, "current"), (CHECKPOINT_PREV_NAME, "previous")):
            path = self.dir / name
            if not path.exists():
                continue
            try:
                columns, meta = _read_checkpoint_file(path)
            except (JournalError, ValueError, KeyError) as e:
                rec.checkpoints_damaged += 1
                log.error("journal.checkpoint_damaged", path=str(path), error=str(e))
                os.replace(path, path.with_name(path.name + DAMAGED_SUFFIX))
                continue
            rec.columns = columns
            rec.tenants = {int(k): v for k, v in meta["tenants"].items()}
            rec.quarantined = {tuple(q) for q in meta["quarantined"]}
            rec.next_seq = int(meta["next_seq"])
            rec.checkpoint_records = len(rec.columns["k0"])
            rec.checkpoint_used = used
            first_segment = int(meta["segment"])
            break
        if rec.checkpoints_damaged and rec.checkpoint_used == "none":
            log.error("journal.rebuilt_from_wal", first_segment=first_segment)
        self.checkpoint_segment = first_segment
        segments = [s for s in self._segments() if s >= first_segment]
        # A checkpoint's segment is created (and its directory entry made durable) before the
        # checkpoint names it, and segments are numbered without gaps: one missing from the
        # run is lost, with whatever it held (it replayed as a clean recovery before)
        present = set(segments)
        if rec.checkpoint_used != "none":
            missing = [s for s in range(first_segment, max([first_segment, *segments]) + 1)
                       if s not in present]  # fmt: skip
        else:  # no checkpoint (a first start has no segment either): gaps only
            missing = [s for s in range(min(segments, default=0), max(segments, default=-1))
                       if s not in present]  # fmt: skip
        if missing:
            rec.missing_segments = len(missing)
            log.error("journal.segments_missing", segments=missing[:16], count=len(missing),
                      dir=str(self.dir))  # fmt: skip
        for seg in segments:
            self._replay_segment(seg, rec)
        self.segment = max([first_segment, *segments]) + 1
        return rec

    def _replay_segment(self, segment: int, rec: Recovered) -> None:
        """Frames are fixed-size: verify every check, skip (and count) the frames that fail,
        and decode the rest: commits and deletes as numpy records, others in log order."""
        data = self._segment_path(segment).read_bytes()
        count = len(data) // FRAME_BYTES
        frames = np.frombuffer(data, dtype=np.uint8, count=count * FRAME_BYTES)
        frames = frames.reshape(count, FRAME_BYTES)
        header = frames[:, : _HDR.size].copy().view("<u4")  # (count, 2): body_len, check
        view = memoryview(data)
        checks = np.fromiter(
            (
                _check(view[i * FRAME_BYTES + _HDR.size : (i + 1) * FRAME_BYTES])
                for i in range(count)
            ),
            dtype=np.uint32,
            count=count,
        )
        good = (header[:, 0] == BODY_BYTES) & (header[:, 1] == checks)
        bodies = frames[good, _HDR.size :]
        ops = bodies[:, 0]
        commits = np.ascontiguousarray(bodies[ops == OP_COMMIT]).view(COMMIT_DTYPE).reshape(-1)
        deletes = np.ascontiguousarray(bodies[ops == OP_DELETE][:, : DELETE_DTYPE.itemsize])
        deletes = deletes.view(DELETE_DTYPE).reshape(-1)
        for row in bodies[(ops != OP_COMMIT) & (ops != OP_DELETE)]:
            _apply_other(row.tobytes(), rec)
        for records, out in ((commits, rec.wal_commits), (deletes, rec.wal_deletes)):
            if len(records):
                out.append(records)
                rec.next_seq = max(rec.next_seq, int(records["seq"].max()) + 1)
        valid = int(good.sum())
        rec.wal_records += valid
        if valid != count:
            rec.damaged_frames += count - valid
            log.error(
                "journal.damaged_frames",
                segment=segment,
                frames_skipped=count - valid,
                frames_replayed=valid,
                first_bad_offset=int(np.argmin(good)) * FRAME_BYTES,
            )
        if count * FRAME_BYTES != len(data):
            rec.torn_segments += 1
            log.warning(
                "journal.torn_tail",
                segment=segment,
                valid_bytes=count * FRAME_BYTES,
                file_bytes=len(data),
            )

    def _segments(self) -> list[int]:
        found = []
        for name in os.listdir(self.dir):
            m = SEGMENT_RE.match(name)
            if m:
                found.append(int(m.group(1)))
        return sorted(found)

    def _segment_path(self, segment: int) -> Path:
        return self.dir / f"wal-{segment:010d}.log"


def _ids_check(body: dict[str, str]) -> str:
    return xxhash.xxh3_64_hexdigest(json.dumps(body, sort_keys=True).encode())


def _apply_other(body: bytes, rec: Recovered) -> None:
    """Tenant and quarantine records (rare): applied in log order."""
    op = body[0]
    if op == OP_TENANT:
        _, tenant, seq = _TENANT.unpack_from(body)
        rec.tenants[tenant] = body[_TENANT.size :].rstrip(b"\0").decode()
    elif op == OP_TENANT_REMOVE:
        _, tenant, seq = _TENANT.unpack_from(body)
        rec.tenants.pop(tenant, None)
        rec.quarantined = {q for q in rec.quarantined if q[0] != tenant}
        rec.removed_tenants[tenant] = max(seq, rec.removed_tenants.get(tenant, 0))
    elif op in (OP_QUARANTINE, OP_UNQUARANTINE):
        _, tenant, seq, tier, lba, count = _EXTENT.unpack_from(body)
        if op == OP_QUARANTINE:
            rec.quarantined.add((tenant, tier, lba, count))
        else:
            rec.quarantined.discard((tenant, tier, lba, count))
    else:
        raise JournalError(
            f"journal record with op {op} (check valid): written by a newer agent version? "
            "Upgrade, or restore from a backup"
        )
    rec.next_seq = max(rec.next_seq, seq + 1)


def _write_checkpoint_file(f: Any, columns: dict[str, np.ndarray], meta: dict[str, Any]) -> int:
    """`MAGIC | u32 header_len | JSON header | column bytes... | u64 xxh3-64 of all before`.
    Columns start at 64-byte offsets so they load as zero-copy numpy views."""
    layout, offset = [], 0
    for name, col in columns.items():
        col = np.ascontiguousarray(col)
        layout.append({"name": name, "dtype": col.dtype.str, "count": len(col), "offset": offset})
        offset += -(-col.nbytes // 64) * 64
    header = json.dumps({"meta": meta, "columns": layout}).encode()
    prefix = CHECKPOINT_MAGIC + struct.pack("<I", len(header)) + header
    prefix += bytes(-len(prefix) % 64)
    digest = xxhash.xxh3_64(prefix)
    f.write(prefix)
    for col in columns.values():
        data = np.ascontiguousarray(col).tobytes()
        data += bytes(-len(data) % 64)
        digest.update(data)
        f.write(data)
    f.write(digest.digest())
    return len(prefix) + offset + 8


def _read_checkpoint_file(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    data = path.read_bytes()
    if data[: len(CHECKPOINT_MAGIC)] != CHECKPOINT_MAGIC or len(data) < 80:
        raise JournalError(f"{path} is not a checkpoint of this format; restore from a backup")
    if xxhash.xxh3_64_digest(memoryview(data)[:-8]) != data[-8:]:
        raise JournalError(f"{path} is corrupt (checksum mismatch); restore from a backup")
    (header_len,) = struct.unpack_from("<I", data, len(CHECKPOINT_MAGIC))
    start = len(CHECKPOINT_MAGIC) + 4
    header = json.loads(data[start : start + header_len])
    base = start + header_len + (-(start + header_len) % 64)
    columns = {
        c["name"]: np.frombuffer(data, np.dtype(c["dtype"]), c["count"], base + c["offset"])
        for c in header["columns"]
    }
    return columns, header["meta"]


def _lock_dir(directory: Path) -> int:
    path = directory / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise JournalError(
            f"journal {directory} is in use by another agent (pid {holder}); stop it, or give "
            "this one another data_dir"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def replace_file(path: Path, data: bytes) -> None:
    """Replace `path` with `data` durably: a 0600 temporary beside it, fsync, rename, directory
    fsync; on failure the temporary is removed and the old file stays."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        os.fchmod(fd, 0o600)  # even if a temporary was left by a crash with other bits
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
