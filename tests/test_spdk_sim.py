"""The SPDK simulator against the recordings of a real SPDK v26.05 target (shared/spdk/).

Every request of calls.json is replayed, in order, through the real `spdk` PyPI client; each
reply must equal the recorded one (the recorded UUIDs are fed to the simulator's UUID source,
so the comparison is exact). The framing probes of raw_protocol_probes.json are replayed on a
raw socket.
"""

from __future__ import annotations

import copy
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from spdk.rpc.client import JSONRPCClient, JSONRPCException
from spdk_sim.sim import _MALFORMED, SpdkSimulator, _Rest, _split_values

SHARED = Path(__file__).resolve().parent / "data" / "spdk"  # recorded from SPDK v26.05
# UUIDs the real target generated, in creation order: Malloc0, AIO0, lvs0, lvs0/lvol0
# (crypto0's is derived from AIO0's and computed by the simulator as SPDK does).
RECORDED_UUIDS = [
    "01207364-4b53-463f-98e8-0b78c18b0d19",
    "8a8ce2ee-260c-4d2e-84c1-fbf4ed85aa07",
    "e06cd86c-a8d8-4c76-8654-7d55f6bf52ec",
    "3e5b71f1-047a-477a-b668-cf827c8a9aac",
]
AIO_FILE_BYTES = 256 * 1024 * 1024  # 524288 blocks of 512 bytes, as recorded
RECV_TIMEOUT_S = 5.0


def _load(name: str) -> Any:
    return json.loads((SHARED / name).read_text())


@pytest.fixture
def recorded_sim(tmp_path: Path) -> Iterator[SpdkSimulator]:
    uuids = iter(RECORDED_UUIDS)
    with SpdkSimulator(
        tmp_path / "spdk.sock",
        uuid_factory=lambda: next(uuids),
        file_sizes={"/var/lib/spdk/aio0.img": AIO_FILE_BYTES},
    ) as sim:
        yield sim


def test_replay_calls_json_gives_recorded_replies(recorded_sim: SpdkSimulator) -> None:
    calls = _load("calls.json")
    client = JSONRPCClient(recorded_sim.socket_path, timeout=RECV_TIMEOUT_S)
    try:
        for i, call in enumerate(calls):
            params = copy.deepcopy(call["params"])
            try:
                got: Any = {"result": client.call(call["method"], params)}
            except JSONRPCException as e:
                got = {"error": e.message}
            want = {k: call[k] for k in ("result", "error") if k in call}
            assert got == want, f"calls.json[{i}] {call['method']}"
    finally:
        client.close()


def test_state_dumps_match_recorded_files(recorded_sim: SpdkSimulator) -> None:
    """After the recorded build-up, each *_get_* equals the dump file of the same name."""
    _build_recorded_state(recorded_sim)
    client = JSONRPCClient(recorded_sim.socket_path, timeout=RECV_TIMEOUT_S)
    try:
        for method in (
            "bdev_get_bdevs",
            "nvmf_get_subsystems",
            "nvmf_get_transports",
            "accel_crypto_keys_get",
            "accel_get_module_info",
            "accel_get_opc_assignments",
            "bdev_lvol_get_lvstores",
            "framework_get_subsystems",
            "spdk_get_version",
        ):
            assert client.call(method) == _load(f"{method}.json"), method
        saved = _save_config(client)
        assert saved == _load("save_config.json")
    finally:
        client.close()


def _build_recorded_state(sim: SpdkSimulator) -> None:
    """Replay calls.json's successful build-up (malloc + aio -> crypto -> lvol -> nvmf)."""
    client = JSONRPCClient(sim.socket_path, timeout=RECV_TIMEOUT_S)
    try:
        for call in _load("calls.json")[:15]:
            assert "result" in call
            client.call(call["method"], copy.deepcopy(call["params"]))
    finally:
        client.close()


