"""A cluster-URL KVClient (ClusterRouter) against one agent that is not in cluster mode (it
owns everything, no epoch is sent), bad seed lists, and Serf's port picking."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dpu_agent.cluster import free_port
from dpu_agent.cluster._serf_process import PICK_PORT_RANGE
from dpu_agent.testing import AgentProcess, spawn_agent
from host_shim import KVClient
from host_shim.client import NodeClient
from kvproto.keys import ChunkLayout

LAYOUT = ChunkLayout("single", "float16", 1, 1, 64, chunk_tokens=16)
SALT = b"single-salt-0123456789"


@pytest.fixture()
def agent(tmp_path: Path) -> Iterator[AgentProcess]:
    a = spawn_agent(tmp_path / "var", env={"DPUKV_METRICS_ENABLED": "0"})
    yield a
    a.stop()


def test_one_plain_agent_behind_a_cluster_url(agent: AgentProcess) -> None:
    dead = "tcp://127.0.0.1:1"  # a seed that does not answer is skipped
    with KVClient(f"{dead},{agent.control_url}", "default", agent.token, LAYOUT, SALT) as kv:
        r = kv.router
        assert r is not None
        assert r.refresh() and r.epoch is None and len(r.placement.serving) == 1
        tokens = np.arange(3 * 16, dtype=np.uint32)
        chunks = [np.full(LAYOUT.chunk_shape, i, np.float16) for i in range(3)]
        assert kv.put(tokens, chunks) == 3 and kv.lookup(tokens) == 3
        assert kv.lookup_lengths(kv.keys(tokens)) == [LAYOUT.chunk_bytes] * 3
        out = [np.empty(LAYOUT.chunk_shape, np.float16) for _ in range(3)]
        assert kv.get(tokens, out) == 3 and out[2].tobytes() == chunks[2].tobytes()
        assert kv.delete(tokens) == 3 and kv.lookup(tokens) == 0
    with KVClient(agent.control_url, "default", agent.token, LAYOUT, SALT) as one:
        assert one.router is None and isinstance(one.node, NodeClient)  # one URL: one agent


def test_no_seed_answering_gives_misses_not_errors() -> None:
    with KVClient("tcp://127.0.0.1:1,", "default", "t", LAYOUT, SALT, timeout_s=0.5) as kv:
        tokens = np.arange(16, dtype=np.uint32)
        assert kv.lookup(tokens) == 0
        assert kv.get(tokens, [np.empty(LAYOUT.chunk_shape, np.float16)]) == 0
        assert kv.put(tokens, [np.zeros(LAYOUT.chunk_shape, np.float16)]) == 0


def test_bad_seed_lists_are_value_errors() -> None:
    with pytest.raises(ValueError, match="names no seed"):
        KVClient(",", "default", "t", LAYOUT, SALT)
    with pytest.raises(ValueError, match="scheme"):
        KVClient("http://a:1,tcp://b:2", "default", "t", LAYOUT, SALT)


def test_serf_port_pick_avoids_the_ephemeral_range_port_zero_binds_use() -> None:
    """Regression: a port picked by binding port 0 was taken by the agent's own NVMe/TCP
    target (also port 0) before Serf bound it; picks now come from below 32768."""
    for _ in range(20):
        port = free_port()
        assert PICK_PORT_RANGE[0] <= port < PICK_PORT_RANGE[1] < 32768
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
            u.bind(("127.0.0.1", port))  # UDP free too (Serf gossips over both)


def test_hot_keys_get_more_owners_and_cold_rows_name_no_extra_owner() -> None:
    """Regression: cold keys' padding (-1) in a batch with hot keys was indexed as the last
    member, so a put wrote cold chunks to a node that does not own them."""
    import time

    from kvproto.placement import Node, Placement

    kv = KVClient("tcp://127.0.0.1:1,", "default", "t", LAYOUT, SALT)
    r = kv.router
    assert r is not None
    try:
        r._placement = Placement([Node(name=f"n{i}") for i in range(5)])
        r._rows = {f"n{i}": {} for i in range(5)}
        r._refreshed_at = time.monotonic()
        hot, cold = kv.keys(np.arange(16, dtype=np.uint32))[0], kv.keys(np.arange(16, 32))[0]
        r._hot[hot] = time.monotonic() + 60
        nodes, owners = r._owners([hot, cold])
        assert owners.shape == (2, 3)
        assert sorted(owners[0]) == sorted(r.placement.owner_index(
            np.frombuffer(hot[:8], "<u8").astype(np.uint64), 3)[0])  # fmt: skip
        assert nodes[int(owners[1, 0])].name == r.placement.owners(cold)[0].name
        assert list(owners[1, 1:]) == [-1, -1]
    finally:
        kv.close()
