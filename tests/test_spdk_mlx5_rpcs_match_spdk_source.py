"""Every RPC of SPDK mode's mlx5 crypto plan, checked against SPDK's own decoders.

The simulator's mlx5 answers cannot be recorded here (no BlueField), so the parameter names,
types and required flags come from SPDK's source instead: tests/data/spdk/
mlx5_crypto_rpcs_v26_05.json, extracted from the C decoder tables of the v26.05 tag
(tests/spdk_sim/extract_spdk_decoders.py). A request passes only if SPDK's
spdk_json_decode_object would accept it: known names, values that fit the decoder's type,
required names present; methods without decoders get no params at all (framework_start_init
refuses even an empty object); keys use a cipher, tweak mode and key size the mlx5 module takes.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path
from typing import Any

import pytest
from spdk_sim.fixtures import EXAMPLE, key_provider, shared
from spdk_sim.sim import NvmeDevice, SpdkSimulator

from spdk_plugins import SpdkClient, apply, boot_config, parse_desired
from spdk_plugins.desired import DesiredStateError

SOURCE = shared("mlx5_crypto_rpcs_v26_05.json")
DECODERS = SOURCE["methods"]
UINT_MAX = {"uint16": 0xFFFF, "uint32": 0xFFFFFFFF, "uint64": 2**64 - 1}
# The enum decoders and which enum each reads (lib/accel/accel_rpc.c).
ENUM_OF = {"cipher": "accel_crypto_cipher", "tweak_mode": "accel_crypto_tweak_mode"}
# What the mlx5 plan must send for this test to mean anything.
PLAN_METHODS = {"mlx5_scan_accel_module", "framework_start_init", "accel_crypto_key_create",
                "bdev_crypto_create", "bdev_crypto_delete", "accel_crypto_key_destroy"}  # fmt: skip
SIM_DATA = Path(__file__).resolve().parent / "spdk_sim" / "sim_data_v26_05.json"


def _decodes(method: str, value: Any, param: dict[str, Any]) -> str | None:
    """Why SPDK's decoder for `param` refuses `value`, or None."""
    kind = param["type"]
    if kind in UINT_MAX:
        ok = isinstance(value, int) and not isinstance(value, bool)
        ok = ok and 0 <= value <= UINT_MAX[kind]
    elif kind == "boolean":
        ok = isinstance(value, bool)
    elif kind == "string":
        ok = isinstance(value, str)
    else:
        ok = value in SOURCE["enums"][ENUM_OF[param["name"]]]
    return None if ok else f"{method}.{param['name']}={value!r} does not decode as {kind}"


def problems(request: dict[str, Any]) -> list[str]:
    """What SPDK v26.05 would refuse in one request of the mlx5 crypto path."""
    method = request["method"]
    spec = DECODERS[method]
    if not spec["params"]:
        return [f"{method} takes no params"] if "params" in request else []
    params = request.get("params") or {}
    by_name = {p["name"]: p for p in spec["params"]}
    out = [f"{method}: unknown parameter {n!r}" for n in params if n not in by_name]
    out += [f"{method}: missing required {n!r}" for n, p in by_name.items()
            if p["required"] and n not in params]  # fmt: skip
    out += [why for n, v in params.items() if n in by_name
            if (why := _decodes(method, v, by_name[n])) is not None]  # fmt: skip
    if method == "accel_crypto_key_create":
        mlx5 = SOURCE["mlx5_module"]
        if params.get("tweak_mode", "SIMPLE_LBA") not in mlx5["tweak_modes"]:
            out.append(f"mlx5 refuses tweak mode {params['tweak_mode']}")
        sizes = mlx5["ciphers"].get(params.get("cipher"), [])
        for half in ("key", "key2"):
            if len(params.get(half, "")) // 2 not in sizes:
                out.append(f"mlx5 refuses a {len(params.get(half, '')) // 2}-byte {half}")
    return out


def _mlx5_desired(**accel: Any) -> Any:
    doc = tomllib.loads(EXAMPLE.read_text())
    doc["spdk"]["accel"] |= accel
    return parse_desired(doc)


