"""CryptoBlockDevice: AES-XTS over any BlockDevice, like SPDK's crypto vbdev over its base bdev.

The base device only ever sees ciphertext. Sector i of an I/O at `lba` is tweaked with
`lba + i`, the LBA on the base device (the crypto vbdev maps blocks 1:1), so a namespace written
here reads back through SPDK's crypto vbdev with the same key and the other way round.
"""

from __future__ import annotations

import threading
from typing import cast

from dpu_agent.blockdev import (
    BlockDevice,
    MemoryViewDevice,
    PageCacheMappedDevice,
    check_range,
)
from dpu_agent.crypto.xts import XtsCipher, Xxh3

__all__ = ["SCRATCH_BYTES_MAX", "CryptoBlockDevice"]

# Writes are encrypted through a per-thread scratch buffer of at most this size (the caller's
# data is never modified): 4 MiB is where a QD1 pwritev reaches full speed here
# (docs/MEASURED.md), and it bounds memory to 4 MiB per writing thread.
SCRATCH_BYTES_MAX = 4 << 20
# One scratch buffer per writing thread, shared by every device: a write fills and empties it
# before it returns. (One per device per thread cost 4 MiB per tenant per writing thread:
# 100 tenants with one chunk each held 425 MiB, found by an attack pass.)
_LOCAL = threading.local()


class CryptoBlockDevice:
    """Encrypts writes and decrypts reads of `base`; safe to call from several threads at once.

    Takes ownership of `base`: `close()` closes it. `deallocate` passes through, so a
    deallocated range reads back as the decryption of zeros (as with SPDK's crypto vbdev):
    callers must not read blocks they have not written.
    """

    def __init__(self, base: BlockDevice, cipher: XtsCipher) -> None:
        if cipher.block_size != base.block_size:
            raise ValueError(
                f"cipher block_size {cipher.block_size} != base device block_size "
                f"{base.block_size}; build XtsCipher(key, block_size={base.block_size})"
            )
        self._base = base
        self._cipher = cipher
        self._block_size = base.block_size
        # Whole blocks only: a write is split at block boundaries.
        self._scratch_bytes = max(
            self._block_size, SCRATCH_BYTES_MAX // self._block_size * self._block_size
        )
        # A base that lends its memory (`view`, the DRAM tier): encrypt into and decrypt out of
        # it directly, one pass over the bytes instead of a cipher pass plus a copy.
        self._lends = base.lends_memory
        self._view_base = cast(MemoryViewDevice, base)
        # A base that maps its page cache for reading (`mapped`, the NVMe tier's file): reads
        # decrypt straight out of it, guarded against a page the kernel cannot supply.
        self._maps = isinstance(base, PageCacheMappedDevice)
        self._mapped_base = cast(PageCacheMappedDevice, base)

    def __repr__(self) -> str:
        return f"CryptoBlockDevice(base={self._base!r}, cipher={self._cipher!r})"

    @property
    def base(self) -> BlockDevice:
        return self._base

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def block_count(self) -> int:
        return self._base.block_count

    @property
    def in_memory(self) -> bool:
        """Whether reads and writes are memory work only: the base lends its memory (the DRAM
        tier), so an I/O is one cipher pass between the caller's buffer and the base's bytes,
        with no system call that could block (the NVMe/TCP target runs these inline)."""
        return self._lends

    @property
    def mapped_reads(self) -> bool:
        """Whether reads are one cipher pass out of the base's page cache (a mapped file tier):
        memory work while the pages are cached, a wait on the disk where they are not."""
        return self._maps

    @property
    def buffered_writes(self) -> bool:
        """Whether writes end in the base's page cache (a file tier): a cipher pass and a copy
        that only block when the kernel throttles the writer (see FileBlockDevice)."""
        return self._base.buffered_writes

    @property
    def lends_memory(self) -> bool:
        """Never: the bytes stored are ciphertext, the caller's are plaintext."""
        return False

    def _scratch(self) -> memoryview:
        view: memoryview | None = getattr(_LOCAL, "scratch", None)
        if view is None or len(view) < self._scratch_bytes:
            view = memoryview(bytearray(self._scratch_bytes))
            _LOCAL.scratch = view
        return view

    def read_into(self, lba: int, buf: memoryview) -> None:
        """Decrypt the blocks at `lba` into `buf`: straight out of a base that lends its memory
        or maps its page cache, else read the ciphertext into `buf` and decrypt it there (no
        extra buffer). A mapped page that cannot be read is read again with the base's
        read_into, which raises its error."""
        check_range(self, lba, len(buf))
        if self._lends:
            src = self._view_base.view(lba, len(buf) // self._block_size)
            self._cipher.decrypt_into(src, buf, lba)
            return
        if self._maps:
            cached = self._mapped_base.mapped(lba, len(buf) // self._block_size)
            if cached is not None and self._cipher.decrypt_mapped_into(cached, buf, lba):
                return
        self._base.read_into(lba, buf)
        self._cipher.decrypt_into(buf, buf, lba)

    def read_hashed_into(self, lba: int, buf: memoryview, hasher: Xxh3, nbytes: int) -> None:
        """`read_into`, and the first `nbytes` of plaintext fed to `hasher` inside the same
        cipher pass (the NIXL get's checksum, without a second pass over the bytes); a partial
        tail block is hashed after."""
        check_range(self, lba, len(buf))
        assert 0 <= nbytes <= len(buf), (nbytes, len(buf))
        whole = nbytes // self._block_size * self._block_size
        if self._lends:
            src = self._view_base.view(lba, len(buf) // self._block_size)
        else:
            self._base.read_into(lba, buf)
            src = buf
        self._cipher.decrypt_into(src[:whole], buf[:whole], lba, hasher=hasher)
        if whole < len(buf):
            tail_lba = lba + whole // self._block_size
            self._cipher.decrypt_into(src[whole:], buf[whole:], tail_lba)
            hasher.update(buf[whole:nbytes])

    def write(self, lba: int, data: memoryview | bytes) -> None:
        """Encrypt `data` piecewise into this thread's scratch buffer and write each piece."""
        view = memoryview(data)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        check_range(self, lba, len(view))
        if self._lends:
            dst = self._view_base.view(lba, len(view) // self._block_size)
            self._cipher.encrypt_into(view, dst, lba)
            return
        scratch = self._scratch()
        done = 0
        while done < len(view):
            n = min(len(view) - done, self._scratch_bytes)
            piece_lba = lba + done // self._block_size
            self._cipher.encrypt_into(view[done : done + n], scratch[:n], piece_lba)
            self._base.write(piece_lba, scratch[:n])
            done += n

    def flush(self) -> None:
        self._base.flush()

    def deallocate(self, lba: int, block_count: int) -> None:
        self._base.deallocate(lba, block_count)

    def close(self) -> None:
        self._base.close()
