"""AES-XTS exactly as SPDK's crypto vbdev with the SIMPLE_LBA tweak mode.

The XTS key is `key || key2` (64 bytes for AES-256-XTS; 32 for AES-128-XTS, which SPDK accepts
too and which the recorded vectors use); one data unit per block; the 16-byte tweak is 8 zero
bytes followed by the LBA as a little-endian u64 (`struct.pack("<QQ", 0, lba)`, checked against
ciphertext a real SPDK target wrote: tests/data/spdk/xts_vectors.json). A namespace written by
the DPU's crypto engine is therefore readable here and the other way round.

The per-sector loop runs in C (`xts_loop.c`, built by `_build.py`): AVX-512 VAES where the CPU
has it, else OpenSSL's EVP. Each thread gets its own pair of handles (key schedules done once
per cipher), so calls from several threads run in parallel without a lock.

`Xxh3` is an xxh3-128 state in the same C module (the real xxHash, inlined from Debian's
`libxxhash-dev`); handed to `encrypt_into`/`decrypt_into` as `hasher`, it is fed each sector's
plaintext inside the cipher pass, while the sector is in L1, instead of in a second pass.
"""

from __future__ import annotations

import hmac
import threading
from typing import Any

from dpu_agent.crypto._loader import IMPLEMENTATIONS, best_implementation, ffi, lib
from dpu_agent.crypto.keystore import XTS_KEY_BYTES

__all__ = [
    "XTS_KEY_BYTES",
    "XTS_TWEAK_OFFSET",
    "XtsCipher",
    "Xxh3",
    "available_implementations",
]

XTS_KEY_BYTES_ALLOWED = (32, 64)
XTS_TWEAK_OFFSET = 8  # the LBA sits in tweak bytes 8..15 (bytes 0..7 are zero)
BLOCK_SIZE_MIN = 512
BLOCK_SIZE_MAX = 1 << 20  # OpenSSL caps one XTS data unit at 16 MiB; real blocks are <= 64 KiB
LBA_MAX = (1 << 64) - 1
# Sectors per C call: keeps the C return code (-(index+1)) inside an int and a single call
# bounded; larger buffers are processed in several calls.
SECTORS_PER_CALL_MAX = 1 << 20
_RC_OVERLAP = 1  # dpukv_xts_run: src and dst overlap without being the same buffer
_RC_FAULT = 2  # dpukv_xts_run_mapped: reading the mapped source raised SIGBUS


def available_implementations() -> list[str]:
    """Implementations this CPU runs, slowest first: 'evp', then 'vaes' where supported."""
    best = best_implementation()
    return ["evp"] if best == "evp" else ["evp", best]


def _c_buffer(buf: Any, *, writable: bool) -> Any:
    """A cffi byte array over `buf` without copying; ValueError for what cannot be one."""
    try:
        return ffi.from_buffer("unsigned char[]", buf, require_writable=writable)
    except BufferError:
        raise ValueError(f"destination buffer ({type(buf).__name__}) is read-only") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"XTS buffers must be C-contiguous bytes-like objects: {e}") from None


class Xxh3:
    """A streaming xxh3-128 (seed 0) over `prefix` and then whatever is fed to it: `digest()`
    equals `xxhash.xxh3_128(prefix).update(...).digest()` bit for bit. Feed it in order, from
    one thread at a time (the C state has no lock)."""

    __slots__ = ("_state",)

    def __init__(self, prefix: bytes = b"") -> None:
        raw = lib.dpukv_xxh3_new(prefix, len(prefix))
        if raw == ffi.NULL:
            raise MemoryError("could not allocate an xxh3 state")
        self._state = ffi.gc(raw, lib.dpukv_xxh3_free)

    def update(self, data: Any) -> None:
        buf = _c_buffer(data, writable=False)
        lib.dpukv_xxh3_update(self._state, buf, len(buf))

    def digest(self) -> bytes:
        out = ffi.new("unsigned char[16]")
        lib.dpukv_xxh3_digest(self._state, out)
        return bytes(ffi.buffer(out, 16))


