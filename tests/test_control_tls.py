"""Control plane over TLS: server certificate, optional client certificates, and the warning
when it listens beyond loopback without TLS."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from dpu_agent.config import AgentConfig
from dpu_agent.control_tls import exposure_warning
from dpu_agent.testing import AgentProcess, spawn_agent
from host_shim.client import AgentUnreachable, ControlChannel, KVClient
from kvproto.keys import ChunkLayout

LAYOUT = ChunkLayout("test-model", "float16", 2, 2, 64, chunk_tokens=16)
SALT = b"control-tls-salt-0001"


def _cert(
    d: Path,
    name: str,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
    *,
    ca: bool = False,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    b = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer[0].subject if issuer else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        b = b.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
    cert = b.sign(issuer[1] if issuer else key, hashes.SHA256())
    (d / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / f"{name}.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    (d / f"{name}.key").chmod(0o600)
    return cert, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    ca = _cert(d, "ca", None, ca=True)
    _cert(d, "server", ca)
    _cert(d, "client", ca)
    _cert(d, "rogue", _cert(d, "rogue-ca", None, ca=True))
    return d


@pytest.fixture(scope="module")
def mtls_agent(pki: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    env = {
        "DPUKV_CONTROL_TLS_CERT": str(pki / "server.pem"),
        "DPUKV_CONTROL_TLS_KEY": str(pki / "server.key"),
        "DPUKV_CONTROL_TLS_CLIENT_CA": str(pki / "ca.pem"),
    }
    a = spawn_agent(tmp_path_factory.mktemp("tls-agent") / "var", env=env)
    yield a
    a.stop()


def test_agent_advertises_tls_url(mtls_agent: AgentProcess) -> None:
    assert mtls_agent.control_url.startswith("tls://127.0.0.1:")


def test_kvclient_over_mutual_tls(
    mtls_agent: AgentProcess, pki: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DPUKV_CONTROL_TLS_CA", str(pki / "ca.pem"))
    monkeypatch.setenv("DPUKV_CONTROL_TLS_CERT", str(pki / "client.pem"))
    monkeypatch.setenv("DPUKV_CONTROL_TLS_KEY", str(pki / "client.key"))
    tokens = np.arange(32, dtype=np.uint32)
    data = [np.ones(LAYOUT.chunk_shape, np.float16) * i for i in range(2)]
    with KVClient(mtls_agent.control_url, "default", mtls_agent.token, LAYOUT, SALT) as c:
        assert c.put(tokens, data) == 2
        out = [np.empty(LAYOUT.chunk_shape, np.float16) for _ in range(2)]
        assert c.get(tokens, out) == 2 and np.array_equal(out[1], data[1])


def test_client_without_certificate_is_refused(
    mtls_agent: AgentProcess, pki: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DPUKV_CONTROL_TLS_CA", str(pki / "ca.pem"))
    monkeypatch.delenv("DPUKV_CONTROL_TLS_CERT", raising=False)
    with pytest.raises(AgentUnreachable):
        with ControlChannel(mtls_agent.control_url, "default", mtls_agent.token) as ch:
            ch.connect()


def test_client_certificate_of_another_ca_is_refused(
    mtls_agent: AgentProcess, pki: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DPUKV_CONTROL_TLS_CA", str(pki / "ca.pem"))
    monkeypatch.setenv("DPUKV_CONTROL_TLS_CERT", str(pki / "rogue.pem"))
    monkeypatch.setenv("DPUKV_CONTROL_TLS_KEY", str(pki / "rogue.key"))
    with pytest.raises(AgentUnreachable):
        with ControlChannel(mtls_agent.control_url, "default", mtls_agent.token) as ch:
            ch.connect()


def test_server_not_signed_by_our_ca_is_refused(
    mtls_agent: AgentProcess, pki: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DPUKV_CONTROL_TLS_CA", str(pki / "rogue-ca.pem"))
    monkeypatch.setenv("DPUKV_CONTROL_TLS_CERT", str(pki / "client.pem"))
    monkeypatch.setenv("DPUKV_CONTROL_TLS_KEY", str(pki / "client.key"))
    with pytest.raises(AgentUnreachable, match="TLS"):
        with ControlChannel(mtls_agent.control_url, "default", mtls_agent.token) as ch:
            ch.connect()


def test_plaintext_client_gets_nothing_from_a_tls_listener(mtls_agent: AgentProcess) -> None:
    url = mtls_agent.control_url.replace("tls://", "tcp://")
    with pytest.raises(Exception) as e:
        with ControlChannel(url, "default", mtls_agent.token, timeout_s=3) as ch:
            ch.connect()
    assert mtls_agent.token not in str(e.value)


def test_exposure_warning() -> None:
    cfg = AgentConfig()
    assert exposure_warning(cfg) is None  # 127.0.0.1 by default
    cfg.control.host = "0.0.0.0"
    warning = exposure_warning(cfg)
    assert warning is not None and "WITHOUT TLS" in warning and "tls_cert" in warning
    cfg.control.tls_cert = "server.pem"
    assert exposure_warning(cfg) is None
    cfg.control.tls_cert, cfg.control.host = "", "::1"
    assert exposure_warning(cfg) is None
    cfg.control.host = "dpu0.example"
    assert exposure_warning(cfg) is not None  # a name may resolve beyond loopback


def test_config_refuses_tls_key_without_cert_and_auth_in_spdk_mode(tmp_path: Path) -> None:
    from dpu_agent.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="tls_cert"):
        load_config(None, {"DPUKV_CONTROL_TLS_KEY": "k.pem", "DPUKV_AGENT_DATA_DIR": str(tmp_path)})
    cfg = load_config(
        None, {"DPUKV_NVMF_REQUIRE_AUTH": "true", "DPUKV_AGENT_DATA_DIR": str(tmp_path)}
    )
    assert cfg.nvmf.require_auth and not cfg.nvmf.secure_channel


def test_config_refuses_embedded_auth_in_spdk_mode(tmp_path: Path) -> None:
    from spdk_sim.fixtures import config_text

    from dpu_agent.config import ConfigError, load_config

    path = tmp_path / "agent.toml"
    path.write_text(config_text(str(tmp_path / "d.img")))
    env = {"DPUKV_AGENT_MODE": "spdk", "DPUKV_NVMF_REQUIRE_AUTH": "true"}
    with pytest.raises(ConfigError, match="nvmf_subsystem_add_host --dhchap-key"):
        load_config(path, environ=env)
