"""`dpuctl config check --production`: the embedded default is flagged (loopback, no TLS, no
auth), oversized tiers are flagged, and docs/examples/dpu-production.toml passes against an SPDK
that speaks v26.05 and is flagged against another release (the simulator built from the v26.05
peer's recordings)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner
from spdk_sim.sim import SpdkSimulator

from dpu_agent.cli import cli

ROOT = Path(__file__).resolve().parent.parent


def _check(config: Path) -> tuple[int, dict]:
    r = CliRunner().invoke(
        cli, ["config", "check", "--production", "--json", "--config", str(config)], env={}
    )
    return r.exit_code, json.loads(r.output)


def test_the_embedded_default_is_flagged_for_production() -> None:
    code, out = _check(ROOT / "docs" / "examples" / "agent.toml")
    assert code == 1 and not out["ok"]
    checks = [f["check"] for f in out["findings"]]
    assert checks.count("listeners") == 2 and "auth" in checks and checks.count("tls") == 2


def test_tiers_beyond_the_devices_are_flagged(tmp_path: Path) -> None:
    cfg = tmp_path / "big.toml"
    cfg.write_text(
        f'[agent]\ndata_dir = "{tmp_path}"\n[storage]\ndram_bytes = "64PiB"\nnvme_bytes = "64PiB"\n'
    )
    code, out = _check(cfg)
    sizes = [f["problem"] for f in out["findings"] if f["check"] == "sizes"]
    assert code == 1 and len(sizes) == 2, out
    assert any("RAM" in s for s in sizes) and any("filesystem" in s for s in sizes)


def _production(tmp_path: Path, sock: Path) -> Path:
    text = (ROOT / "docs" / "examples" / "dpu-production.toml").read_text()
    text = text.replace("/var/lib/dpukv", str(tmp_path)).replace("/etc/dpukv/", f"{tmp_path}/")
    text = text.replace("/var/tmp/spdk.sock", str(sock))
    old = os.umask(0o077)
    try:
        (tmp_path / "cluster-peer.key").write_text(base64.b64encode(os.urandom(32)).decode())
        (tmp_path / "serf-keyring.json").write_text(
            json.dumps([base64.b64encode(os.urandom(32)).decode()])
        )
        (tmp_path / "serf-rpc.key").write_text(base64.b64encode(os.urandom(32)).decode())
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
             "-nodes", "-keyout", str(tmp_path / "control.key"), "-out",
             str(tmp_path / "control.crt"), "-days", "1", "-subj", "/CN=dpu"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
    finally:
        os.umask(old)
    path = tmp_path / "agent.toml"
    path.write_text(text)
    return path


def test_the_production_example_passes_against_spdk_v26_05(tmp_path: Path) -> None:
    sock = tmp_path / "spdk.sock"
    cfg = _production(tmp_path, sock)
    with SpdkSimulator(str(sock)):
        code, out = _check(cfg)
    assert (code, out["findings"]) == (0, [])


@pytest.mark.parametrize("without_spdk", [True, False])
def test_the_production_example_is_flagged_against_another_spdk(
    tmp_path: Path, without_spdk: bool
) -> None:
    sock = tmp_path / "spdk.sock"
    cfg = _production(tmp_path, sock)
    if without_spdk:
        code, out = _check(cfg)
        assert code == 1 and [f["check"] for f in out["findings"]] == ["spdk"]
        return
    sim = SpdkSimulator(str(sock))
    sim.target.data["spdk_get_version"] = {
        "version": "SPDK v24.01.1 git sha1 abc",
        "fields": {"major": 24, "minor": 1, "patch": 1, "suffix": "", "commit": "abc"},
    }
    with sim:
        code, out = _check(cfg)
    assert code == 1 and "v24.01.1" in out["findings"][0]["problem"], out
