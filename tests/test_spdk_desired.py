"""The [spdk] config: parsing, and bad desired state refused with the field's path."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from spdk_sim.fixtures import AGENT_NQN, EXAMPLE, NQN_A, config_doc, key_provider
from spdk_sim.sim import SpdkSimulator

from spdk_plugins import (
    DesiredStateError,
    SpdkClient,
    agent_tiers,
    check_key_material,
    load_desired,
    parse_desired,
    plan,
)
from spdk_plugins.desired import MallocBdev, NvmeBdev


def _doc() -> dict[str, Any]:
    return config_doc("/tmp/disk0.img")


def test_example_config_parses() -> None:
    d = load_desired(EXAMPLE)
    assert d.accel.module == "mlx5" and d.accel.allowed_devs == ("mlx5_0",)
    assert isinstance(d.bdevs[0], NvmeBdev) and d.bdevs[0].bdev_names == ("Nvme0n1",)
    assert isinstance(d.bdevs[1], MallocBdev) and d.bdevs[1].num_blocks == 262144
    assert [s.allow_any_host for s in d.subsystems] == [False, False]
    assert dict(d.transports[0].tuning)["c2h_success"] is True


def _set(doc: dict[str, Any], path: str, value: Any) -> None:
    node: Any = doc["spdk"]
    *parents, last = path.split(".")
    for p in parents:
        node = node[int(p)] if p.isdigit() else node[p]
    node[int(last) if last.isdigit() else last] = value


BAD = [
    (
        "subsystems.0.namespaces.0.bdev_name",
        "nope",
        "spdk.subsystems[0].namespaces[0].bdev_name",
        "not declared",
    ),
    ("crypto.0.key_name", "ghost", "spdk.crypto[0].key_name", "unknown key"),
    ("bdevs.0.block_size", "4096", "spdk.bdevs[0].block_size", "expected int"),
    ("bdevs.0.block_size", 1000, "spdk.bdevs[0].block_size", "multiple of 512"),
    ("bdevs.0.bogus", 1, "spdk.bdevs[0].bogus", "unknown field"),
    ("keys.0.key", "00" * 32, "spdk.keys[0].key", "does not belong in the config"),
    ("keys.0.tweak_mode", "XTS_WRONG", "spdk.keys[0].tweak_mode", "not one of"),
    ("subsystems.0.hosts", [], "spdk.subsystems[0].hosts", "no host could connect"),
    ("subsystems.0.nqn", "tenant-a", "spdk.subsystems[0].nqn", "not an NQN"),
    ("subsystems.0.serial_number", "X" * 21, "spdk.subsystems[0].serial_number", "longer"),
    (
        "subsystems.0.listeners.0.trtype",
        "RDMA",
        "spdk.subsystems[0].listeners[0].trtype",
        "no RDMA transport",
    ),
    ("transports.0.no_srq", True, "spdk.transports[0].no_srq", "not a TCP transport parameter"),
    ("lvols.0.lvs_name", "lvs9", "spdk.lvols[0].lvs_name", "unknown lvstore"),
    (
        "subsystems.0.namespaces.1.bdev_name",
        "dram-a",
        "spdk.subsystems[0].namespaces[1].bdev_name",
        "claimed by one user only",
    ),
    ("subsystems.0.namespaces.1.nsid", 1, "spdk.subsystems[0].namespaces[1].nsid", "duplicate"),
]


@pytest.mark.parametrize(("path", "value", "field", "message"), BAD)
def test_bad_desired_state_names_the_field(path, value, field, message) -> None:
    doc = _doc()
    _set(doc, path, value)
    with pytest.raises(DesiredStateError, match=message) as err:
        parse_desired(doc)
    assert err.value.field == field


def test_duplicate_nqn_refused() -> None:
    doc = _doc()
    doc["spdk"]["subsystems"].append(copy.deepcopy(doc["spdk"]["subsystems"][0]))
    doc["spdk"]["subsystems"][1]["namespaces"] = []
    with pytest.raises(DesiredStateError, match=f"duplicate NQN '{NQN_A}'") as err:
        parse_desired(doc)
    assert err.value.field == "spdk.subsystems[1].nqn"


def test_mlx5_refuses_other_tweak_modes() -> None:
    doc = _doc()
    doc["spdk"]["accel"] = {"module": "mlx5"}
    doc["spdk"]["keys"][0]["tweak_mode"] = "INCR_512_FULL_LBA"
    with pytest.raises(DesiredStateError, match="only SIMPLE_LBA") as err:
        parse_desired(doc)
    assert err.value.field == "spdk.keys[0].tweak_mode"


def test_crypto_cycle_refused() -> None:
    doc = _doc()
    doc["spdk"]["crypto"].append({"name": "c2", "base_bdev_name": "c3", "key_name": "key-a"})
    doc["spdk"]["crypto"].append({"name": "c3", "base_bdev_name": "c2", "key_name": "key-a"})
    with pytest.raises(DesiredStateError, match="sits on itself"):
        parse_desired(doc)


@pytest.mark.parametrize(
    ("module", "key", "key2", "field", "message"),
    [
        ("software", "ab" * 32, "ab" * 32, "spdk.keys[0].key2", "key equal to key2"),
        ("mlx5", "ab" * 24, "cd" * 24, "spdk.keys[0].key", "mlx5 accel module takes 16 or 32"),
        ("software", "ab" * 32, "cd" * 16, "spdk.keys[0].key2", "differ in length"),
        ("software", "zz" * 32, "cd" * 32, "spdk.keys[0].key", "not even-length hex"),
    ],
)
def test_bad_key_material_refused_without_echoing_it(module, key, key2, field, message) -> None:
    doc = _doc()
    if module == "mlx5":
        doc["spdk"]["accel"] = {"module": "mlx5"}
    with pytest.raises(DesiredStateError, match=message) as err:
        check_key_material(parse_desired(doc), lambda name: (key, key2))
    assert err.value.field == field
    assert key not in str(err.value) and key2 not in str(err.value)


def test_bad_key_refused_at_plan_time_before_any_rpc(tmp_path: Path) -> None:
    d = parse_desired(_doc())
    with SpdkSimulator(tmp_path / "s.sock") as sim, SpdkClient(sim.socket_path) as c:
        with pytest.raises(DesiredStateError, match="key equal to key2"):
            plan(d, c, lambda name: ("ab" * 32, "ab" * 32))
        assert sim.requests == []


def test_agent_tiers_maps_each_tenant_tier_to_loopback_namespace() -> None:
    tiers = agent_tiers(parse_desired(_doc()))
    assert [(t.tenant, t.tier, t.nsid) for t in tiers] == [("a", "dram", 1), ("a", "nvme", 2)]
    assert {(t.subnqn, t.hostnqn, t.traddr, t.trsvcid) for t in tiers} == {
        (NQN_A, AGENT_NQN, "127.0.0.1", "4420")
    }
    example = agent_tiers(load_desired(EXAMPLE))
    assert [(t.tenant, t.tier, t.bdev_name) for t in example] == [
        ("a", "dram", "dram-a"),
        ("a", "nvme", "tenant-a-crypt"),
        ("b", "dram", "dram-b"),
        ("b", "nvme", "tenant-b-crypt"),
    ]


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("subsystems.0.listeners.0.traddr", "192.0.2.1", "no TCP listener on a loopback"),
        ("subsystems.0.hosts", ["nqn.2014-08.org.x:host"], "must list the agent's host NQN"),
        ("subsystems.0.namespaces.0.tier", "nvme", "tier nvme must be nsid 2"),
    ],
)
def test_agent_tiers_refuses_unreachable_tiers(path, value, message) -> None:
    doc = _doc()
    _set(doc, path, value)
    with pytest.raises(DesiredStateError, match=message):
        agent_tiers(parse_desired(doc))


def test_key_provider_fixture_keys_are_valid() -> None:
    check_key_material(parse_desired(_doc()), key_provider)
