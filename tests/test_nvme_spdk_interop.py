"""SPDK's initiator against the project's NVMe/TCP target (the real peer: SPDK v26.05).

bdevperf -w verify (writes, reads back, compares every byte), spdk_nvme_perf randrw over four
queues, spdk_nvme_identify and spdk_nvme_discover, 100 detach/attach cycles and a target
restarted under a connected host. Each asserts zero mismatches, zero failed I/O and no
protocol error (C2HTermReq) in either side's log. A short matrix runs by default (2 s per
cell); `pytest -m full` runs every size x depth x encryption x digest cell for 10 s.
Skipped, with the reason, when the peer is not installed (tests/spdk_peer.py).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from spdk_peer import (
    attach_params,
    bdevperf,
    bdevperf_idle,
    discover,
    free_port,
    identify,
    needs_spdk,
    nvme_perf,
    protocol_errors,
)

from dpu_agent.testing import TargetProcess

pytestmark = needs_spdk

NQN = "nqn.2026-11.io.dpu-kvtier:tenant:interop"
HOST = "nqn.2026-11.io.dpu-kvtier:host:spdk"
BLOCKS = 32768  # 128 MiB: bdevperf verify spans qd x io_size (1 MiB x 128)
CYCLES = 100  # detach/attach cycles (the figure)
RECONNECT_TIMEOUT_S = 30.0


class LoggedTarget:
    """The project's target in its own process, logging at INFO into a file we inspect."""

    def __init__(self, tmp: Path, *, encrypted: bool, **kw: object) -> None:
        self.log_path = tmp / f"target-{'enc' if encrypted else 'plain'}-{free_port()}.log"
        self.key = os.urandom(64) if encrypted else None
        self.kw = kw
        self.proc = self._start(0)
        self.port = self.proc.port
        self._seen = 0

    def _start(self, port: int) -> TargetProcess:
        return TargetProcess(
            NQN,
            allow_hosts=[HOST],
            blocks=BLOCKS,
            xts_key=self.key,
            log_level="INFO",
            log_path=self.log_path,
            port=port,
            **self.kw,  # type: ignore[arg-type]
        )

    def restart(self) -> None:
        self.proc.close()
        self.proc = self._start(self.port)

    def new_log(self) -> str:
        """Log lines written since the last call."""
        text = self.log_path.read_text(errors="replace")
        new, self._seen = text[self._seen :], len(text)
        return new

    def events(self, text: str, event: str) -> list[dict[str, object]]:
        out = []
        for line in text.splitlines():
            if f'"{event}"' in line:
                out.append(json.loads(line))
        return out

    def close(self) -> None:
        self.proc.close()


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[bool, LoggedTarget]]:
    tmp = tmp_path_factory.mktemp("interop")
    ts = {enc: LoggedTarget(tmp, encrypted=enc) for enc in (True, False)}
    try:
        yield ts
    finally:
        for t in ts.values():
            assert t.proc.alive(), "the target died during the tests"
            t.close()


def _assert_clean(t: LoggedTarget) -> None:
    log = t.new_log()
    bad = protocol_errors(log)
    assert not bad, bad[:5]


SHORT = [  # (io bytes, qd, encrypted, hdgst, ddgst)
    (4096, 8, True, False, False),  # finding 1: bdevperf's Buffer mismatch at Disk Offset 2832
    (4096, 32, True, True, True),
    (16384, 1, False, False, False),
    (131072, 32, True, True, False),
    (1 << 20, 8, True, False, True),
    (1 << 20, 128, False, False, False),
]
# (io bytes, qd, encrypted, hdgst, ddgst, queues); four queues only where the four jobs'
# slices of the namespace hold qd x io each (verify needs its I/Os not to overlap)
FULL = [
    (io, qd, enc, hd, dd, queues)
    for io, qd, enc, (hd, dd), queues in itertools.product(
        (4096, 16384, 131072, 1 << 20),
        (1, 8, 32, 128),
        (True, False),
        ((False, False), (True, False), (False, True), (True, True)),
        (1, 4),
    )
    if queues == 1 or io * qd * queues <= BLOCKS * 4096
]


