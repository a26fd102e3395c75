"""DH-HMAC-CHAP on the project's target: our initiator, and SPDK's initiator (bdevperf).

SPDK's bdevperf attaches with `bdev_nvme_attach_controller(dhchap_key=NAME[, dhchap_ctrlr_key])`
(keys from `keyring_file_add_key`) and must pass `-w verify` on a plain namespace; a wrong or
missing key is refused. Hosts that fail are logged by NQN hash only.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from spdk_auth_peer import bdevperf, require_spdk, write_key

from dpu_agent.nvmf import HostKeys, nqn_hash
from dpu_agent.nvmf._host_keys import host_keys_to_dict
from dpu_agent.testing import TargetProcess
from host_shim.nvme import NvmeAuthError, NvmeStatusError, NvmeTcpController
from kvproto.nvme import DhchapHash, DhchapSecret, Status

NQN = "nqn.2026-11.io.dpu-kvtier:tenant:auth"
H_UNI = f"nqn.2014-08.org.nvmexpress:uuid:{uuid.uuid4()}"
H_BI = f"nqn.2014-08.org.nvmexpress:uuid:{uuid.uuid4()}"
H_NOKEY = f"nqn.2014-08.org.nvmexpress:uuid:{uuid.uuid4()}"
KEY = DhchapSecret.generate(DhchapHash.SHA256)
BI_KEY = DhchapSecret.generate()
CTRL_KEY = DhchapSecret.generate(DhchapHash.SHA384)


@pytest.fixture(scope="module")
def auth_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TargetProcess]:
    d = tmp_path_factory.mktemp("auth-target")
    keys = {
        H_UNI: HostKeys(dhchap_key=KEY),
        H_BI: HostKeys(dhchap_key=BI_KEY, dhchap_ctrlr_key=CTRL_KEY),
    }
    path = write_key(
        d, "hosts.json", json.dumps({h: host_keys_to_dict(k) for h, k in keys.items()})
    )
    with TargetProcess(
        NQN,
        allow_hosts=[H_UNI, H_BI, H_NOKEY],
        blocks=4096,
        host_keys_file=path,
        require_auth=True,
        log_level="INFO",
    ) as t:
        yield t


def test_our_initiator_uni_and_bidirectional(auth_target: TargetProcess) -> None:
    for host, kw in [
        (H_UNI, {"dhchap_key": KEY, "dhchap_dhgroups": ["ffdhe2048"]}),
        (H_BI, {"dhchap_key": BI_KEY, "dhchap_ctrlr_key": CTRL_KEY, "dhchap_hashes": ["sha512"]}),
    ]:
        with NvmeTcpController.connect(
            "127.0.0.1", auth_target.port, NQN, host, io_queues=2, **kw
        ) as c:
            data = os.urandom(1 << 20)
            c.write(1, 0, data)
            out = bytearray(len(data))
            c.read(1, 0, out)
            assert out == data
            c.reauthenticate()  # our target supports re-authentication on every queue
            c.read(1, 0, out[:4096])


def test_wrong_key_gets_authentication_failed(auth_target: TargetProcess) -> None:
    with pytest.raises(NvmeAuthError, match="refused authentication: FAILED"):
        NvmeTcpController.connect("127.0.0.1", auth_target.port, NQN, H_UNI, dhchap_key=BI_KEY)


def test_host_without_a_key_gets_authentication_required(auth_target: TargetProcess) -> None:
    # the shim knows it must authenticate and has no key: it says so before sending anything
    with pytest.raises(NvmeAuthError, match="requires DH-HMAC-CHAP"):
        NvmeTcpController.connect("127.0.0.1", auth_target.port, NQN, H_NOKEY)
    # a host that knows the NQN, has a key of its own, but none is registered: refused
    with pytest.raises(NvmeAuthError, match="FAILED"):
        NvmeTcpController.connect("127.0.0.1", auth_target.port, NQN, H_NOKEY, dhchap_key=KEY)


def test_commands_before_authentication_get_status_0x191(auth_target: TargetProcess) -> None:
    from host_shim.nvme._auth import ATR_BIT
    from host_shim.nvme._controller import _connect_queue
    from host_shim.nvme._queue import QueuePairSocket
    from kvproto.nvme import ConnectData, Property

    q = QueuePairSocket("127.0.0.1", auth_target.port, qid=0, depth=8, timeout_s=10)
    try:
        cd = ConnectData(hostid=uuid.uuid4().bytes, cntlid=0xFFFF, subnqn=NQN, hostnqn=H_UNI)
        cqe = _connect_queue(q, cd, 0)
        assert cqe.cdw0 & ATR_BIT
        c = NvmeTcpController(
            admin=q, subnqn=NQN, hostnqn=H_UNI, hostid=cd.hostid, kato_ms=0, max_transfer_bytes=None
        )
        with pytest.raises(NvmeStatusError) as e:
            c.property_get(Property.CAP)
        assert e.value.code == Status.AUTHENTICATION_REQUIRED and (e.value.sct, e.value.sc) == (
            1,
            0x91,
        )
    finally:
        q.close()


def test_refusals_are_logged_by_nqn_hash_only(tmp_path: Path) -> None:
    # the target logs to its stderr (inherited): checked on a fresh one with captured output
    import subprocess
    import sys

    path = write_key(
        tmp_path, "k.json", json.dumps({H_UNI: host_keys_to_dict(HostKeys(dhchap_key=KEY))})
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dpu_agent.nvmf",
            "--nqn",
            NQN,
            "--allow-host",
            H_UNI,
            "--blocks",
            "64",
            "--host-keys",
            str(path),
            "--log-level",
            "INFO",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        port = json.loads(proc.stdout.readline())["port"]
        with pytest.raises(NvmeAuthError):
            NvmeTcpController.connect("127.0.0.1", port, NQN, H_UNI, dhchap_key=BI_KEY)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        assert proc.stderr is not None
        err = proc.stderr.read()
        proc.wait(30)
    text = err.decode()
    assert "nvmf_auth_refused" in text and nqn_hash(H_UNI) in text
    refusal = [line for line in text.splitlines() if "nvmf_auth_refused" in line]
    assert refusal and all(H_UNI not in line and KEY.format() not in line for line in refusal)


def _attach(port: int, host: str, name: str, **keys: str) -> dict[str, object]:
    return {
        "name": name,
        "trtype": "tcp",
        "adrfam": "ipv4",
        "traddr": "127.0.0.1",
        "trsvcid": str(port),
        "subnqn": NQN,
        "hostnqn": host,
        **keys,
    }


@pytest.fixture(scope="module")
def key_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    require_spdk()
    d = tmp_path_factory.mktemp("bdevperf-keys")
    return {
        n: write_key(d, n, k.format())
        for n, k in (
            ("key0", KEY),
            ("key1", BI_KEY),
            ("ckey1", CTRL_KEY),
            ("bad", DhchapSecret.generate()),
        )
    }


def test_spdk_initiator_unidirectional_verify(
    auth_target: TargetProcess, key_files: dict[str, Path], tmp_path: Path
) -> None:
    out = bdevperf(tmp_path, _attach(auth_target.port, H_UNI, "Uni", dhchap_key="key0"), key_files)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "Uni" in out.stdout and "Fail/s" in out.stdout


@pytest.mark.parametrize("group", ["null", "ffdhe2048"])
@pytest.mark.parametrize("digest", ["sha256", "sha384", "sha512"])
def test_spdk_initiator_each_hash_and_group(
    auth_target: TargetProcess, key_files: dict[str, Path], tmp_path: Path, digest: str, group: str
) -> None:
    # SPDK offers only this digest and group, so our target (strongest common) must use them
    opts = {"dhchap_digests": [digest], "dhchap_dhgroups": [group]}
    attach = _attach(auth_target.port, H_UNI, f"H{digest}{group}", dhchap_key="key0")
    out = bdevperf(tmp_path, attach, key_files, seconds=1, options=opts)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]


def test_spdk_initiator_bidirectional_verify(
    auth_target: TargetProcess, key_files: dict[str, Path], tmp_path: Path
) -> None:
    attach = _attach(auth_target.port, H_BI, "Bi", dhchap_key="key1", dhchap_ctrlr_key="ckey1")
    out = bdevperf(tmp_path, attach, key_files)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]


def test_spdk_initiator_wrong_key_refused(
    auth_target: TargetProcess, key_files: dict[str, Path], tmp_path: Path
) -> None:
    out = bdevperf(tmp_path, _attach(auth_target.port, H_UNI, "Bad", dhchap_key="bad"), key_files)
    assert out.returncode != 0
    assert "authentication failed" in (out.stdout + out.stderr)


def test_spdk_initiator_missing_key_refused(
    auth_target: TargetProcess, key_files: dict[str, Path], tmp_path: Path
) -> None:
    out = bdevperf(tmp_path, _attach(auth_target.port, H_UNI, "NoKey"), key_files)
    assert out.returncode != 0


def test_spdk_initiator_reauthenticates(key_files: dict[str, Path], tmp_path: Path) -> None:
    """bdev_nvme_set_keys makes SPDK's host re-authenticate every queue on our target."""
    import subprocess
    import sys

    from spdk.rpc.client import JSONRPCException
    from spdk_auth_peer import bdevperf_waiting

    keys = {H_BI: host_keys_to_dict(HostKeys(dhchap_key=BI_KEY, dhchap_ctrlr_key=CTRL_KEY))}
    path = write_key(tmp_path, "hosts.json", json.dumps(keys))
    log = tmp_path / "target.log"
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dpu_agent.nvmf", "--nqn", NQN, "--allow-host", H_BI,
             "--blocks", "4096", "--host-keys", str(path), "--require-auth", "--log-level", "INFO"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
        )  # fmt: skip
    try:
        assert proc.stdout is not None
        port = json.loads(proc.stdout.readline())["port"]
        attach = _attach(port, H_BI, "Reauth", dhchap_key="key1", dhchap_ctrlr_key="ckey1")
        with bdevperf_waiting(tmp_path, attach, key_files) as rpc:
            before = log.read_text().count("nvmf_auth_ok")
            assert before >= 2  # admin + I/O queue(s) authenticated at attach
            rpc.call(
                "bdev_nvme_set_keys",
                {"name": "Reauth", "dhchap_key": "key1", "dhchap_ctrlr_key": "ckey1"},
            )
            after = log.read_text().count("nvmf_auth_ok")
            assert after >= 2 * before - 1, (before, after)  # every queue again
            rpc.call("perform_tests")  # -w verify after re-authentication
            with pytest.raises(JSONRPCException):  # re-authenticating with a wrong key fails
                rpc.call(
                    "bdev_nvme_set_keys",
                    {"name": "Reauth", "dhchap_key": "bad", "dhchap_ctrlr_key": "ckey1"},
                )
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(30)
    assert "nvmf_auth_refused" in log.read_text()


