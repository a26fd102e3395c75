"""The agent in SPDK mode, end to end, with no SPDK binary here.

Control plane: `spdk_sim.SpdkSimulator` (test support) on a Unix socket, driven by the agent's real
SPDK client (plan, or apply at start). Data plane: a real NVMe/TCP target, our own
`dpu_agent.nvmf` target on loopback, serving the subsystem and namespaces [spdk] declares:
nsid 1 a MemoryBlockDevice (SPDK's malloc bdev), nsid 2 a CryptoBlockDevice over a
FileBlockDevice (SPDK's crypto vbdev over the lvol), keyed with the key the agent's key store
gives SPDK. A real `dpuctl agent run` child in SPDK mode connects to it with its own
initiator; KVClient puts and gets through the agent's lookups and the target's namespaces.

A live variant runs against a real `spdk_tgt` (with nvmf over TCP) when SPDK_TGT names one.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from spdk_sim.fixtures import AGENT_NQN, HOST_A, NQN_A, config_text
from spdk_sim.sim import SpdkSimulator

from dpu_agent.blockdev import BLOCK_SIZE, BlockDeviceError, FileBlockDevice, MemoryBlockDevice
from dpu_agent.config import ConfigError, load_config
from dpu_agent.crypto import CryptoBlockDevice, KeyStore, XtsCipher
from dpu_agent.engine import Engine, EngineConfig, TierSpec
from dpu_agent.nvmf import NvmeTcpTarget, Subsystem
from dpu_agent.spdk_mode import SpdkDevices, listener_for
from dpu_agent.testing import AgentProcess, spawn_agent
from host_shim import KVClient
from host_shim.client import ControlChannel, ControlError
from kvproto.control import ADMIN_TENANT
from kvproto.keys import ChunkLayout
from spdk_plugins import SpdkClient

# 2 layers x K/V x 2 heads x 16 tokens x 64 dims x fp16 = 16 KiB (4 blocks) per chunk
LAYOUT = ChunkLayout("test-model", "float16", 2, 2, 64, chunk_tokens=16)
SALT = b"tenant-salt-0123456789"
DRAM_BLOCKS = 128  # 512 KiB: 32 chunks; chunks of 4 blocks stay under 1/8 of it (DRAM-placed)
NVME_BLOCKS = 4096  # the 16 MiB lvol of the fixture config
AIO_BYTES = 64 << 20
CHUNKS = 48  # more than DRAM holds: demotion DRAM -> NVMe has to run
THREAD_JOIN_S = 10.0
WAIT_S = 30.0  # a tick is 0.05 s; a loaded 2-core box gets room


def chunks_for(seed: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        rng.integers(0, 1 << 16, LAYOUT.chunk_shape, dtype=np.uint16).view(np.float16)
        for _ in range(n)
    ]


def tokens_for(n: int) -> np.ndarray:
    return np.arange(n * LAYOUT.chunk_tokens, dtype=np.uint32)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class CountingDevice:
    """A BlockDevice that counts the writes reaching it (who wrote: only the agent demotes)."""

    in_memory = lends_memory = mapped_reads = buffered_writes = False

    def __init__(self, base: Any) -> None:
        self.base = base
        self.writes = 0
        self.block_size = base.block_size
        self.block_count = base.block_count

    def read_into(self, lba: int, buf: memoryview) -> None:
        self.base.read_into(lba, buf)

    def write(self, lba: int, data: memoryview | bytes) -> None:
        self.writes += 1
        self.base.write(lba, data)

    def flush(self) -> None:
        self.base.flush()

    def deallocate(self, lba: int, block_count: int) -> None:
        self.base.deallocate(lba, block_count)

    def close(self) -> None:
        self.base.close()


class TargetThread:
    """Our NVMe/TCP target on its own event loop in a thread (SPDK's nvmf target stand-in)."""

    def __init__(self, subsystems: list[Subsystem], port: int = 0) -> None:
        self.loop = asyncio.new_event_loop()
        self.target = NvmeTcpTarget(subsystems, "127.0.0.1", port)
        self.thread = threading.Thread(target=self.loop.run_forever, name="nvmf", daemon=True)

    def start(self) -> int:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.target.start(), self.loop).result(THREAD_JOIN_S)
        return int(self.target.port)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.target.stop(), self.loop).result(THREAD_JOIN_S)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(THREAD_JOIN_S)
        self.loop.close()


