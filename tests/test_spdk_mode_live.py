"""SPDK mode against a real spdk_tgt (SPDK v26.05) for every example config and both layouts.

Each config is made runnable here and keeps its structure: the mlx5 accel module becomes the
software one (same AES_XTS keys), the PCIe drive an AIO file under the drive's bdev name,
RDMA transports and listeners on the hosts' network are dropped, sizes shrink, ports are free
ones. Then: `dpuctl spdk apply` converges, a `plan` right after it is empty, the agent starts
in SPDK mode, and KVClient put/get is byte-exact, also after an agent restart. Layouts: lvol ->
crypto (the examples) and aio -> crypto -> lvstore -> lvol (the recorded one).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from spdk_peer import SpdkApp, free_port, needs_spdk, spdk_tgt
from spdk_sim.fixtures import HOST_A, config_text
from test_spdk_mode import LAYOUT, SALT, chunks_for, tokens_for

from dpu_agent.cli import cli
from dpu_agent.crypto.keystore import env_var_name
from dpu_agent.testing import spawn_agent
from host_shim import KVClient
from spdk_plugins import load_desired

pytestmark = needs_spdk

EXAMPLES = Path(__file__).resolve().parents[1] / "spdk_plugins" / "examples"
AIO_BYTES = 128 << 20
CHUNKS = 12
# Host NQNs the examples allow (tenant a, tenant b) and the fixture's.
EXAMPLE_HOSTS = {
    "a": "nqn.2014-08.org.nvmexpress:uuid:9b1c3a52-0c7e-4a55-9d0f-3e4cbe1f2a01",
    "b": "nqn.2014-08.org.nvmexpress:uuid:4f0e77d1-2b6a-4c1e-8f3b-6a0d9c2e5b17",
}

CRYPTO_UNDER_LVSTORE = """
[agent]
mode = "spdk"
spdk_apply_on_start = false

[spdk]
socket = "{socket}"
rpc_timeout_s = 30
agent_hostnqn = "nqn.2026-11.io.dpu-kvtier:agent"

[[spdk.keys]]
name = "key-a"
tenant = "a"

[[spdk.bdevs]]
type = "malloc"
name = "dram-a"
block_size = 4096
num_blocks = 4096

[[spdk.bdevs]]
type = "aio"
name = "disk0"
filename = "{aio}"
block_size = 4096

[[spdk.crypto]]
name = "crypt0"
base_bdev_name = "disk0"
key_name = "key-a"

[[spdk.lvstores]]
lvs_name = "lvs0"
bdev_name = "crypt0"
cluster_sz = 1048576

[[spdk.lvols]]
lvs_name = "lvs0"
lvol_name = "tenant-a"
size_in_mib = 16

[[spdk.transports]]
trtype = "TCP"

[[spdk.subsystems]]
nqn = "nqn.2026-11.io.dpu-kvtier:tenant:a"
tenant = "a"
hosts = ["nqn.2026-11.io.dpu-kvtier:agent", "{host}"]

[[spdk.subsystems.namespaces]]
nsid = 1
bdev_name = "dram-a"
tier = "dram"

[[spdk.subsystems.namespaces]]
nsid = 2
bdev_name = "lvs0/tenant-a"
tier = "nvme"

