"""Shared fixtures of the SPDK tests: a software-accel config over malloc + aio, test keys."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

SHARED_SPDK = Path(__file__).resolve().parents[1] / "data" / "spdk"  # recorded from SPDK v26.05
EXAMPLE = Path(__file__).resolve().parents[2] / "spdk_plugins" / "examples" / "bluefield.toml"
AGENT_NQN = "nqn.2026-11.io.dpu-kvtier:agent"
HOST_A = "nqn.2014-08.org.nvmexpress:uuid:11111111-2222-3333-4444-555555555555"
NQN_A = "nqn.2026-11.io.dpu-kvtier:tenant:a"
# Test keys (never real ones): 32-byte halves, distinct.
KEYS = {
    "key-a": ("00112233445566778899aabbccddeeff" * 2, "ffeeddccbbaa99887766554433221100" * 2),
    "key-b": ("0f1e2d3c4b5a69788796a5b4c3d2e1f0" * 2, "f0e1d2c3b4a5968778695a4b3c2d1e0f" * 2),
}


def key_provider(name: str) -> tuple[str, str]:
    return KEYS[name]


def config_text(aio_path: str, socket: str = "/var/tmp/spdk.sock") -> str:
    """Tenant a: DRAM (malloc) tier + NVMe tier (aio -> lvstore -> lvol -> crypto)."""
    return f"""
[spdk]
socket = "{socket}"
rpc_timeout_s = 5
agent_hostnqn = "{AGENT_NQN}"

[[spdk.keys]]
name = "key-a"

[[spdk.bdevs]]
type = "malloc"
name = "dram-a"
block_size = 4096
num_blocks = 4096

[[spdk.bdevs]]
type = "aio"
name = "disk0"
filename = "{aio_path}"
block_size = 4096

[[spdk.lvstores]]
lvs_name = "lvs0"
bdev_name = "disk0"
cluster_sz = 1048576

[[spdk.lvols]]
lvs_name = "lvs0"
lvol_name = "tenant-a"
size_in_mib = 16

[[spdk.crypto]]
name = "crypt-a"
base_bdev_name = "lvs0/tenant-a"
key_name = "key-a"

[[spdk.transports]]
trtype = "TCP"
max_queue_depth = 128
in_capsule_data_size = 4096

[[spdk.subsystems]]
nqn = "{NQN_A}"
tenant = "a"
serial_number = "KVTIER-A"
model_number = "dpu-kvtier tenant a"
hosts = ["{AGENT_NQN}", "{HOST_A}"]

[[spdk.subsystems.namespaces]]
nsid = 1
bdev_name = "dram-a"
tier = "dram"

[[spdk.subsystems.namespaces]]
nsid = 2
bdev_name = "crypt-a"
tier = "nvme"

[[spdk.subsystems.listeners]]
trtype = "TCP"
traddr = "127.0.0.1"
trsvcid = "4420"
"""


def config_doc(aio_path: str, socket: str = "/var/tmp/spdk.sock") -> dict[str, Any]:
    return tomllib.loads(config_text(aio_path, socket))


def shared(name: str) -> Any:
    return json.loads((SHARED_SPDK / name).read_text())