@dataclass
class Rig:
    tmp: Path
    data: Path
    sock: str
    port: int
    dram: MemoryBlockDevice
    nvme_raw: FileBlockDevice
    nvme: CountingDevice  # plaintext side: CryptoBlockDevice(nvme_raw), counted
    sim: SpdkSimulator
    target: TargetThread | None = None

    def config(self, *, apply_on_start: bool, port: int | None = None) -> Path:
        text = config_text(str(self.tmp / "disk0.img"), self.sock)
        text = text.replace('trsvcid = "4420"', f'trsvcid = "{port or self.port}"')
        text = text.replace("num_blocks = 4096", f"num_blocks = {DRAM_BLOCKS}")
        path = self.tmp / f"agent-{int(apply_on_start)}.toml"
        path.write_text(
            f'[agent]\nmode = "spdk"\nspdk_apply_on_start = {str(apply_on_start).lower()}\n'
            "tick_interval_s = 0.05\n" + text
        )
        return path

    def spawn(self, config: Path) -> AgentProcess:
        return spawn_agent(self.data, config=config, env={"DPUKV_AGENT_LOG_LEVEL": "WARNING"})

    def client(self, a: AgentProcess) -> KVClient:
        token = (self.data / "tenant-a.token").read_text().strip()
        return KVClient(a.control_url, "a", token, LAYOUT, SALT, hostnqn=HOST_A, io_queues=2)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    data = tmp_path / "var"
    data.mkdir(mode=0o700)
    # The key SPDK's crypto vbdev gets: [[spdk.keys]] key-a from the agent's key store.
    key = KeyStore(data / "keys.json").key_for("key-a")
    dram = MemoryBlockDevice(DRAM_BLOCKS)
    nvme_raw = FileBlockDevice(tmp_path / "lvol-a.img", NVME_BLOCKS)
    nvme = CountingDevice(CryptoBlockDevice(nvme_raw, XtsCipher(key, block_size=BLOCK_SIZE)))
    sub = Subsystem(nqn=NQN_A, allowed_hosts={AGENT_NQN, HOST_A}, namespaces={1: dram, 2: nvme})
    target = TargetThread([sub])
    port = target.start()
    sock = str(tmp_path / "spdk.sock")
    sim = SpdkSimulator(sock, file_sizes={str(tmp_path / "disk0.img"): AIO_BYTES})
    sim.start()
    r = Rig(tmp_path, data, sock, port, dram, nvme_raw, nvme, sim, target)
    try:
        yield r
    finally:
        sim.stop()
        if r.target is not None:
            r.target.stop()


def test_spdk_mode_end_to_end(rig: Rig) -> None:
    # Plan-only start against an empty SPDK: refused, naming the socket and the fix.
    with pytest.raises(RuntimeError, match="does not match \\[spdk\\]") as e:
        rig.spawn(rig.config(apply_on_start=False))
    assert rig.sock in str(e.value) and "spdk_apply_on_start" in str(e.value)

    # apply_on_start: the agent provisions SPDK, connects its initiator, serves.
    agent = rig.spawn(rig.config(apply_on_start=True))
    try:
        with SpdkClient(rig.sock) as c:
            (sub,) = c.nvmf_get_subsystems(nqn=NQN_A)
        assert {n["nsid"] for n in sub["namespaces"]} == {1, 2}
        assert AGENT_NQN in {h["nqn"] for h in sub["hosts"]}
        chunks = chunks_for(1, CHUNKS)
        tokens = tokens_for(CHUNKS)
        with rig.client(agent) as c:
            nv = c.channel.hello["nvme"]
            assert (nv["host"], nv["port"], nv["subnqn"]) == ("127.0.0.1", rig.port, NQN_A)
            # 8 at a time: DRAM holds 32 chunks, the agent demotes between the puts
            for i in range(0, CHUNKS, 8):
                assert c.put(tokens[: (i + 8) * 16], chunks[: i + 8]) == i + 8
            out = [np.empty_like(x) for x in chunks]
            assert c.get(tokens, out) == CHUNKS
            assert all(np.array_equal(a.view(np.uint16), b.view(np.uint16))
                       for a, b in zip(out, chunks, strict=True))  # fmt: skip
            _check_extents(rig, c, tokens, chunks)
            deadline = time.monotonic() + 10  # demotion is the agent's tick's job (0.5 s)
            while (stats := c.channel.call("stats")["stats"])["demotions"] == 0:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        assert stats["demotions"] > 0, stats
        assert rig.nvme.writes > 0  # only the agent's initiator writes nsid 2
    finally:
        assert agent.stop() == 0

    # Restart, plan only: SPDK is in sync now; DRAM was demoted at close through the initiator.
    agent = rig.spawn(rig.config(apply_on_start=False))
    try:
        with rig.client(agent) as c:
            out = [np.empty_like(x) for x in chunks]
            assert c.get(tokens, out) == CHUNKS
            assert all(np.array_equal(a.view(np.uint16), b.view(np.uint16))
                       for a, b in zip(out, chunks, strict=True))  # fmt: skip
        with ControlChannel(agent.control_url, ADMIN_TENANT, agent.admin_token) as adm:
            adm.connect()
            with pytest.raises(ControlError, match="not available in SPDK mode"):
                adm.call("backup", dir=str(rig.tmp / "bk"), incremental=False)
            with pytest.raises(ControlError, match="SPDK mode: add tenant 'b'"):
                adm.call("tenant_add", tenant="b")
    finally:
        assert agent.stop() == 0


