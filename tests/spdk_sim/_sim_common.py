"""Shared pieces of the simulated SPDK target: errors, records, parameter decoding.

Recorded behaviour (shared/spdk/calls.json) is reproduced exactly; where the recordings are
silent the behaviour follows SPDK's C sources, and the few guesses are marked "(inferred)".
"""

from __future__ import annotations

import json
import re
import uuid as uuidlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SIM_DATA_FILE = "sim_data_v26_05.json"
MIB = 1024 * 1024
MD_PAGE_BYTES = 4096
CLUSTER_MASK_BITS_PER_PAGE = (MD_PAGE_BYTES - 5) * 8  # blobstore mask page: 5-byte header
CRYPTO_NAMESPACE_UUID = uuidlib.UUID("078e3cf7-f4b4-4545-b2c3-d40045a64ae2")
ERR_PARSE = -32700
ERR_METHOD_NOT_FOUND = -32601
ERR_INVALID_PARAMS = -32602
ERR_INTERNAL = -32603
ERR_INVALID_STATE = -32604
_STARTUP_AND_RUNTIME = frozenset({"rpc_get_methods", "spdk_get_version", "framework_wait_init"})
_MSG_STARTUP_ONLY = (
    "Method may only be called before framework is initialized. Use --wait-for-rpc command "
    "line parameter and then issue this RPC before the framework_start_init RPC."
)
_MSG_RUNTIME_ONLY = (
    "Method may only be called after framework is initialized using framework_start_init RPC."
)
_UUID_RE = re.compile(
    r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"
)
_INT_RANGES = {
    "uint8": (0, 2**8 - 1),
    "uint16": (0, 2**16 - 1),
    "uint32": (0, 2**32 - 1),
    "uint64": (0, 2**64 - 1),
    "int32": (-(2**31), 2**31 - 1),
}
# errno values SPDK answers with (negative errno as the code, strerror as the message).
_ERRNO = {
    1: "Operation not permitted",
    2: "No such file or directory",
    16: "Device or resource busy",
    17: "File exists",
    19: "No such device",
    22: "Invalid argument",
    28: "No space left on device",
    114: "Operation already in progress",
}


class RpcFail(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{code} {message}")
        self.code = code
        self.message = message


def errno_fail(err: int) -> RpcFail:
    return RpcFail(-err, _ERRNO[err])


def load_sim_data() -> dict[str, Any]:
    text = (Path(__file__).parent / SIM_DATA_FILE).read_text()
    data: dict[str, Any] = json.loads(text)
    return data


def decode_error(method: str) -> RpcFail:
    """What SPDK answers when spdk_json_decode_object fails for `method`."""
    if method == "accel_crypto_key_create":
        return RpcFail(ERR_PARSE, "spdk_json_decode_object failed")  # recorded
    if method.startswith(("nvmf_", "bdev_crypto_")):
        return RpcFail(ERR_INVALID_PARAMS, "Invalid parameters")  # recorded for nvmf_*
    return RpcFail(ERR_INTERNAL, "spdk_json_decode_object failed")  # recorded for bdev_*


@dataclass(kw_only=True)
class NvmeDevice:
    """A drive the simulator pretends is attached (PCIe BDF or NVMe-oF subsystem)."""

    num_blocks: int
    block_size: int = 4096
    namespaces: int = 1
    model_number: str = "SPDK simulated NVMe"
    serial_number: str = "SIM00000000000001"


@dataclass(kw_only=True)
class _Bdev:
    name: str
    product: str
    kind: str
    block_size: int
    num_blocks: int
    uuid: str
    aliases: list[str]
    driver_specific: dict[str, Any]
    create_params: dict[str, Any] = field(default_factory=dict)
    claim_type: str | None = None
    claimed_by: str | None = None
    accel_domain: bool = False


def make_bdev(
    name: str,
    product: str,
    kind: str,
    block_size: int,
    num_blocks: int,
    uid: str,
    ds: dict[str, Any],
    params: dict[str, Any] | None = None,
) -> _Bdev:
    return _Bdev(
        name=name,
        product=product,
        kind=kind,
        block_size=block_size,
        num_blocks=num_blocks,
        uuid=uid,
        aliases=[uid],
        driver_specific=ds,
        create_params=params or {},
    )


def insert_after(d: dict[str, Any], after: str, key: str, value: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if k != key:
            out[k] = v
        if k == after:
            out[key] = value
    return out


def is_hex(s: str) -> bool:
    return all(c in "0123456789abcdefABCDEF" for c in s)


def fits(params: dict[str, Any], spec: list[dict[str, Any]], objects: dict[str, Any]) -> bool:
    """spdk_json_decode_object: no unknown names, right JSON types, required ones present."""
    by_name = {p["name"]: p for p in spec}
    if any(k not in by_name for k in params):
        return False
    if any(p["required"] and p["name"] not in params for p in spec):
        return False
    for k, v in params.items():
        p = by_name[k]
        if not _type_ok(v, p):
            return False
        if p["schema_type"] == "object" and k in objects and not fits(v, objects[k], objects):
            return False
    return True


def _type_ok(v: Any, p: dict[str, Any]) -> bool:
    t = p["schema_type"]
    if t in _INT_RANGES:
        lo, hi = _INT_RANGES[t]
        return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi
    if t == "boolean":
        return isinstance(v, bool)
    if t == "string":
        return isinstance(v, str)
    if t == "uuid":
        return isinstance(v, str) and bool(_UUID_RE.match(v))
    if t == "enum":
        return isinstance(v, str) and v in p.get("enum_values", ())
    if t == "object":
        return isinstance(v, dict)
    if t == "array":
        return isinstance(v, list)
    raise AssertionError(f"schema type {t!r} unknown to the simulator")
