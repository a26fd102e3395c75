"""DH-HMAC-CHAP against SPDK (v26.05, found through SPDK_TGT): our initiator -> SPDK's target.

SPDK's target holds the host secrets as keyring files (`keyring_file_add_key`) bound with
`nvmf_subsystem_add_host --dhchap-key [--dhchap-ctrlr-key]`. Each hash, ffdhe2048 and null,
uni- and bidirectional, wrong/missing keys, re-authentication. The whole hash x group matrix
is `-m full`.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
from spdk_auth_peer import (
    free_port,
    keyring_config,
    listen_address,
    require_spdk,
    spdk_target,
    write_key,
)

from host_shim.nvme import NvmeAuthError, NvmeTcpController
from kvproto.nvme import DhchapHash, DhchapSecret, DhGroup

NQN = "nqn.2026-11.io.dpu-kvtier:auth-interop"
H_UNI = f"nqn.2014-08.org.nvmexpress:uuid:{uuid.uuid4()}"
H_BI = f"nqn.2014-08.org.nvmexpress:uuid:{uuid.uuid4()}"
KEY = DhchapSecret.generate(DhchapHash.SHA384)
BI_KEY = DhchapSecret.generate()
CTRL_KEY = DhchapSecret.generate(DhchapHash.SHA512)
HASHES = ["sha256", "sha384", "sha512"]


@pytest.fixture(scope="module")
def spdk_auth_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    require_spdk()
    d = tmp_path_factory.mktemp("spdk-auth")
    keys = {
        n: write_key(d, n, k.format())
        for n, k in (("key0", KEY), ("key1", BI_KEY), ("ckey1", CTRL_KEY))
    }
    port = free_port()
    nvmf = [
        {"method": "nvmf_create_transport", "params": {"trtype": "TCP"}},
        {
            "method": "nvmf_create_subsystem",
            "params": {"nqn": NQN, "allow_any_host": False, "serial_number": "SPDKAUTH1"},
        },
        {
            "method": "nvmf_subsystem_add_host",
            "params": {"nqn": NQN, "host": H_UNI, "dhchap_key": "key0"},
        },
        {
            "method": "nvmf_subsystem_add_host",
            "params": {"nqn": NQN, "host": H_BI, "dhchap_key": "key1", "dhchap_ctrlr_key": "ckey1"},
        },
        {
            "method": "nvmf_subsystem_add_ns",
            "params": {"nqn": NQN, "namespace": {"bdev_name": "Malloc0"}},
        },
        {
            "method": "nvmf_subsystem_add_listener",
            "params": {"nqn": NQN, "listen_address": listen_address(port)},
        },
    ]
    bdev = [
        {
            "method": "bdev_malloc_create",
            "params": {"name": "Malloc0", "num_blocks": 4096, "block_size": 4096},
        }
    ]
    config = {
        "subsystems": [
            keyring_config(keys),
            {"subsystem": "bdev", "config": bdev},
            {"subsystem": "nvmf", "config": nvmf},
        ]
    }
    with spdk_target(d, config, port):
        yield port


def _io(c: NvmeTcpController) -> None:
    data = os.urandom(256 << 10)
    c.write(1, 8, data)
    out = bytearray(len(data))
    c.read(1, 8, out)
    assert out == data


@pytest.mark.parametrize("group", ["null", "ffdhe2048"])
@pytest.mark.parametrize("digest", HASHES)
def test_each_hash_unidirectional(spdk_auth_target: int, digest: str, group: str) -> None:
    with NvmeTcpController.connect(
        "127.0.0.1",
        spdk_auth_target,
        NQN,
        H_UNI,
        io_queues=2,
        dhchap_key=KEY,
        dhchap_hashes=[digest],
        dhchap_dhgroups=[group],
    ) as c:
        _io(c)


@pytest.mark.parametrize(("digest", "group"), [("sha256", "null"), ("sha512", "ffdhe2048")])
def test_bidirectional(spdk_auth_target: int, digest: str, group: str) -> None:
    with NvmeTcpController.connect(
        "127.0.0.1",
        spdk_auth_target,
        NQN,
        H_BI,
        dhchap_key=BI_KEY.format(),
        dhchap_ctrlr_key=CTRL_KEY.format(),
        dhchap_hashes=[digest],
        dhchap_dhgroups=[group],
    ) as c:
        _io(c)


def test_wrong_key_refused_by_spdk(spdk_auth_target: int) -> None:
    with pytest.raises(NvmeAuthError, match="refused authentication: FAILED"):
        NvmeTcpController.connect(
            "127.0.0.1", spdk_auth_target, NQN, H_UNI, dhchap_key=DhchapSecret.generate()
        )


def test_missing_key_refused(spdk_auth_target: int) -> None:
    with pytest.raises(NvmeAuthError, match="requires DH-HMAC-CHAP"):
        NvmeTcpController.connect("127.0.0.1", spdk_auth_target, NQN, H_UNI)


def test_wrong_controller_key_refused_by_us(spdk_auth_target: int) -> None:
    with pytest.raises(NvmeAuthError, match="controller's response does not match"):
        NvmeTcpController.connect(
            "127.0.0.1",
            spdk_auth_target,
            NQN,
            H_BI,
            dhchap_key=BI_KEY,
            dhchap_ctrlr_key=DhchapSecret.generate(),
        )


def test_reauthentication(spdk_auth_target: int) -> None:
    with NvmeTcpController.connect(
        "127.0.0.1",
        spdk_auth_target,
        NQN,
        H_BI,
        io_queues=2,
        dhchap_key=BI_KEY,
        dhchap_ctrlr_key=CTRL_KEY,
    ) as c:
        c.reauthenticate()
        _io(c)


@pytest.mark.full
@pytest.mark.parametrize("group", [g.name.lower() for g in DhGroup])
@pytest.mark.parametrize("digest", HASHES)
@pytest.mark.parametrize("bidirectional", [False, True])
def test_full_matrix(spdk_auth_target: int, digest: str, group: str, bidirectional: bool) -> None:
    kw = (
        {"dhchap_key": BI_KEY, "dhchap_ctrlr_key": CTRL_KEY}
        if bidirectional
        else {"dhchap_key": KEY}
    )
    host = H_BI if bidirectional else H_UNI
    with NvmeTcpController.connect(
        "127.0.0.1",
        spdk_auth_target,
        NQN,
        host,
        dhchap_hashes=[digest],
        dhchap_dhgroups=[group],
        **kw,
    ) as c:
        _io(c)
