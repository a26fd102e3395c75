"""The same scenarios against a real `spdk_tgt`: set SPDK_TGT to its path to run them.

    SPDK_TGT=/opt/spdk/build/bin/spdk_tgt .venv/bin/pytest tests/test_spdk_live.py

The target is started on a socket in a temporary directory (extra arguments in
SPDK_TGT_ARGS, default `--no-huge -s 1024 -m 0x1`, so no hugepages are needed) and killed
afterwards. It uses the software accel module, an AIO file and NVMe/TCP on 127.0.0.1.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from spdk_sim.fixtures import NQN_A, config_doc, key_provider

from spdk_plugins import SpdkClient, SpdkDesired, apply, parse_desired, plan, status

SPDK_TGT = os.environ.get("SPDK_TGT")
START_TIMEOUT_S = 30.0  # spdk_tgt starts in about a second; slow CI boxes get 30
pytestmark = pytest.mark.skipif(
    not SPDK_TGT, reason="SPDK_TGT is not set (path to a real spdk_tgt binary)"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def target(tmp_path: Path) -> Iterator[str]:
    assert SPDK_TGT is not None
    sock = str(tmp_path / "spdk.sock")
    args = shlex.split(os.environ.get("SPDK_TGT_ARGS", "--no-huge -s 1024 -m 0x1"))
    log = open(tmp_path / "spdk_tgt.log", "wb")
    proc = subprocess.Popen([SPDK_TGT, "-r", sock, *args], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not os.path.exists(sock):
            assert proc.poll() is None, (tmp_path / "spdk_tgt.log").read_text()
            assert time.monotonic() < deadline, "spdk_tgt did not create its socket"
            time.sleep(0.1)
        yield sock
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


@pytest.fixture
def desired(tmp_path: Path) -> SpdkDesired:
    aio = tmp_path / "disk0.img"
    with open(aio, "wb") as f:
        f.truncate(64 << 20)
    doc = config_doc(str(aio))
    doc["spdk"]["subsystems"][0]["listeners"][0]["trsvcid"] = str(_free_port())
    return parse_desired(doc)


def test_live_apply_idempotent_drift_prune(target: str, desired: SpdkDesired) -> None:
    with SpdkClient(target, timeout_s=30) as c:
        first = apply(desired, c, key_provider)
        assert first.after.in_sync, first.after.to_json()
        second = apply(desired, c, key_provider)
        assert second.applied == ()
        ns = c.nvmf_get_subsystems(nqn=NQN_A)[0]["namespaces"]
        assert {n["nsid"] for n in ns} == {1, 2}
        c.nvmf_subsystem_remove_ns(nqn=NQN_A, nsid=2)
        c.bdev_malloc_create(name="stray", block_size=512, num_blocks=8)
        report = status(desired, c, key_provider)
        assert f"{NQN_A} nsid 2 -> crypt-a missing" in report.missing and any(
            "stray" in x for x in report.extra
        )
        apply(desired, c, key_provider, prune=True)
        assert status(desired, c, key_provider).in_sync
        empty = dataclasses.replace(
            desired, keys=(), bdevs=(), crypto=(), lvstores=(), lvols=(), subsystems=()
        )
        apply(empty, c, None, prune=True)
        assert c.bdev_get_bdevs() == [] and plan(empty, c, prune=True).in_sync
