"""Import the compiled AES-XTS loop, or fail saying how to build it (no Python fallback).

On import, the module must have been built from the sources present (else: rebuild), and the
loop the CPU would use is checked against OpenSSL's EVP on a fixed input, for
both key sizes and both directions: a miscompiled or misdetected fast path fails here, loudly,
instead of writing ciphertext that SPDK's crypto vbdev cannot read.
"""

from __future__ import annotations

from typing import Any

BUILD_COMMAND = "python -m dpu_agent.crypto._build"

try:
    from dpu_agent.crypto._xts_cffi import ffi as _ffi
    from dpu_agent.crypto._xts_cffi import lib as _lib
except ImportError as e:
    raise ImportError(
        f"the compiled AES-XTS module dpu_agent.crypto._xts_cffi is missing or stale ({e}); "
        f"build it with `{BUILD_COMMAND}` (or `make install`); needs gcc, libssl-dev and "
        "libxxhash-dev"
    ) from e

from dpu_agent.crypto._build import source_digest  # noqa: E402  (after the clear ImportError)

ffi: Any = _ffi
lib: Any = _lib


def _check_fresh() -> None:
    built = (
        ffi.string(lib.dpukv_xts_source_digest()).decode()
        if hasattr(lib, "dpukv_xts_source_digest")
        else "none"
    )
    if built != source_digest():
        raise ImportError(
            "the compiled AES-XTS module dpu_agent.crypto._xts_cffi was built from other "
            f"sources than xts_loop.c/_build.py hold now; rebuild it with `{BUILD_COMMAND}`"
        )


# Names for the C side's DPUKV_IMPL_* numbers.
IMPLEMENTATIONS: dict[str, int] = {"evp": 1, "vaes": 2}
_NAMES = {number: name for name, number in IMPLEMENTATIONS.items()}
_SELF_TEST_SECTOR_BYTES = 512
_SELF_TEST_LBA = 0x0123_4567_89AB_CDEF  # every tweak byte non-zero


def best_implementation() -> str:
    return _NAMES[int(lib.dpukv_xts_best_impl())]


def _crypt(key: bytes, data: bytes, impl: int, encrypt: bool) -> bytes:
    handle = ffi.gc(lib.dpukv_xts_new(key, len(key), int(encrypt), impl), lib.dpukv_xts_free)
    assert handle != ffi.NULL, impl
    out = bytearray(len(data))
    count = len(data) // _SELF_TEST_SECTOR_BYTES
    rc = lib.dpukv_xts_run(
        handle, data, ffi.from_buffer(out), _SELF_TEST_SECTOR_BYTES, count, _SELF_TEST_LBA
    )
    assert rc == 0, rc
    return bytes(out)


def _self_test() -> None:
    best = IMPLEMENTATIONS[best_implementation()]
    if best == IMPLEMENTATIONS["evp"]:
        return
    data = bytes((i * 37 + 11) & 0xFF for i in range(3 * _SELF_TEST_SECTOR_BYTES))
    for key_bytes in (32, 64):
        key = bytes((i * 7 + 3) & 0xFF for i in range(key_bytes))
        for encrypt in (True, False):
            want = _crypt(key, data, IMPLEMENTATIONS["evp"], encrypt)
            if _crypt(key, data, best, encrypt) != want:
                raise ImportError(
                    f"AES-XTS self-test failed: the {best_implementation()!r} loop disagrees "
                    f"with OpenSSL (AES-{key_bytes * 4}-XTS, encrypt={encrypt}); rebuild with "
                    f"`{BUILD_COMMAND}` and report this CPU (/proc/cpuinfo)"
                )


_check_fresh()
_self_test()
