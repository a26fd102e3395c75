"""The agent raises its soft descriptor limit to the hard one at start, and warns when even
that is below what its connection bounds allow (dpu_agent.service.raise_fd_limit).

A shell's soft limit is 1,024 (for select(), which the agent does not use on sockets); the
agent's own bounds allow 1,024 tenants' control connections, 256 strangers, 4,096 NVMe/TCP
queues and 64 scrapers. Under the soft limit a busy agent hit EMFILE, and the journal and the
tenants' sockets need descriptors too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dpu_agent.config import AgentConfig
from dpu_agent.service import fds_needed
from dpu_agent.testing import AGENT_PROGRAM, spawn_agent


def _nofile(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no open files line")


def _limited(soft: int, hard: int) -> str:
    return (f"import resource; resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard})); "
            + AGENT_PROGRAM)  # fmt: skip


def _warnings(data: Path) -> list[dict[str, object]]:
    out = []
    for line in (data / "agent.log").read_text().splitlines():
        if line.startswith("{") and '"fd_limit_low"' in line:
            out.append(json.loads(line))
    return out


def test_the_soft_limit_is_raised_to_the_hard_one(tmp_path: Path) -> None:
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < fds_needed(AgentConfig()):
        pytest.skip(f"this machine's hard descriptor limit ({hard}) is below the agent's need")
    want = fds_needed(AgentConfig())
    agent = spawn_agent(tmp_path, program=_limited(1024, want))
    try:
        assert _nofile(agent.proc.pid) == (want, want)
        assert _warnings(tmp_path) == []
    finally:
        assert agent.stop() == 0


def test_a_hard_limit_below_the_need_is_warned_about(tmp_path: Path) -> None:
    agent = spawn_agent(tmp_path, program=_limited(512, 2048))
    try:
        assert _nofile(agent.proc.pid) == (2048, 2048)
        (w,) = _warnings(tmp_path)
        assert w["limit"] == 2048 and w["needed"] == fds_needed(AgentConfig())
        assert "LimitNOFILE" in str(w["fix"])
    finally:
        assert agent.stop() == 0