def test_the_recorded_definitions_name_their_spdk_source() -> None:
    assert SOURCE["spdk"]["tag"] == "v26.05" and len(SOURCE["spdk"]["commit"]) == 40
    scan = {p["name"]: p for p in DECODERS["mlx5_scan_accel_module"]["params"]}
    assert set(scan) == {"qp_size", "num_requests", "allowed_devs", "crypto_split_blocks",
                         "enable_driver"}  # fmt: skip
    assert not any(p["required"] for p in scan.values())
    assert DECODERS["mlx5_scan_accel_module"]["state"] == "SPDK_RPC_STARTUP"
    sim = json.loads(SIM_DATA.read_text())["params"]["mlx5_scan_accel_module"]
    assert sim["checked_against_source"].startswith("spdk v26.05")
    assert [p["name"] for p in sim["params"]] == list(scan)


def test_mlx5_plan_and_boot_config_send_only_what_spdks_decoders_accept(tmp_path: Path) -> None:
    desired = _mlx5_desired(crypto_split_blocks=0, enable_driver=False)
    keys = {k.name: key_provider("key-a") for k in desired.keys}
    nvme = {"0000:03:00.0": NvmeDevice(num_blocks=1 << 26)}
    sim_opts: dict[str, Any] = {"features": frozenset({"mlx5"}), "wait_for_rpc": True,
                                "nvme_devices": nvme}  # fmt: skip
    with SpdkSimulator(tmp_path / "m.sock", **sim_opts) as sim, SpdkClient(sim.socket_path) as c:
        apply(desired, c, keys.__getitem__)
        nothing = dataclasses.replace(desired, keys=(), bdevs=(), crypto=(), lvstores=(),
                                      lvols=(), subsystems=())  # fmt: skip
        apply(nothing, c, None, prune=True)  # the deletes of the crypto path too
        sent = [r for r in sim.requests if r["method"] in DECODERS]
    boot = boot_config(desired, keys.__getitem__, provisioned=True)
    sent += [e for sub in boot["subsystems"] for e in sub["config"] if e["method"] in DECODERS]
    assert PLAN_METHODS <= {r["method"] for r in sent}
    scan = next(r for r in sent if r["method"] == "mlx5_scan_accel_module")
    assert set(scan["params"]) == {"qp_size", "num_requests", "allowed_devs",
                                   "crypto_split_blocks", "enable_driver"}  # fmt: skip
    found = [p for r in sent for p in problems(r)]
    assert found == []


@pytest.mark.parametrize(
    ("request_", "complaint"),
    [
        ({"method": "mlx5_scan_accel_module", "params": {"qp_sz": 256}}, "unknown parameter"),
        ({"method": "mlx5_scan_accel_module", "params": {"crypto_split_blocks": 70000}},
         "does not decode as uint16"),
        ({"method": "framework_start_init", "params": {}}, "takes no params"),
        ({"method": "bdev_crypto_create", "params": {"name": "c"}}, "missing required"),
        ({"method": "accel_crypto_key_create", "params": {"name": "k", "cipher": "AES_XTS",
          "key": "00" * 32, "key2": "11" * 32, "tweak_mode": "INCR_512_FULL_LBA"}},
         "mlx5 refuses tweak mode"),
        ({"method": "accel_crypto_key_create", "params": {"name": "k", "cipher": "AES_XTS",
          "key": "00" * 24, "key2": "11" * 24}}, "24-byte key"),
    ],
)  # fmt: skip
def test_the_check_refuses_what_spdk_refuses(request_: dict[str, Any], complaint: str) -> None:
    assert any(complaint in p for p in problems(request_))


@pytest.mark.parametrize("bad", [70000, -1])
def test_crypto_split_blocks_outside_spdks_uint16_is_refused_before_it_reaches_spdk(
    bad: int,
) -> None:
    """SPDK decodes crypto_split_blocks as uint16: a larger value used to go into the plan and
    the boot config, where spdk_tgt refuses the whole mlx5_scan_accel_module call."""
    with pytest.raises(DesiredStateError, match=r"crypto_split_blocks.*\[0, 65535\]"):
        _mlx5_desired(crypto_split_blocks=bad)
    assert _mlx5_desired(crypto_split_blocks=0xFFFF).accel.crypto_split_blocks == 0xFFFF