def test_garbage_auth_messages_get_failure1_and_others_keep_working(
    auth_target: TargetProcess,
) -> None:
    """Random AUTH_Send payloads on a live queue: the target answers AUTH_Failure1 (never
    crashes or authenticates), and an honest host authenticates meanwhile."""
    import random

    from host_shim.nvme._auth import _recv, _send
    from host_shim.nvme._controller import _connect_queue
    from host_shim.nvme._queue import QueuePairSocket
    from kvproto.nvme import AuthFailure, ConnectData, parse_auth_message

    rng = random.Random(15)
    for _ in range(5):
        q = QueuePairSocket("127.0.0.1", auth_target.port, qid=0, depth=8, timeout_s=10)
        try:
            cd = ConnectData(hostid=uuid.uuid4().bytes, cntlid=0xFFFF, subnqn=NQN, hostnqn=H_UNI)
            _connect_queue(q, cd, 0)
            _send(q, rng.randbytes(rng.randrange(1, 300)))
            reply = parse_auth_message(_recv(q))
            assert isinstance(reply, AuthFailure) and reply.from_controller
        finally:
            q.close()
        with NvmeTcpController.connect(
            "127.0.0.1", auth_target.port, NQN, H_UNI, dhchap_key=KEY
        ) as c:
            assert c.active_namespaces() == [1]
