"""Issued keys and tenant isolation on the data plane (agent with `[nvmf] require_auth`).

The agent issues each host's DH-HMAC-CHAP secret when it says hello with its tenant's token,
and `dpuctl hosts add` issues one for an operator. A host that knows another tenant's NQN (and
even a host NQN allowed there) but not that host's secret gets nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dpu_agent.nvmf import tenant_nqn
from dpu_agent.testing import AgentProcess, spawn_agent
from host_shim.client import ControlChannel, ControlError, KVClient
from host_shim.nvme import NvmeAuthError, NvmeError, NvmeStatusError, NvmeTcpController
from kvproto.control import ADMIN_TENANT
from kvproto.keys import ChunkLayout
from kvproto.nvme import DhchapSecret, Status

LAYOUT = ChunkLayout("test-model", "float16", 2, 2, 64, chunk_tokens=16)
SALT = b"tenant-isolation"


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    a = spawn_agent(
        tmp_path_factory.mktemp("auth-agent") / "var", env={"DPUKV_NVMF_REQUIRE_AUTH": "true"}
    )
    yield a
    a.stop()


def _admin(a: AgentProcess, op: str, **fields: object) -> dict[str, object]:
    with ControlChannel(a.control_url, ADMIN_TENANT, a.admin_token) as adm:
        adm.connect()
        return dict(adm.call(op, **fields))


def _hello(a: AgentProcess, tenant: str, token: str, hostnqn: str) -> dict[str, object]:
    with _session(a, tenant, token, hostnqn) as nvme:
        return nvme


@contextlib.contextmanager
def _session(a: AgentProcess, tenant: str, token: str, hostnqn: str) -> Iterator[dict[str, object]]:
    """A control session that said hello with `hostnqn`: the host is allowed on the data path
    while it stays open (docs/OPERATIONS.md, Tenants)."""
    with ControlChannel(a.control_url, tenant, token, hostnqn=hostnqn) as ch:
        yield dict(ch.connect()["nvme"])


def _nvme_addr(nv: dict[str, object]) -> tuple[str, int]:
    return str(nv["host"]), int(str(nv["port"]))


def test_kvclient_gets_its_key_by_hello_and_round_trips(agent: AgentProcess) -> None:
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 50000, size=LAYOUT.chunk_tokens * 2, dtype=np.int64)
    data = [rng.standard_normal(LAYOUT.chunk_shape).astype(np.float16) for _ in range(2)]
    with KVClient(agent.control_url, "default", agent.token, LAYOUT, SALT) as c:
        assert c.put(tokens, data) == 2
        out = [np.empty(LAYOUT.chunk_shape, np.float16) for _ in range(2)]
        assert c.get(tokens, out) == 2
        assert all(np.array_equal(x, y) for x, y in zip(out, data, strict=True))


def test_same_host_gets_the_same_key_and_it_survives_restart_of_the_client(
    agent: AgentProcess,
) -> None:
    host = f"nqn.2014-08.org.nvmexpress:uuid:{uuid.uuid4()}"
    first = _hello(agent, "default", agent.token, host)
    second = _hello(agent, "default", agent.token, host)
    assert first["dhchap_key"] == second["dhchap_key"]
    DhchapSecret.parse(str(first["dhchap_key"]))


def test_host_knowing_another_tenants_nqn_but_not_its_secret_gets_nothing(
    agent: AgentProcess,
) -> None:
    token_b = str(_admin(agent, "tenant_add", tenant="bravo")["token"])
    victim = f"nqn.2014-08.org.nvmexpress:uuid:{uuid.uuid4()}"
    attacker = f"nqn.2014-08.org.nvmexpress:uuid:{uuid.uuid4()}"
    with (
        _session(agent, "default", agent.token, victim) as nv_a,  # the victim, tenant default
        _session(agent, "bravo", token_b, attacker) as nv_b,  # the attacker: a real tenant
    ):
        host, port = _nvme_addr(nv_a)
        sub_a = tenant_nqn("default")
        assert nv_a["subnqn"] == sub_a and nv_b["subnqn"] != sub_a
        # 1. its own host NQN on tenant default's subsystem: not allowed there at all
        with pytest.raises(NvmeStatusError) as e:
            NvmeTcpController.connect(
                host, port, sub_a, attacker, dhchap_key=str(nv_b["dhchap_key"])
            )
        assert e.value.code == Status.CONNECT_INVALID_HOST
        # 2. the victim's host NQN (allowed there) with its own, bravo-issued secret: refused
        with pytest.raises(NvmeAuthError, match="FAILED"):
            NvmeTcpController.connect(host, port, sub_a, victim, dhchap_key=str(nv_b["dhchap_key"]))
        # 3. the victim's host NQN and no secret at all: Authentication Required on every command
        with pytest.raises(NvmeAuthError, match="requires DH-HMAC-CHAP"):
            NvmeTcpController.connect(host, port, sub_a, victim)
        # 4. a guessed secret: refused
        with pytest.raises(NvmeAuthError, match="FAILED"):
            NvmeTcpController.connect(host, port, sub_a, victim, dhchap_key=DhchapSecret.generate())
        # the victim itself gets in
        with NvmeTcpController.connect(
            host, port, sub_a, victim, dhchap_key=str(nv_a["dhchap_key"])
        ) as c:
            assert c.active_namespaces()


def test_dpuctl_hosts_add_issues_a_key(agent: AgentProcess) -> None:
    nqn = f"nqn.2014-08.org.nvmexpress:uuid:{uuid.uuid4()}"
    env = {**os.environ, "DPUKV_AGENT_DATA_DIR": str(agent.data_dir)}
    run = [sys.executable, "-c", "from dpu_agent.cli import main; main()", "hosts", "add"]
    out = subprocess.run(
        [*run, "--tenant", "default", "--nqn", nqn, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    key = DhchapSecret.parse(reply["dhchap_key"])
    host, port = agent.state["nvmf"].rsplit(":", 1)
    with NvmeTcpController.connect(host, int(port), reply["subnqn"], nqn, dhchap_key=key) as c:
        assert c.active_namespaces()
    keys_file = Path(agent.data_dir) / "host_keys.json"
    assert keys_file.stat().st_mode & 0o077 == 0
    bad = subprocess.run(
        [*run, "--tenant", "default", "--nqn", "not an nqn"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    missing = subprocess.run(
        [*run, "--tenant", "nosuch", "--nqn", nqn, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode != 0 and "Traceback" not in missing.stderr
    assert "error" in missing.stdout.lower() or "error" in missing.stderr.lower()


def test_a_session_cannot_claim_an_operator_added_host(agent: AgentProcess) -> None:
    """Found by an attack pass: any client of the tenant said hello with a kernel host's NQN
    (added by `hosts add`), got that host's secret back, and, closing its session, took the
    host off the subsystem (CONNECT_INVALID_HOST until an operator re-added it)."""
    token = str(_admin(agent, "tenant_add", tenant="kilo")["token"])
    kernel = f"nqn.2014-08.org.nvmexpress:uuid:{uuid.uuid4()}"
    added = _admin(agent, "host_add", tenant="kilo", nqn=kernel)
    with pytest.raises(ControlError, match="added by the operator") as e:
        _hello(agent, "kilo", token, kernel)
    assert e.value.code == "forbidden"
    host, port = agent.state["nvmf"].rsplit(":", 1)
    with NvmeTcpController.connect(
        host, int(port), tenant_nqn("kilo"), kernel, dhchap_key=str(added["dhchap_key"])
    ) as c:  # still allowed, its key unchanged
        assert c.active_namespaces()
    # a host a session bound first, then added by the operator: its session's close keeps it
    both = f"nqn.2014-08.org.nvmexpress:uuid:{uuid.uuid4()}"
    with _session(agent, "kilo", token, both):
        key = _admin(agent, "host_add", tenant="kilo", nqn=both)["dhchap_key"]
    with NvmeTcpController.connect(
        host, int(port), tenant_nqn("kilo"), both, dhchap_key=str(key)
    ) as c:
        assert c.active_namespaces()


def test_hosts_add_of_a_host_a_hello_had_claimed_issues_new_keys(agent: AgentProcess) -> None:
    """A re-attack pass: a holder of the token said hello with a host's NQN (no secret: it is
    in /etc/nvme/hostnqn and every Connect) before the operator added that host; `hosts add`
    then returned the same key, and as an operator's host it outlived a token rotation."""
    token = str(_admin(agent, "tenant_add", tenant="mike")["token"])
    host = f"nqn.2014-08.org.nvmexpress:uuid:{uuid.uuid4()}"
    claimed = str(_hello(agent, "mike", token, host)["dhchap_key"])
    added = str(_admin(agent, "host_add", tenant="mike", nqn=host)["dhchap_key"])
    assert added != claimed
    addr, port = agent.state["nvmf"].rsplit(":", 1)
    with pytest.raises(NvmeAuthError, match="FAILED"):
        NvmeTcpController.connect(addr, int(port), tenant_nqn("mike"), host, dhchap_key=claimed)
    with NvmeTcpController.connect(
        addr, int(port), tenant_nqn("mike"), host, dhchap_key=added
    ) as c:
        assert c.active_namespaces()
    again = str(_admin(agent, "host_add", tenant="mike", nqn=host)["dhchap_key"])
    assert again == added  # adding it again (an operator's script re-run) keeps its key


