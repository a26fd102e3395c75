"""The commit log: the journal, the sequence counter and the write fence.

Every change to a persistent record is appended here before the index changes (the engine's
`Records` does that). A failing append or fsync fences writes (`check_writable` refuses them)
until a probe passes; reads go on. Called with the engine lock held, except `sync` and
`write_checkpoint`, which do disk I/O and run without it.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dpu_agent.blockdev import BlockDevice, BlockDeviceError
from dpu_agent.engine.errors import JournalUnavailable
from dpu_agent.engine.journal import Journal, JournalError, JournalLost
from dpu_agent.log import get_logger
from dpu_agent.metrics import REGISTRY, Counter, Gauge

__all__ = ["CommitLog", "errno_of"]

log = get_logger(__name__)

_FENCED = Gauge(
    "kvtier_engine_journal_fenced",
    "1 while the journal cannot take writes and the engine refuses them",
    registry=REGISTRY,
)
_JOURNAL_ERRORS = Counter(
    "kvtier_engine_journal_errors",
    "Journal appends or fsyncs that failed (each fences writes until a probe passes)",
    ["reason"],
    registry=REGISTRY,
)


class CommitLog:
    """Owns the `Journal`, the next sequence number `seq` and the fence (the journal error
    that refuses writes, None while writable)."""

    def __init__(self, journal_dir: str | Path) -> None:
        self.journal = Journal(journal_dir)
        self.seq = 1
        self.fence: JournalError | None = None
        # the live segment lost what was appended (journal.lost()): a checkpoint from memory
        # must land before the fence lifts; a probe alone would not bring the records back
        self.rewrite_due = False
        # the live segment's header (its tenant frames) was not written: write it when the
        # fence lifts, before anything else is appended there
        self.header_due = False

    def next_seq(self) -> int:
        seq = self.seq
        self.seq += 1
        return seq

    # --- the fence ---------------------------------------------------------------------------

    def check_writable(self) -> None:
        """Refuse a write while the journal is fenced (reads go on)."""
        if self.fence is not None:
            raise self.unavailable(self.fence)

    @staticmethod
    def unavailable(e: JournalError) -> JournalUnavailable:
        full = e.errno == errno.ENOSPC
        what = "the disk holding the journal is full" if full else "the journal cannot be written"
        return JournalUnavailable(
            f"writes refused: {what} ({e}); free space or fix the disk, the agent retries "
            "every tick; reads are still served",
            full=full,
        )

    def set_fence(self, e: JournalError) -> None:
        _JOURNAL_ERRORS.labels("full" if e.errno == errno.ENOSPC else "io").inc()
        if self.fence is None:
            log.error("engine.journal_fenced", error=str(e), errno=e.errno)
            _FENCED.set(1)
        self.fence = e

    def try_lift_fence(self) -> None:
        """Probe the journal (cut back, write, fsync, cut back); lift the fence if it works.
        A lost segment keeps its fence until the checkpoint that replaces it lands."""
        if self.rewrite_due:
            return
        try:
            self.journal.probe()
        except JournalError as e:
            self.fence = e
            return
        self.lift_fence()

    def lift_fence(self) -> None:
        if self.fence is not None:
            log.warning("engine.journal_writable", was=str(self.fence))
        self.fence = None
        _FENCED.set(0)

    def check_lost(self) -> bool:
        """True when the live segment was truncated, deleted or replaced underneath the agent
        and a rewrite is due (writes fenced until then)."""
        if not self.rewrite_due:
            why = self.journal.lost()
            if why is not None:
                log.error("engine.journal_lost", error=why)
                self.set_fence(JournalError(f"{why}; rewriting it from memory"))
                self.rewrite_due = True
        return self.rewrite_due

    def save_tenant_ids(self, names: dict[int, str], *, soft: bool) -> None:
        """Write tenant-ids.json; a failure raises JournalUnavailable, or with `soft` is
        logged (the WAL and the checkpoint still name every tenant)."""
        try:
            self.journal.save_tenant_ids(names)
        except JournalError as e:
            if not soft:
                raise self.unavailable(e) from e
            log.warning("engine.tenant_ids_not_written", error=str(e))

    # --- appends -----------------------------------------------------------------------------

    def append(self, body: bytes) -> None:
        """Append one frame; on failure fence writes and raise JournalUnavailable. Callers
        append before they change the index, so a failure leaves nothing half-done."""
        self.check_writable()
        try:
            self.journal.append(body)
        except JournalError as e:
            self._failed(e)
            raise self.unavailable(e) from e

    def append_soft(self, body: bytes) -> None:
        """Append a frame whose loss costs no acknowledged data (a quarantine, a segment
        header); on failure fence writes but do not raise (the state it records is kept in
        memory and goes into the next checkpoint)."""
        if self.fence is not None:
            return
        try:
            self.journal.append(body)
        except JournalError as e:
            self._failed(e)

    def _failed(self, e: JournalError) -> None:
        if isinstance(e, JournalLost) and not self.rewrite_due:
            log.error("engine.journal_lost", error=str(e))
            e = JournalError(f"{e}; rewriting it from memory")
            self.rewrite_due = True
        self.set_fence(e)

    # --- disk I/O, without the engine lock ---------------------------------------------------

    def sync(self, devices: Sequence[BlockDevice]) -> JournalError | None:
        """Chunk data first, then the journal: a synced commit never points at unsynced data.
        Returns the error that must fence writes (the caller sets it under the lock)."""
        try:
            for dev in devices:
                dev.flush()
            self.journal.sync()
        except (BlockDeviceError, OSError, JournalError) as e:
            return e if isinstance(e, JournalError) else JournalError(str(e), errno_of(e))
        return None

    def write_checkpoint(
        self, devices: Sequence[BlockDevice], columns: dict[str, np.ndarray], meta: dict[str, Any]
    ) -> int:
        """Flush the chunk data, then write the checkpoint; returns its size in bytes. Raises
        JournalError (a device error converted) for the caller to fence under the lock."""
        try:
            for dev in devices:
                dev.flush()
            return self.journal.write_checkpoint(columns, meta)
        except BlockDeviceError as e:
            raise JournalError(str(e), errno_of(e)) from e


def errno_of(e: BaseException) -> int | None:
    """The OS error number behind a device error (its cause), if any."""
    cur: BaseException | None = e
    while cur is not None:
        if isinstance(cur, OSError) and cur.errno is not None:
            return cur.errno
        cur = cur.__cause__ or cur.__context__
    return None
