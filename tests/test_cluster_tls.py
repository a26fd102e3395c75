"""A cluster whose control planes are TLS (mutual: [control] tls_client_ca): members reach
each other at tls:// URLs, verify each other's certificates against the cluster's CA and
present their own, and hand chunks over as in a plaintext cluster."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from cluster_harness import Cluster
from test_control_tls import _cert

from host_shim import KVClient
from kvproto.keys import ChunkLayout

pytestmark = [
    pytest.mark.skipif(shutil.which("serf") is None, reason="needs the serf binary"),
    pytest.mark.timeout(240),
]

LAYOUT = ChunkLayout("cluster-tls", "float16", 1, 1, 64, chunk_tokens=16)
SALT = b"cluster-tls-salt-0123456"


def _moved(c: Cluster, name: str) -> dict:
    return dict(c.members(name)["rebalance"])


def test_tls_members_hand_chunks_to_each_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: a TLS member published its control URL as tcp:// (so peers spoke
    plaintext to its TLS listener), and an agent connecting to a tls:// member had no TLS
    context of its own (only the host client's environment defaults: the system CAs, no
    client certificate): every hand-over to a TLS member failed and a joiner got nothing.
    Now the ctl tag keeps tls://, the member's certificate is verified against the cluster CA
    ([control] tls_client_ca here) and ours is presented."""
    pki = tmp_path / "pki"
    pki.mkdir()
    ca = _cert(pki, "ca", None, ca=True)
    for name in ("a", "b"):
        _cert(pki, f"node-{name}", ca)
    c = Cluster(tmp_path / "cluster", replicas=1)

    def tls(name: str) -> dict[str, str]:
        return {
            "DPUKV_CONTROL_TLS_CERT": str(pki / f"node-{name}.pem"),
            "DPUKV_CONTROL_TLS_KEY": str(pki / f"node-{name}.key"),
            "DPUKV_CONTROL_TLS_CLIENT_CA": str(pki / "ca.pem"),
        }

    # This test process is a host: it trusts the CA and presents a certificate it signed
    # (host_shim's environment). Agents never see those variables (an agent refuses the
    # unknown DPUKV_CONTROL_TLS_CA, and must find the CA in its own config).
    _cert(pki, "host", ca)
    host = {"DPUKV_CONTROL_TLS_CA": str(pki / "ca.pem"),
            "DPUKV_CONTROL_TLS_CERT": str(pki / "host.pem"),
            "DPUKV_CONTROL_TLS_KEY": str(pki / "host.key")}  # fmt: skip

    def start(name: str) -> None:
        for k in host:
            monkeypatch.delenv(k, raising=False)
        c.start(name, extra_env=tls(name))
        for k, v in host.items():
            monkeypatch.setenv(k, v)

    try:
        start("a")
        assert c.nodes["a"].agent.control_url.startswith("tls://")
        c.wait_serving(["a"], on=["a"])
        chunks = [np.full(LAYOUT.chunk_shape, i, np.float16) for i in range(24)]
        prompts = [np.arange(16, dtype=np.uint32) + 1000 * (i + 1) for i in range(24)]
        with KVClient(c.seeds(), "default", c.token, LAYOUT, SALT, io_queues=1) as kv:
            assert all(kv.put(p, [ch]) == 1 for p, ch in zip(prompts, chunks, strict=True))
        start("b")
        c.wait_serving(["a", "b"], on=["a", "b"])
        deadline = time.monotonic() + 60
        while True:
            r = _moved(c, "a")
            if r["moved_chunks"] > 0 and r["pending"] == 0 and not r["running"]:
                break
            assert time.monotonic() < deadline, r
            time.sleep(0.3)
        assert r["failed"] == 0, r
        c.nodes["a"].agent.stop(timeout_s=20)  # what b owns must now be on b
        with KVClient(c.nodes["b"].agent.control_url + ",", "default", c.token, LAYOUT, SALT,
                      io_queues=1) as kv:  # fmt: skip
            router = kv.router
            assert router is not None
            deadline = time.monotonic() + 60
            while not (router.refresh() and [n.name for n in router.placement.serving] == ["b"]):
                assert time.monotonic() < deadline
                time.sleep(0.3)
            out = [np.empty(LAYOUT.chunk_shape, np.float16)]
            got = sum(kv.get(p, out) == 1 and out[0].tobytes() == ch.tobytes()
                      for p, ch in zip(prompts, chunks, strict=True))  # fmt: skip
        assert got == r["moved_chunks"] > 0, (got, r)
    finally:
        c.stop_all()