def _check_extents(rig: Rig, c: KVClient, tokens: np.ndarray, chunks: list[np.ndarray]) -> None:
    """Each hit's extent, read from the target's own devices, is the chunk (ciphertext on the
    lvol's file, plaintext through the crypto stand-in)."""
    hits = c.channel.call("lookup", keys=c.keys(tokens), lease=False)["hits"]
    assert len(hits) == CHUNKS
    nsids = set()
    for (_key, nsid, lba, block_count, length, _sum), chunk in zip(hits, chunks, strict=True):
        nsids.add(nsid)
        want = chunk.tobytes()
        assert length == len(want)
        buf = bytearray(block_count * BLOCK_SIZE)
        (rig.dram if nsid == 1 else rig.nvme).read_into(lba, memoryview(buf))
        assert bytes(buf[:length]) == want
        if nsid == 2:
            rig.nvme_raw.read_into(lba, memoryview(buf))
            assert bytes(buf[:length]) != want  # stored encrypted
    assert nsids == {1, 2}


def test_spdk_mode_target_unreachable_names_address(rig: Rig) -> None:
    port = free_port()  # nobody listens there
    want = re.escape(f"cannot reach SPDK NVMe/TCP listener 127.0.0.1:{port}")
    with pytest.raises(RuntimeError, match=want):
        rig.spawn(rig.config(apply_on_start=True, port=port))


def test_spdk_link_lost_is_block_device_error_engine_keeps_serving(
    rig: Rig, tmp_path: Path
) -> None:
    """A dead initiator connection: BlockDeviceError naming the subsystem; the engine's
    background demotion gives its chunk back (no leaked lease or NVMe extent) and close() still
    closes (the WAL keeps the commits)."""
    cfg = load_config(rig.config(apply_on_start=False), environ={})
    devices = SpdkDevices.connect(cfg.spdk_tiers(), timeout_s=5.0)
    config = EngineConfig(
        data_dir=tmp_path / "engine",
        dram_bytes=DRAM_BLOCKS * BLOCK_SIZE,
        nvme_bytes=NVME_BLOCKS * BLOCK_SIZE,
        fsync_interval_s=3600.0,  # no flush in tick(): this test is about demotion
        tenants={"a": 0},
    )
    engine = Engine(config, device_factory=devices)
    try:
        keys = [i.to_bytes(16, "big") for i in range(30)]  # 120 of 128 DRAM blocks
        for i, key in enumerate(keys):
            engine.put_chunk("a", key, bytes([i]) * (4 * BLOCK_SIZE))
        assert engine.get_chunk("a", keys[3]) == bytes([3]) * (4 * BLOCK_SIZE)
        nvme = devices("a", _spec(1)).device
        assert nvme.block_count == NVME_BLOCKS
        assert rig.target is not None
        rig.target.stop()
        rig.target = None
        with pytest.raises(BlockDeviceError, match=NQN_A):
            nvme.read_into(0, memoryview(bytearray(BLOCK_SIZE)))
        assert engine.tick()["demoted"] == 0  # DRAM is over its free target: it tried
        stats = engine.stats("a")
        assert stats["records"] == 30 and engine.stats()["leases"] == 0
        assert stats["tiers"]["nvme"]["used_bytes"] == 0, stats  # the NVMe extent came back
        assert len(engine.lookup("a", keys, lease=False).hits) == 30  # extents still served
        with pytest.raises(BlockDeviceError):
            engine.get_chunk("a", keys[0])
    finally:
        engine.close()
        devices.close()


def _spec(index: int) -> TierSpec:
    return TierSpec(index=index, block_count=NVME_BLOCKS, persistent=index == 1)


# --- configuration -----------------------------------------------------------------------------