def test_a_token_rotation_revokes_the_keys_its_hellos_were_issued(agent: AgentProcess) -> None:
    """A leaked token's hello-issued keys outlived `tenants rotate`: the holder kept connecting
    over NVMe/TCP as that host. Now they go with the token; operator-added hosts keep theirs."""
    token = str(_admin(agent, "tenant_add", tenant="lima")["token"])
    host_nqn = f"nqn.2014-08.org.nvmexpress:uuid:{uuid.uuid4()}"
    kernel = f"nqn.2014-08.org.nvmexpress:uuid:{uuid.uuid4()}"
    kernel_key = str(_admin(agent, "host_add", tenant="lima", nqn=kernel)["dhchap_key"])
    old = str(_hello(agent, "lima", token, host_nqn)["dhchap_key"])
    rotated = _admin(agent, "tenant_rotate", tenant="lima")
    assert rotated["host_keys_revoked"] == 1
    new_token = str(rotated["token"])
    host, port = agent.state["nvmf"].rsplit(":", 1)
    sub = tenant_nqn("lima")
    with _session(agent, "lima", new_token, host_nqn) as nv:  # the host is allowed again...
        assert nv["dhchap_key"] != old  # ...with a new key
        with pytest.raises(NvmeAuthError, match="FAILED"):
            NvmeTcpController.connect(host, int(port), sub, host_nqn, dhchap_key=old)
        with NvmeTcpController.connect(
            host, int(port), sub, host_nqn, dhchap_key=str(nv["dhchap_key"])
        ) as c:
            assert c.active_namespaces()
    with NvmeTcpController.connect(host, int(port), sub, kernel, dhchap_key=kernel_key) as c:
        assert c.active_namespaces()


