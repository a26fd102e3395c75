"""Issue 10, finding 13: the host NQN was the data-plane bearer secret, logged in full, left on
the allowlist after the client closed, and addable by any hello.

Now an allowlist entry is bound to the authenticated control session that added it and to its
peer address; it goes when the session closes (its NVMe/TCP controllers too); logs carry a
short hash of the NQN. A real agent on loopback, real NVMe/TCP.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from waits import wait_until

from dpu_agent.log import nqn_tag
from dpu_agent.testing import AgentProcess, spawn_agent
from host_shim.client import ControlChannel
from host_shim.nvme import NvmeError, NvmeTcpController


@pytest.fixture()
def agent(tmp_path: Path) -> Iterator[AgentProcess]:
    a = spawn_agent(tmp_path / "var")
    yield a
    a.stop()


class FromAddress(ControlChannel):
    """A control channel whose socket leaves from another loopback address."""

    source = "127.0.0.2"

    def _open(self) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        sock.bind((self.source, 0))
        sock.connect(self.address)
        return sock


def nvme_connect(ch: ControlChannel, hostnqn: str | None = None) -> NvmeTcpController:
    nv = ch.hello["nvme"]
    return NvmeTcpController.connect(nv["host"], nv["port"], nv["subnqn"],
                                     hostnqn or ch.hostnqn, timeout_s=5)  # fmt: skip


def test_allowlist_entry_ends_with_its_session(agent: AgentProcess) -> None:
    ch = ControlChannel(agent.control_url, "default", agent.token)
    ch.connect()
    ctrl = nvme_connect(ch)
    buf = bytearray(4096)
    ctrl.read(2, 0, buf)  # allowed while the session lives
    hostnqn = ch.hostnqn
    ch.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # its controller is disconnected with it
        try:
            ctrl.read(2, 0, buf)
        except (NvmeError, OSError):
            break
        time.sleep(0.05)
    else:
        pytest.fail("the NVMe/TCP controller outlived its control session")
    ctrl.close()
    other = ControlChannel(agent.control_url, "default", agent.token)  # another session
    other.connect()
    try:
        with pytest.raises(NvmeError):  # the NQN alone no longer opens the data plane
            nvme_connect(other, hostnqn)
        nvme_connect(other).close()  # its own NQN works
    finally:
        other.close()


def test_allowlist_entry_is_bound_to_the_sessions_address(agent: AgentProcess) -> None:
    ch = FromAddress(agent.control_url, "default", agent.token)
    ch.connect()  # the session comes from 127.0.0.2; the NVMe/TCP connect from 127.0.0.1
    try:
        with pytest.raises(NvmeError):
            nvme_connect(ch)
    finally:
        ch.close()


def test_logs_carry_a_hash_of_the_nqn_never_the_nqn(agent: AgentProcess) -> None:
    ch = ControlChannel(agent.control_url, "default", agent.token)
    ch.connect()
    nvme_connect(ch).close()
    stranger = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-00000000beef"
    with pytest.raises(NvmeError):
        nvme_connect(ch, stranger)  # refused: logged
    ch.close()
    log = agent.data_dir / "agent.log"

    def both_logged() -> str:  # the refusal and the accepted connect, as the log writes them
        text = log.read_text()
        return text if nqn_tag(ch.hostnqn) in text and nqn_tag(stranger) in text else ""

    text = wait_until(both_logged, "the agent logs the connect and the refusal")
    assert ch.hostnqn not in text and stranger not in text
