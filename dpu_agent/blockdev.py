"""Block devices: what a tier stores chunks on and what the NVMe/TCP target exports.

One interface for every backing store, so the engine, the embedded NVMe/TCP target and SPDK
mode see the same thing: a memory region (the DPU DRAM tier), a file or block device (the NVMe
tier in embedded mode), an encrypting wrapper (as SPDK's crypto vbdev), or a namespace reached
over NVMe/TCP (SPDK mode). Blocks are 4096 bytes; LBAs count blocks.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat
import threading
from typing import Any, Protocol, runtime_checkable

from kvproto.nvme import BLOCK_BYTES

BLOCK_SIZE = BLOCK_BYTES  # the tiers' block: the namespace block the target exports
# A file-backed tier starts the kernel's write-out after this many bytes written (as RocksDB's
# `bytes_per_sync` and PostgreSQL's `backend_flush_after`): without it, a second of puts leaves
# hundreds of MiB dirty and the group-commit fsync then flushes them in one burst, which on the
# 2-vCPU box stalled every thread of the machine for 2-6 ms (docs/BENCHMARKS.md, "lookup during
# sync"). 1 MiB: one KV chunk; smaller kicks cost a syscall per write for no gain measured.
WRITEBACK_AFTER_BYTES = 1 << 20
_SYNC_FILE_RANGE_WRITE = 2  # <fcntl.h>: start write-out of dirty pages, do not wait for it


class BlockDeviceError(Exception):
    """An operating error of a backing store (full disk, I/O error, out-of-range LBA)."""


@runtime_checkable
class BlockDevice(Protocol):
    """`read_into` fills `buf` (a multiple of block_size) from `lba` on; `write` stores `data`.

    Every implementation also declares its I/O traits, the four booleans below (a class
    attribute or a property): what an I/O of the device costs, from which the NVMe/TCP target
    decides where it runs (dpu_agent/nvmf/_placement.py).
    """

    @property
    def block_size(self) -> int: ...

    @property
    def block_count(self) -> int: ...

    @property
    def in_memory(self) -> bool:
        """Reads and writes are memory work only, with no system call that could block."""
        ...

    @property
    def lends_memory(self) -> bool:
        """The device is a MemoryViewDevice: `view()` lends its own bytes (zero copy)."""
        ...

    @property
    def mapped_reads(self) -> bool:
        """Reads are one pass out of a mapped page cache: memory work while the pages are
        cached, a wait on the disk where they are not."""
        ...

    @property
    def buffered_writes(self) -> bool:
        """Writes end in the page cache: a copy that only blocks when the kernel throttles the
        writer (dirty limits)."""
        ...

    def read_into(self, lba: int, buf: memoryview) -> None: ...

    def write(self, lba: int, data: memoryview | bytes) -> None: ...

    def flush(self) -> None: ...

    def deallocate(self, lba: int, block_count: int) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class MemoryViewDevice(Protocol):
    """The capability behind `lends_memory`: a device that is memory (a DRAM tier).

    `view(lba, block_count)` returns a writable memoryview of the device's own bytes for that
    range. With it the target sends reads straight from, and receives writes straight into,
    the device: no copy through its own buffers (measured here: 15-25 % less target CPU per
    byte). Writes then land as they arrive, so a read overlapping a write in flight may see
    part of a block updated (NVMe orders neither; the engine never overlaps them).
    """

    def view(self, lba: int, block_count: int) -> memoryview: ...


@runtime_checkable
class PageCacheMappedDevice(Protocol):
    """A device that can lend a read-only view of its page cache (FileBlockDevice.mapped)."""

    def mapped(self, lba: int, block_count: int) -> memoryview | None: ...


def check_range(dev: BlockDevice, lba: int, nbytes: int) -> int:
    """Validate an I/O and return its block count; raises BlockDeviceError when out of range."""
    if nbytes % dev.block_size:
        raise BlockDeviceError(f"I/O of {nbytes} bytes is not a multiple of {dev.block_size}")
    count = nbytes // dev.block_size
    if lba < 0 or lba + count > dev.block_count:
        raise BlockDeviceError(
            f"LBA range {lba}+{count} outside device of {dev.block_count} blocks"
        )
    return count


class MemoryBlockDevice:
    """DRAM tier: an anonymous mmap (page-aligned, zero-filled, not swapped into Python's heap)."""

    in_memory = True
    lends_memory = True
    mapped_reads = False
    buffered_writes = False

    def __init__(self, block_count: int, block_size: int = BLOCK_SIZE) -> None:
        assert block_count > 0 and block_size > 0, (block_count, block_size)
        self._block_size = block_size
        self._block_count = block_count
        self._map = mmap.mmap(-1, block_count * block_size)
        self._view = memoryview(self._map)

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def block_count(self) -> int:
        return self._block_count

    def read_into(self, lba: int, buf: memoryview) -> None:
        check_range(self, lba, len(buf))
        start = lba * self._block_size
        buf[:] = self._view[start : start + len(buf)]

    def write(self, lba: int, data: memoryview | bytes) -> None:
        check_range(self, lba, len(data))
        start = lba * self._block_size
        self._view[start : start + len(data)] = data

    def view(self, lba: int, block_count: int) -> memoryview:
        """The device's own bytes for an extent: the NVMe/TCP target sends from and receives
        into them with no copy. Callers hold a lease or reservation on the extent."""
        check_range(self, lba, block_count * self._block_size)
        start = lba * self._block_size
        return self._view[start : start + block_count * self._block_size]

    def flush(self) -> None:
        pass

    def deallocate(self, lba: int, block_count: int) -> None:
        check_range(self, lba, block_count * self._block_size)
        start = lba * self._block_size
        self._view[start : start + block_count * self._block_size] = bytes(
            block_count * self._block_size
        )

    def close(self) -> None:
        self._view.release()
        self._map.close()


class FileBlockDevice:
    """NVMe tier in embedded mode: a regular file (created and sized) or a block device.

    Uses positional I/O (`os.preadv`/`os.pwritev`); the page cache is kept, since O_DIRECT needs
    aligned user buffers that callers do not always own, and ext4 on virtio measured no faster
    at QD1 (docs/MEASURED.md). A full disk surfaces as BlockDeviceError(ENOSPC).

    `mapped(lba, block_count)` lends a read-only view of the file's page cache (one shared
    mmap of the whole device), so a reader that can survive a page the kernel cannot supply
    (CryptoBlockDevice: its cipher pass catches the SIGBUS) reads without the preadv copy.
    Writes never go through the mapping: a write fault on a sparse file with a full disk is a
    SIGBUS too, where pwritev says ENOSPC.
    """

    in_memory = False
    lends_memory = False
    # Its own reads are preadv copies (a CryptoBlockDevice over it reads through `mapped`).
    mapped_reads = False
    # Writes are copies into the page cache (no O_DIRECT): the NVMe/TCP target runs them on its
    # loop, and sends them to its I/O pool when the kernel makes one wait (nvmf/_placement.py).
    buffered_writes = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        block_count: int | None = None,
        block_size: int = BLOCK_SIZE,
        *,
        writeback_after_bytes: int = WRITEBACK_AFTER_BYTES,
    ) -> None:
        """`writeback_after_bytes`: start the kernel's write-out of this file's dirty pages each
        time that many bytes were written since the last start (0: leave it all to flush())."""
        self._block_size = block_size
        self.path = os.fspath(path)
        self._writeback_after = writeback_after_bytes if _sync_file_range() else 0
        self._unkicked = 0
        # The file system under the file refused the last write for space (it is sparse:
        # sized at open, its blocks taken as they are written); writes since it refused.
        self.full = False
        self.full_writes = 0
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise BlockDeviceError(f"cannot open {self.path}: {e.strerror}") from e
        # One process at a time: two agents given the same [storage] nvme_dir overwrote each
        # other's chunks. A POSIX record lock (per process, gone with it, kill -9 included);
        # not flock, which would refuse this process's own reopen of the file after a crash
        # it simulates (the tests, `dpuctl bench recovery`).
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self._fd)
            raise BlockDeviceError(
                f"{self.path} is in use by another process (another agent with the same "
                "[storage] nvme_dir?): give each agent its own"
                if e.errno in (errno.EACCES, errno.EAGAIN)
                else f"cannot lock {self.path}: {e.strerror}"
            ) from e
        st = os.fstat(self._fd)
        if stat.S_ISBLK(st.st_mode):
            size = os.lseek(self._fd, 0, os.SEEK_END)
        else:
            size = st.st_size
            if block_count is not None and size < block_count * block_size:
                try:
                    os.ftruncate(self._fd, block_count * block_size)
                except OSError as e:
                    os.close(self._fd)
                    raise BlockDeviceError(f"cannot size {self.path}: {e.strerror}") from e
                size = block_count * block_size
        self._block_count = size // block_size if block_count is None else block_count
        if self._block_count <= 0:
            os.close(self._fd)
            raise BlockDeviceError(f"{self.path} has no blocks; give block_count to create it")
        # The descriptor outlives close() while a call still uses it: a tenant removed while
        # the tick fsyncs every device (or a read or write is in flight outside the engine
        # lock) closed it under the call, which then raised on -1 (the agent stopped) or could
        # have used the number after the kernel gave it to another file.
        self._fd_lock = threading.Lock()
        self._fd_users = 0
        self._closing = False
        self._map: mmap.mmap | None = None
        self._map_view: memoryview | None = None
        try:  # address space only: pages come in as they are read
            self._map = mmap.mmap(self._fd, self._block_count * block_size, prot=mmap.PROT_READ)
            self._map_view = memoryview(self._map)
        except (OSError, ValueError):  # a file system or device that cannot be mapped
            pass

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def block_count(self) -> int:
        return self._block_count

    def _take(self) -> int | None:
        """The descriptor, held open until `_done()`; None once the device is closed."""
        with self._fd_lock:
            if self._closing:
                return None
            self._fd_users += 1
            return self._fd

    def _use(self, what: str) -> int:
        """`_take`, or BlockDeviceError once the device is closed."""
        fd = self._take()
        if fd is None:
            raise BlockDeviceError(f"{what} {self.path}: the device is closed")
        return fd

    def _done(self) -> None:
        with self._fd_lock:
            self._fd_users -= 1
            if self._closing and not self._fd_users and self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def read_into(self, lba: int, buf: memoryview) -> None:
        check_range(self, lba, len(buf))
        offset, done = lba * self._block_size, 0
        fd = self._use("read")
        try:
            while done < len(buf):
                try:
                    n = os.preadv(fd, [buf[done:]], offset + done)
                except OSError as e:
                    raise BlockDeviceError(f"read {self.path} at LBA {lba}: {e.strerror}") from e
                if n == 0:  # sparse tail past EOF of a file that was never written
                    buf[done:] = bytes(len(buf) - done)
                    return
                done += n
        finally:
            self._done()

    def mapped(self, lba: int, block_count: int) -> memoryview | None:
        """A read-only view of blocks `lba`.. in the file's memory mapping, or None where the
        file cannot be mapped (then use read_into). Reading it raises SIGBUS where a page
        cannot be read: only for callers that catch that (XtsCipher.decrypt_mapped_into)."""
        check_range(self, lba, block_count * self._block_size)
        view = self._map_view
        if view is None:
            return None
        start = lba * self._block_size
        return view[start : start + block_count * self._block_size]

    def drop_cache(self) -> None:
        """Evict the file's clean pages from memory, so that the next reads come from the disk:
        first out of this device's own mapping (a page mapped into a process is not dropped by
        posix_fadvise), then out of the page cache. Dirty pages stay until flushed."""
        if self._map is not None:
            self._map.madvise(mmap.MADV_DONTNEED)
        fd = self._use("drop the cache of")
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            self._done()

    def write(self, lba: int, data: memoryview | bytes) -> None:
        check_range(self, lba, len(data))
        view, offset, done = memoryview(data), lba * self._block_size, 0
        fd = self._use("write")
        try:
            while done < len(view):
                try:
                    done += os.pwritev(fd, [view[done:]], offset + done)
                except OSError as e:
                    code = "full" if e.errno == errno.ENOSPC else "error"
                    if e.errno == errno.ENOSPC:  # a sparse file larger than its free space
                        self.full = True
                        self.full_writes += 1
                    raise BlockDeviceError(
                        f"write {self.path} at LBA {lba} ({code}): {e.strerror}"
                    ) from e
            self.full = False
            self._unkicked += len(view)
            if self._writeback_after and self._unkicked >= self._writeback_after:
                self._start_writeback(fd)
        finally:
            self._done()

    def _start_writeback(self, fd: int) -> None:
        """Start write-out of the whole file's dirty pages without waiting for it (flush() still
        makes them durable). A failure here is not an error of the write that triggered it: the
        data is in the page cache and flush() reports what the disk refused."""
        self._unkicked = 0
        sync_file_range = _sync_file_range()
        assert sync_file_range is not None
        sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)

    def flush(self) -> None:
        """Make what was written durable; nothing to do once closed (a removed tenant's
        device: an error here would fence every tenant's writes)."""
        fd = self._take()
        if fd is None:
            return
        try:
            os.fdatasync(fd)
        except OSError as e:
            raise BlockDeviceError(f"flush {self.path}: {e.strerror}") from e
        finally:
            self._done()

    def deallocate(self, lba: int, block_count: int) -> None:
        check_range(self, lba, block_count * self._block_size)
        # Punching holes needs fallocate(PUNCH_HOLE), which os does not expose; zero instead.
        self.write(lba, bytes(block_count * self._block_size))

    def close(self) -> None:
        if self._map is not None:
            assert self._map_view is not None
            self._map_view.release()
            try:
                self._map.close()
            except BufferError:  # a view still lent out: the mapping goes with its last user
                pass
            self._map = self._map_view = None
        with self._fd_lock:  # the last call still using the descriptor closes it
            self._closing = True
            if not self._fd_users and self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


_SFR: list[Any] = []  # [function or None], with the ffi and library objects it needs kept alive


def _sync_file_range() -> Any:
    """glibc's sync_file_range(2) through cffi (Python's os module does not expose it), loaded
    once; None where the C library lacks it (not Linux). cffi drops the GIL during the call."""
    if not _SFR:
        import cffi

        ffi = cffi.FFI()
        ffi.cdef("int sync_file_range(int fd, int64_t offset, int64_t nbytes, unsigned int flags);")
        try:
            lib = ffi.dlopen(None)
            _SFR[:] = [lib.sync_file_range, ffi, lib]
        except (OSError, AttributeError):
            _SFR[:] = [None]
    return _SFR[0]
