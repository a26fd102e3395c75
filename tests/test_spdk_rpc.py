"""The typed client: structured errors, None = omit, wall-clock bound, connection errors."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from spdk_sim.sim import SpdkSimulator

from spdk_plugins import SpdkClient, SpdkConnectionError, SpdkRpcError, SpdkTimeout
from spdk_plugins._omit import omit_none
from spdk_plugins.rpc import redact_params


@pytest.fixture
def client(tmp_path: Path) -> Iterator[SpdkClient]:
    with SpdkSimulator(tmp_path / "s.sock") as sim, SpdkClient(sim.socket_path, timeout_s=5) as c:
        yield c


def test_none_is_omitted_but_zero_and_false_are_sent() -> None:
    assert omit_none(a=None, b=0, c=False, d="") == {"b": 0, "c": False, "d": ""}


def test_duplicate_bdev_error_keeps_method_params_code(client: SpdkClient) -> None:
    client.bdev_malloc_create(name="m0", block_size=512, num_blocks=8)
    with pytest.raises(SpdkRpcError) as err:
        client.bdev_malloc_create(name="m0", block_size=512, num_blocks=8)
    e = err.value
    assert (e.method, e.code, e.message, e.is_exists) == (
        "bdev_malloc_create",
        -17,
        "File exists",
        True,
    )
    assert e.params == {"name": "m0", "block_size": 512, "num_blocks": 8}


def test_key_error_is_redacted(client: SpdkClient) -> None:
    key = "00112233445566778899aabbccddeeff"
    with pytest.raises(SpdkRpcError) as err:
        client.accel_crypto_key_create(cipher="AES_XTS", key=key, key2=key, name="k")
    assert (err.value.code, err.value.message) == (-32602, "failed to create DEK, rc -22")
    assert err.value.params["key"] == "<redacted>" and key not in str(err.value)


def test_keys_get_drops_material(client: SpdkClient) -> None:
    client.accel_crypto_key_create(cipher="AES_XTS", key="11" * 16, key2="22" * 16, name="k")
    assert client.accel_crypto_keys_get() == [
        {"name": "k", "cipher": "AES_XTS", "tweak_mode": "SIMPLE_LBA"}
    ]


def test_redact_params_nested() -> None:
    doc = {"params": [{"key": "aa", "key2": "bb", "name": "n"}]}
    assert redact_params(doc) == {
        "params": [{"key": "<redacted>", "key2": "<redacted>", "name": "n"}]
    }


def test_unreachable_socket(tmp_path: Path) -> None:
    with pytest.raises(SpdkConnectionError, match="is spdk_tgt running"):
        SpdkClient(str(tmp_path / "missing.sock"))


def test_stalled_target_bounded_by_wall_clock(tmp_path: Path) -> None:
    """A target that accepts and never answers: the call ends after timeout_s, not never."""
    path = str(tmp_path / "stall.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    held: list[socket.socket] = []
    t = threading.Thread(target=lambda: held.append(srv.accept()[0]), daemon=True)
    t.start()
    try:
        c = SpdkClient(path, timeout_s=0.5)
        start = time.monotonic()
        with pytest.raises(SpdkTimeout, match=r"within 0\.5 s"):
            c.spdk_get_version()
        assert time.monotonic() - start < 3.0
        with pytest.raises(SpdkConnectionError, match="closed"):
            c.spdk_get_version()
    finally:
        t.join(timeout=2)
        for s in held:
            s.close()
        srv.close()


def test_target_closing_connection_is_connection_error(tmp_path: Path) -> None:
    path = str(tmp_path / "close.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)

    def serve() -> None:
        conn, _ = srv.accept()
        conn.recv(4096)
        conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        with pytest.raises(SpdkConnectionError, match="lost"):
            SpdkClient(path, timeout_s=5).spdk_get_version()
    finally:
        t.join(timeout=2)
        srv.close()
