"""Issue 10, finding 12: removing and re-adding a tenant name revived it.

`tenants remove` kept the token file, the XTS key and the namespace data; `tenants add NAME`
re-read the old token, the new owner read the old tenant's chunks in plaintext over raw
NVMe/TCP, and a control session opened before the removal kept working after the re-add. Now
removal is crypto-erase: token revoked, sessions ended, subsystem removed, key destroyed,
space freed. A real agent on loopback, real NVMe/TCP.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_service import LAYOUT, SALT, chunks_for, tokens_for

from dpu_agent.testing import spawn_agent
from host_shim import KVClient
from host_shim.client import AgentUnreachable, ControlChannel, ControlError
from host_shim.nvme import NvmeTcpController
from kvproto.control import ADMIN_TENANT


def admin(a, op: str, **fields: object) -> dict:  # type: ignore[no-untyped-def]
    with ControlChannel(a.unix_url, ADMIN_TENANT, a.admin_token) as adm:
        adm.connect()
        return adm.call(op, **fields)


def test_removed_tenant_name_readded_starts_empty_with_new_token_and_key(tmp_path: Path) -> None:
    a = spawn_agent(tmp_path / "var")
    try:
        token1 = admin(a, "tenant_add", tenant="echo")["token"]
        data, tokens = chunks_for(5, 9), tokens_for(5, 9)
        with KVClient(a.control_url, "echo", token1, LAYOUT, SALT) as c:
            assert c.put(tokens, data) == 9
            keys = c.keys(tokens)
        old = ControlChannel(a.control_url, "echo", token1)
        old.connect()
        hits = old.call("lookup", keys=keys, lease=False)["hits"]
        assert len(hits) == 9
        keyfile = json.loads((a.data_dir / "keys.json").read_text())
        assert "echo" in keyfile

        gone = admin(a, "tenant_remove", tenant="echo")
        assert gone["key_destroyed"] is True and gone["records_dropped"] >= 1
        assert not (a.data_dir / "tenant-echo.token").exists()
        assert "echo" not in json.loads((a.data_dir / "keys.json").read_text())
        with pytest.raises((ControlError, AgentUnreachable, OSError)):
            old.call("stats")  # its session was ended
        old.close()

        token2 = admin(a, "tenant_add", tenant="echo")["token"]
        assert token2 != token1
        with pytest.raises(ControlError, match="auth"):
            ControlChannel(a.control_url, "echo", token1).connect()  # the revoked token
        with KVClient(a.control_url, "echo", token2, LAYOUT, SALT) as c:
            assert c.lookup(tokens) == 0  # nothing of the old tenant is indexed
            ch = c.channel
            nv = ch.hello["nvme"]
            ctrl = NvmeTcpController.connect(nv["host"], nv["port"], nv["subnqn"], ch.hostnqn)
            try:
                plain = {d.tobytes()[:4096] for d in data}
                for h in hits:  # raw reads of the old blocks: nothing usable
                    _key, nsid, lba, count, _length, _sum = h
                    buf = bytearray(count * 4096)
                    ctrl.read(nsid, lba, buf)
                    assert bytes(buf[:4096]) not in plain
            finally:
                ctrl.close()
            assert c.put(tokens_for(6, 2), chunks_for(6, 2)) == 2  # and it serves the new one
            out = [np.empty(LAYOUT.chunk_shape, np.float16) for _ in range(2)]
            assert c.get(tokens_for(6, 2), out) == 2
    finally:
        a.stop()
    a = spawn_agent(tmp_path / "var")  # the removal survives a restart (journaled)
    try:
        with KVClient(a.control_url, "echo", token2, LAYOUT, SALT) as c:
            assert c.lookup(tokens) == 0
            assert c.lookup(tokens_for(6, 2)) == 2
    finally:
        a.stop()