def _cfg(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "agent.toml"
    p.write_text(body)
    return p


def test_config_spdk_mode_without_section(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs an \\[spdk\\] section"):
        load_config(_cfg(tmp_path, '[agent]\nmode = "spdk"\n'), environ={})


def test_config_unknown_mode(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="must be one of embedded, spdk"):
        load_config(_cfg(tmp_path, '[agent]\nmode = "dpdk"\n'), environ={})


def test_config_agent_nqn_not_in_allowlist(tmp_path: Path) -> None:
    text = config_text(str(tmp_path / "d.img")).replace(f'"{AGENT_NQN}", ', "")
    with pytest.raises(ConfigError, match="must list the agent's host NQN"):
        load_config(_cfg(tmp_path, '[agent]\nmode = "spdk"\n' + text), environ={})


def test_config_bad_spdk_section_names_field(tmp_path: Path) -> None:
    text = config_text(str(tmp_path / "d.img")).replace("rpc_timeout_s = 5", "rpc_timeout = 5")
    with pytest.raises(ConfigError, match=r"spdk\.rpc_timeout: unknown field"):
        load_config(_cfg(tmp_path, text), environ={})


def test_config_tenant_without_spdk_tiers(tmp_path: Path) -> None:
    body = '[agent]\nmode = "spdk"\n[tenants.b]\n' + config_text(str(tmp_path / "d.img"))
    with pytest.raises(ConfigError, match="tenant 'b' has no SPDK namespace for tier dram, nvme"):
        load_config(_cfg(tmp_path, body), environ={})


def test_config_spdk_mode_tenants_default_to_spdk_subsystems(tmp_path: Path) -> None:
    path = _cfg(tmp_path, config_text(str(tmp_path / "d.img")))
    cfg = load_config(path, environ={"DPUKV_AGENT_MODE": "spdk"})
    cfg.agent.data_dir = str(tmp_path / "var")
    cfg.prepare()
    assert list(cfg.tenants) == ["a"]
    assert cfg.redacted()["spdk"]["agent_hostnqn"] == AGENT_NQN
    embedded = load_config(path, environ={})  # [spdk] alone does not switch modes
    assert not embedded.spdk_mode and embedded.spdk is not None


def test_example_agent_spdk_config_loads() -> None:
    example = Path(__file__).resolve().parents[1] / "spdk_plugins/examples/agent-spdk.toml"
    cfg = load_config(example, environ={})
    assert cfg.spdk_mode and not cfg.agent.spdk_apply_on_start
    assert {(t.tenant, t.tier, t.nsid, t.traddr) for t in cfg.spdk_tiers()} == {
        ("a", "dram", 1, "127.0.0.1"),
        ("a", "nvme", 2, "127.0.0.1"),
    }
    assert cfg.spdk is not None
    nv = listener_for(cfg.spdk, "a", "192.0.2.10")
    assert nv is not None and (nv["host"], nv["port"]) == ("192.0.2.10", 4420)


# --- live: a real spdk_tgt ---------------------------------------------------------------------

SPDK_TGT = os.environ.get("SPDK_TGT")
START_TIMEOUT_S = 30.0


@pytest.mark.skipif(not SPDK_TGT, reason="SPDK_TGT is not set (path to a real spdk_tgt binary)")
def test_live_spdk_tgt_agent_put_get(tmp_path: Path) -> None:
    """The agent provisions a real spdk_tgt (malloc DRAM, aio -> lvol -> crypto NVMe tier,
    nvmf/TCP on 127.0.0.1) and serves puts and gets through SPDK's namespaces."""
    assert SPDK_TGT is not None
    sock = str(tmp_path / "spdk.sock")
    args = shlex.split(os.environ.get("SPDK_TGT_ARGS", "--no-huge -s 1024 -m 0x1"))
    with open(tmp_path / "spdk_tgt.log", "wb") as log:
        proc = subprocess.Popen([SPDK_TGT, "-r", sock, *args], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not os.path.exists(sock):
            assert proc.poll() is None, (tmp_path / "spdk_tgt.log").read_text()
            assert time.monotonic() < deadline, "spdk_tgt did not create its socket"
            time.sleep(0.1)
        with open(tmp_path / "disk0.img", "wb") as f:
            f.truncate(AIO_BYTES)
        text = config_text(str(tmp_path / "disk0.img"), sock)
        text = text.replace('trsvcid = "4420"', f'trsvcid = "{free_port()}"')
        cfg = tmp_path / "agent.toml"
        cfg.write_text('[agent]\nmode = "spdk"\nspdk_apply_on_start = true\n' + text)
        data = tmp_path / "var"
        agent = spawn_agent(data, config=cfg)
        try:
            token = (data / "tenant-a.token").read_text().strip()
            chunks, tokens = chunks_for(2, 8), tokens_for(8)
            with KVClient(agent.control_url, "a", token, LAYOUT, SALT, hostnqn=HOST_A) as c:
                assert c.put(tokens, chunks) == 8
                out = [np.empty_like(x) for x in chunks]
                assert c.get(tokens, out) == 8
                assert all(np.array_equal(a.view(np.uint16), b.view(np.uint16))
                           for a, b in zip(out, chunks, strict=True))  # fmt: skip
        finally:
            assert agent.stop() == 0
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
