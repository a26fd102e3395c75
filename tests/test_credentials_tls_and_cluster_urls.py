"""The integrations use the whole credentials file: its CA for tls:// agents, and every control
URL (a cluster's seeds), not only the first.

Before, the vLLM and LMCache connectors took `control[0]` and ignored `control_ca`: a host
enrolled against a TLS agent failed certificate verification unless DPUKV_CONTROL_TLS_CA was
also set by hand, and a cluster enrolment talked to one node only. A real agent with control TLS,
a real `dpuctl hosts enrol`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from test_control_tls import _cert

from dpu_agent.cli import cli
from dpu_agent.testing import AgentProcess, spawn_agent
from host_shim import KVClient
from host_shim.integrations.credentials import load_credentials
from kvproto.keys import ChunkLayout

LAYOUT = ChunkLayout("creds-model", "float16", 2, 2, 64, chunk_tokens=16)


@pytest.fixture(scope="module")
def tls_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[AgentProcess, Path]]:
    pki = tmp_path_factory.mktemp("pki")
    ca = _cert(pki, "ca", None, ca=True)
    _cert(pki, "server", ca)  # signed by a CA: the host needs the CA, not the leaf
    env = {
        "DPUKV_CONTROL_TLS_CERT": str(pki / "server.pem"),
        "DPUKV_CONTROL_TLS_KEY": str(pki / "server.key"),
    }
    a = spawn_agent(tmp_path_factory.mktemp("creds-agent") / "var", env=env)
    yield a, pki
    a.stop()


def _enrol(agent: AgentProcess, out: Path, *extra: str) -> Path:
    r = CliRunner().invoke(
        cli,
        ["hosts", "enrol", "--tenant", "default", "--out", str(out), "--json", *extra],
        env={"DPUKV_AGENT_DATA_DIR": str(agent.data_dir)},
    )
    assert r.exit_code == 0, r.output
    return out


def test_credentials_ca_verifies_a_tls_agent_without_environment(
    tls_agent: tuple[AgentProcess, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent, pki = tls_agent
    monkeypatch.delenv("DPUKV_CONTROL_TLS_CA", raising=False)
    creds = load_credentials(
        _enrol(agent, tmp_path / "h.json", "--control-ca", str(pki / "ca.pem"))
    )
    assert creds.client_url.startswith("tls://127.0.0.1:")
    src = [np.full(LAYOUT.chunk_shape, i, np.float16) for i in range(2)]
    dst = [np.zeros(LAYOUT.chunk_shape, np.float16) for _ in range(2)]
    tokens = list(range(2 * LAYOUT.chunk_tokens))
    with KVClient(creds.client_url, creds.tenant, creds.token, LAYOUT, creds.salt,
                  ssl_context=creds.tls_context()) as c:  # fmt: skip
        assert c.put(tokens, src) == 2
        assert c.get(tokens, dst) == 2
    assert all(np.array_equal(a, b) for a, b in zip(src, dst, strict=True))


def test_vllm_settings_carry_the_ca_and_every_control_url(tmp_path: Path) -> None:
    pytest.importorskip("torch")  # the vLLM integration module imports torch
    from host_shim.integrations.vllm import ConnectorSettings

    _cert(tmp_path, "ca", None, ca=True)
    ca_pem = (tmp_path / "ca.pem").read_text()
    f = tmp_path / "c.json"
    f.write_text(json.dumps({
        "version": 1, "control": ["tls://10.0.0.1:7400", "tls://10.0.0.2:7400"],
        "tenant": "acme", "token": "t" * 32, "salt": "ab" * 16, "control_ca": ca_pem,
    }))  # fmt: skip
    s = ConnectorSettings.from_extra_config({"credentials_file": str(f)})
    assert s.control == "tls://10.0.0.1:7400,tls://10.0.0.2:7400"  # a cluster URL: both seeds
    assert s.control_ca == ca_pem and s.tls_context() is not None


def test_one_url_is_one_agent_several_are_a_cluster(tmp_path: Path) -> None:
    f = tmp_path / "c.json"
    base = {"version": 1, "tenant": "acme", "token": "t" * 32, "salt": "ab" * 16}
    f.write_text(json.dumps({**base, "control": ["tcp://10.0.0.1:7400"]}))
    assert load_credentials(f).client_url == "tcp://10.0.0.1:7400"
    assert load_credentials(f).tls_context() is None
    f.write_text(json.dumps({**base, "control": ["tcp://10.0.0.1:7400", "tcp://10.0.0.2:7400"]}))
    assert load_credentials(f).client_url == "tcp://10.0.0.1:7400,tcp://10.0.0.2:7400"


def test_a_control_ca_that_is_not_a_certificate_is_refused_naming_the_file(tmp_path: Path) -> None:
    """It raised ssl.SSLError ("no start line") from inside the connector's start."""
    f = tmp_path / "c.json"
    f.write_text(json.dumps({
        "version": 1, "control": ["tls://10.0.0.1:7400"], "tenant": "acme", "token": "t" * 32,
        "salt": "ab" * 16,
        "control_ca": "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
    }))  # fmt: skip
    with pytest.raises(ValueError, match=rf"credentials file {f}: control_ca is not a PEM"):
        load_credentials(f)
