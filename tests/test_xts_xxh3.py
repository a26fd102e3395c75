"""xxh3-128 fused into the AES-XTS pass (`hasher=`): the same digest as the `xxhash` package and
the same ciphertext/plaintext as the unfused pass, for every cipher implementation and every
xxh3 vector variant this CPU runs."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import xxhash

from dpu_agent.blockdev import BlockDevice, FileBlockDevice, MemoryBlockDevice
from dpu_agent.crypto import CryptoBlockDevice, _build
from dpu_agent.crypto._loader import lib
from dpu_agent.crypto.xts import XtsCipher, Xxh3, available_implementations

IMPLS = available_implementations()
KEYS = {32: bytes(range(1, 33)), 64: bytes(range(100, 164))}
# 1 sector; sizes around the 256 KiB hash group; 4 MiB + a sector (the NIXL segment and a tail)
SIZES = [4096, 3 * 4096, (256 << 10) - 4096, (256 << 10) + 4096, (4 << 20) + 4096]
PREFIXES = [b"", b"k", os.urandom(32)]  # chunk keys are the xxh3 prefix on the NIXL path
XXH3_PORTABLE = 1


def variants() -> list[int]:
    """The xxh3 update variants this CPU runs: 1 portable, 2 AVX2, 3 AVX-512."""
    best = int(lib.dpukv_xxh3_set_variant(0))
    return list(range(XXH3_PORTABLE, best + 1))


@pytest.fixture
def variant_reset() -> Iterator[None]:
    yield
    lib.dpukv_xxh3_set_variant(0)  # back to the best for the other tests


def random_bytes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("key_bytes", sorted(KEYS))
@pytest.mark.parametrize("nbytes", SIZES)
def test_fused_decrypt_digest_equals_xxhash(impl: str, key_bytes: int, nbytes: int) -> None:
    cipher = XtsCipher(KEYS[key_bytes], implementation=impl)
    plain = random_bytes(nbytes, nbytes + key_bytes)
    sealed = np.empty_like(plain)
    cipher.encrypt_into(plain, sealed, 77)
    for prefix in PREFIXES:
        out = np.empty_like(plain)
        hasher = Xxh3(prefix)
        cipher.decrypt_into(sealed, out, 77, hasher=hasher)
        assert out.tobytes() == plain.tobytes()
        assert hasher.digest() == xxhash.xxh3_128(prefix + plain.tobytes()).digest()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("block_size", [512, 4096, 65536])
def test_fused_encrypt_hashes_plaintext_and_matches_unfused(impl: str, block_size: int) -> None:
    cipher = XtsCipher(KEYS[64], block_size=block_size, implementation=impl)
    plain = random_bytes(block_size * 9, block_size)
    want = np.empty_like(plain)
    cipher.encrypt_into(plain, want, 5)
    fused = plain.copy()
    hasher = Xxh3(b"chunk-key")
    cipher.encrypt_into(fused, fused, 5, hasher=hasher)  # in place: hashed before overwritten
    assert fused.tobytes() == want.tobytes()
    assert hasher.digest() == xxhash.xxh3_128(b"chunk-key" + plain.tobytes()).digest()


@pytest.mark.parametrize("impl", IMPLS)
def test_fused_digest_over_segments_in_order(impl: str) -> None:
    """A chunk decrypted segment by segment into one state: the digest of the whole chunk."""
    cipher = XtsCipher(KEYS[64], implementation=impl)
    plain = random_bytes(3 << 20, 9)
    sealed = np.empty_like(plain)
    cipher.encrypt_into(plain, sealed, 1000)
    hasher, out = Xxh3(b"key"), np.empty_like(plain)
    for off in range(0, len(plain), 1 << 20):
        lba = 1000 + off // 4096
        cipher.decrypt_into(sealed[off : off + (1 << 20)], out[off : off + (1 << 20)], lba,
                            hasher=hasher)  # fmt: skip
    assert hasher.digest() == xxhash.xxh3_128(b"key" + plain.tobytes()).digest()


@pytest.mark.usefixtures("variant_reset")
@pytest.mark.parametrize("nbytes", [0, 1, 17, 240, 1024, 4096, 100_003, 1 << 20])
def test_every_xxh3_variant_equals_xxhash(nbytes: int) -> None:
    data = random_bytes(nbytes, 3).tobytes()
    for variant in variants():
        assert lib.dpukv_xxh3_set_variant(variant) == variant
        one, pieces = Xxh3(b"p"), Xxh3(b"p")
        one.update(data)
        for off in range(0, nbytes, 4099):  # odd pieces: the state's buffering
            pieces.update(data[off : off + 4099])
        want = xxhash.xxh3_128(b"p" + data).digest()
        assert one.digest() == want, variant
        assert pieces.digest() == want, variant


@pytest.mark.usefixtures("variant_reset")
def test_xxh3_variant_the_cpu_lacks_is_refused() -> None:
    best = int(lib.dpukv_xxh3_set_variant(0))
    assert lib.dpukv_xxh3_set_variant(best + 1) == best
    assert lib.dpukv_xxh3_set_variant(-1) == best


def test_digest_leaves_the_state_usable() -> None:
    hasher = Xxh3(b"a")
    hasher.update(b"bc")
    first = hasher.digest()
    assert hasher.digest() == first == xxhash.xxh3_128(b"abc").digest()
    hasher.update(b"d")
    assert hasher.digest() == xxhash.xxh3_128(b"abcd").digest()


@pytest.mark.parametrize("group", ["EXTRA_C_FILES", "HEADER_FILES"])
def test_source_digest_covers_the_xxh3_variant_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, group: str
) -> None:
    """Regression guard: an edited xxh3_avx2.c, or the xxh3_variant.h both variants include,
    must make the built module stale."""
    before = _build.source_digest()
    copies = []
    for path in getattr(_build, group):
        shutil.copy(path, tmp_path / path.name)
        copies.append(tmp_path / path.name)
    monkeypatch.setattr(_build, group, tuple(copies))
    assert _build.source_digest() == before
    copies[0].write_text(copies[0].read_text() + "\n/* edited */\n")
    assert _build.source_digest() != before


@pytest.mark.parametrize("base_kind", ["memory", "file"])
@pytest.mark.parametrize("nbytes", [4096 * 5, 4096 * 5 - 1000])  # whole blocks; a partial tail
def test_read_hashed_into_equals_read_into_then_xxhash(
    tmp_path: Path, base_kind: str, nbytes: int
) -> None:
    """Both kinds of tier (memory that lends itself: the DRAM tier; a file: the NVMe tier)."""
    base: BlockDevice = (
        MemoryBlockDevice(64)
        if base_kind == "memory"
        else FileBlockDevice(tmp_path / "ns", block_count=64)
    )
    dev = CryptoBlockDevice(base, XtsCipher(KEYS[64]))
    plain = random_bytes(4096 * 5, 11)
    plain[nbytes:] = 0  # the tail block's padding, as the engine writes it
    dev.write(9, memoryview(plain))
    want, got = bytearray(4096 * 5), bytearray(4096 * 5)
    dev.read_into(9, memoryview(want))
    hasher = Xxh3(b"chunk")
    dev.read_hashed_into(9, memoryview(got), hasher, nbytes)
    assert got == want == plain.tobytes()
    assert hasher.digest() == xxhash.xxh3_128(b"chunk" + plain.tobytes()[:nbytes]).digest()
    dev.close()
