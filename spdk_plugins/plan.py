"""plan(desired, client): the ordered RPCs that take the live SPDK state to the desired one.

Deletions come first, in reverse dependency order (hosts, listeners, namespaces, subsystems,
the bdev stack top down, keys), then creations in dependency order (accel module, keys, the
bdev stack bottom up, transports, subsystems, namespaces, listeners, hosts). The bdev stack
is ordered by what sits on what, not by kind: the recorded layout is base -> crypto ->
lvstore -> lvol, a per-tenant-key layout is base -> lvstore -> lvol -> crypto.
Differences SPDK cannot change in place (a malloc bdev's size, a crypto vbdev's key, a
transport's tuning) are conflicts: reported, never "fixed" by destroying data.
Namespaces are compared by bdev UUID, since nvmf_get_subsystems names an lvol by its UUID.
Plans never hold key material: a key step carries `<redacted>` and the key's name, and apply
asks the key store for the material just before sending it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from spdk_plugins.calls import (
    Call,
    base_bdev_call,
    call,
    crypto_call,
    host_call,
    key_create_call,
    listener_call,
    lvol_call,
    lvstore_call,
    mlx5_scan_call,
    ns_call,
    subsystem_call,
    transport_call,
)
from spdk_plugins.desired import (
    AioBdev,
    KeyProvider,
    MallocBdev,
    NvmeBdev,
    SpdkDesired,
    Subsystem,
    UringBdev,
    check_key_material,
)
from spdk_plugins.rpc import REDACTED, SpdkClient, redact_params
from spdk_plugins.saved import saved_state
from spdk_plugins.state import LiveState, read_live

__all__ = [
    "PHASES",
    "Plan",
    "Step",
    "desired_depths",
    "live_depths",
    "plan",
    "plan_from_live",
    "plan_saved",
]

PHASES = (
    "accel",
    "key",
    "base",
    "crypto",
    "lvstore",
    "lvol",
    "transport",
    "subsystem",
    "ns",
    "listener",
    "host",
)
MIB = 1024 * 1024
_NVME_BDEV_RE = re.compile(r"^(?P<ctrlr>.+)n\d+$")
_BASE_DELETE = {
    "Malloc disk": "bdev_malloc_delete",
    "AIO disk": "bdev_aio_delete",
    "URING bdev": "bdev_uring_delete",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Step:
    method: str
    params: dict[str, Any]
    why: str
    secret_ref: str | None = None  # key name whose material apply fetches from the key store

    def to_json(self) -> dict[str, Any]:
        return {"method": self.method, "params": redact_params(self.params), "why": self.why}


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    steps: tuple[Step, ...] = ()
    conflicts: tuple[str, ...] = ()  # differences the driver will not reconcile
    unmanaged: tuple[str, ...] = ()  # live objects outside the desired state, kept

    @property
    def in_sync(self) -> bool:
        return not self.steps and not self.conflicts

    def to_json(self) -> dict[str, Any]:
        return {
            "steps": [s.to_json() for s in self.steps],
            "conflicts": list(self.conflicts),
            "unmanaged": list(self.unmanaged),
        }


_STACK = ("base", "crypto", "lvstore", "lvol")


def _stack_key(step: Step) -> str:
    """The name a bdev-stack step creates or deletes, as the depth tables key it."""
    p = step.params
    if step.method == "bdev_lvol_create":
        return f"{p['lvs_name']}/{p['lvol_name']}"
    if step.method in ("bdev_lvol_create_lvstore", "bdev_lvol_delete_lvstore"):
        return "lvs:" + str(p["lvs_name"])
    return str(p.get("name", ""))


def _depths(parent: dict[str, str]) -> dict[str, int]:
    """How many layers each object sits on; parent maps object -> what it sits on."""
    out: dict[str, int] = {}
    for name in parent:
        depth, cur = 0, name
        while cur in parent and depth <= len(parent):
            cur, depth = parent[cur], depth + 1
        assert depth <= len(parent), f"bdev stack cycle through {name}"
        out[name] = depth
    return out


def desired_depths(d: SpdkDesired) -> dict[str, int]:
    parent = {c.name: c.base_bdev_name for c in d.crypto}
    parent.update({"lvs:" + s.lvs_name: s.bdev_name for s in d.lvstores})
    parent.update({v.alias: "lvs:" + v.lvs_name for v in d.lvols})
    return _depths(parent)


def live_depths(live: LiveState) -> dict[str, int]:
    parent: dict[str, str] = {}
    by_uuid = {s["uuid"]: s["name"] for s in live.lvstores.values()}
    for s in live.lvstores.values():
        parent["lvs:" + s["name"]] = s["base_bdev"]
    for b in live.bdevs.values():
        ds = b.get("driver_specific", {})
        if "crypto" in ds:
            parent[b["name"]] = ds["crypto"]["base_bdev_name"]
        if "lvol" in ds and ds["lvol"]["lvol_store_uuid"] in by_uuid:
            for n in (b["name"], *b.get("aliases", ())):
                parent[n] = "lvs:" + by_uuid[ds["lvol"]["lvol_store_uuid"]]
    return _depths(parent)


class _Builder:
    def __init__(self, create_depth: dict[str, int], delete_depth: dict[str, int]) -> None:
        self.create_depth = create_depth
        self.delete_depth = delete_depth
        self.create: dict[str, list[Step]] = {p: [] for p in PHASES}
        self.delete: dict[str, list[Step]] = {p: [] for p in PHASES}
        self.conflicts: list[str] = []
        self.unmanaged: list[str] = []

    def add(self, phase: str, method: str, why: str, **params: Any) -> None:
        self.add_call(phase, why, call(method, **params))

    def add_call(self, phase: str, why: str, c: Call, secret_ref: str | None = None) -> None:
        """Create an object with the call `spdk_plugins.calls` builds for it."""
        method, params = c
        self.create[phase].append(
            Step(method=method, params=params, why=why, secret_ref=secret_ref)
        )

    def remove(self, phase: str, method: str, why: str, **params: Any) -> None:
        method, params = call(method, **params)
        self.delete[phase].append(Step(method=method, params=params, why=why))

    def build(self) -> Plan:
        """Deletions (reverse order) then creations; the bdev stack ordered by real depth."""

        def create_key(item: tuple[str, Step]) -> tuple[int, int]:
            return self.create_depth.get(_stack_key(item[1]), 0), _STACK.index(item[0])

        def delete_key(item: tuple[str, Step]) -> tuple[int, int]:
            return -self.delete_depth.get(_stack_key(item[1]), 0), -_STACK.index(item[0])

        def stack(table: dict[str, list[Step]]) -> list[tuple[str, Step]]:
            return [(p, s) for p in _STACK for s in table[p]]

        steps: list[Step] = []
        for p in reversed(PHASES):
            if p == "base":
                steps += [s for _, s in sorted(stack(self.delete), key=delete_key)]
            elif p not in _STACK:
                steps += self.delete[p]
        for p in PHASES:
            if p == "base":
                steps += [s for _, s in sorted(stack(self.create), key=create_key)]
            elif p not in _STACK:
                steps += self.create[p]
        return Plan(
            steps=tuple(steps), conflicts=tuple(self.conflicts), unmanaged=tuple(self.unmanaged)
        )


def plan(
    desired: SpdkDesired,
    client: SpdkClient,
    key_provider: KeyProvider | None = None,
    *,
    prune: bool | None = None,
) -> Plan:
    """Read the live state and compare; with key_provider, key material is checked too."""
    if key_provider is not None:
        check_key_material(desired, key_provider)
    live = read_live(client)
    mismatched: set[str] = set()
    if key_provider is not None and live.keys:
        mismatched = _mismatched(desired, client.accel_crypto_keys_fingerprint(), key_provider)
    return plan_from_live(desired, live, mismatched_keys=mismatched, prune=prune)


def plan_saved(
    desired: SpdkDesired,
    doc: dict[str, Any],
    key_provider: KeyProvider | None = None,
    *,
    prune: bool | None = None,
) -> tuple[Plan, tuple[str, ...]]:
    """plan() against a saved configuration (spdk_plugins.saved), with its assumptions."""
    if key_provider is not None:
        check_key_material(desired, key_provider)
    saved = saved_state(doc, desired)
    mismatched: set[str] = set()
    if key_provider is not None:
        mismatched = _mismatched(desired, saved.fingerprints, key_provider)
    result = plan_from_live(desired, saved.live, mismatched_keys=mismatched, prune=prune)
    return result, saved.notes


def _mismatched(
    desired: SpdkDesired, fingerprints: dict[str, tuple[str, str]], key_provider: KeyProvider
) -> set[str]:
    """Keys whose material on the target differs from the key store (compared, never kept)."""
    return {
        k.name
        for k in desired.keys
        if k.name in fingerprints and _norm(fingerprints[k.name]) != _norm(key_provider(k.name))
    }


def _norm(pair: tuple[str, str]) -> tuple[str, str]:
    return pair[0].lower(), pair[1].lower()


def plan_from_live(
    desired: SpdkDesired,
    live: LiveState,
    *,
    mismatched_keys: set[str] | None = None,
    prune: bool | None = None,
) -> Plan:
    """The pure part of plan(): desired + live -> steps. No I/O."""
    b = _Builder(desired_depths(desired), live_depths(live))
    _plan_accel(b, desired, live)
    _plan_keys(b, desired, live, mismatched_keys or set())
    _plan_base(b, desired, live)
    _plan_crypto(b, desired, live)
    _plan_lvol(b, desired, live)
    _plan_transports(b, desired, live)
    for sub in desired.subsystems:
        _plan_subsystem(b, sub, live)
    _plan_extra(b, desired, live, desired.prune if prune is None else prune)
    return b.build()


def _plan_accel(b: _Builder, d: SpdkDesired, live: LiveState) -> None:
    acc = d.accel
    wants_mlx5 = acc.module == "mlx5" and "mlx5" not in live.accel_modules
    if wants_mlx5 and "mlx5_scan_accel_module" not in live.methods:
        b.conflicts.append(
            "spdk.accel.module: 'mlx5' but this SPDK build has no mlx5 accel module "
            "(mlx5_scan_accel_module not served); use a DOCA SPDK build"
        )
    elif wants_mlx5 and live.started:
        b.conflicts.append(
            "spdk.accel.module: 'mlx5' is not loaded and can only be loaded before "
            "framework_start_init; restart spdk_tgt with `dpuctl spdk boot-config` output "
            "(--json) or with --wait-for-rpc and apply again"
        )
    elif wants_mlx5:
        b.add_call("accel", "load the mlx5 accel module (crypto offload)", mlx5_scan_call(acc))
    if not live.started:
        b.add("accel", "framework_start_init", "target waits for RPC (--wait-for-rpc): start it")


def _plan_keys(b: _Builder, d: SpdkDesired, live: LiveState, mismatched: set[str]) -> None:
    for i, k in enumerate(d.keys):
        have = live.keys.get(k.name)
        if have is None:
            call = key_create_call(k, REDACTED, REDACTED)
            b.add_call("key", f"key {k.name} missing", call, secret_ref=k.name)
        elif (have.get("cipher"), have.get("tweak_mode")) != (k.cipher, k.tweak_mode):
            b.conflicts.append(
                f"spdk.keys[{i}]: key {k.name} is {have.get('cipher')}/{have.get('tweak_mode')} "
                f"on the target, desired {k.cipher}/{k.tweak_mode}"
            )
        elif k.name in mismatched:
            b.conflicts.append(
                f"spdk.keys[{i}]: key {k.name} on the target differs from the key store; "
                "rotating a key in use re-encrypts nothing: recreate its crypto vbdev (data loss)"
            )


def _plan_base(b: _Builder, d: SpdkDesired, live: LiveState) -> None:
    for i, bdev in enumerate(d.bdevs):
        path = f"spdk.bdevs[{i}]"
        if isinstance(bdev, NvmeBdev):
            _plan_nvme(b, bdev, live, path)
            continue
        have = live.bdevs.get(bdev.name)
        if have is None:
            b.add_call("base", f"bdev {bdev.name} missing", base_bdev_call(bdev))
            continue
        want: dict[str, Any] = {}
        if isinstance(bdev, MallocBdev):
            want = {
                "product_name": "Malloc disk",
                "block_size": bdev.block_size,
                "num_blocks": bdev.num_blocks,
            }
        elif isinstance(bdev, AioBdev):
            want = {"product_name": "AIO disk", "block_size": bdev.block_size}
            aio = have.get("driver_specific", {}).get("aio", {})
            if aio.get("filename") != bdev.filename:
                b.conflicts.append(f"{path}.filename: {aio.get('filename')!r} on the target")
        elif isinstance(bdev, UringBdev):
            want = {"block_size": bdev.block_size}
        _compare(b, path, have, want)


_FIX_DELETE = "delete the object (its data is lost) or change the config"
_FIX_RESTART = "SPDK v26.05 cannot delete a transport: restart the target or change the config"


def _compare(
    b: _Builder, path: str, have: dict[str, Any], want: dict[str, Any], fix: str = _FIX_DELETE
) -> None:
    for k, v in want.items():
        if v is not None and have.get(k) != v:
            b.conflicts.append(
                f"{path}.{k}: {have.get(k)!r} on the target, desired {v!r}; SPDK cannot change "
                f"it in place: {fix}"
            )


def _plan_nvme(b: _Builder, n: NvmeBdev, live: LiveState, path: str) -> None:
    present = [name for name in n.bdev_names if name in live.bdevs]
    if len(present) == len(n.bdev_names):
        trid = live.bdevs[present[0]].get("driver_specific", {}).get("nvme", [{}])[0].get("trid")
        if trid and trid.get("traddr") != n.traddr:
            b.conflicts.append(f"{path}.traddr: controller {n.name} is {trid.get('traddr')}")
        return
    if present:
        b.conflicts.append(f"{path}: controller {n.name} has only {present}; detach it first")
        return
    b.add_call("base", f"controller {n.name} missing", base_bdev_call(n))


def _plan_crypto(b: _Builder, d: SpdkDesired, live: LiveState) -> None:
    for i, c in enumerate(d.crypto):
        have = live.bdevs.get(c.name)
        pending = live.crypto_configs.get(c.name)
        if have is None and pending is not None:
            # configured, waiting for its base bdev (SPDK creates it when the base appears)
            pending = dict(pending)
            if _same_bdev(live, pending.get("base_bdev_name"), c.base_bdev_name):
                pending["base_bdev_name"] = c.base_bdev_name
            _compare(
                b,
                f"spdk.crypto[{i}]",
                pending,
                {"base_bdev_name": c.base_bdev_name, "key_name": c.key_name},
            )
            continue
        if have is None:
            b.add_call("crypto", f"crypto vbdev {c.name} missing", crypto_call(c))
            continue
        got = dict(have.get("driver_specific", {}).get("crypto", {}))
        if _same_bdev(live, got.get("base_bdev_name"), c.base_bdev_name):
            got["base_bdev_name"] = c.base_bdev_name
        _compare(
            b,
            f"spdk.crypto[{i}]",
            got,
            {"base_bdev_name": c.base_bdev_name, "key_name": c.key_name},
        )


def _same_bdev(live: LiveState, have: object, want: str) -> bool:
    """Whether `have` (a name SPDK reports) and `want` (a desired name) are one bdev.

    SPDK reports a crypto vbdev's base by the base's own name: for an lvol that is its UUID,
    not the `lvs/lvol` alias it was created with (recorded from v26.05, tests/data/spdk).
    """
    if not isinstance(have, str):
        return False
    a, w = live.resolve(have), live.resolve(want)
    return have == want or (a is not None and w is not None and a["uuid"] == w["uuid"])


def _plan_lvol(b: _Builder, d: SpdkDesired, live: LiveState) -> None:
    for i, s in enumerate(d.lvstores):
        have = live.lvstores.get(s.lvs_name)
        if have is None:
            b.add_call("lvstore", f"lvstore {s.lvs_name} missing", lvstore_call(s))
            continue
        base = live.resolve(s.bdev_name)
        base_name = base["name"] if base else s.bdev_name
        _compare(
            b, f"spdk.lvstores[{i}]", have, {"base_bdev": base_name, "cluster_size": s.cluster_sz}
        )
    for i, v in enumerate(d.lvols):
        have = live.resolve(v.alias)
        if have is None:
            b.add_call("lvol", f"lvol {v.alias} missing", lvol_call(v))
            continue
        lvs = live.lvstores.get(v.lvs_name, {})
        cluster = lvs.get("cluster_size", MIB)
        want_bytes = math.ceil(v.size_in_mib * MIB / cluster) * cluster
        have_bytes = have["num_blocks"] * have["block_size"]
        if have_bytes != want_bytes:
            b.conflicts.append(
                f"spdk.lvols[{i}].size_in_mib: {have_bytes // MIB} MiB on the target, desired "
                f"{v.size_in_mib}; resize is not automated"
            )
        thin = have.get("driver_specific", {}).get("lvol", {}).get("thin_provision")
        _compare(
            b, f"spdk.lvols[{i}]", {"thin_provision": thin}, {"thin_provision": v.thin_provision}
        )


def _plan_transports(b: _Builder, d: SpdkDesired, live: LiveState) -> None:
    for i, t in enumerate(d.transports):
        have = live.transports.get(t.trtype)
        if have is None:
            b.add_call("transport", f"{t.trtype} transport missing", transport_call(t))
            continue
        shown = {k: v for k, v in t.tuning if k in have}  # v26.05 hides some (io_unit_size)
        _compare(b, f"spdk.transports[{i}]", have, shown, _FIX_RESTART)


def _listen_key(a: dict[str, Any]) -> tuple[str, str, str, str]:
    return (
        str(a.get("trtype", "")).upper(),
        str(a.get("adrfam", "IPv4")).lower(),
        str(a.get("traddr", "")),
        str(a.get("trsvcid", "")),
    )


def _plan_subsystem(b: _Builder, s: Subsystem, live: LiveState) -> None:
    have = live.subsystems.get(s.nqn)
    if have is None:
        b.add_call("subsystem", f"subsystem {s.nqn} missing", subsystem_call(s))
        have = {
            "namespaces": [],
            "listen_addresses": [],
            "hosts": [],
            "allow_any_host": s.allow_any_host,
        }
    else:
        _compare(
            b,
            f"subsystem {s.nqn}",
            have,
            {"serial_number": s.serial_number, "model_number": s.model_number},
        )
    _plan_namespaces(b, s, have, live)
    wanted = {_listen_key(x.address()): x for x in s.listeners}
    present = {_listen_key(a): a for a in have["listen_addresses"]}
    for key, x in wanted.items():
        if key not in present:
            why = f"{s.nqn} listener {x.trtype} {x.traddr}:{x.trsvcid} missing"
            b.add_call("listener", why, listener_call(s.nqn, x))
    for key, a in present.items():
        if key not in wanted:
            b.remove(
                "listener",
                "nvmf_subsystem_remove_listener",
                f"{s.nqn} listener {a.get('traddr')}:{a.get('trsvcid')} not desired",
                nqn=s.nqn,
                listen_address=a,
            )
    hosts = {h["nqn"] for h in have["hosts"]}
    for h in s.hosts:
        if h not in hosts:
            b.add_call("host", f"{s.nqn} host {h} missing", host_call(s.nqn, h))
    for h in sorted(hosts - set(s.hosts)):
        why = f"{s.nqn} host {h} not desired"
        b.remove("host", "nvmf_subsystem_remove_host", why, nqn=s.nqn, host=h)
    if have["allow_any_host"] != s.allow_any_host:
        step = b.add if s.allow_any_host else b.remove  # tightening runs first
        step(
            "host",
            "nvmf_subsystem_allow_any_host",
            f"allow_any_host -> {s.allow_any_host}",
            nqn=s.nqn,
            allow_any_host=s.allow_any_host,
        )


def _plan_namespaces(b: _Builder, s: Subsystem, have: dict[str, Any], live: LiveState) -> None:
    live_ns = {n["nsid"]: n for n in have["namespaces"]}
    for ns in s.namespaces:
        want = live.resolve(ns.bdev_name)
        cur = live_ns.get(ns.nsid)
        if cur is not None:
            cur_bdev = live.resolve(cur["bdev_name"])
            if want is not None and cur_bdev is not None and cur_bdev["uuid"] == want["uuid"]:
                continue
            b.remove(
                "ns",
                "nvmf_subsystem_remove_ns",
                f"{s.nqn} nsid {ns.nsid} exports another bdev",
                nqn=s.nqn,
                nsid=ns.nsid,
            )
        b.add_call("ns", f"{s.nqn} nsid {ns.nsid} -> {ns.bdev_name} missing", ns_call(s.nqn, ns))
    desired_nsids = {ns.nsid for ns in s.namespaces}
    for nsid in sorted(set(live_ns) - desired_nsids):
        why = f"{s.nqn} nsid {nsid} not desired"
        b.remove("ns", "nvmf_subsystem_remove_ns", why, nqn=s.nqn, nsid=nsid)


def _plan_extra(b: _Builder, d: SpdkDesired, live: LiveState, prune: bool) -> None:
    """Live objects the desired state does not name: deleted with prune, else listed."""
    found: list[tuple[str, str, str, dict[str, Any]]] = []  # (phase, method, label, params)
    nqns = {s.nqn for s in d.subsystems}
    found += [
        ("subsystem", "nvmf_delete_subsystem", f"subsystem {n}", {"nqn": n})
        for n in live.subsystems
        if n not in nqns
    ]
    names = set(d.bdev_names())
    for bdev in live.bdevs.values():
        name, product = bdev["name"], bdev.get("product_name", "")
        alias = live.lvol_alias(bdev)
        if name in names or (alias is not None and alias in names):
            continue
        if alias is not None:
            found.append(("lvol", "bdev_lvol_delete", f"lvol {alias}", {"name": alias}))
        elif product == "crypto":
            found.append(("crypto", "bdev_crypto_delete", f"crypto {name}", {"name": name}))
        elif product in _BASE_DELETE:
            found.append(("base", _BASE_DELETE[product], f"bdev {name}", {"name": name}))
        elif product == "NVMe disk" and (m := _NVME_BDEV_RE.match(name)):
            ctrlr = {"name": m["ctrlr"]}
            if ("base", "bdev_nvme_detach_controller", f"nvme {m['ctrlr']}", ctrlr) not in found:
                found.append(("base", "bdev_nvme_detach_controller", f"nvme {m['ctrlr']}", ctrlr))
        else:
            b.unmanaged.append(f"bdev {name} ({product}): not a kind this driver deletes")
    lvs_names = {s.lvs_name for s in d.lvstores}
    found += [
        ("lvstore", "bdev_lvol_delete_lvstore", f"lvstore {n}", {"lvs_name": n})
        for n in live.lvstores
        if n not in lvs_names
    ]
    key_names = {k.name for k in d.keys}
    found += [
        ("key", "accel_crypto_key_destroy", f"key {n}", {"key_name": n})
        for n in live.keys
        if n not in key_names
    ]
    trtypes = {t.trtype for t in d.transports}
    b.unmanaged += [
        f"transport {t}: SPDK v26.05 cannot delete a transport"
        for t in live.transports
        if t not in trtypes
    ]
    for phase, method, label, params in found:
        if prune:
            b.remove(phase, method, f"{label} not desired (prune)", **params)
        else:
            b.unmanaged.append(f"{label}: not in the desired state (kept; prune = true deletes)")
