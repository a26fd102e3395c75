"""Plan against a saved SPDK configuration instead of a running target (`spdk plan --saved`).

A `save_config` reply (or the `spdk_tgt --json FILE` a DPU boots with) lists, per subsystem, the
RPCs that rebuild the target's state. This module turns it into the `LiveState` the planner
compares, in the shapes a running v26.05 target answers (tests/data/spdk holds both forms of
one recorded target, and the tests check the two give the same plan).

What a saved config cannot say: lvstores and lvols live in the lvstore metadata on the device,
and SPDK recreates them by examining it, so `save_config` has no call for them; nor does it
know how many namespaces an attached NVMe-oF controller has. Offline, those the desired state
names are assumed present as desired when what they sit on is in the saved config, and each
assumption is listed in the plan's notes. The recorded release's `rpc_get_methods` stands in
for the target's (plus `mlx5_scan_accel_module` when the saved config loads it: a DOCA build).
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spdk_plugins.desired import SpdkDesired
from spdk_plugins.state import DISCOVERY_NQN, LiveState
from spdk_plugins.versions import SUPPORTED_RELEASES, recorded_release

__all__ = ["SAVED_CONFIG_BYTES_MAX", "SavedConfigError", "SavedState", "load_saved", "saved_state"]

# save_config of a DPU with thousands of subsystems is a few MB; anything far larger is not one
SAVED_CONFIG_BYTES_MAX = 64 * 1024 * 1024
MIB = 1024 * 1024
_UUID_NS = uuid.UUID("6ba7b811-9dad-11d1-80b4-00c04fd430c8")  # RFC 4122's URL namespace


class SavedConfigError(ValueError):
    """The file is not a saved SPDK configuration."""


@dataclass(frozen=True, slots=True)
class SavedState:
    live: LiveState
    fingerprints: dict[str, tuple[str, str]]  # key name -> (key, key2); never log it
    notes: tuple[str, ...] = field(default=())


def load_saved(path: str | Path) -> dict[str, Any]:
    """Read a save_config document (`{"subsystems": [...]}`, or the JSON-RPC reply holding one)
    and check it (index_saved)."""
    p = Path(path)
    size = p.stat().st_size
    if size > SAVED_CONFIG_BYTES_MAX:
        raise SavedConfigError(f"{p}: {size} bytes, more than {SAVED_CONFIG_BYTES_MAX}")
    try:
        doc = json.loads(p.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SavedConfigError(f"{p}: not JSON ({e})") from None
    if isinstance(doc, dict) and isinstance(doc.get("result"), dict):
        doc = doc["result"]  # a raw JSON-RPC reply to save_config
    try:
        index_saved(doc)
    except SavedConfigError as e:
        raise SavedConfigError(f"{p}: {e}") from None
    return dict(doc)


# What this module reads of each call's params, and the JSON type SPDK writes it as: a saved
# config from elsewhere is input, checked where it enters (a list where a name belongs is an
# error naming the call and the field, not a crash in the planner).
_STRINGS = frozenset({
    "name", "nqn", "trtype", "adrfam", "traddr", "trsvcid", "subnqn", "filename",
    "base_bdev_name", "key_name", "host", "cipher", "tweak_mode", "uuid", "nguid", "bdev_name",
    "serial_number", "model_number",
})  # fmt: skip
_INTEGERS = frozenset({"block_size", "num_blocks", "nsid"})
_OBJECTS = frozenset({"namespace", "listen_address"})
_NOT_SAVED = (
    'not a saved SPDK configuration (want {"subsystems": [{"subsystem", "config": [...]}]}, '
    "what `rpc.py save_config` writes)"
)
Calls = dict[str, list[tuple[str, dict[str, Any]]]]  # subsystem -> [(method, params)] in order


def index_saved(doc: Any) -> Calls:
    """The calls of a saved configuration by subsystem, each checked; SavedConfigError naming
    the call and field that is not what SPDK writes."""
    subsystems = doc.get("subsystems") if isinstance(doc, dict) else None
    if not isinstance(subsystems, list):
        raise SavedConfigError(_NOT_SAVED)
    out: Calls = {}
    for s in subsystems:
        config = s.get("config") if isinstance(s, dict) else None
        if not isinstance(s, dict) or not isinstance(s.get("subsystem"), str):
            raise SavedConfigError(_NOT_SAVED)
        if not isinstance(config or [], list):
            raise SavedConfigError(f"subsystem {s['subsystem']}: config is not a list")
        calls = out.setdefault(s["subsystem"], [])
        for c in config or []:
            if not isinstance(c, dict) or not isinstance(c.get("method"), str):
                raise SavedConfigError(f"subsystem {s['subsystem']}: an entry without a method")
            params = c.get("params") or {}
            _check_params(f"{c['method']}: params", params)
            calls.append((c["method"], params))
    return out


def _check_params(where: str, params: Any) -> None:
    if not isinstance(params, dict):
        raise SavedConfigError(f"{where} is not an object")
    for key, value in params.items():
        if value is None:
            continue
        if key in _STRINGS and not isinstance(value, str):
            raise SavedConfigError(f"{where}.{key} is not a string ({type(value).__name__})")
        if key in _INTEGERS and (not isinstance(value, int) or isinstance(value, bool)):
            raise SavedConfigError(f"{where}.{key} is not an integer ({type(value).__name__})")
        if key in _OBJECTS:
            _check_params(f"{where}.{key}", value)


def _uuid_for(name: str) -> str:
    return str(uuid.uuid5(_UUID_NS, name))


def _bdev(name: str, product: str, uid: str | None, **fields: Any) -> dict[str, Any]:
    uid = uid or _uuid_for(name)
    aliases = [uid] if name != uid else []
    return {"name": name, "aliases": aliases, "product_name": product, "uuid": uid, **fields}


class _Builder:
    def __init__(self, calls: Calls, desired: SpdkDesired) -> None:
        self.calls, self.desired = calls, desired
        self.bdevs: dict[str, dict[str, Any]] = {}
        self.notes: list[str] = []

    def resolve(self, name: str) -> dict[str, Any] | None:
        if name in self.bdevs:
            return self.bdevs[name]
        for b in self.bdevs.values():
            if name in b["aliases"]:
                return b
        return None

    def base_bdevs(self) -> None:
        nvme_names = {n.name: n for n in self.desired.bdevs if hasattr(n, "num_namespaces")}
        for method, p in self.calls.get("bdev", []):
            name = p.get("name")
            if method == "bdev_malloc_create" and name:
                self.bdevs[name] = _bdev(
                    name,
                    "Malloc disk",
                    p.get("uuid"),
                    block_size=p.get("block_size"),
                    num_blocks=p.get("num_blocks"),
                )
            elif method in ("bdev_aio_create", "bdev_uring_create") and name:
                product = "AIO disk" if method == "bdev_aio_create" else "URING bdev"
                kind = "aio" if method == "bdev_aio_create" else "uring"
                self.bdevs[name] = _bdev(
                    name,
                    product,
                    p.get("uuid"),
                    block_size=p.get("block_size"),
                    driver_specific={kind: {"filename": p.get("filename")}},
                )
            elif method == "bdev_nvme_attach_controller" and name:
                want = nvme_names.get(name)
                count = getattr(want, "num_namespaces", 1)
                self.notes.append(
                    f"controller {name}: {count} namespace(s) assumed (the saved config does "
                    "not record what the remote controller exports)"
                )
                trid = {k: p.get(k) for k in ("trtype", "traddr", "trsvcid", "subnqn", "adrfam")}
                for i in range(1, count + 1):
                    self.bdevs[f"{name}n{i}"] = _bdev(
                        f"{name}n{i}", "NVMe disk", None, driver_specific={"nvme": [{"trid": trid}]}
                    )

    def stacked(self) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
        """Crypto vbdevs, lvstores and lvols, to a fixpoint: each layer may sit on the other."""
        crypto = {p["name"]: p for m, p in self.calls.get("bdev", []) if m == "bdev_crypto_create"}
        lvstores: dict[str, dict[str, Any]] = {}
        hinted = self._lvol_uuids(crypto)
        changed = True
        while changed:
            changed = False
            for name, p in crypto.items():
                base = self.resolve(str(p.get("base_bdev_name")))
                if name not in self.bdevs and base is not None:
                    self.bdevs[name] = _bdev(
                        name, "crypto", None, driver_specific={"crypto": dict(p)}
                    )
                    changed = True
            for s in self.desired.lvstores:
                base = self.resolve(s.bdev_name)
                if s.lvs_name not in lvstores and base is not None:
                    lvstores[s.lvs_name] = {
                        "name": s.lvs_name,
                        "uuid": _uuid_for(f"lvs:{s.lvs_name}"),
                        "base_bdev": base["name"],
                        "block_size": base.get("block_size") or 512,
                        "cluster_size": s.cluster_sz or 4 * MIB,
                    }
                    self.notes.append(
                        f"lvstore {s.lvs_name} on {s.bdev_name}: assumed present as desired "
                        "(lvstores are on the device, not in a saved config)"
                    )
                    changed = True
            for v in self.desired.lvols:
                lvs = lvstores.get(v.lvs_name)
                if lvs is None or self.resolve(v.alias) is not None:
                    continue
                cluster = lvs["cluster_size"]
                block = lvs["block_size"]
                size = math.ceil(v.size_in_mib * MIB / cluster) * cluster
                uid = hinted.get(v.alias) or _uuid_for(v.alias)
                self.bdevs[uid] = {
                    "name": uid,
                    "aliases": [v.alias],
                    "product_name": "Logical Volume",
                    "uuid": uid,
                    "block_size": block,
                    "num_blocks": size // block,
                    "driver_specific": {
                        "lvol": {
                            "lvol_store_uuid": lvs["uuid"],
                            "base_bdev": lvs["base_bdev"],
                            "thin_provision": v.thin_provision,
                        }
                    },
                }
                self.notes.append(f"lvol {v.alias}: assumed present as desired")
                changed = True
        return crypto, lvstores

    def _lvol_uuids(self, crypto: dict[str, dict[str, Any]]) -> dict[str, str]:
        """Which UUID the saved config uses for a desired lvol: SPDK names an lvol that a
        namespace or a crypto vbdev sits on by its UUID, which only the device knows."""
        lvols = {v.alias for v in self.desired.lvols}
        hints: dict[str, str] = {}
        saved_ns = {
            (p.get("nqn"), (p.get("namespace") or {}).get("nsid")): (p.get("namespace") or {})
            for m, p in self.calls.get("nvmf", [])
            if m == "nvmf_subsystem_add_ns"
        }
        for sub in self.desired.subsystems:
            for ns in sub.namespaces:
                got = saved_ns.get((sub.nqn, ns.nsid))
                if ns.bdev_name in lvols and got and got.get("bdev_name"):
                    hints.setdefault(ns.bdev_name, str(got["bdev_name"]))
        for c in self.desired.crypto:
            got = crypto.get(c.name)
            if c.base_bdev_name in lvols and got and got.get("base_bdev_name"):
                hints.setdefault(c.base_bdev_name, str(got["base_bdev_name"]))
        return hints


def _methods(calls: Calls) -> frozenset[str]:
    methods = set(recorded_release(SUPPORTED_RELEASES[max(SUPPORTED_RELEASES)])["rpc_get_methods"])
    if any(m == "mlx5_scan_accel_module" for m, _ in calls.get("accel", [])):
        methods.add("mlx5_scan_accel_module")
    return frozenset(methods)


def _subsystems(calls: Calls) -> dict[str, dict[str, Any]]:
    subs: dict[str, dict[str, Any]] = {}
    for method, p in calls.get("nvmf", []):
        nqn = p.get("nqn")
        if method == "nvmf_create_subsystem" and nqn and nqn != DISCOVERY_NQN:
            subs[nqn] = {
                "nqn": nqn,
                "subtype": "NVMe",
                "allow_any_host": bool(p.get("allow_any_host", False)),
                "serial_number": p.get("serial_number"),
                "model_number": p.get("model_number"),
                "namespaces": [],
                "listen_addresses": [],
                "hosts": [],
            }
        elif nqn in subs and method == "nvmf_subsystem_add_ns":
            subs[nqn]["namespaces"].append(dict(p.get("namespace") or {}))
        elif nqn in subs and method == "nvmf_subsystem_add_listener":
            subs[nqn]["listen_addresses"].append(dict(p.get("listen_address") or {}))
        elif nqn in subs and method == "nvmf_subsystem_add_host" and p.get("host"):
            subs[nqn]["hosts"].append({"nqn": p["host"]})
    return subs


def saved_state(doc: dict[str, Any], desired: SpdkDesired) -> SavedState:
    """The LiveState a target booted from `doc` would answer, with the assumptions made."""
    calls = index_saved(doc)
    b = _Builder(calls, desired)
    b.base_bdevs()
    crypto, lvstores = b.stacked()
    accel = calls.get("accel", [])
    keys = {p["name"]: p for m, p in accel if m == "accel_crypto_key_create" and p.get("name")}
    modules = ["software"] + (
        ["mlx5"] if any(m == "mlx5_scan_accel_module" for m, _ in accel) else []
    )
    live = LiveState(
        started=True,
        methods=_methods(calls),
        accel_modules=tuple(modules),
        bdevs=b.bdevs,
        keys={
            n: {"name": n, "cipher": k.get("cipher"), "tweak_mode": k.get("tweak_mode")}
            for n, k in keys.items()
        },
        lvstores=lvstores,
        transports={
            str(p["trtype"]).upper(): dict(p)
            for m, p in calls.get("nvmf", [])
            if m == "nvmf_create_transport" and p.get("trtype")
        },
        subsystems=_subsystems(calls),
        crypto_configs=crypto,
    )
    fingerprints = {n: (str(k.get("key", "")), str(k.get("key2", ""))) for n, k in keys.items()}
    return SavedState(live=live, fingerprints=fingerprints, notes=tuple(b.notes))
