"""The simulated SPDK target's state and RPC semantics (the socket side is `sim.py`).

Recorded behaviour (shared/spdk/calls.json) is reproduced exactly; where the recordings are
silent the behaviour follows SPDK's C sources, and the few guesses are marked "(inferred)".
This module: dispatch and parameter decoding, framework, accel and nvmf; bdevs are in
`_sim_bdev.py`.
"""

from __future__ import annotations

import copy
import json
import re
import uuid as uuidlib
from collections.abc import Callable
from typing import Any

from spdk_sim._sim_bdev import BdevMixin
from spdk_sim._sim_common import (
    _MSG_RUNTIME_ONLY,
    _MSG_STARTUP_ONLY,
    _STARTUP_AND_RUNTIME,
    ERR_INTERNAL,
    ERR_INVALID_PARAMS,
    ERR_INVALID_STATE,
    ERR_METHOD_NOT_FOUND,
    NvmeDevice,
    RpcFail,
    decode_error,
    fits,
    is_hex,
)
from spdk_sim._sim_common import (
    _Bdev as Bdev,
)


class SimTarget(BdevMixin):
    def __init__(
        self,
        data: dict[str, Any],
        *,
        uuid_factory: Callable[[], str] | None,
        file_sizes: dict[str, int],
        nvme_devices: dict[str, NvmeDevice],
        features: frozenset[str],
        wait_for_rpc: bool,
    ) -> None:
        self.data = data
        self.new_uuid = uuid_factory or (lambda: str(uuidlib.uuid4()))
        self.file_sizes = file_sizes
        self.nvme_devices = nvme_devices
        self.features = features
        self.started = not wait_for_rpc
        self.accel_modules: dict[str, dict[str, Any]] = {}
        self.bdevs: dict[str, Bdev] = {}
        self.keys: dict[str, dict[str, Any]] = {}
        self.crypto_cfg: dict[str, dict[str, str]] = {}
        self.lvstores: dict[str, dict[str, Any]] = {}
        self.nvme_ctrlrs: dict[str, dict[str, Any]] = {}
        self.transports: list[dict[str, Any]] = []
        self.subsystems: dict[str, dict[str, Any]] = {}
        self.params = data["params"]

    # ------------------------------------------------------------------ dispatch

    def methods(self) -> list[str]:
        extra = []
        if "mlx5" in self.features:
            extra.append("mlx5_scan_accel_module")
        if "uring" in self.features:
            extra += ["bdev_uring_create", "bdev_uring_delete"]
        return [*extra, *self.data["rpc_methods"]]

    def startup_only(self) -> set[str]:
        only = set(self.data["rpc_methods"]) - set(self.data["rpc_methods_current"])
        return only | {"mlx5_scan_accel_module"}

    def dispatch(self, method: str, params: Any) -> Any:
        if method not in self.methods():
            raise RpcFail(ERR_METHOD_NOT_FOUND, "Method not found")
        if self.started and method in self.startup_only():
            raise RpcFail(ERR_INVALID_STATE, _MSG_STARTUP_ONLY)
        if (
            not self.started
            and method not in self.startup_only()
            and method not in _STARTUP_AND_RUNTIME
        ):
            raise RpcFail(ERR_INVALID_STATE, _MSG_RUNTIME_ONLY)
        handler = getattr(self, "rpc_" + method, None)
        if handler is None:
            raise RpcFail(ERR_INTERNAL, f"simulator: {method} is not simulated")
        spec = self.params.get(method)
        if spec is not None:
            self._decode(method, params, spec["params"])
        return handler(dict(params) if isinstance(params, dict) else {})

    def _decode(self, method: str, params: Any, spec: list[dict[str, Any]]) -> None:
        if params is None:
            params = {}
        if not spec and params:
            raise RpcFail(ERR_INVALID_PARAMS, f"{method} method requires no parameters")
        if not isinstance(params, dict):
            raise decode_error(method)
        if not fits(params, spec, self.data["objects"]):
            raise decode_error(method)

    # ------------------------------------------------------------------ framework

    def rpc_spdk_get_version(self, p: dict[str, Any]) -> Any:
        return copy.deepcopy(self.data["spdk_get_version"])

    def rpc_rpc_get_methods(self, p: dict[str, Any]) -> Any:
        if not p.get("current"):
            return self.methods()
        if self.started:
            return [m for m in self.methods() if m not in self.startup_only()]
        return [m for m in self.methods() if m in self.startup_only() | _STARTUP_AND_RUNTIME]

    def rpc_framework_start_init(self, p: dict[str, Any]) -> Any:
        self.started = True
        return True

    def rpc_framework_get_subsystems(self, p: dict[str, Any]) -> Any:
        return copy.deepcopy(self.data["framework_get_subsystems"])

    def rpc_framework_get_config(self, p: dict[str, Any]) -> Any:
        name = p["name"]
        builders = {"accel": self._accel_config, "bdev": self._bdev_config}
        if name in builders:
            return builders[name]()
        if name == "nvmf":
            return self._nvmf_config()
        static = self.data["framework_config_static"]
        if name not in static:
            raise RpcFail(ERR_INVALID_PARAMS, "Subsystem not found")  # (inferred)
        return copy.deepcopy(static[name])

    def rpc_bdev_wait_for_examine(self, p: dict[str, Any]) -> Any:
        return True

    # ------------------------------------------------------------------ accel

    def rpc_accel_get_module_info(self, p: dict[str, Any]) -> Any:
        info = copy.deepcopy(self.data["accel_get_module_info"])
        if "mlx5" in self.accel_modules:
            ops = ["copy", "crc32c", "copy_crc32c", "encrypt", "decrypt"]  # (inferred)
            info.insert(0, {"module": "mlx5", "supported ops": ops})
        return info

    def rpc_accel_get_opc_assignments(self, p: dict[str, Any]) -> Any:
        opc = copy.deepcopy(self.data["accel_get_opc_assignments"])
        if "mlx5" in self.accel_modules:
            for op in ("copy", "crc32c", "copy_crc32c", "encrypt", "decrypt"):
                opc[op] = "mlx5"
        return opc

    def rpc_mlx5_scan_accel_module(self, p: dict[str, Any]) -> Any:
        self.accel_modules["mlx5"] = p
        return True

    def rpc_accel_crypto_key_create(self, p: dict[str, Any]) -> Any:
        key, key2 = p["key"], p.get("key2")
        tweak = p.get("tweak_mode", "SIMPLE_LBA")
        rc = 0
        if p["name"] in self.keys:
            rc = -17
        elif key2 is None or key.lower() == key2.lower() or len(key) != len(key2):
            rc = -22
        elif not is_hex(key) or not is_hex(key2) or len(key) // 2 not in (16, 32):
            rc = -22
        elif "mlx5" in self.accel_modules and tweak != "SIMPLE_LBA":
            rc = -22
        if rc:
            raise RpcFail(ERR_INVALID_PARAMS, f"failed to create DEK, rc {rc}")
        self.keys[p["name"]] = {
            "name": p["name"],
            "cipher": p["cipher"],
            "key": key,
            "key2": key2,
            "tweak_mode": tweak,
        }
        return True

    def rpc_accel_crypto_key_destroy(self, p: dict[str, Any]) -> Any:
        if p["key_name"] not in self.keys:
            raise RpcFail(ERR_INVALID_PARAMS, "No key object found")  # (inferred)
        if any(c["key_name"] == p["key_name"] for c in self.crypto_cfg.values()):
            raise RpcFail(ERR_INTERNAL, "Failed to destroy key, rc -16")  # (inferred)
        del self.keys[p["key_name"]]
        return True

    def rpc_accel_crypto_keys_get(self, p: dict[str, Any]) -> Any:
        name = p.get("key_name")
        if name is not None and name not in self.keys:
            raise RpcFail(ERR_INVALID_PARAMS, "key was not found")  # (inferred)
        return [copy.deepcopy(k) for n, k in self.keys.items() if name in (None, n)]

    def _accel_config(self) -> list[dict[str, Any]]:
        out = copy.deepcopy(self.data["accel_options"])
        if "mlx5" in self.accel_modules:
            out.append({"method": "mlx5_scan_accel_module", "params": self.accel_modules["mlx5"]})
        for k in self.keys.values():
            out.append({"method": "accel_crypto_key_create", "params": copy.deepcopy(k)})
        return out

    # ------------------------------------------------------------------ nvmf

    def rpc_nvmf_create_transport(self, p: dict[str, Any]) -> Any:
        trtype = p["trtype"].upper()
        if trtype not in ("TCP", "RDMA"):
            raise RpcFail(ERR_INVALID_PARAMS, f"Transport type '{p['trtype']}' unavailable.")
        if any(t["trtype"] == trtype for t in self.transports):
            raise RpcFail(ERR_INVALID_PARAMS, f"Transport type '{trtype}' already exists")
        t = copy.deepcopy(self.data["tcp_transport"])
        t["trtype"] = trtype
        for k, v in p.items():
            if k in t and k != "trtype":
                t[k] = v
        if trtype == "RDMA":  # (inferred) RDMA shows its own knobs instead of TCP's
            for k in ("c2h_success", "sock_priority"):
                t.pop(k, None)
            t.update(
                max_srq_depth=p.get("max_srq_depth", 4096),
                no_srq=p.get("no_srq", False),
                acceptor_backlog=p.get("acceptor_backlog", 100),
            )
        self.transports.append(t)
        return True

    def rpc_nvmf_get_transports(self, p: dict[str, Any]) -> Any:
        want = p.get("trtype")
        return [copy.deepcopy(t) for t in self.transports if want in (None, t["trtype"])]

    def _ss(self, nqn: str) -> dict[str, Any]:
        if nqn not in self.subsystems:
            raise RpcFail(
                ERR_INVALID_PARAMS, f"Unable to find subsystem with NQN {nqn}"
            )  # (inferred)
        return self.subsystems[nqn]

    def rpc_nvmf_create_subsystem(self, p: dict[str, Any]) -> Any:
        nqn = p["nqn"]
        if nqn in self.subsystems or not nqn.startswith("nqn.") or len(nqn.encode()) > 223:
            raise RpcFail(ERR_INTERNAL, f"Unable to create subsystem {nqn}")
        self.subsystems[nqn] = {
            "nqn": nqn,
            "subtype": "NVMe",
            "listen_addresses": [],
            "allow_any_host": p.get("allow_any_host", False),
            "hosts": [],
            "serial_number": p.get("serial_number", "00000000000000000000"),
            "model_number": p.get("model_number", "SPDK bdev Controller"),
            "max_namespaces": p.get("max_namespaces", 32),
            "passthrough": p.get("passthrough", False),
            "min_cntlid": p.get("min_cntlid", 1),
            "max_cntlid": p.get("max_cntlid", 65519),
            "dmrsl": p.get("dmrsl", 2097152),
            "wzsl": p.get("wzsl", 12),
            "namespaces": [],
            "_ana_reporting": p.get("ana_reporting", False),
        }
        return True

    def rpc_nvmf_delete_subsystem(self, p: dict[str, Any]) -> Any:
        ss = self._ss(p["nqn"])
        for ns in ss["namespaces"]:
            self._release_ns(ns)
        del self.subsystems[p["nqn"]]
        return True

    def _release_ns(self, ns: dict[str, Any]) -> None:
        b = self._find(ns["bdev_name"])
        if b is not None:
            b.claim_type = b.claimed_by = None

    def rpc_nvmf_get_subsystems(self, p: dict[str, Any]) -> Any:
        disc = {
            "nqn": "nqn.2014-08.org.nvmexpress.discovery",
            "subtype": "Discovery",
            "listen_addresses": [],
            "allow_any_host": True,
            "hosts": [],
        }
        out = [disc] + [_public(s) for s in self.subsystems.values()]
        if "nqn" in p:
            out = [s for s in out if s["nqn"] == p["nqn"]]
            if not out:
                raise RpcFail(ERR_INVALID_PARAMS, "Invalid parameters")  # (inferred)
        return out

    def rpc_nvmf_subsystem_add_ns(self, p: dict[str, Any]) -> Any:
        ss = self._ss(p["nqn"])
        want = p["namespace"]
        b = self._find(want["bdev_name"])
        used = {n["nsid"] for n in ss["namespaces"]}
        nsid = want.get("nsid") or next(i for i in range(1, len(used) + 2) if i not in used)
        if b is None or b.claim_type is not None or nsid in used or nsid > ss["max_namespaces"]:
            raise RpcFail(ERR_INVALID_PARAMS, "Invalid parameters")  # recorded
        b.claim_type, b.claimed_by = "exclusive_write", p["nqn"]
        uid = want.get("uuid", b.uuid)
        ns = {
            "nsid": nsid,
            "bdev_name": b.name,
            "name": b.name,
            "nguid": want.get("nguid", uid.replace("-", "").upper()),
            "uuid": uid,
        }
        ss["namespaces"] = sorted([*ss["namespaces"], ns], key=lambda n: n["nsid"])
        return nsid

    def rpc_nvmf_subsystem_remove_ns(self, p: dict[str, Any]) -> Any:
        ss = self._ss(p["nqn"])
        match = [n for n in ss["namespaces"] if n["nsid"] == p["nsid"]]
        if not match:
            raise RpcFail(ERR_INVALID_PARAMS, "Invalid parameters")
        self._release_ns(match[0])
        ss["namespaces"].remove(match[0])
        return True

    def rpc_nvmf_subsystem_add_listener(self, p: dict[str, Any]) -> Any:
        ss = self._ss(p["nqn"])
        addr = _listen_address(p["listen_address"])
        have_transport = any(t["trtype"] == addr["trtype"] for t in self.transports)
        if not have_transport or addr in ss["listen_addresses"]:
            raise RpcFail(ERR_INVALID_PARAMS, "Invalid parameters")
        ss["listen_addresses"].append(addr)
        ss.setdefault("_secure", {})[json.dumps(addr)] = p.get("secure_channel", False)
        return True

    def rpc_nvmf_subsystem_remove_listener(self, p: dict[str, Any]) -> Any:
        ss = self._ss(p["nqn"])
        addr = _listen_address(p["listen_address"])
        if addr not in ss["listen_addresses"]:
            raise RpcFail(ERR_INVALID_PARAMS, "Invalid parameters")
        ss["listen_addresses"].remove(addr)
        return True

    def rpc_nvmf_subsystem_add_host(self, p: dict[str, Any]) -> Any:
        ss = self._ss(p["nqn"])
        # recorded from v26.05 (issue 9): an invalid host NQN ("uuid is not the correct
        # length") and a host already listed both answer -32603 "Internal error"
        if not _host_nqn_valid(p["host"]) or any(h["nqn"] == p["host"] for h in ss["hosts"]):
            raise RpcFail(ERR_INTERNAL, "Internal error")
        ss["hosts"].append({"nqn": p["host"]})
        return True

    def rpc_nvmf_subsystem_remove_host(self, p: dict[str, Any]) -> Any:
        ss = self._ss(p["nqn"])
        if not any(h["nqn"] == p["host"] for h in ss["hosts"]):
            raise RpcFail(ERR_INTERNAL, "Internal error")  # (inferred)
        ss["hosts"] = [h for h in ss["hosts"] if h["nqn"] != p["host"]]
        return True

    def rpc_nvmf_subsystem_allow_any_host(self, p: dict[str, Any]) -> Any:
        self._ss(p["nqn"])["allow_any_host"] = p["allow_any_host"]
        return True

    def _nvmf_config(self) -> list[dict[str, Any]]:
        out = copy.deepcopy(self.data["nvmf_options"])
        out += [
            {"method": "nvmf_create_transport", "params": copy.deepcopy(t)} for t in self.transports
        ]
        for s in self.subsystems.values():
            params = {
                "nqn": s["nqn"],
                "allow_any_host": s["allow_any_host"],
                "serial_number": s["serial_number"],
                "model_number": s["model_number"],
                "max_namespaces": s["max_namespaces"],
                "min_cntlid": s["min_cntlid"],
                "max_cntlid": s["max_cntlid"],
                "ana_reporting": s["_ana_reporting"],
                "dmrsl": s["dmrsl"],
                "wzsl": s["wzsl"],
                "passthrough": s["passthrough"],
                "enable_nssr": False,
            }
            out.append({"method": "nvmf_create_subsystem", "params": params})
            for h in s["hosts"]:
                out.append(
                    {
                        "method": "nvmf_subsystem_add_host",
                        "params": {"nqn": s["nqn"], "host": h["nqn"]},
                    }
                )
            for n in s["namespaces"]:
                ns = {k: n[k] for k in ("nsid", "bdev_name", "nguid", "uuid")}
                ns["no_auto_visible"] = False
                out.append(
                    {
                        "method": "nvmf_subsystem_add_ns",
                        "params": {"nqn": s["nqn"], "namespace": ns},
                    }
                )
            for a in s["listen_addresses"]:
                secure = s.get("_secure", {}).get(json.dumps(a), False)
                out.append(
                    {
                        "method": "nvmf_subsystem_add_listener",
                        "params": {
                            "nqn": s["nqn"],
                            "listen_address": dict(a),
                            "secure_channel": secure,
                        },
                    }
                )
        return out


def _public(s: dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy({k: v for k, v in s.items() if not k.startswith("_")})


def _listen_address(a: dict[str, Any]) -> dict[str, str]:
    out = {"trtype": a["trtype"].upper() if a["trtype"].lower() != "pcie" else "PCIe"}
    out["adrfam"] = {"ipv4": "IPv4", "ipv6": "IPv6"}.get(a.get("adrfam", "ipv4").lower(), "IPv4")
    out["traddr"] = a["traddr"]
    out["trsvcid"] = a.get("trsvcid", "")
    return out


_UUID_NQN_PREFIX = "nqn.2014-08.org.nvmexpress:uuid:"


def _host_nqn_valid(nqn: str) -> bool:
    """SPDK's nvmf_nqn_is_valid, in the parts a host NQN meets: at most 223 bytes, `nqn.`
    followed by a yyyy-mm. date, and a UUID NQN's UUID exactly 36 characters."""
    if len(nqn.encode()) > 223 or not nqn.startswith("nqn."):
        return False
    if nqn.startswith(_UUID_NQN_PREFIX):
        return len(nqn) - len(_UUID_NQN_PREFIX) == 36
    return bool(re.match(r"nqn\.\d{4}-\d{2}\.", nqn))
