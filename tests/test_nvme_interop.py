"""Live interoperability with third-party NVMe/TCP peers, when they are installed.

- SPDK_NVMF_TGT=/path/to/nvmf_tgt (or spdk_tgt): our initiator against SPDK's target
  (a malloc bdev with 4096-byte blocks exported over TCP on 127.0.0.1).
- NVME_CLI=/path/to/nvme: nvme-cli's `nvme discover` against our target (needs the kernel's
  nvme-fabrics module, which nvme-cli opens as /dev/nvme-fabrics).

Neither SPDK nor a kernel NVMe/TCP initiator exists on the machines this project builds on,
so these are skipped there, with that reason.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dpu_agent.nvmf import TargetProcess
from host_shim.nvme import NvmeStatusError, NvmeTcpController, discover

SPDK = os.environ.get("SPDK_NVMF_TGT", "")
NVME_CLI = os.environ.get("NVME_CLI", "")
NQN = "nqn.2026-11.io.dpu-kvtier:interop"
HOST = "nqn.2026-11.io.dpu-kvtier:host:interop"
START_TIMEOUT_S = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spdk_config(port: int) -> dict[str, object]:
    listen = {"trtype": "TCP", "adrfam": "IPv4", "traddr": "127.0.0.1", "trsvcid": str(port)}
    return {
        "subsystems": [
            {
                "subsystem": "bdev",
                "config": [
                    {
                        "method": "bdev_malloc_create",
                        "params": {"name": "Malloc0", "num_blocks": 8192, "block_size": 4096},
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
def spdk_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    if not SPDK:
        pytest.skip("SPDK_NVMF_TGT is not set: no SPDK nvmf_tgt to test against on this machine")
    port = _free_port()
    cfg = tmp_path_factory.mktemp("spdk") / "nvmf.json"
    cfg.write_text(json.dumps(_spdk_config(port)))
    rpc = cfg.parent / "spdk.sock"
    proc = subprocess.Popen(
        [SPDK, "--json", str(cfg), "-r", str(rpc), "-m", "0x1", "--no-huge", "-s", "1024"]
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"SPDK target did not listen on {port} (exit {proc.poll()})")
                time.sleep(0.2)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


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