def _save_config(client: JSONRPCClient) -> dict[str, Any]:
    """What `rpc.py save_config` does: framework_get_subsystems, then each one's config."""
    subsystems = client.call("framework_get_subsystems")
    return {
        "subsystems": [
            {
                "subsystem": s["subsystem"],
                "config": client.call("framework_get_config", {"name": s["subsystem"]}),
            }
            for s in subsystems
        ]
    }


def _raw_exchange(path: str, sent: str) -> str:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(RECV_TIMEOUT_S)
        s.connect(path)
        s.sendall(sent.encode())
        s.shutdown(socket.SHUT_WR)
        chunks = []
        for _ in range(1024):  # bounded: replies here are a few kB
            try:
                data = s.recv(65536)
            except TimeoutError:
                break
            if not data:
                break
            chunks.append(data)
        return b"".join(chunks).decode()


@pytest.mark.parametrize(
    "probe",
    [
        "batch_array",
        "notification_no_id",
        "malformed_json",
        "missing_jsonrpc_field",
        "string_id",
        "params_as_array",
    ],
)
def test_raw_protocol_probes_answered_as_recorded(recorded_sim: SpdkSimulator, probe: str) -> None:
    rec = _load("raw_protocol_probes.json")[probe]
    _build_recorded_state(recorded_sim)
    got = _raw_exchange(recorded_sim.socket_path, rec["sent"])
    assert got == rec["received"]


def test_malformed_json_closes_connection_without_reply(recorded_sim: SpdkSimulator) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(RECV_TIMEOUT_S)
        s.connect(recorded_sim.socket_path)
        s.sendall(b'{"jsonrpc": "2.0", "method": ] }')
        assert s.recv(100) == b""  # closed by the server, though we kept our side open


def test_request_split_across_writes_is_reassembled(recorded_sim: SpdkSimulator) -> None:
    msg = b'{"jsonrpc": "2.0", "method": "spdk_get_version", "id": 3}'
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(RECV_TIMEOUT_S)
        s.connect(recorded_sim.socket_path)
        for i in range(len(msg)):
            s.sendall(msg[i : i + 1])
        reply = json.loads(s.recv(65536))
    assert reply["id"] == 3 and reply["result"]["fields"]["major"] == 26


def test_sim_data_is_current_copy_of_the_recordings() -> None:
    """tests/spdk_sim/sim_data_v26_05.json must be regenerated when tests/data/spdk changes."""
    data = json.loads(
        (Path(__file__).resolve().parent / "spdk_sim" / "sim_data_v26_05.json").read_text()
    )
    used = _load("rpc_params_used.json")["methods"]
    for method, spec in used.items():
        assert data["params"][method]["recorded"] is True
        assert [p["name"] for p in data["params"][method]["params"]] == [
            p["name"] for p in spec["params"]
        ]
    assert sorted(data["rpc_methods"]) == sorted(_load("rpc_methods.json"))


def test_every_prefix_of_a_request_waits_for_more_bytes() -> None:
    """Regression: a read ending inside a string or literal was taken for malformed JSON."""
    msg = '{"jsonrpc": "2.0", "method": "x", "id": "a b", "p": [true, -1.5e3, null, false]}'
    for i in range(1, len(msg)):
        out = list(_split_values(msg[:i]))
        assert len(out) == 1 and isinstance(out[0], _Rest), msg[:i]
    assert next(_split_values(msg))["id"] == "a b"
    assert list(_split_values('{"jsonrpc": "2.0", "method": ] }')) == [_MALFORMED]


def test_batch_through_real_client(recorded_sim: SpdkSimulator) -> None:
    client = JSONRPCClient(recorded_sim.socket_path, timeout=RECV_TIMEOUT_S, batch_mode=True)
    try:
        results, errors = client.call_batch(
            [
                {"method": "spdk_get_version"},
                {"method": "bdev_get_bdevs", "params": {"name": "nope"}},
                {"method": "bdev_malloc_create", "params": {"block_size": 512}},
            ]
        )
    finally:
        client.close()
    assert results == [_load("spdk_get_version.json")]
    assert errors == [
        {"code": -19, "message": "No such device"},
        {"code": -32603, "message": "spdk_json_decode_object failed"},
    ]
