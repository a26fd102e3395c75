"""Issued TLS PSKs and SPDK's initiator: no issued key is one SPDK's host takes for no key
(its derived TLS PSK beginning 0x00, docs/NVME_AUTH.md), and a remembered one that is (issued
before the rule) is named at start."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from dpu_agent.nvmf import Subsystem
from dpu_agent.nvmf._host_keys import HostKeys, host_keys_to_dict, nqn_hash
from dpu_agent.nvmf._keys import HostKeyIssuer
from kvproto.nvme import TlsPsk

SUB = "nqn.2026-11.io.dpu-kvtier:tenant:a"
HOST = f"nqn.2014-08.org.nvmexpress:uuid:{uuid.uuid4()}"


def _draw(blind: bool) -> bytes:
    while True:
        raw = os.urandom(32)
        if TlsPsk(psk=raw).spdk_takes_for_none(HOST, SUB) == blind:
            return raw


def test_issuer_draws_again_past_a_key_spdk_would_take_for_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blind, good = _draw(True), _draw(False)
    draws = iter([blind, good])
    monkeypatch.setattr("kvproto.nvme._secrets.os.urandom", lambda n: next(draws))
    issuer = HostKeyIssuer(tmp_path / "host_keys.json", dhchap=False, psk=True)
    keys = issuer.issue("a", Subsystem(nqn=SUB), HOST, any_address=True)
    issuer.close()
    assert keys.psk is not None and keys.psk.psk == good


def test_a_remembered_key_spdk_would_take_for_none_is_named_at_start(tmp_path: Path) -> None:
    path = tmp_path / "host_keys.json"
    other = f"nqn.2014-08.org.nvmexpress:uuid:{uuid.uuid4()}"
    docs = {
        HOST: {**host_keys_to_dict(HostKeys(psk=TlsPsk(psk=_draw(True)))), "any_address": True},
        other: host_keys_to_dict(HostKeys(psk=TlsPsk.generate(other, SUB))),
    }
    path.write_text(json.dumps({"a": docs}))
    sub = Subsystem(nqn=SUB)
    with capture_logs() as logs:
        HostKeyIssuer(path, dhchap=False, psk=True).bind("a", sub)
    named = [e for e in logs if e["event"] == "nvmf_host_psk_spdk_plaintext"]
    assert [(e["tenant"], e["host"]) for e in named] == [("a", nqn_hash(HOST))]
    assert HOST in sub.allowed_hosts and sub.host_keys[HOST].psk is not None  # kept, named