def _cell_id(cell: tuple[int, ...]) -> str:
    io, qd, enc, hd, dd = cell[:5]
    queues = cell[5] if len(cell) > 5 else 1
    return f"{io // 1024}k-qd{qd}-{'enc' if enc else 'plain'}-h{int(hd)}d{int(dd)}-q{queues}"


def _verify(
    targets: dict[bool, LoggedTarget], tmp_path: Path, cell: tuple[int, ...], seconds: int
) -> None:
    io, qd, enc, hd, dd = cell[:5]
    queues = cell[5] if len(cell) > 5 else 1
    t = targets[bool(enc)]
    t.new_log()
    r = bdevperf(
        tmp_path, t.port, NQN, HOST, io_bytes=io, qd=qd, seconds=seconds, hdgst=bool(hd),
        ddgst=bool(dd), jobs=queues, ns_blocks=BLOCKS,
    )  # fmt: skip
    assert r.clean and r.out.count("Verification LBA range") == queues, r.out[-3000:]
    _assert_clean(t)


@pytest.mark.parametrize("cell", SHORT, ids=_cell_id)
def test_bdevperf_verify_against_our_target(
    targets: dict[bool, LoggedTarget], tmp_path: Path, cell: tuple[int, ...]
) -> None:
    _verify(targets, tmp_path, cell, seconds=2)


@pytest.mark.full
@pytest.mark.parametrize("cell", FULL, ids=_cell_id)
def test_bdevperf_verify_full_matrix(
    targets: dict[bool, LoggedTarget], tmp_path: Path, cell: tuple[int, ...]
) -> None:
    _verify(targets, tmp_path, cell, seconds=10)


@pytest.mark.parametrize(("io", "qd"), [(4096, 32), (1 << 20, 8)], ids=["4k-qd32", "1m-qd8"])
def test_bdevperf_verify_encrypted_file_namespace(tmp_path: Path, io: int, qd: int) -> None:
    """The NVMe tier's stack (AES-XTS over a page-cache file), whose writes the target runs
    on its loop (a cipher pass into a scratch buffer, then pwritev): SPDK pipelines writes
    and verifies every byte it reads back."""
    t = LoggedTarget(tmp_path, encrypted=True, file=tmp_path / "ns.img")
    try:
        r = bdevperf(tmp_path, t.port, NQN, HOST, io_bytes=io, qd=qd, seconds=2, ns_blocks=BLOCKS)
        assert r.clean and r.out.count("Verification LBA range") == 1, r.out[-3000:]
        _assert_clean(t)
    finally:
        t.close()


@pytest.mark.parametrize(
    ("io", "qd", "enc", "hd", "dd"),
    [(4096, 32, True, True, True), (131072, 8, False, False, False)],
    ids=["4k-qd32-enc-dig", "128k-qd8-plain"],
)
def test_bdevperf_verify_four_queues(
    targets: dict[bool, LoggedTarget],
    tmp_path: Path,
    io: int,
    qd: int,
    enc: bool,
    hd: bool,
    dd: bool,
) -> None:
    """Four bdevperf jobs on one controller, each on its own thread and qpair and its own
    quarter of the namespace: four I/O queues of one controller, every byte verified."""
    t = targets[enc]
    t.new_log()
    r = bdevperf(
        tmp_path, t.port, NQN, HOST, io_bytes=io, qd=qd, seconds=2, hdgst=hd, ddgst=dd,
        jobs=4, ns_blocks=BLOCKS,
    )  # fmt: skip
    assert r.clean and r.out.count("Verification LBA range") == 4, r.out[-3000:]
    log = t.new_log()
    assert not protocol_errors(log), protocol_errors(log)[:5]
    qids = {e["qid"] for e in t.events(log, "nvmf_io_queue_connected")}
    assert qids == {1, 2, 3, 4}, qids


