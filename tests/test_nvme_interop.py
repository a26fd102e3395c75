"""Live interoperability with third-party NVMe/TCP peers, when they are installed.

- SPDK_BIN (the SPDK v26.05 peer, tests/spdk_peer.py): our initiator against SPDK's target
  (a malloc bdev with 4096-byte blocks exported over TCP on 127.0.0.1): I/O sizes x queue
  depths x queues x digests (a short matrix by default, every cell under `-m full`), allowlist
  refusal, discovery, clean shutdown.
- NVME_CLI=/path/to/nvme: nvme-cli's `nvme discover` against our target (needs the kernel's
  nvme-fabrics module, which nvme-cli opens as /dev/nvme-fabrics).

Without the peer these are skipped, with the reason.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from spdk_peer import SKIP_REASON, SPDK_BIN, SpdkApp, free_port, protocol_errors, spdk_tgt
from waits import wait_until

from dpu_agent.testing import TargetProcess
from host_shim.nvme import NvmeStatusError, NvmeTcpController, discover

NVME_CLI = os.environ.get("NVME_CLI", "")
NQN = "nqn.2026-11.io.dpu-kvtier:interop"
HOST = "nqn.2026-11.io.dpu-kvtier:host:interop"
START_TIMEOUT_S = 60.0
SHUTDOWN_WAIT_S_MAX = 5.0  # SPDK reports SHST complete in milliseconds


def _spdk_config(port: int) -> dict[str, object]:
    listen = {"trtype": "TCP", "adrfam": "IPv4", "traddr": "127.0.0.1", "trsvcid": str(port)}
    return {
        "subsystems": [
            {
                "subsystem": "bdev",
                "config": [
                    {
                        "method": "bdev_malloc_create",
                        "params": {"name": "Malloc0", "num_blocks": 16384, "block_size": 4096},
                    },
                ],
            },
            {
                "subsystem": "nvmf",
                "config": [
                    {"method": "nvmf_create_transport", "params": {"trtype": "TCP"}},
                    {
                        "method": "nvmf_create_subsystem",
                        "params": {
                            "nqn": NQN,
                            "allow_any_host": False,
                            "serial_number": "SPDK0001",
                        },
                    },
                    {"method": "nvmf_subsystem_add_host", "params": {"nqn": NQN, "host": HOST}},
                    {
                        "method": "nvmf_subsystem_add_ns",
                        "params": {"nqn": NQN, "namespace": {"bdev_name": "Malloc0"}},
                    },
                    {
                        "method": "nvmf_subsystem_add_listener",
                        "params": {"nqn": NQN, "listen_address": listen},
                    },
                    {
                        "method": "nvmf_subsystem_add_listener",
                        "params": {
                            "nqn": "nqn.2014-08.org.nvmexpress.discovery",
                            "listen_address": listen,
                        },
                    },
                ],
            },
        ]
    }


@pytest.fixture(scope="module")
def spdk_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, SpdkApp]]:
    if not SPDK_BIN:
        pytest.skip(SKIP_REASON)
    port = free_port()
    with spdk_tgt(tmp_path_factory.mktemp("spdk"), _spdk_config(port)) as app:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if app.proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"SPDK target did not listen on {port}: {app.log()[-2000:]}")
                time.sleep(0.1)
        yield port, app


@pytest.fixture(scope="module")
def spdk_target(spdk_app: tuple[int, SpdkApp]) -> int:
    return spdk_app[0]


def test_our_initiator_reads_and_writes_spdk_namespace(spdk_target: int) -> None:
    with NvmeTcpController.connect("127.0.0.1", spdk_target, NQN, HOST, io_queues=2) as c:
        ident = c.identify_controller()
        assert ident.subnqn == NQN and ident.ioccsz * 16 - 64 == 4096
        assert c.active_namespaces() == [1]
        assert c.identify_namespace(1).block_size == 4096
        data = os.urandom(1 << 20)  # beyond SPDK's 128 KiB MDTS: split over commands
        c.write(1, 10, data)
        c.flush(1)
        out = bytearray(len(data))
        c.read(1, 10, out)
        assert out == data
        c.write_zeroes(1, 10, 1)
        c.read(1, 10, memoryview(out)[:4096])  # a view: `out[:4096]` would read into a copy
        assert out[:4096] == bytes(4096) and out[4096:] == data[4096:]


def test_spdk_refuses_a_host_not_on_its_list(spdk_target: int) -> None:
    with pytest.raises(NvmeStatusError) as err:
        NvmeTcpController.connect("127.0.0.1", spdk_target, NQN, HOST + "-other")
    assert (err.value.sct, err.value.sc) == (1, 0x84)


def test_spdk_discovery_log(spdk_target: int) -> None:
    entries = discover("127.0.0.1", spdk_target, HOST)
    assert NQN in [e.subnqn for e in entries]


@pytest.mark.skipif(not NVME_CLI, reason="NVME_CLI is not set: no nvme-cli on this machine")
def test_nvme_cli_discovers_our_target() -> None:
    if not Path("/dev/nvme-fabrics").exists():
        pytest.skip("no /dev/nvme-fabrics: the kernel nvme-fabrics/nvme-tcp modules are not loaded")
    assert shutil.which(NVME_CLI) or Path(NVME_CLI).exists()
    with TargetProcess(NQN, allow_hosts=[HOST]) as t:
        out = subprocess.run(
            [
                NVME_CLI,
                "discover",
                "-t",
                "tcp",
                "-a",
                "127.0.0.1",
                "-s",
                str(t.port),
                "-q",
                HOST,
                "-o",
                "json",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        records = json.loads(out.stdout).get("records", [])
        assert NQN in [r.get("subnqn") for r in records]


SHORT = [  # (io bytes, qd, queues, hdgst, ddgst)
    (4096, 32, 1, False, False),
    (4096, 8, 4, True, True),
    (16384, 1, 1, True, False),
    (131072, 32, 4, False, True),
    (1 << 20, 8, 1, False, False),
    (1 << 20, 128, 4, True, True),
]
FULL = [
    (io, qd, queues, hd, dd)
    for io, qd, queues, (hd, dd) in itertools.product(
        (4096, 16384, 131072, 1 << 20),
        (1, 8, 32, 128),
        (1, 4),
        ((False, False), (True, False), (False, True), (True, True)),
    )
]


def _cell_id(cell: tuple[int, int, int, bool, bool]) -> str:
    io, qd, queues, hd, dd = cell
    return f"{io // 1024}k-qd{qd}-q{queues}-h{int(hd)}d{int(dd)}"


def _pipelined_write_read(port: int, cell: tuple[int, int, int, bool, bool], rounds: int) -> None:
    """Many commands in flight per queue (as SPDK's own tools), every byte compared."""
    io, qd, queues, hd, dd = cell
    span = 16384 * 4096 // io  # I/Os that fit the namespace
    with NvmeTcpController.connect(
        "127.0.0.1", port, NQN, HOST, io_queues=queues, queue_depth=max(qd, 2), hdgst=hd, ddgst=dd
    ) as c:
        for r in range(rounds):
            count = min(span, qd * queues * 2)
            data = os.urandom(io * count)
            first = (r * count) % (span - count + 1)
            c.write(1, first * io // 4096, data)
            out = bytearray(len(data))
            c.read(1, first * io // 4096, out)
            assert out == data, f"round {r}: read back differs"


@pytest.mark.parametrize("cell", SHORT, ids=_cell_id)
def test_our_initiator_matrix_against_spdk(
    spdk_app: tuple[int, SpdkApp], cell: tuple[int, int, int, bool, bool]
) -> None:
    port, app = spdk_app
    _pipelined_write_read(port, cell, rounds=2)
    assert not protocol_errors(app.log())


@pytest.mark.full
@pytest.mark.parametrize("cell", FULL, ids=_cell_id)
def test_our_initiator_full_matrix_against_spdk(
    spdk_app: tuple[int, SpdkApp], cell: tuple[int, int, int, bool, bool]
) -> None:
    port, app = spdk_app
    _pipelined_write_read(port, cell, rounds=8)
    assert not protocol_errors(app.log())


def test_close_is_a_clean_shutdown_for_spdk(spdk_app: tuple[int, SpdkApp]) -> None:
    """Finding 3: closing without waiting for CSTS.SHST made SPDK busy-loop ~100 ms per close
    ("freeing ctrlr with disconnect in progress"). We poll SHST (bounded) before hanging up."""
    port, app = spdk_app
    before = app.log().count("disconnect in progress")
    for _ in range(3):
        c = NvmeTcpController.connect("127.0.0.1", port, NQN, HOST, io_queues=2)
        c.write(1, 0, bytes(4096))
        t0 = time.monotonic()
        c.close()
        assert time.monotonic() - t0 < SHUTDOWN_WAIT_S_MAX
    # SPDK lists a controller until its teardown is done: once none is left, every close
    # above has been processed, and none of them may have left a disconnect in progress
    wait_until(lambda: _controllers(app) == [], "SPDK tears the closed controllers down")
    assert app.log().count("disconnect in progress") == before


def _controllers(app: SpdkApp) -> list[object]:
    return list(app.rpc("nvmf_subsystem_get_controllers", nqn=NQN))
