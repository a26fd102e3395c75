"""NVMe/TCP secure channel (TLS 1.3 PSK, TP 8011) both ways against SPDK, and ours with ours.

- our initiator -> SPDK's target (`nvmf_subsystem_add_listener --secure-channel`,
  `nvmf_subsystem_add_host --psk NAME`): right key reads and writes, wrong key refused,
  plaintext host refused;
- SPDK's bdevperf (`bdev_nvme_attach_controller psk=NAME`) -> our secure target: `-w verify`
  passes, wrong key refused, and our own plaintext host is refused.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from spdk_auth_peer import (
    bdevperf,
    free_port,
    keyring_config,
    listen_address,
    require_spdk,
    spdk_target,
    write_key,
)

from dpu_agent.nvmf import HostKeys
from dpu_agent.nvmf._host_keys import host_keys_to_dict
from dpu_agent.testing import TargetProcess
from host_shim.nvme import NvmeStatusError, NvmeTcpController, NvmeTransportError
from kvproto.nvme import DhchapHash, DhchapSecret, TlsPsk

NQN = "nqn.2026-11.io.dpu-kvtier:tenant:tls"
HOST = f"nqn.2014-08.org.nvmexpress:uuid:{uuid.uuid4()}"
HOST2 = f"nqn.2014-08.org.nvmexpress:uuid:{uuid.uuid4()}"
PSK = TlsPsk.generate(HOST, NQN)
PSK384 = TlsPsk.generate(HOST2, NQN, DhchapHash.SHA384)


def _io(c: NvmeTcpController, size: int = 1 << 20) -> None:
    data = os.urandom(size)
    c.write(1, 16, data)
    out = bytearray(size)
    c.read(1, 16, out)
    assert out == data


@pytest.fixture(scope="module")
def our_secure_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TargetProcess]:
    d = tmp_path_factory.mktemp("tls-target")
    keys = {
        HOST: HostKeys(psk=PSK),
        HOST2: HostKeys(psk=PSK384, dhchap_key=DhchapSecret.generate()),
    }
    path = write_key(
        d, "hosts.json", json.dumps({h: host_keys_to_dict(k) for h, k in keys.items()})
    )
    with TargetProcess(
        NQN,
        allow_hosts=[HOST, HOST2],
        blocks=4096,
        host_keys_file=path,
        extra_args=["--secure-channel"],
    ) as t:
        yield t


def test_ours_to_ours_over_tls(our_secure_target: TargetProcess) -> None:
    with NvmeTcpController.connect(
        "127.0.0.1", our_secure_target.port, NQN, HOST, io_queues=2, psk=PSK
    ) as c:
        _io(c, 4 << 20)


def test_ours_to_ours_tls_sha384_with_dhchap_on_top(our_secure_target: TargetProcess) -> None:
    # HOST2 also has a DH-HMAC-CHAP key: the target asks for both (TLS, then in-band auth)
    with pytest.raises(Exception, match="DH-HMAC-CHAP"):
        NvmeTcpController.connect("127.0.0.1", our_secure_target.port, NQN, HOST2, psk=PSK384)


def test_wrong_psk_refused_by_our_target(our_secure_target: TargetProcess) -> None:
    with pytest.raises(NvmeTransportError, match="TLS handshake refused"):
        NvmeTcpController.connect(
            "127.0.0.1", our_secure_target.port, NQN, HOST, psk=TlsPsk.generate(HOST, NQN)
        )


def test_identity_of_another_host_cannot_connect_as_this_host(
    our_secure_target: TargetProcess,
) -> None:
    # TLS as HOST (right key) but Connect claiming HOST2: the Connect is refused (Invalid Host)
    from host_shim.nvme._controller import _connect_queue
    from host_shim.nvme._queue import QueuePairSocket
    from host_shim.nvme._tls import tls_wrapper
    from kvproto.nvme import ConnectData

    with pytest.raises(NvmeStatusError) as e:
        q = QueuePairSocket(
            "127.0.0.1",
            our_secure_target.port,
            qid=0,
            depth=8,
            timeout_s=10,
            tls=tls_wrapper(PSK, HOST, NQN),
        )
        try:
            _connect_queue(
                q, ConnectData(hostid=bytes(16), cntlid=0xFFFF, subnqn=NQN, hostnqn=HOST2), 0
            )
        finally:
            q.close()
    assert (e.value.sct, e.value.sc) == (1, 0x84)


def test_plaintext_host_refused_by_our_secure_target(our_secure_target: TargetProcess) -> None:
    with pytest.raises(NvmeTransportError):
        NvmeTcpController.connect("127.0.0.1", our_secure_target.port, NQN, HOST, timeout_s=5)


@pytest.fixture(scope="module")
def spdk_keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    require_spdk()
    d = tmp_path_factory.mktemp("tls-keys")
    return {
        n: write_key(d, n, k.format())
        for n, k in (("psk0", PSK), ("psk1", PSK384), ("bad", TlsPsk.generate(HOST, NQN)))
    }


@pytest.fixture(scope="module")
def spdk_secure_target(
    tmp_path_factory: pytest.TempPathFactory, spdk_keys: dict[str, Path]
) -> Iterator[int]:
    d = tmp_path_factory.mktemp("spdk-tls")
    port = free_port()
    nvmf = [
        {"method": "nvmf_create_transport", "params": {"trtype": "TCP"}},
        {
            "method": "nvmf_create_subsystem",
            "params": {"nqn": NQN, "allow_any_host": False, "serial_number": "SPDKTLS1"},
        },
        {"method": "nvmf_subsystem_add_host", "params": {"nqn": NQN, "host": HOST, "psk": "psk0"}},
        {"method": "nvmf_subsystem_add_host", "params": {"nqn": NQN, "host": HOST2, "psk": "psk1"}},
        {
            "method": "nvmf_subsystem_add_ns",
            "params": {"nqn": NQN, "namespace": {"bdev_name": "Malloc0"}},
        },
        # Last: the fixture starts connecting as soon as the port listens, and SPDK applies the
        # config in order. With the listener first, a loaded CI box connected before the hosts
        # and their PSKs were added, and SPDK answered the handshake with an internal-error alert.
        {
            "method": "nvmf_subsystem_add_listener",
            "params": {"nqn": NQN, "listen_address": listen_address(port), "secure_channel": True},
        },
    ]
    bdev = [
        {
            "method": "bdev_malloc_create",
            "params": {"name": "Malloc0", "num_blocks": 4096, "block_size": 4096},
        }
    ]
    keys = {k: v for k, v in spdk_keys.items() if k != "bad"}
    config = {
        "subsystems": [
            keyring_config(keys),
            {"subsystem": "bdev", "config": bdev},
            {"subsystem": "nvmf", "config": nvmf},
        ]
    }
    with spdk_target(d, config, port):
        yield port


@pytest.mark.parametrize(("host", "psk"), [(HOST, PSK), (HOST2, PSK384)], ids=["sha256", "sha384"])
def test_our_initiator_to_spdk_secure_channel(
    spdk_secure_target: int, host: str, psk: TlsPsk
) -> None:
    with NvmeTcpController.connect(
        "127.0.0.1", spdk_secure_target, NQN, host, io_queues=2, psk=psk.format()
    ) as c:
        _io(c)


def test_spdk_refuses_our_wrong_psk(spdk_secure_target: int) -> None:
    with pytest.raises(NvmeTransportError, match="TLS handshake refused"):
        NvmeTcpController.connect(
            "127.0.0.1", spdk_secure_target, NQN, HOST, psk=TlsPsk.generate(HOST, NQN), timeout_s=5
        )


def test_spdk_refuses_our_plaintext_host(spdk_secure_target: int) -> None:
    with pytest.raises(NvmeTransportError):
        NvmeTcpController.connect("127.0.0.1", spdk_secure_target, NQN, HOST, timeout_s=5)


def _attach(port: int, name: str, host: str, **kw: str) -> dict[str, object]:
    return {
        "name": name,
        "trtype": "tcp",
        "adrfam": "ipv4",
        "traddr": "127.0.0.1",
        "trsvcid": str(port),
        "subnqn": NQN,
        "hostnqn": host,
        **kw,
    }


def test_spdk_initiator_verify_over_tls_to_our_target(
    our_secure_target: TargetProcess, spdk_keys: dict[str, Path], tmp_path: Path
) -> None:
    out = bdevperf(tmp_path, _attach(our_secure_target.port, "Tls", HOST, psk="psk0"), spdk_keys)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "Tls" in out.stdout


def test_spdk_initiator_wrong_psk_refused_by_our_target(
    our_secure_target: TargetProcess, spdk_keys: dict[str, Path], tmp_path: Path
) -> None:
    out = bdevperf(tmp_path, _attach(our_secure_target.port, "TlsBad", HOST, psk="bad"), spdk_keys)
    assert out.returncode != 0


def test_spdk_plaintext_initiator_refused_by_our_target(
    our_secure_target: TargetProcess, spdk_keys: dict[str, Path], tmp_path: Path
) -> None:
    out = bdevperf(tmp_path, _attach(our_secure_target.port, "Plain", HOST), spdk_keys)
    assert out.returncode != 0


def _key(host: str, blind: bool) -> TlsPsk:
    """A PSK for `host` on NQN whose derived TLS PSK begins with 0x00 (`blind`) or not."""
    while True:
        k = TlsPsk(psk=os.urandom(32))
        if k.spdk_takes_for_none(host, NQN) == blind:
            return k


def test_spdk_initiator_takes_a_zero_led_derived_psk_for_no_key(tmp_path: Path) -> None:
    # SPDK's nvme_tcp.c picks its ssl socket by psk[0] of the derived TLS PSK: with a key
    # deriving 0x00 first it sends a plaintext ICReq (why TlsPsk.generate draws such a key
    # again). The same bdevperf with a key that derives another first byte passes.
    require_spdk()
    host = f"nqn.2014-08.org.nvmexpress:uuid:{uuid.uuid4()}"
    for blind in (True, False):
        psk = _key(host, blind)
        hosts = write_key(tmp_path, f"hosts-{blind}.json",
                          json.dumps({host: host_keys_to_dict(HostKeys(psk=psk))}))  # fmt: skip
        log = tmp_path / f"target-{blind}.log"
        with TargetProcess(NQN, allow_hosts=[host], blocks=4096, host_keys_file=hosts,
                           extra_args=["--secure-channel"], log_path=log) as t:  # fmt: skip
            keys = {"k": write_key(tmp_path, f"k-{blind}", psk.format())}
            out = bdevperf(tmp_path, _attach(t.port, f"B{int(blind)}", host, psk="k"), keys)
        refusals = [json.loads(line) for line in log.read_text().splitlines()
                    if "nvmf_tls_refused" in line]  # fmt: skip
        if blind:
            assert out.returncode != 0
            assert [r["reason"].startswith("plaintext NVMe/TCP ICReq") for r in refusals] == [True]
        else:
            assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
            assert refusals == []


def test_plaintext_host_is_named_in_the_secure_targets_log(tmp_path: Path) -> None:
    psk = TlsPsk.generate(HOST, NQN)
    hosts = write_key(
        tmp_path, "hosts.json", json.dumps({HOST: host_keys_to_dict(HostKeys(psk=psk))})
    )
    log = tmp_path / "target.log"
    with TargetProcess(NQN, allow_hosts=[HOST], blocks=4096, host_keys_file=hosts,
                       extra_args=["--secure-channel"], log_path=log) as t:  # fmt: skip
        with pytest.raises(NvmeTransportError):
            NvmeTcpController.connect("127.0.0.1", t.port, NQN, HOST, timeout_s=5)
        with pytest.raises(NvmeTransportError, match="TLS handshake refused"):
            NvmeTcpController.connect(
                "127.0.0.1", t.port, NQN, HOST, psk=TlsPsk.generate(HOST, NQN)
            )
    reasons = [json.loads(line)["reason"] for line in log.read_text().splitlines()
               if "nvmf_tls_refused" in line]  # fmt: skip
    assert len(reasons) == 2 and reasons[0].startswith("plaintext NVMe/TCP ICReq"), reasons
    assert "plaintext" not in reasons[1]


def test_silent_connection_to_secure_target_is_closed_after_the_handshake_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import asyncio

    from dpu_agent.nvmf import NvmeTcpTarget, Subsystem, _tls

    monkeypatch.setattr(_tls, "HANDSHAKE_TIMEOUT_S", 0.3)

    async def run() -> bytes:
        target = NvmeTcpTarget([Subsystem(NQN, {HOST})], port=0, secure_channel=True)
        await target.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", target.port)
            data = await asyncio.wait_for(reader.read(100), 5)  # EOF when the target closes
            writer.close()
            return data
        finally:
            await target.stop()

    assert asyncio.run(run()) == b""
