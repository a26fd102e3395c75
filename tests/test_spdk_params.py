"""Every RPC the driver sends, checked against SPDK v26.05's schema (rpc_params_used.json):
method known, parameter names known, JSON types right, required ones present. Methods the
schema dump does not list are named here explicitly, with where their names come from.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from spdk_sim.fixtures import EXAMPLE, config_doc, key_provider, shared
from spdk_sim.sim import NvmeDevice, SpdkSimulator

from spdk_plugins import SpdkClient, apply, boot_config, load_desired, parse_desired

# Not in rpc_params_used.json; names from SPDK's C decoders (module/accel/mlx5,
# module/bdev/uring, lib/nvmf/nvmf_rpc.c) and the PyPI client's CLI.
UNLISTED = {
    "mlx5_scan_accel_module": {
        "qp_size",
        "num_requests",
        "allowed_devs",
        "crypto_split_blocks",
        "enable_driver",
    },
    "framework_start_init": set(),
    "accel_get_module_info": set(),
    "accel_get_opc_assignments": set(),
    "bdev_uring_create": {"name", "filename", "block_size", "uuid"},
    "nvmf_subsystem_remove_host": {"nqn", "host", "tgt_name"},
    "nvmf_subsystem_allow_any_host": {"nqn", "allow_any_host", "tgt_name"},
    "bdev_wait_for_examine": set(),
}
NAMESPACE_FIELDS = {"bdev_name", "nsid", "nguid", "eui64", "uuid", "ptpl_file", "anagrpid"}
LISTEN_FIELDS = {"trtype", "adrfam", "traddr", "trsvcid"}


def _json_type_ok(value: Any, json_type: str) -> bool:
    if json_type.startswith("number"):
        return isinstance(value, int) and not isinstance(value, bool)
    if json_type.startswith("string"):
        return isinstance(value, str)
    return {"boolean": bool, "object": dict, "array": list}[json_type] is type(value)


def check_request(method: str, params: dict[str, Any] | None) -> None:
    params = params or {}
    schema = shared("rpc_params_used.json")["methods"]
    if method not in schema:
        assert method in UNLISTED, f"{method}: not in the v26.05 schema dump nor UNLISTED"
        assert set(params) <= UNLISTED[method], (method, params)
        return
    spec = {p["name"]: p for p in schema[method]["params"]}
    for name, value in params.items():
        assert name in spec, f"{method}: unknown parameter {name!r}"
        assert _json_type_ok(value, spec[name]["json_type"]), (method, name, value)
        if "enum_values" in spec[name]:
            assert value in spec[name]["enum_values"], (method, name, value)
    for name, p in spec.items():
        assert not p["required"] or name in params, f"{method}: missing required {name!r}"
    if method == "nvmf_subsystem_add_ns":
        assert set(params["namespace"]) <= NAMESPACE_FIELDS
        assert isinstance(params["namespace"].get("nsid", 1), int)
    if "listen_address" in params:
        assert set(params["listen_address"]) <= LISTEN_FIELDS
        assert all(isinstance(v, str) for v in params["listen_address"].values())


def test_driver_requests_match_schema(tmp_path: Path) -> None:
    aio = tmp_path / "disk0.img"
    with open(aio, "wb") as f:
        f.truncate(64 << 20)
    d = parse_desired(config_doc(str(aio)))
    empty = dataclasses.replace(
        d, keys=(), bdevs=(), crypto=(), lvstores=(), lvols=(), subsystems=()
    )
    example = load_desired(EXAMPLE)
    example_keys = {k.name: key_provider("key-a") for k in example.keys}
    nvme = {"0000:03:00.0": NvmeDevice(num_blocks=1 << 26)}
    sent: list[dict[str, Any]] = []
    with SpdkSimulator(tmp_path / "a.sock") as sim, SpdkClient(sim.socket_path) as c:
        apply(d, c, key_provider)  # create everything
        # drift made by hand (these two requests are checked too), then repaired by apply
        c.nvmf_subsystem_allow_any_host(nqn=d.subsystems[0].nqn, allow_any_host=True)
        c.nvmf_subsystem_add_host(nqn=d.subsystems[0].nqn, host="nqn.2014-08.org.x:y")
        apply(d, c, key_provider)  # tighten + remove host
        apply(empty, c, None, prune=True)  # delete everything
        sent += sim.requests
    with (
        SpdkSimulator(
            tmp_path / "b.sock", features=frozenset({"mlx5"}), wait_for_rpc=True, nvme_devices=nvme
        ) as sim,
        SpdkClient(sim.socket_path) as c,
    ):
        apply(example, c, example_keys.__getitem__)
        sent += sim.requests
    methods = {r["method"] for r in sent}
    assert {"nvmf_subsystem_remove_host", "bdev_lvol_delete", "mlx5_scan_accel_module"} <= methods
    for r in sent:
        check_request(r["method"], r.get("params"))


def test_boot_config_entries_match_schema() -> None:
    example = load_desired(EXAMPLE)
    doc = boot_config(example, provisioned=True)
    for sub in doc["subsystems"]:
        for entry in sub["config"]:
            params = dict(entry.get("params", {}))
            if entry["method"] == "accel_crypto_key_create":
                params.update(key="00" * 32, key2="11" * 32)
            check_request(entry["method"], params)
