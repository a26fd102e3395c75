"""The boot JSON config: save_config's shape, its ordering habits, keys, and that a target
loaded from it then converges with apply."""

from __future__ import annotations

import json
from pathlib import Path

from spdk_sim.fixtures import EXAMPLE, KEYS, config_doc, shared
from spdk_sim.sim import NvmeDevice, SpdkSimulator

from spdk_plugins import SpdkClient, apply, boot_config, load_desired, parse_desired, plan


def _methods(doc: dict, subsystem: str) -> list[str]:
    sub = next(s for s in doc["subsystems"] if s["subsystem"] == subsystem)
    return [e["method"] for e in sub["config"]]


def test_shape_and_order_follow_save_config() -> None:
    doc = boot_config(load_desired(EXAMPLE))
    saved = shared("save_config.json")
    assert set(doc) == set(saved) == {"subsystems"}
    order = [s["subsystem"] for s in saved["subsystems"]]
    ours = [s["subsystem"] for s in doc["subsystems"]]
    assert ours == sorted(ours, key=order.index)  # same relative order as SPDK's
    bdev = _methods(doc, "bdev")
    # as in save_config.json: crypto vbdevs first (deferred until their base appears), then the
    # base bdevs, bdev_wait_for_examine last so lvols on disk exist before nvmf runs
    assert bdev[0] == "bdev_crypto_create" and bdev[-1] == "bdev_wait_for_examine"
    assert _methods(saved, "bdev")[-1] == "bdev_wait_for_examine"
    nvmf = _methods(doc, "nvmf")
    assert nvmf.index("nvmf_create_transport") < nvmf.index("nvmf_create_subsystem")
    assert _methods(doc, "accel")[0] == "mlx5_scan_accel_module"


def test_keys_redacted_unless_provider_given() -> None:
    d = load_desired(EXAMPLE)
    text = json.dumps(boot_config(d))
    assert "<redacted>" in text
    with_keys = boot_config(d, lambda n: KEYS["key-a"])
    entries = [
        e
        for s in with_keys["subsystems"]
        for e in s["config"]
        if e["method"] == "accel_crypto_key_create"
    ]
    assert [e["params"]["key"] for e in entries] == [KEYS["key-a"][0]] * 2


def test_lvol_namespaces_left_to_apply_unless_provisioned() -> None:
    d = load_desired(EXAMPLE)
    fresh = [
        e["params"]["namespace"]["bdev_name"]
        for s in boot_config(d)["subsystems"]
        for e in s["config"]
        if e["method"] == "nvmf_subsystem_add_ns"
    ]
    assert fresh == ["dram-a", "dram-b"]
    provisioned = boot_config(d, provisioned=True)
    ns = [
        e
        for s in provisioned["subsystems"]
        for e in s["config"]
        if e["method"] == "nvmf_subsystem_add_ns"
    ]
    assert len(ns) == 4


def _load_config(client: SpdkClient, doc: dict) -> None:
    """What spdk_tgt --json does: startup-state methods first, framework_start_init, the rest,
    each pass in file order (lib/init/json_config.c)."""
    startup = set(client.rpc_get_methods(current=True))
    entries = [e for s in doc["subsystems"] for e in s["config"]]
    for entry in [e for e in entries if e["method"] in startup]:
        client.call(entry["method"], entry.get("params"))
    client.framework_start_init()
    for entry in [e for e in entries if e["method"] not in startup]:
        client.call(entry["method"], entry.get("params"))


def test_boot_then_apply_converges(tmp_path: Path) -> None:
    example = load_desired(EXAMPLE)
    keys = {k.name: KEYS["key-a"] for k in example.keys}
    nvme = {"0000:03:00.0": NvmeDevice(num_blocks=1 << 26)}
    with (
        SpdkSimulator(
            tmp_path / "s.sock", features=frozenset({"mlx5"}), wait_for_rpc=True, nvme_devices=nvme
        ) as sim,
        SpdkClient(sim.socket_path) as c,
    ):
        _load_config(c, boot_config(example, keys.__getitem__))
        todo = plan(example, c, keys.__getitem__)
        assert {s.method for s in todo.steps} == {
            "bdev_lvol_create_lvstore",
            "bdev_lvol_create",
            "nvmf_subsystem_add_ns",
        }
        apply(example, c, keys.__getitem__)
        assert plan(example, c, keys.__getitem__).in_sync


def test_recorded_layout_boot_config_is_save_config_subset(tmp_path: Path) -> None:
    """Our boot config of the recorded layout: every entry appears in save_config.json."""
    doc = config_doc("/var/lib/spdk/aio0.img")
    doc["spdk"]["keys"] = [{"name": "key0"}]
    doc["spdk"]["bdevs"] = [
        {"type": "malloc", "name": "Malloc0", "block_size": 512, "num_blocks": 131072},
        {"type": "aio", "name": "AIO0", "filename": "/var/lib/spdk/aio0.img", "block_size": 512},
    ]
    doc["spdk"]["crypto"] = [{"name": "crypto0", "base_bdev_name": "AIO0", "key_name": "key0"}]
    doc["spdk"]["lvstores"] = [{"lvs_name": "lvs0", "bdev_name": "crypto0"}]
    doc["spdk"]["lvols"] = [{"lvs_name": "lvs0", "lvol_name": "lvol0", "size_in_mib": 128}]
    doc["spdk"]["transports"] = [{"trtype": "TCP"}]
    doc["spdk"]["subsystems"] = [
        {
            "nqn": "nqn.2016-06.io.spdk:cnode1",
            "allow_any_host": True,
            "serial_number": "SPDK00000000000001",
            "model_number": "SPDK held-out peer",
            "namespaces": [{"nsid": 2, "bdev_name": "Malloc0"}],
            "listeners": [{"trtype": "TCP", "traddr": "127.0.0.1", "trsvcid": "4420"}],
        }
    ]
    recorded_keys = {
        "key0": ("00112233445566778899aabbccddeeff", "ffeeddccbbaa99887766554433221100")
    }
    ours = boot_config(parse_desired(doc), recorded_keys.__getitem__)
    saved = {s["subsystem"]: s["config"] for s in shared("save_config.json")["subsystems"]}
    for sub in ours["subsystems"]:
        for entry in sub["config"]:
            params = {k: v for k, v in entry.get("params", {}).items() if k != "namespace"}
            match = [
                e
                for e in saved[sub["subsystem"]]
                if e["method"] == entry["method"]
                and all(e.get("params", {}).get(k) == v for k, v in params.items())
            ]
            assert match, entry


def test_boot_config_sends_the_same_create_calls_as_a_plan_from_empty(tmp_path: Path) -> None:
    """Both come from spdk_plugins.calls: a field added to one cannot be missing in the other."""
    example = load_desired(EXAMPLE)
    nvme = {"0000:03:00.0": NvmeDevice(num_blocks=1 << 26)}
    with (
        SpdkSimulator(
            tmp_path / "s.sock", features=frozenset({"mlx5"}), wait_for_rpc=True, nvme_devices=nvme
        ) as sim,
        SpdkClient(sim.socket_path) as c,
    ):
        steps = plan(example, c).steps
    planned = [(s.method, json.dumps(s.params, sort_keys=True)) for s in steps]
    doc = boot_config(example, provisioned=True)
    booted = [
        (e["method"], json.dumps(e["params"], sort_keys=True))
        for sub in doc["subsystems"]
        for e in sub["config"]
        if e["method"] != "bdev_wait_for_examine"
    ]
    assert booted and all(entry in planned for entry in booted), set(booted) - set(planned)
