"""A member Serf lists as failed whose control port answers is split off by gossip once that
lasts past GOSSIP_SPLIT_S (dpu_agent/cluster/_reach.py): found by an attack pass, where a
gossip key rotated during a partition left the healed cluster split for good and every node
said it was fine (`reach.cut_off` false: each reached every control port)."""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest

from dpu_agent.cluster import _reach, free_port
from dpu_agent.cluster._reach import Reachability
from dpu_agent.metrics import REGISTRY


def test_a_failed_member_that_answers_is_named_split_after_the_grace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_reach, "GOSSIP_SPLIT_S", 0.3)
    with (
        socket.create_server(("127.0.0.1", 0)) as up,
        socket.create_server(("127.0.0.1", 0)) as up2,
    ):
        answers = f"tcp://127.0.0.1:{up.getsockname()[1]}"
        answers2 = f"tcp://127.0.0.1:{up2.getsockname()[1]}"
        silent = f"tcp://127.0.0.1:{free_port()}"
        rows: list[dict[str, Any]] = [
            {"name": "a", "status": "alive", "control": "tcp://127.0.0.1:1"},  # this node
            {"name": "b", "status": "failed", "control": answers},  # split by gossip
            {"name": "c", "status": "failed", "control": silent},  # really down
            {"name": "d", "status": "alive", "control": answers2},  # fine
        ]
        r = Reachability("a", lambda: rows)
        try:
            r.check()
            assert r.as_dict()["gossip_split"] == []  # within the grace: Serf may reconnect
            time.sleep(0.4)
            r.check()
            assert r.as_dict()["gossip_split"] == ["b"]
            assert REGISTRY.get_sample_value("kvtier_cluster_gossip_split_members") == 1
            rows[1]["status"] = "alive"  # Serf reconnected it
            r.check()
            assert r.as_dict()["gossip_split"] == []
            assert REGISTRY.get_sample_value("kvtier_cluster_gossip_split_members") == 0
            rows[1]["status"] = "failed"  # failed again: the grace starts again
            r.check()
            assert r.as_dict()["gossip_split"] == []
            rows[1]["control"] = silent  # stopped answering before the grace ended
            time.sleep(0.4)
            r.check()
            assert r.as_dict()["gossip_split"] == []
        finally:
            r.stop()
