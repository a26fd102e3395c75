"""`dpuctl hosts list|remove`: a removed host loses its issued keys (also on disk), its live
control session ends, and it is off the list; an unknown host is a clear error."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from dpu_agent.cli import cli
from dpu_agent.testing import AgentProcess, spawn_agent
from host_shim import KVClient
from kvproto.keys import ChunkLayout

HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:0f6e1a2b-0000-4000-8000-0000000000aa"
LAYOUT = ChunkLayout("hosts-model", "float16", 2, 2, 64, chunk_tokens=16)


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    a = spawn_agent(
        tmp_path_factory.mktemp("hostsrm") / "var", env={"DPUKV_NVMF_REQUIRE_AUTH": "true"}
    )
    yield a
    a.stop()


def _dpuctl(agent: AgentProcess, *args: str) -> tuple[int, dict]:
    r = CliRunner().invoke(
        cli, [*args, "--json"], env={"DPUKV_AGENT_DATA_DIR": str(agent.data_dir)}
    )
    return r.exit_code, json.loads(r.output) if r.output.strip().startswith("{") else {
        "output": r.output
    }


def test_removed_host_loses_keys_and_session_and_leaves_the_list(
    agent: AgentProcess, tmp_path: Path
) -> None:
    # an operator's host: listed, then removed with its keys (a control session cannot claim
    # it: tests/test_nvme_auth_tenants.py)
    kernel = HOSTNQN[:-4] + "beef"
    code, _ = _dpuctl(agent, "hosts", "add", "--tenant", "default", "--nqn", kernel)
    assert code == 0
    code, removed = _dpuctl(agent, "hosts", "remove", "--tenant", "default", "--nqn", kernel)
    assert code == 0 and removed["keys_revoked"] and removed["sessions_ended"] == 0
    # a host a session's hello was issued keys for
    tokens = list(range(LAYOUT.chunk_tokens))
    chunk = [np.ones(LAYOUT.chunk_shape, np.float16)]
    with KVClient(agent.control_url, "default", agent.token, LAYOUT, b"s" * 16,
                  hostnqn=HOSTNQN) as c:  # fmt: skip
        assert c.put(tokens, chunk) == 1
        code, listed = _dpuctl(agent, "hosts", "list", "--tenant", "default")
        assert code == 0
        (row,) = [h for h in listed["hosts"] if h["hostnqn"] == HOSTNQN]
        assert "dhchap_key" in row["keys"]
        assert row["sessions"] == 1 and row["allowed"]
        code, removed = _dpuctl(agent, "hosts", "remove", "--tenant", "default", "--nqn", HOSTNQN)
        assert code == 0 and removed["keys_revoked"] and removed["sessions_ended"] == 1
        # its session is gone: the shim serves misses (until it says hello again)
        assert c.get(tokens, [np.zeros(LAYOUT.chunk_shape, np.float16)]) == 0
    code, listed = _dpuctl(agent, "hosts", "list", "--tenant", "default")
    assert not {HOSTNQN, kernel} & {h["hostnqn"] for h in listed["hosts"]}
    keys_file = json.loads((agent.data_dir / "host_keys.json").read_text())
    assert not {HOSTNQN, kernel} & set(keys_file.get("default", {}))


def test_removing_an_unknown_host_names_it(agent: AgentProcess) -> None:
    code, out = _dpuctl(
        agent, "hosts", "remove", "--tenant", "default", "--nqn", "nqn.2014-08.org.x:nobody"
    )
    assert code != 0 and "no host" in json.dumps(out)