class XtsCipher:
    """Encrypt/decrypt runs of `block_size`-byte sectors, sector i tweaked with `first_lba + i`."""

    __slots__ = ("_block_size", "_impl", "_key", "_key_bits", "_local")

    def __init__(self, key: bytes, *, block_size: int = 4096, implementation: str = "auto") -> None:
        if not isinstance(key, bytes | bytearray) or len(key) not in XTS_KEY_BYTES_ALLOWED:
            got = len(key) if isinstance(key, bytes | bytearray) else type(key).__name__
            raise ValueError(
                f"XTS key must be key||key2 of {XTS_KEY_BYTES} bytes (or 32 for AES-128-XTS), "
                f"got {got}"
            )
        half = len(key) // 2
        if hmac.compare_digest(bytes(key[:half]), bytes(key[half:])):
            raise ValueError(
                "XTS key halves are equal (key == key2), which XTS forbids and SPDK rejects "
                "('failed to create DEK'); generate two independent keys"
            )
        if not BLOCK_SIZE_MIN <= block_size <= BLOCK_SIZE_MAX or block_size & (block_size - 1):
            raise ValueError(
                f"block_size={block_size} must be a power of two in "
                f"[{BLOCK_SIZE_MIN}, {BLOCK_SIZE_MAX}]"
            )
        if implementation == "auto":
            implementation = best_implementation()
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"implementation={implementation!r} is unknown; use 'auto' or one of "
                f"{sorted(IMPLEMENTATIONS)}"
            )
        if implementation != "evp" and implementation != best_implementation():
            raise ValueError(f"this CPU cannot run the {implementation!r} AES-XTS implementation")
        self._impl = implementation
        self._key = bytes(key)
        self._key_bits = len(key) * 4
        self._block_size = block_size
        self._local = threading.local()

    def __repr__(self) -> str:
        return (
            f"XtsCipher(AES-{self._key_bits}-XTS, block_size={self._block_size}, "
            f"implementation={self._impl!r})"
        )

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def implementation(self) -> str:
        """'vaes' (AVX-512 VAES loop) or 'evp' (OpenSSL EVP loop)."""
        return self._impl

    def _handle(self, encrypt: bool) -> Any:
        """This thread's OpenSSL context for one direction, created on first use."""
        attr = "enc" if encrypt else "dec"
        handle = getattr(self._local, attr, None)
        if handle is None:  # first call of this thread and direction
            impl = IMPLEMENTATIONS[self._impl]
            raw = lib.dpukv_xts_new(self._key, len(self._key), 1 if encrypt else 0, impl)
            if raw == ffi.NULL:
                raise MemoryError(f"could not create an AES-XTS context ({self._impl})")
            handle = ffi.gc(raw, lib.dpukv_xts_free)
            setattr(self._local, attr, handle)
        return handle

    def _run(
        self,
        src: Any,
        dst: Any,
        first_lba: int,
        encrypt: bool,
        hasher: Xxh3 | None = None,
        mapped: bool = False,
    ) -> bool:
        # Lean on purpose: a 4 KiB call spends more time here than in the cipher.
        src_c = _c_buffer(src, writable=False)
        dst_c = _c_buffer(dst, writable=True)
        nbytes = len(src_c)
        if nbytes != len(dst_c):
            raise ValueError(f"src is {nbytes} bytes but dst is {len(dst_c)}; they must match")
        if nbytes % self._block_size:
            raise ValueError(f"{nbytes} bytes is not a multiple of block_size={self._block_size}")
        count = nbytes // self._block_size
        if not isinstance(first_lba, int) or first_lba < 0 or first_lba + count - 1 > LBA_MAX:
            raise ValueError(f"LBA range {first_lba}+{count} does not fit an unsigned 64-bit LBA")
        if count > SECTORS_PER_CALL_MAX:  # C checks overlap per call; check the whole once
            src_addr = int(ffi.cast("uintptr_t", src_c))
            dst_addr = int(ffi.cast("uintptr_t", dst_c))
            if src_addr != dst_addr and abs(src_addr - dst_addr) < nbytes:
                raise ValueError("src and dst overlap without being the same buffer (in place)")
        handle = self._handle(encrypt)
        done = 0
        while done < count:
            n = min(count - done, SECTORS_PER_CALL_MAX)
            off = done * self._block_size
            if mapped:
                rc = lib.dpukv_xts_run_mapped(
                    handle, src_c + off, dst_c + off, self._block_size, n, first_lba + done,
                    ffi.NULL if hasher is None else hasher._state,
                )  # fmt: skip
                if rc == _RC_FAULT:
                    return False
            elif hasher is None:
                rc = lib.dpukv_xts_run(
                    handle, src_c + off, dst_c + off, self._block_size, n, first_lba + done
                )
            else:
                rc = lib.dpukv_xts_run_xxh3(
                    handle, src_c + off, dst_c + off, self._block_size, n, first_lba + done,
                    hasher._state,
                )  # fmt: skip
            if rc == _RC_OVERLAP:
                raise ValueError("src and dst overlap without being the same buffer (in place)")
            if rc != 0:
                raise RuntimeError(
                    f"AES-XTS ({self._impl}) failed at LBA {first_lba + done - rc - 1}"
                )
            done += n
        return True

    def encrypt_into(
        self, src: Any, dst: Any, first_lba: int, *, hasher: Xxh3 | None = None
    ) -> None:
        """Encrypt `src` into `dst` (same length, may be the same buffer); with `hasher`, feed it
        the plaintext `src` in the same pass."""
        self._run(src, dst, first_lba, True, hasher)

    def decrypt_into(
        self, src: Any, dst: Any, first_lba: int, *, hasher: Xxh3 | None = None
    ) -> None:
        """Decrypt `src` into `dst` (same length, may be the same buffer); with `hasher`, feed it
        the plaintext `dst` in the same pass."""
        self._run(src, dst, first_lba, False, hasher)

    def decrypt_mapped_into(self, src: Any, dst: Any, first_lba: int) -> bool:
        """`decrypt_into` from `src` in a file's memory mapping (the NVMe tier's page cache):
        False, with `dst` partly written, where a page of `src` could not be read (the SIGBUS
        of an I/O error or of a file cut short, caught in C); read the range again with preadv
        then, which reports the error."""
        return self._run(src, dst, first_lba, False, mapped=True)
