"""The bdev side of the simulated SPDK target (a mixin of `SimTarget`).

Claims follow the recording: a crypto vbdev claims its base `exclusive_write`, an lvstore
`read_many_write_one`, an nvmf namespace `exclusive_write`. Deleting a claimed bdev
hot-removes what sits on it, as SPDK does. "(inferred)" marks unrecorded behaviour.
"""

from __future__ import annotations

import copy
import hashlib
import math
import os
import uuid as uuidlib
from collections.abc import Callable
from typing import Any

from spdk_sim._sim_common import (
    CLUSTER_MASK_BITS_PER_PAGE,
    CRYPTO_NAMESPACE_UUID,
    ERR_INVALID_PARAMS,
    MD_PAGE_BYTES,
    MIB,
    NvmeDevice,
    RpcFail,
    errno_fail,
    insert_after,
    make_bdev,
)
from spdk_sim._sim_common import _Bdev as Bdev


class BdevMixin:
    """Bdevs, crypto vbdevs, lvstores and lvols of the simulated target."""

    data: dict[str, Any]
    new_uuid: Callable[[], str]
    file_sizes: dict[str, int]
    nvme_devices: dict[str, NvmeDevice]
    bdevs: dict[str, Bdev]
    keys: dict[str, dict[str, Any]]
    crypto_cfg: dict[str, dict[str, str]]
    lvstores: dict[str, dict[str, Any]]
    nvme_ctrlrs: dict[str, dict[str, Any]]
    subsystems: dict[str, dict[str, Any]]

    # ------------------------------------------------------------------ bdev: common

    def _find(self, name: str) -> Bdev | None:
        if name in self.bdevs:
            return self.bdevs[name]
        for b in self.bdevs.values():
            if name in b.aliases:
                return b
        return None

    def _name_taken(self, name: str) -> bool:
        return self._find(name) is not None or name in self.crypto_cfg

    def _add(self, b: Bdev) -> None:
        self.bdevs[b.name] = b
        for cname, cfg in self.crypto_cfg.items():  # deferred crypto vbdevs wake up
            if cfg["base_bdev_name"] in (b.name, *b.aliases) and cname not in self.bdevs:
                self._make_crypto(cname, b, cfg)

    def _claim(self, b: Bdev, claim_type: str, by: str) -> None:
        if b.claim_type is not None:
            raise errno_fail(1)
        b.claim_type, b.claimed_by = claim_type, by

    def _remove(self, b: Bdev) -> None:
        """Unregister a bdev the way SPDK hot-removes it: its claimer goes first."""
        for ss in self.subsystems.values():
            ss["namespaces"] = [n for n in ss["namespaces"] if n["uuid"] != b.uuid]
        for lvs_name, lvs in list(self.lvstores.items()):
            if lvs["base_bdev"] == b.name:
                for lv in [x for x in self.bdevs.values() if x.kind == "lvol"]:
                    if lv.driver_specific["lvol"]["lvol_store_uuid"] == lvs["uuid"]:
                        self._remove(lv)
                del self.lvstores[lvs_name]
        for c in [x for x in self.bdevs.values() if x.kind == "crypto"]:
            if c.driver_specific["crypto"]["base_bdev_name"] in (b.name, *b.aliases):
                self._remove(c)
        self.bdevs.pop(b.name, None)
        if b.kind == "lvol":
            for lvs in self.lvstores.values():
                if lvs["uuid"] == b.driver_specific["lvol"]["lvol_store_uuid"]:
                    lvs["free_clusters"] += b.create_params["clusters"]
        if b.kind == "crypto":
            base_name = b.driver_specific["crypto"]["base_bdev_name"]
            base = self._find(base_name)
            if base is not None:
                base.claim_type = base.claimed_by = None

    def _delete_named(self, name: str, kind: str) -> bool:
        b = self.bdevs.get(name)
        if b is None or b.kind != kind:
            raise errno_fail(19)
        self._remove(b)
        return True

    def rpc_bdev_get_bdevs(self, p: dict[str, Any]) -> Any:
        name = p.get("name")
        if name is None:
            return [self._bdev_json(b) for b in self.bdevs.values()]
        b = self._find(name)
        if b is None:
            raise errno_fail(19)
        return [self._bdev_json(b)]

    def _bdev_json(self, b: Bdev) -> dict[str, Any]:
        templates = self.data["bdev_templates"]
        out = copy.deepcopy(templates.get(b.product, templates["AIO disk"]))
        out.update(
            name=b.name,
            aliases=list(b.aliases),
            product_name=b.product,
            block_size=b.block_size,
            num_blocks=b.num_blocks,
            uuid=b.uuid,
            claimed=b.claim_type is not None,
            driver_specific=copy.deepcopy(b.driver_specific),
        )
        if b.claim_type is None:
            out.pop("claim_type", None)
        else:
            out = insert_after(out, "claimed", "claim_type", b.claim_type)
        if not b.accel_domain:
            out.pop("memory_domains", None)
        return out

    # ------------------------------------------------------------------ bdev: base

    def rpc_bdev_malloc_create(self, p: dict[str, Any]) -> Any:
        name = p.get("name") or f"Malloc{len(self.bdevs)}"
        if self._name_taken(name):
            raise errno_fail(17)
        if p["block_size"] == 0 or p["block_size"] % 512 or p["num_blocks"] == 0:
            raise errno_fail(22)
        uid = p.get("uuid") or self.new_uuid()
        params = {
            "name": name,
            "num_blocks": p["num_blocks"],
            "block_size": p["block_size"],
            "physical_block_size": p.get("physical_block_size", p["block_size"]),
            "uuid": uid,
            "optimal_io_boundary": p.get("optimal_io_boundary", 0),
            "md_size": p.get("md_size", 0),
            "dif_type": p.get("dif_type", 0),
            "dif_is_head_of_md": p.get("dif_is_head_of_md", False),
            "dif_pi_format": p.get("dif_pi_format", 0),
            "numa_id": p.get("numa_id", -1),
        }
        self._add(
            make_bdev(
                name, "Malloc disk", "malloc", p["block_size"], p["num_blocks"], uid, {}, params
            )
        )
        return name

    def rpc_bdev_malloc_delete(self, p: dict[str, Any]) -> Any:
        return self._delete_named(p["name"], "malloc")

    def _file_blocks(self, filename: str, block_size: int) -> int:
        if filename in self.file_sizes:
            size = self.file_sizes[filename]
        else:
            try:
                size = os.stat(filename).st_size
            except OSError as e:
                raise errno_fail(2) from e  # (inferred)
        if size < block_size:
            raise errno_fail(22)
        return size // block_size

    def rpc_bdev_aio_create(self, p: dict[str, Any]) -> Any:
        name = p["name"]
        if self._name_taken(name):
            raise errno_fail(17)
        block_size = p.get("block_size") or 512  # 0: detect (a file: 512)
        blocks = self._file_blocks(p["filename"], block_size)
        uid = p.get("uuid") or self.new_uuid()
        aio = {
            "filename": p["filename"],
            "block_size_override": "block_size" in p,
            "readonly": p.get("readonly", False),
            "fallocate": p.get("fallocate", False),
            "nowait": p.get("nowait", False),
        }
        params = {
            "name": name,
            "block_size": block_size,
            "filename": p["filename"],
            "readonly": aio["readonly"],
            "fallocate": aio["fallocate"],
            "uuid": uid,
            "nowait": aio["nowait"],
        }
        self._add(make_bdev(name, "AIO disk", "aio", block_size, blocks, uid, {"aio": aio}, params))
        return name

    def rpc_bdev_aio_delete(self, p: dict[str, Any]) -> Any:
        return self._delete_named(p["name"], "aio")

    def rpc_bdev_uring_create(self, p: dict[str, Any]) -> Any:
        name = p["name"]
        if self._name_taken(name):
            raise errno_fail(17)
        block_size = p.get("block_size") or 512  # 0: detect (a file: 512)
        blocks = self._file_blocks(p["filename"], block_size)
        uid = p.get("uuid") or self.new_uuid()
        params = {"name": name, "filename": p["filename"], "block_size": block_size, "uuid": uid}
        ds = {"uring": {"filename": p["filename"]}}  # (inferred)
        self._add(make_bdev(name, "URING bdev", "uring", block_size, blocks, uid, ds, params))
        return name

    def rpc_bdev_uring_delete(self, p: dict[str, Any]) -> Any:
        return self._delete_named(p["name"], "uring")

    def rpc_bdev_nvme_attach_controller(self, p: dict[str, Any]) -> Any:
        name, trtype = p["name"], p["trtype"]
        if name in self.nvme_ctrlrs:
            raise RpcFail(
                -114, f"A controller named {name} already exists with the specified network path"
            )
        key = p["traddr"] if trtype.lower() == "pcie" else f"{p.get('subnqn')}@{p['traddr']}"
        dev = self.nvme_devices.get(key)
        if dev is None:
            raise errno_fail(19)  # (inferred)
        names = []
        for nsid in range(1, dev.namespaces + 1):
            bname = f"{name}n{nsid}"
            trid = {
                "trtype": "PCIe" if trtype.lower() == "pcie" else trtype.upper(),
                "traddr": p["traddr"],
            }
            for k in ("adrfam", "trsvcid", "subnqn"):
                if k in p:
                    trid[k] = p[k]
            ds = {
                "nvme": [
                    {
                        "trid": trid,
                        "ctrlr_data": {
                            "model_number": dev.model_number,
                            "serial_number": dev.serial_number,
                        },
                        "ns_data": {"id": nsid},
                    }
                ]
            }
            uid = self.new_uuid()
            self._add(
                make_bdev(bname, "NVMe disk", "nvme", dev.block_size, dev.num_blocks, uid, ds)
            )
            names.append(bname)
        self.nvme_ctrlrs[name] = {"params": p, "bdevs": names}
        return names

    def rpc_bdev_nvme_detach_controller(self, p: dict[str, Any]) -> Any:
        ctrlr = self.nvme_ctrlrs.pop(p["name"], None)
        if ctrlr is None:
            raise errno_fail(19)
        for bname in ctrlr["bdevs"]:
            if bname in self.bdevs:
                self._remove(self.bdevs[bname])
        return True

    # ------------------------------------------------------------------ bdev: crypto

    def rpc_bdev_crypto_create(self, p: dict[str, Any]) -> Any:
        name = p["name"]
        key_name = p.get("key_name")
        if key_name is None or key_name not in self.keys:
            raise RpcFail(ERR_INVALID_PARAMS, "Key was not found")  # recorded
        if self._name_taken(name):
            raise errno_fail(17)
        base = self._find(p["base_bdev_name"])
        if base is not None and base.claim_type is not None:
            raise errno_fail(1)
        cfg = {"base_bdev_name": p["base_bdev_name"], "name": name, "key_name": key_name}
        self.crypto_cfg[name] = cfg
        if base is not None:  # else deferred until the base bdev arrives, as SPDK does
            self._make_crypto(name, base, cfg)
        return name

    def _make_crypto(self, name: str, base: Bdev, cfg: dict[str, str]) -> None:
        # SPDK v26.05 then reports the base by its own name (an lvol's UUID), in the bdev's
        # driver_specific and in framework_get_config, whatever alias it was created with.
        cfg = dict(cfg, base_bdev_name=base.name)
        self.crypto_cfg[name] = cfg
        digest = hashlib.sha1(CRYPTO_NAMESPACE_UUID.bytes + uuidlib.UUID(base.uuid).bytes)
        uid = str(uuidlib.UUID(bytes=digest.digest()[:16], version=5))
        base.claim_type, base.claimed_by = "exclusive_write", name
        b = make_bdev(
            name,
            "crypto",
            "crypto",
            base.block_size,
            base.num_blocks,
            uid,
            {"crypto": dict(cfg)},
            dict(cfg),
        )
        self.bdevs[name] = b

    def rpc_bdev_crypto_delete(self, p: dict[str, Any]) -> Any:
        b = self.bdevs.get(p["name"])
        if b is None or b.kind != "crypto":
            raise errno_fail(19)
        self._remove(b)
        self.crypto_cfg.pop(p["name"], None)
        return True

    # ------------------------------------------------------------------ lvol

    def rpc_bdev_lvol_create_lvstore(self, p: dict[str, Any]) -> Any:
        base = self._find(p["bdev_name"])
        if base is None:
            raise errno_fail(19)
        if p["lvs_name"] in self.lvstores:
            raise errno_fail(17)
        cluster = p.get("cluster_sz") or 4 * MIB  # 0: the default
        if cluster % MD_PAGE_BYTES or not p["lvs_name"]:
            raise errno_fail(22)
        clusters = base.num_blocks * base.block_size // cluster
        ratio = p.get("num_md_pages_per_cluster_ratio", 100)
        md_pages = 4 + math.ceil(clusters * ratio / 100)  # super block + 3 masks + md pages
        md_clusters = math.ceil(md_pages * MD_PAGE_BYTES / cluster)
        if clusters <= md_clusters:
            raise errno_fail(28)
        self._claim(base, "read_many_write_one", p["lvs_name"])
        uid = self.new_uuid()
        mask_pages = max(1, math.ceil(clusters / CLUSTER_MASK_BITS_PER_PAGE))
        self.lvstores[p["lvs_name"]] = {
            "uuid": uid,
            "name": p["lvs_name"],
            "base_bdev": base.name,
            "total_data_clusters": clusters - md_clusters,
            "free_clusters": clusters - md_clusters,
            "block_size": base.block_size,
            "cluster_size": cluster,
            "max_growable_size": mask_pages * CLUSTER_MASK_BITS_PER_PAGE * cluster,
        }
        return uid

    def _lvstore(self, p: dict[str, Any]) -> dict[str, Any]:
        for lvs in self.lvstores.values():
            if p.get("uuid") in (None, lvs["uuid"]) and p.get("lvs_name") in (None, lvs["name"]):
                return lvs
        raise errno_fail(19)

    def rpc_bdev_lvol_get_lvstores(self, p: dict[str, Any]) -> Any:
        if "uuid" in p or "lvs_name" in p:
            return [copy.deepcopy(self._lvstore(p))]
        return [copy.deepcopy(v) for v in self.lvstores.values()]

    def rpc_bdev_lvol_delete_lvstore(self, p: dict[str, Any]) -> Any:
        if ("uuid" in p) == ("lvs_name" in p):
            raise RpcFail(ERR_INVALID_PARAMS, "One of 'uuid' or 'lvs_name' may be specified")
        lvs = self._lvstore(p)
        lvols = [
            b
            for b in self.bdevs.values()
            if b.kind == "lvol" and b.driver_specific["lvol"]["lvol_store_uuid"] == lvs["uuid"]
        ]
        if any(b.claim_type is not None for b in lvols):
            raise errno_fail(16)  # (inferred)
        for b in lvols:
            self._remove(b)
        del self.lvstores[lvs["name"]]
        self.bdevs[lvs["base_bdev"]].claim_type = None
        return True

    def rpc_bdev_lvol_create(self, p: dict[str, Any]) -> Any:
        lvs = self._lvstore({k: p[k] for k in ("uuid", "lvs_name") if k in p})
        alias = f"{lvs['name']}/{p['lvol_name']}"
        if not p["lvol_name"]:
            raise errno_fail(22)
        if self._find(alias) is not None:
            raise errno_fail(17)
        clusters = math.ceil(p["size_in_mib"] * MIB / lvs["cluster_size"])
        thin = p.get("thin_provision", False)
        if not thin and clusters > lvs["free_clusters"]:
            raise errno_fail(28)
        allocated = 0 if thin else clusters
        lvs["free_clusters"] -= allocated
        uid = self.new_uuid()
        base = self.bdevs[lvs["base_bdev"]]
        ds = {
            "lvol": {
                "lvol_store_uuid": lvs["uuid"],
                "base_bdev": base.name,
                "thin_provision": thin,
                "num_allocated_clusters": allocated,
                "snapshot": False,
                "clone": False,
                "esnap_clone": False,
            }
        }
        blocks = clusters * lvs["cluster_size"] // lvs["block_size"]
        b = make_bdev(
            uid,
            "Logical Volume",
            "lvol",
            lvs["block_size"],
            blocks,
            uid,
            ds,
            {"clusters": allocated},
        )
        b.aliases = [alias]
        b.accel_domain = base.kind == "crypto"
        self._add(b)
        return uid

    def rpc_bdev_lvol_delete(self, p: dict[str, Any]) -> Any:
        b = self._find(p["name"])
        if b is None or b.kind != "lvol":
            raise errno_fail(19)
        if b.claim_type is not None:
            raise errno_fail(16)  # (inferred)
        self._remove(b)
        return True

    def rpc_bdev_lvol_get_lvols(self, p: dict[str, Any]) -> Any:
        out = []
        for b in self.bdevs.values():
            if b.kind != "lvol":
                continue
            lv = b.driver_specific["lvol"]
            lvs = next(x for x in self.lvstores.values() if x["uuid"] == lv["lvol_store_uuid"])
            if p.get("lvs_uuid") not in (None, lvs["uuid"]) or p.get("lvs_name") not in (
                None,
                lvs["name"],
            ):
                continue
            out.append(
                {
                    "alias": b.aliases[0],
                    "uuid": b.uuid,
                    "name": b.aliases[0].split("/")[1],
                    "is_thin_provisioned": lv["thin_provision"],
                    "is_snapshot": False,
                    "is_clone": False,
                    "is_esnap_clone": False,
                    "is_degraded": False,
                    "lvs": {"name": lvs["name"], "uuid": lvs["uuid"]},
                }
            )
        return out

    def _bdev_config(self) -> list[dict[str, Any]]:
        opts = copy.deepcopy(self.data["bdev_options"])
        out = opts[:2]
        out += [
            {"method": "bdev_crypto_create", "params": dict(c)} for c in self.crypto_cfg.values()
        ]
        out.append(opts[2])
        for ctrlr in self.nvme_ctrlrs.values():
            out.append({"method": "bdev_nvme_attach_controller", "params": dict(ctrlr["params"])})
        out.append(opts[3])
        for kind, method in (
            ("malloc", "bdev_malloc_create"),
            ("aio", "bdev_aio_create"),
            ("uring", "bdev_uring_create"),
        ):
            out += [
                {"method": method, "params": dict(b.create_params)}
                for b in self.bdevs.values()
                if b.kind == kind
            ]
        out.append({"method": "bdev_wait_for_examine"})
        return out