[[spdk.subsystems.listeners]]
trtype = "TCP"
traddr = "127.0.0.1"
trsvcid = "4420"
"""


def _runnable(text: str, socket: str, aio: str, port: int) -> str:
    """An example config made runnable on this machine, structure unchanged."""
    text = re.sub(r"(?m)[ \t]*#.*$", "", text)  # comments (no value here holds a '#')
    text = re.sub(r"\n{3,}", "\n\n", text)
    text = re.sub(r'(?m)^socket = ".*"$', f'socket = "{socket}"', text)
    text = re.sub(r"(?m)^rpc_timeout_s = \d+.*$", "rpc_timeout_s = 30", text)
    # mlx5 -> software accel (the same AES_XTS keys)
    text = re.sub(r'\[spdk\.accel\]\nmodule = "mlx5".*?\n\n', "", text, flags=re.DOTALL)
    # the PCIe drive -> an AIO file under the drive's bdev name
    text = re.sub(
        r'type = "nvme"\nname = "(\w+)"[^\n]*\ntrtype = "PCIe"\ntraddr = "[^"]+"',
        lambda m: f'type = "aio"\nname = "{m[1]}n1"\nfilename = "{aio}"\nblock_size = 4096',
        text,
    )
    text = re.sub(r"(?m)^num_blocks = 262144.*$", "num_blocks = 4096", text)  # 16 MiB DRAM
    text = re.sub(r"(?m)^size_in_mib = 65536.*$", "size_in_mib = 16", text)
    text = re.sub(r"\[\[spdk\.transports\]\]\ntrtype = \"RDMA\".*?\n\n", "", text, flags=re.DOTALL)
    # listeners on the hosts' network (RDMA, or TCP on 192.0.2.10) -> dropped
    text = re.sub(
        r"\[\[spdk\.subsystems\.listeners\]\]\ntrtype = \"\w+\"\ntraddr = \"192\.0\.2\.10\".*?"
        r"trsvcid = \"4420\"[^\n]*\n(#[^\n]*\n)?",
        "",
        text,
        flags=re.DOTALL,
    )
    text = text.replace('trsvcid = "4420"', f'trsvcid = "{port}"')
    text = re.sub(r"(?ms)^\[agent\].*?(?=^\[spdk\])", "", text)  # our own [agent] goes first
    assert "192.0.2.10" not in text and "RDMA" not in text and "mlx5" not in text
    agent = '[agent]\nmode = "spdk"\nspdk_apply_on_start = false\n\n'
    return agent + text


def _configs(tmp: Path, socket: str) -> dict[str, tuple[str, dict[str, str]]]:
    """name -> (config text, tenant -> host NQN)."""
    aio = str(tmp / "disk0.img")
    with open(aio, "wb") as f:
        f.truncate(AIO_BYTES)
    port = free_port()
    fixture = config_text(aio, socket).replace('trsvcid = "4420"', f'trsvcid = "{port}"')
    return {
        "bluefield.toml": (
            _runnable((EXAMPLES / "bluefield.toml").read_text(), socket, aio, port),
            EXAMPLE_HOSTS,
        ),
        "agent-spdk.toml": (
            _runnable((EXAMPLES / "agent-spdk.toml").read_text(), socket, aio, port),
            {"a": EXAMPLE_HOSTS["a"]},
        ),
        "aio-lvol-crypto": (
            '[agent]\nmode = "spdk"\nspdk_apply_on_start = false\n' + fixture,
            {"a": HOST_A},
        ),
        "aio-crypto-lvol": (
            CRYPTO_UNDER_LVSTORE.format(socket=socket, aio=aio, host=HOST_A).replace(
                'trsvcid = "4420"', f'trsvcid = "{port}"'
            ),
            {"a": HOST_A},
        ),
    }


@pytest.fixture
def tgt(tmp_path: Path) -> Iterator[SpdkApp]:
    with spdk_tgt(tmp_path) as app:
        yield app


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(
        np.array_equal(x.view(np.uint16), y.view(np.uint16)) for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize(
    "name", ["bluefield.toml", "agent-spdk.toml", "aio-lvol-crypto", "aio-crypto-lvol"]
)
def test_spdk_mode_against_spdk_tgt(
    name: str, tgt: SpdkApp, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text, hosts = _configs(tmp_path, str(tgt.sock))[name]
    cfg = tmp_path / "agent.toml"
    cfg.write_text(text)
    for i, key in enumerate(load_desired(cfg).keys):  # the agent's key store: environment
        material = bytes(range(i * 7, i * 7 + 64))  # distinct halves: a valid XTS key
        monkeypatch.setenv(env_var_name(key.tenant or key.name), material.hex())
    monkeypatch.delenv("DPUKV_CONFIG", raising=False)
    runner = CliRunner()
    applied = runner.invoke(cli, ["spdk", "apply", "--config", str(cfg), "--json"])
    doc = json.loads(applied.output)
    assert applied.exit_code == 0 and doc["converged"], applied.output
    planned = runner.invoke(cli, ["spdk", "plan", "--config", str(cfg), "--json"])
    p = json.loads(planned.output)
    assert planned.exit_code == 0 and p["steps"] == [] and p["conflicts"] == [], planned.output

    data = tmp_path / "var"
    written: dict[str, list[np.ndarray]] = {}
    agent = spawn_agent(data, config=cfg)
    try:
        for seed, (tenant, host) in enumerate(sorted(hosts.items()), 1):
            token = (data / f"tenant-{tenant}.token").read_text().strip()
            chunks = written[tenant] = chunks_for(seed, CHUNKS)
            with KVClient(agent.control_url, tenant, token, LAYOUT, SALT, hostnqn=host) as c:
                assert c.put(tokens_for(CHUNKS), chunks) == CHUNKS
                out = [np.empty_like(x) for x in chunks]
                assert c.get(tokens_for(CHUNKS), out) == CHUNKS and _same(out, chunks)
    finally:
        assert agent.stop() == 0, (data / "agent.log").read_text()[-3000:]
    agent = spawn_agent(data, config=cfg)  # restart: the index and the tiers come back
    try:
        for tenant, host in sorted(hosts.items()):
            token = (data / f"tenant-{tenant}.token").read_text().strip()
            with KVClient(agent.control_url, tenant, token, LAYOUT, SALT, hostnqn=host) as c:
                out = [np.empty_like(x) for x in written[tenant]]
                got = c.get(tokens_for(CHUNKS), out)
                assert got == CHUNKS and _same(out, written[tenant]), (tenant, got)
    finally:
        assert agent.stop() == 0, (data / "agent.log").read_text()[-3000:]
