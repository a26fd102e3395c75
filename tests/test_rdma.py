"""host_shim.rdma: the pure sysfs parsing (GID table, RoCE v2 GID for an address, PFC/trust/ECN)
on a tree in the kernel's format (tests/data/rdma)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from host_shim import rdma

DATA = json.loads((Path(__file__).parent / "data" / "rdma" / "roce_port.json").read_text())


def _tree(root: Path, doc: dict[str, Any] = DATA) -> Path:
    port = root / "class" / "infiniband" / doc["device"] / "ports" / str(doc["port"])
    for sub in ("gids", "gid_attrs/types", "gid_attrs/ndevs"):
        (port / sub).mkdir(parents=True)
    (port / "link_layer").write_text(doc["link_layer"] + "\n")
    for index, (gid, gid_type, ndev) in doc["gids"].items():
        (port / "gids" / index).write_text(gid + "\n")
        if gid_type is not None:  # unused slots: the kernel's read fails (EINVAL); absent here
            (port / "gid_attrs" / "types" / index).write_text(gid_type + "\n")
            (port / "gid_attrs" / "ndevs" / index).write_text(ndev + "\n")
    qos = root / "class" / "net" / "p0" / "qos"
    qos.mkdir(parents=True)
    for name, text in doc["qos"].items():
        (qos / name).write_text(text)
    return port


def test_gid_table_skips_zero_slots_and_keeps_types(tmp_path: Path) -> None:
    entries = rdma.read_gid_table(_tree(tmp_path))
    assert [e.index for e in entries] == [0, 1, 2, 3, 4]
    assert entries[3].type == "RoCE v2" and entries[3].ndev == "p0"
    assert entries[3].ipv4 == "192.168.1.10" and entries[0].ipv4 is None


def test_roce_v2_gid_for_an_address(tmp_path: Path) -> None:
    entries = rdma.read_gid_table(_tree(tmp_path))
    picked = rdma.gid_for_address(entries, "192.168.1.10")
    assert picked is not None and picked.index == 3  # v2, not the v1 entry at index 2
    v6 = rdma.gid_for_address(entries, "2001:db8::10")
    assert v6 is not None and v6.index == 4
    assert rdma.gid_for_address(entries, "10.0.0.1") is None


@pytest.mark.parametrize(
    ("text", "flags"),
    [("0 0 0 1 0 0 0 0\n", (0, 0, 0, 1, 0, 0, 0, 0)), ("00010000", (0, 0, 0, 1, 0, 0, 0, 0)),
     ("1,1,1,1,1,1,1,1", (1,) * 8)],
)  # fmt: skip
def test_parse_pfc(text: str, flags: tuple[int, ...]) -> None:
    assert rdma.parse_pfc(text) == tuple(bool(f) for f in flags)


@pytest.mark.parametrize("bad", ["0 0 0 1", "0 0 0 1 0 0 0 0 1", "on", "0 0 0 2 0 0 0 0"])
def test_parse_pfc_refuses_other_text(bad: str) -> None:
    with pytest.raises(ValueError, match="8 flags"):
        rdma.parse_pfc(bad)


def test_qos_lossless_roce_ok_and_problems(tmp_path: Path) -> None:
    _tree(tmp_path)
    ok = rdma.read_qos("p0", sysfs=tmp_path)
    assert ok.trust == "dscp" and ok.pfc is not None and ok.pfc[3] and ok.problems == []
    qos = tmp_path / "class" / "net" / "p0" / "qos"
    (qos / "trust").write_text("pcp\n")
    (qos / "pfc").write_text("0 0 0 0 0 0 0 0\n")
    ecn = tmp_path / "class" / "net" / "p0" / "ecn" / "roce_np"
    ecn.mkdir(parents=True)
    for p in range(8):
        (ecn / str(p)).write_text("0\n")
    bad = rdma.read_qos("p0", sysfs=tmp_path)
    assert len(bad.problems) == 3, bad.problems
    assert any("trust pcp" in p for p in bad.problems)
    assert any("PFC off on priority 3" in p for p in bad.problems)
    none = rdma.read_qos("eth9", sysfs=tmp_path)
    assert none.trust is None and "dcb -j pfc show dev eth9" in none.problems[0]
