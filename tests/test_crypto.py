"""AES-XTS as SPDK's crypto vbdev does it: recorded vectors, per-sector reference, buffers."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from hypothesis import given, settings
from hypothesis import strategies as st

from dpu_agent.crypto import XtsCipher
from dpu_agent.crypto.xts import available_implementations

SPDK_DIR = Path(__file__).resolve().parent / "data" / "spdk"  # recorded from SPDK v26.05
VECTORS = SPDK_DIR / "xts_vectors.json"
KEY = bytes(range(64))
IMPLS = available_implementations()


def reference_encrypt(key: bytes, data: bytes, first_lba: int, block_size: int) -> bytes:
    """One `cryptography` call per sector, tweak = struct.pack('<QQ', 0, lba)."""
    out = []
    for i in range(len(data) // block_size):
        tweak = struct.pack("<QQ", 0, first_lba + i)
        enc = Cipher(algorithms.AES(key), modes.XTS(tweak)).encryptor()
        out.append(enc.update(data[i * block_size : (i + 1) * block_size]) + enc.finalize())
    return b"".join(out)


@pytest.mark.skipif(not VECTORS.exists(), reason=f"SPDK recordings not found at {SPDK_DIR}")
@pytest.mark.parametrize("impl", IMPLS)
def test_spdk_recorded_vectors_byte_exact(impl: str) -> None:
    doc = json.loads(VECTORS.read_text())
    assert doc["tweak_mode"] == "SIMPLE_LBA"
    key = bytes.fromhex(doc["key"] + doc["key2"])
    cipher = XtsCipher(key, block_size=doc["block_size"], implementation=impl)
    plaintext = bytes.fromhex(doc["plaintext_hex_every_vector"])
    assert len(doc["vectors"]) >= 3
    for vector in doc["vectors"]:
        lba = vector["lba_on_base_bdev"]
        out = bytearray(len(plaintext))
        cipher.encrypt_into(plaintext, out, lba)
        assert out.hex() == vector["ciphertext_hex"], lba
        back = bytearray(len(out))
        cipher.decrypt_into(out, back, lba)
        assert back == plaintext


@pytest.mark.parametrize("first_lba", [0, 1, 7, 4095, 123456789, (1 << 64) - 8])
@pytest.mark.parametrize("key_bytes", [32, 64])
@pytest.mark.parametrize("impl", IMPLS)
def test_c_loop_matches_per_sector_reference(first_lba: int, key_bytes: int, impl: str) -> None:
    key = os.urandom(key_bytes)
    data = os.urandom(4096 * 8)
    cipher = XtsCipher(key, implementation=impl)
    out = bytearray(len(data))
    cipher.encrypt_into(data, out, first_lba)
    assert bytes(out) == reference_encrypt(key, data, first_lba, 4096)
    back = bytearray(len(data))
    cipher.decrypt_into(out, back, first_lba)
    assert bytes(back) == data


@pytest.mark.parametrize("block_size", [512, 1024, 8192, 65536])
@pytest.mark.parametrize("impl", IMPLS)
def test_other_sector_sizes_match_reference(block_size: int, impl: str) -> None:
    data = os.urandom(block_size * 3)
    out = bytearray(len(data))
    cipher = XtsCipher(KEY, block_size=block_size, implementation=impl)
    cipher.encrypt_into(data, out, 99)
    assert bytes(out) == reference_encrypt(KEY, data, 99, block_size)
    cipher.decrypt_into(out, out, 99)
    assert bytes(out) == data


def test_auto_picks_the_fastest_available() -> None:
    assert "evp" in IMPLS
    assert XtsCipher(KEY).implementation == IMPLS[-1]
    with pytest.raises(ValueError, match="unknown"):
        XtsCipher(KEY, implementation="python")


def test_missing_compiled_module_names_build_command() -> None:
    code = (
        "import sys; sys.modules['dpu_agent.crypto._xts_cffi'] = None\n"
        "try:\n    from dpu_agent.crypto import XtsCipher\n"
        "except ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert "python -m dpu_agent.crypto._build" in out.stdout


@pytest.mark.parametrize("impl", IMPLS)
def test_in_place_and_numpy_buffers(impl: str) -> None:
    cipher = XtsCipher(KEY, implementation=impl)
    arr = np.random.default_rng(3).integers(0, 256, 4096 * 4, dtype=np.uint8)
    plain = arr.tobytes()
    cipher.encrypt_into(arr, arr, 10)  # in place
    assert arr.tobytes() == reference_encrypt(KEY, plain, 10, 4096)
    view = arr.data
    cipher.decrypt_into(view, view, 10)
    assert arr.tobytes() == plain
    floats = np.frombuffer(plain, dtype=np.float32).copy()
    out = np.empty_like(floats)
    cipher.encrypt_into(floats, out, 10)
    assert out.tobytes() == reference_encrypt(KEY, plain, 10, 4096)


def test_each_sector_depends_on_its_lba() -> None:
    cipher = XtsCipher(KEY)
    sector = b"\x00" * 4096
    a, b = bytearray(4096), bytearray(4096)
    cipher.encrypt_into(sector, a, 5)
    cipher.encrypt_into(sector, b, 6)
    assert a != b


def test_equal_key_halves_rejected() -> None:
    with pytest.raises(ValueError, match="key == key2"):
        XtsCipher(b"\x11" * 64)


@pytest.mark.parametrize("length", [0, 16, 48, 63, 65, 128])
def test_bad_key_length_rejected(length: int) -> None:
    with pytest.raises(ValueError, match="64 bytes"):
        XtsCipher(os.urandom(length))


def test_bad_buffers_rejected() -> None:
    cipher = XtsCipher(KEY)
    with pytest.raises(ValueError, match="multiple of block_size"):
        cipher.encrypt_into(b"x" * 100, bytearray(100), 0)
    with pytest.raises(ValueError, match="must match"):
        cipher.encrypt_into(b"x" * 4096, bytearray(8192), 0)
    with pytest.raises(ValueError, match="read-only"):
        cipher.encrypt_into(b"x" * 4096, b"y" * 4096, 0)
    with pytest.raises(ValueError, match="unsigned 64-bit"):
        cipher.encrypt_into(b"x" * 8192, bytearray(8192), (1 << 64) - 1)
    buf = bytearray(4096 * 3)
    with pytest.raises(ValueError, match="overlap"):
        cipher.encrypt_into(memoryview(buf)[:8192], memoryview(buf)[4096:], 0)
    with pytest.raises(ValueError, match="power of two"):
        XtsCipher(KEY, block_size=1000)


def test_repr_hides_key() -> None:
    key = bytes.fromhex("a1" * 32 + "b2" * 32)
    text = repr(XtsCipher(key))
    assert "a1a1" not in text and "b2b2" not in text and str(key) not in text
    assert "AES-256-XTS" in text


@pytest.mark.parametrize("impl", IMPLS)
def test_threads_share_one_cipher(impl: str) -> None:
    cipher = XtsCipher(KEY, implementation=impl)
    data = os.urandom(4096 * 64)
    expected = reference_encrypt(KEY, data, 1000, 4096)
    results: list[bool] = []

    def work() -> None:
        for _ in range(20):
            out = bytearray(len(data))
            cipher.encrypt_into(data, out, 1000)
            back = bytearray(len(data))
            cipher.decrypt_into(out, back, 1000)
            results.append(bytes(out) == expected and bytes(back) == data)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == [True] * 80


def test_build_command_works_without_a_built_module(tmp_path: Path) -> None:
    """Regression: the package must not need the compiled module to run its own build."""
    src = Path(__file__).resolve().parents[1] / "dpu_agent"
    pkg = tmp_path / "dpu_agent"
    (pkg / "crypto").mkdir(parents=True)
    for name in ("__init__.py", "log.py", "blockdev.py"):
        shutil.copy(src / name, pkg / name)
    for path in (src / "crypto").iterdir():
        if path.suffix in (".py", ".c", ".h") and not path.name.startswith("_xts_cffi"):
            shutil.copy(path, pkg / "crypto" / path.name)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    build = [sys.executable, "-m", "dpu_agent.crypto._build"]
    subprocess.run(build, cwd=tmp_path, env=env, check=True, capture_output=True, timeout=240)
    assert list((pkg / "crypto").glob("_xts_cffi*.so"))
    check = "import dpu_agent.crypto as c; print(c.__file__, c.XtsCipher(bytes(range(64))))"
    out = subprocess.run(
        [sys.executable, "-c", check],
        cwd=tmp_path,
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.startswith(str(pkg)), out.stdout
    assert "AES-256-XTS" in out.stdout


@settings(max_examples=40, deadline=None)
@given(
    key=st.binary(min_size=64, max_size=64).filter(lambda k: k[:32] != k[32:]),
    sectors=st.integers(min_value=1, max_value=4),
    block_size=st.sampled_from([512, 4096]),
    first_lba=st.integers(min_value=0, max_value=(1 << 64) - 4),
    seed=st.integers(min_value=0, max_value=1 << 30),
)
def test_every_implementation_agrees_with_reference(
    key: bytes, sectors: int, block_size: int, first_lba: int, seed: int
) -> None:
    data = np.random.default_rng(seed).integers(0, 256, sectors * block_size, dtype=np.uint8)
    expected = reference_encrypt(key, data.tobytes(), first_lba, block_size)
    for impl in IMPLS:
        out = bytearray(len(expected))
        XtsCipher(key, block_size=block_size, implementation=impl).encrypt_into(
            data, out, first_lba
        )
        assert bytes(out) == expected, impl
