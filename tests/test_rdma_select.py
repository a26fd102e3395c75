"""host_shim.rdma.select_rdma: the device, port and RoCE v2 GID index UCX gets for the
configured address, and the refusals (port down, wrong link layer, no PFC on the RoCE
priority), on a BlueField-3 port's sysfs layout laid out under a scratch root."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from host_shim.rdma import RdmaRefused, select_rdma

BF3 = json.loads((Path(__file__).parent / "data" / "rdma" / "bf3_p0.json").read_text())


def _tree(root: Path, doc: dict[str, Any] = BF3, *, qos: bool = True) -> Path:
    for dev, ports in doc["devices"].items():
        for port, p in ports.items():
            d = root / "class" / "infiniband" / dev / "ports" / port
            for sub in ("gids", "gid_attrs/types", "gid_attrs/ndevs"):
                (d / sub).mkdir(parents=True)
            (d / "state").write_text(p["state"] + "\n")
            (d / "link_layer").write_text(p["link_layer"] + "\n")
            for i, (gid, gid_type, ndev) in p["gids"].items():
                (d / "gids" / i).write_text(gid + "\n")
                if gid_type is not None:  # unused slots fail to read (EINVAL): absent here
                    (d / "gid_attrs" / "types" / i).write_text(gid_type + "\n")
                    (d / "gid_attrs" / "ndevs" / i).write_text(ndev + "\n")
    for netdev, knobs in doc["qos"].items():
        q = root / "class" / "net" / netdev / "qos"
        q.mkdir(parents=True)
        for name, text in knobs.items() if qos else ():
            (q / name).write_text(text)
    return root


def test_selects_the_ports_roce_v2_gid_index_for_ucx(tmp_path: Path) -> None:
    sel = select_rdma(BF3["addresses"]["p0"], sysfs=_tree(tmp_path))
    assert (sel.device, sel.port, sel.gid_index, sel.netdev) == ("mlx5_0", 1, 3, "p0")
    assert sel.ucx_env() == {"UCX_NET_DEVICES": "mlx5_0:1", "UCX_IB_GID_INDEX": "3"}
    assert sel.pfc == (3,) and sel.as_dict()["ucx_env"] == sel.ucx_env()


def test_refuses_a_port_that_is_down(tmp_path: Path) -> None:
    with pytest.raises(RdmaRefused, match=r"mlx5_1 port 1 .* DOWN, not ACTIVE"):
        select_rdma(BF3["addresses"]["p1"], sysfs=_tree(tmp_path))


def test_refuses_the_wrong_link_layer(tmp_path: Path) -> None:
    doc = copy.deepcopy(BF3)
    doc["devices"]["mlx5_0"]["1"]["link_layer"] = "InfiniBand"
    with pytest.raises(RdmaRefused, match="link layer is InfiniBand"):
        select_rdma(BF3["addresses"]["p0"], sysfs=_tree(tmp_path, doc))


def test_refuses_without_pfc_on_the_roce_priority(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    with pytest.raises(RdmaRefused, match="PFC off on priority 4"):
        select_rdma(BF3["addresses"]["p0"], roce_priority=4, sysfs=root)


def test_pfc_from_the_callers_reader_where_sysfs_has_no_qos(tmp_path: Path) -> None:
    """Upstream mlx5 keeps PFC in dcbnl only: the caller's `dcb` reader answers, or refusal."""
    root = _tree(tmp_path, qos=False)
    asked: list[str] = []

    def dcb(netdev: str) -> tuple[int, ...] | None:
        asked.append(netdev)
        return (3,)

    assert select_rdma(BF3["addresses"]["p0"], sysfs=root, pfc_of=dcb).gid_index == 3
    assert asked == ["p0"]
    with pytest.raises(RdmaRefused, match="PFC state unreadable"):
        select_rdma(BF3["addresses"]["p0"], sysfs=root, pfc_of=lambda _n: None)


def test_refuses_an_address_with_no_roce_v2_gid(tmp_path: Path) -> None:
    with pytest.raises(RdmaRefused, match=r"no RoCE v2 GID for 203\.0\.113\.1"):
        select_rdma("203.0.113.1", sysfs=_tree(tmp_path))
    with pytest.raises(RdmaRefused, match="no RDMA devices"):
        select_rdma("192.0.2.10", sysfs=tmp_path / "empty")


def test_nixl_start_hands_the_selection_to_ucx_or_refuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent's and the shim's NIXL start (new_agent) goes through select_ucx_rdma."""
    from host_shim.transport._lib import NixlUnavailable, select_ucx_rdma

    root = _tree(tmp_path)
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    monkeypatch.delenv("UCX_IB_GID_INDEX", raising=False)
    monkeypatch.delenv("DPUKV_RDMA_ADDRESS", raising=False)
    assert select_ucx_rdma(root) == {}  # unset: UCX picks
    monkeypatch.setenv("DPUKV_RDMA_ADDRESS", BF3["addresses"]["p0"])
    assert select_ucx_rdma(root) == {"UCX_NET_DEVICES": "mlx5_0:1", "UCX_IB_GID_INDEX": "3"}
    import os

    assert os.environ["UCX_IB_GID_INDEX"] == "3"
    monkeypatch.setenv("DPUKV_RDMA_ADDRESS", BF3["addresses"]["p1"])
    with pytest.raises(NixlUnavailable, match="DOWN"):
        select_ucx_rdma(root)


def test_doctor_shows_the_selection_or_the_refusal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dpu_agent.cli.ops import probe_rdma_select

    root = _tree(tmp_path)
    monkeypatch.setenv("DPUKV_RDMA_ADDRESS", BF3["addresses"]["p0"])
    status, detail = probe_rdma_select(root)
    assert (
        status == "ok" and "UCX_IB_GID_INDEX=3" in detail and "UCX_NET_DEVICES=mlx5_0:1" in detail
    )
    monkeypatch.setenv("DPUKV_RDMA_ADDRESS", BF3["addresses"]["p1"])
    assert probe_rdma_select(root)[0] == "missing"