def test_agent_with_secure_channel_and_auth_issues_both_keys(tmp_path: Path) -> None:
    env = {"DPUKV_NVMF_REQUIRE_AUTH": "true", "DPUKV_NVMF_SECURE_CHANNEL": "true"}
    a = spawn_agent(tmp_path / "var", env=env)
    try:
        host = f"nqn.2014-08.org.nvmexpress:uuid:{uuid.uuid4()}"
        session = _session(a, "default", a.token, host)
        nv = session.__enter__()  # open until the end: the host is allowed while it is
        assert str(nv["psk"]).startswith("NVMeTLSkey-1:01:") and "dhchap_key" in nv
        addr, port = _nvme_addr(nv)
        sub = str(nv["subnqn"])
        with NvmeTcpController.connect(
            addr, port, sub, host, psk=str(nv["psk"]), dhchap_key=str(nv["dhchap_key"])
        ) as c:
            assert c.active_namespaces()
        with pytest.raises(NvmeError):  # plaintext to the TLS listener
            NvmeTcpController.connect(
                addr, port, sub, host, dhchap_key=str(nv["dhchap_key"]), timeout_s=5
            )
        rng = np.random.default_rng(2)
        tokens = rng.integers(0, 50000, size=LAYOUT.chunk_tokens, dtype=np.int64)
        data = [rng.standard_normal(LAYOUT.chunk_shape).astype(np.float16)]
        with KVClient(a.control_url, "default", a.token, LAYOUT, SALT) as c:
            assert c.put(tokens, data) == 1
            out = [np.empty(LAYOUT.chunk_shape, np.float16)]
            assert c.get(tokens, out) == 1 and np.array_equal(out[0], data[0])
        session.__exit__(None, None, None)
    finally:
        a.stop()