@pytest.mark.parametrize(
    ("io", "hd", "dd"), [(4096, True, True), (131072, False, False)], ids=["4k-dig", "128k"]
)
def test_spdk_nvme_perf_randrw_four_queues(
    targets: dict[bool, LoggedTarget], io: int, hd: bool, dd: bool
) -> None:
    t = targets[True]
    t.new_log()
    r = nvme_perf(t.port, NQN, HOST, io_bytes=io, qd=32, seconds=2, queues=4, hdgst=hd, ddgst=dd)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert re.search(r"^Total\s*:\s+[1-9]", r.stdout, re.MULTILINE), out[-3000:]
    assert not protocol_errors(out), out[-3000:]
    created = t.events(t.new_log(), "nvmf_controller_created")
    assert created, "spdk_nvme_perf never connected"


def test_spdk_nvme_identify_and_discover(tmp_path: Path) -> None:
    # spdk_nvme_identify v26.05 ignores hostnqn: an allow-any-host subsystem (PEER.md)
    with TargetProcess(NQN, allow_any_host=True, blocks=BLOCKS) as t:
        r = identify(t.port, NQN)
        out = r.stdout + r.stderr
        assert r.returncode == 0, out[-3000:]
        assert f"Subsystem NQN:                         {NQN}" in r.stdout or NQN in r.stdout
        assert re.search(rf"Size \(in LBAs\):\s+{BLOCKS}\b", r.stdout), r.stdout[-3000:]
        assert "Current LBA Format:" in r.stdout and not protocol_errors(out)
        d = discover(t.port)
        assert d.returncode == 0, (d.stdout + d.stderr)[-3000:]
        assert "Discovery Log" in d.stdout and NQN in d.stdout, d.stdout[-3000:]
        assert not protocol_errors(d.stdout + d.stderr)


def test_detach_attach_cycles_leave_no_error_and_no_controller(tmp_path: Path) -> None:
    """Finding 2 through the real peer: every detach reuses the ids of abandoned AERs."""
    t = LoggedTarget(tmp_path, encrypted=True)
    try:
        with bdevperf_idle(tmp_path) as app:
            for _ in range(CYCLES):
                app.rpc("bdev_nvme_attach_controller", **attach_params("N0", t.port, NQN, HOST))
                app.rpc("bdev_nvme_detach_controller", name="N0")
            assert app.rpc("bdev_nvme_get_controllers") == []
            peer_log = app.log()
        deadline = time.monotonic() + 10
        log = t.new_log()
        while time.monotonic() < deadline:
            created = t.events(log, "nvmf_controller_created")
            destroyed = t.events(log, "nvmf_controller_destroyed")
            if len(destroyed) >= len(created) >= CYCLES:
                break
            time.sleep(0.2)
            log += t.new_log()
        assert len(created) == len(destroyed) >= CYCLES, (len(created), len(destroyed))
        bad = protocol_errors(log)
        assert not bad, bad[:5]
        assert not protocol_errors(peer_log), peer_log[-3000:]
        # finding 3's mirror: SPDK's own initiator waits for CSTS.SHST, so no busy wait here
        assert "disconnect in progress" not in peer_log
    finally:
        t.close()


def test_target_restarted_under_a_connected_host_is_reconnected(tmp_path: Path) -> None:
    t = LoggedTarget(tmp_path, encrypted=True, file=tmp_path / "ns.img")
    try:
        with bdevperf_idle(tmp_path) as app:
            params = attach_params("N0", t.port, NQN, HOST)
            params.update(ctrlr_loss_timeout_sec=-1, reconnect_delay_sec=1)
            app.rpc("bdev_nvme_attach_controller", **params)
            t.restart()
            deadline = time.monotonic() + RECONNECT_TIMEOUT_S
            state = ""
            while time.monotonic() < deadline:
                time.sleep(0.5)
                ctrls = app.rpc("bdev_nvme_get_controllers")
                state = ctrls[0]["ctrlrs"][0]["state"] if ctrls else "gone"
                created = t.events(t.log_path.read_text(), "nvmf_controller_created")
                if state == "enabled" and len(created) >= 2:
                    break
            assert state == "enabled" and len(created) >= 2, (state, app.log()[-2000:])
            result = app.rpc("perform_tests", timeout_s=60)  # verify -t 1 on the new session
            assert result, result
        log = t.new_log()
        bad = protocol_errors(log)
        assert not bad, bad[:5]
    finally:
        t.close()
