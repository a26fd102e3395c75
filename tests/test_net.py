"""dpuctl net: [net] parsing, plans from live state, apply in a network namespace with a veth
pair the test creates (real rtnetlink through pyroute2, read back with iproute2's `ip -j`),
dcb command lines and recorded JSON, and the real dcb's refusal on veth."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from dpu_agent import net
from dpu_agent.cli import cli
from dpu_agent.config import ConfigError, load_config

DATA = Path(__file__).parent / "data" / "net"
can_netns = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="network namespaces need root and iproute2 (ip)",
)


def _recorded(name: str) -> object:
    return json.loads((DATA / name).read_text())


def _ip(ns: str, *args: str) -> object:
    out = subprocess.run(["ip", "-n", ns, "-j", *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout or "[]")


@pytest.fixture
def netns() -> Iterator[str]:
    """A namespace with a veth pair va/vb (vb up), deleted afterwards."""
    ns = f"t16-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "-n", ns, "link", "add", "va", "type", "veth", "peer", "name", "vb"],
                       check=True)  # fmt: skip
        subprocess.run(["ip", "-n", ns, "link", "set", "vb", "up"], check=True)
        yield ns
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=True)


def _desired(ns: str, **iface: object) -> net.NetDesired:
    return net.parse_net({"netns": ns, "interfaces": [{"name": "va", **iface}]})


def _plan(desired: net.NetDesired, sysfs_root: Path = net.SYSFS_NET) -> net.NetPlan:
    with net.open_ipr(desired.netns) as ipr:
        return net.plan(desired, net.read_live(desired, ipr, sysfs_root))


def _apply(desired: net.NetDesired, sysfs_root: Path = net.SYSFS_NET) -> net.NetApplyResult:
    with net.open_ipr(desired.netns) as ipr:
        return net.apply(desired, ipr, sysfs_root)


# --- [net] ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("iface", "message"),
    [
        ({"name": "this-name-is-too-long"}, "1..15 characters"),
        ({"name": "p0", "mtu": 10000}, "mtu = 10000"),
        ({"name": "p0", "vlan": 4095}, "vlan = 4095"),
        ({"name": "p0", "addresses": ["192.0.2.300/24"]}, "not an address"),
        ({"name": "p0", "addresses": ["192.0.2.1"]}, "prefix length"),
        ({"name": "p0", "routes": [{"dst": "10.0.0.0/8", "gateway": "2001:db8::1"}]}, "not IPv4"),
        ({"name": "p0", "pfc_priorities": [8]}, "0..7"),
        ({"name": "p0", "trust": "dscp"}, "needs a dscp_prio"),
        ({"name": "p0", "trust": "pcp"}, "'dscp' or ''"),
        ({"name": "p0", "dscp_prio": {"64": 3}}, "0..63"),
        ({"name": "p0", "ets": {"prio_tc": [0] * 8, "tc_tsa": ["ets"] * 8, "tc_bw": [10] * 8}},
         "add up to 100"),
        ({"name": "p0", "ets": {"prio_tc": [0] * 8, "tc_tsa": ["wfq"] * 8, "tc_bw": [0] * 8}},
         "tc_tsa values"),
        ({"name": "p0", "speed": 100}, "unknown key"),
    ],
)  # fmt: skip
def test_net_config_violations_name_the_key(iface: dict, message: str) -> None:
    with pytest.raises(net.NetConfigError, match=message):
        net.parse_net({"interfaces": [iface]})


def test_agent_config_accepts_net_and_reports_errors_as_config_errors(tmp_path: Path) -> None:
    good = tmp_path / "a.toml"
    good.write_text('[net]\n[[net.interfaces]]\nname = "p0"\nmtu = 9000\nvlan = 100\n'
                    'dscp_prio = { "26" = 3 }\ntrust = "dscp"\npfc_priorities = [3]\n')  # fmt: skip
    cfg = load_config(good, environ={})
    assert cfg.net is not None and cfg.net.interfaces[0].l3_name == "p0.100"
    assert cfg.net.interfaces[0].dscp_prio == {26: 3}
    bad = tmp_path / "b.toml"
    bad.write_text('[net]\n[[net.interfaces]]\nname = "p0"\nmtu = 1\n')
    with pytest.raises(ConfigError, match="mtu = 1"):
        load_config(bad, environ={})


# --- dcb: command lines and recorded JSON --------------------------------------------------


def test_dcb_command_lines() -> None:
    assert net.pfc_argv("p0", (3,)) == ["dcb", "pfc", "set", "dev", "p0", "prio-pfc",
                                        "all:off", "3:on"]  # fmt: skip
    assert net.app_argv("add", "p0", {48: 6, 26: 3}, netns="ns1") == [
        "dcb", "-n", "ns1", "app", "add", "dev", "p0", "dscp-prio", "26:3", "48:6",
    ]  # fmt: skip
    ets = net.EtsSpec(prio_tc=(0, 0, 0, 3, 0, 0, 6, 0), tc_tsa=("ets",) * 6 + ("strict",) * 2,
                      tc_bw=(20, 0, 0, 80, 0, 0, 0, 0))  # fmt: skip
    argv = net.ets_argv("p0", ets)
    assert argv[:6] == ["dcb", "ets", "set", "dev", "p0", "prio-tc"]
    assert argv[argv.index("tc-tsa") + 7] == "6:strict" and argv[-8] == "0:20"
    assert net.show_argv("pfc", "p0") == ["dcb", "-j", "-N", "pfc", "show", "dev", "p0"]


def test_dcb_recorded_json_parses() -> None:
    assert net.parse_pfc(_recorded("dcb_pfc_show.json")) == (3,)
    assert net.parse_pfc(_recorded("dcb_pfc_show_default.json")) == ()
    assert net.parse_app(_recorded("dcb_app_show.json")) == {26: 3, 48: 6}
    assert net.parse_app(_recorded("dcb_app_show_names.json")) == {26: 3, 46: 5, 48: 6}
    ets = net.parse_ets(_recorded("dcb_ets_show.json"))
    assert ets.prio_tc == tuple(range(8)) and sum(ets.tc_bw) == 100
    bad_docs = [(net.parse_pfc, {"prio_pfc": [True]}), (net.parse_pfc, []),
                (net.parse_app, {"dscp_prio": [[1]]}), (net.parse_app, {"dscp_prio": [["XX1", 1]]}),
                (net.parse_app, []), (net.parse_ets, {"tc_bw": []})]  # fmt: skip
    for parser, bad in bad_docs:
        with pytest.raises(ValueError):
            parser(bad)  # type: ignore[operator]


def _live_with_dcb(dcb: net.DcbState, sysfs: dict[str, str] | None = None) -> net.NetLive:
    link = net.LinkState(index=2, mtu=9000, up=True, kind="")
    return net.NetLive(links={"p0": link}, dcb={"p0": dcb}, sysfs={"p0": sysfs or {}})


def test_plan_from_recorded_dcb_sets_pfc_replaces_stale_dscp_and_ets() -> None:
    live = _live_with_dcb(net.DcbState(
        pfc=net.parse_pfc(_recorded("dcb_pfc_show_default.json")),
        dscp_prio=net.parse_app(_recorded("dcb_app_show_names.json")),
        ets=net.parse_ets(_recorded("dcb_ets_show.json")),
    ))  # fmt: skip
    desired = net.parse_net({"interfaces": [{
        "name": "p0", "pfc_priorities": [3], "trust": "dscp", "dscp_prio": {"26": 3, "48": 7},
        "ets": {"prio_tc": [0, 0, 0, 3, 0, 0, 0, 0], "tc_tsa": ["ets"] * 8,
                "tc_bw": [50, 0, 0, 50, 0, 0, 0, 0]},
    }]})  # fmt: skip
    p = net.plan(desired, live)
    kinds = [(s.kind, s.params) for s in p.steps]
    assert ("dcb_pfc", {"prios": [3]}) in kinds
    assert ("dcb_app_del", {"dscp_prio": {46: 5, 48: 6}}) in kinds  # EF and the old CS6 entry
    assert ("dcb_app_add", {"dscp_prio": {48: 7}}) in kinds
    assert [k for k, _ in kinds].index("dcb_app_del") < [k for k, _ in kinds].index("dcb_app_add")
    assert any(k == "dcb_ets" for k, _ in kinds)
    assert any("qos/trust" in n for n in p.notes)  # this "driver" has no trust knob: noted
    in_sync = _live_with_dcb(net.DcbState(pfc=(3,), dscp_prio={26: 3, 48: 7},
                                          ets=desired.interfaces[0].ets))  # fmt: skip
    assert not net.plan(desired, in_sync).steps


# --- in a namespace ------------------------------------------------------------------------


@can_netns
def test_apply_sets_mtu_addresses_routes_qdisc_and_reads_back(netns: str) -> None:
    desired = _desired(netns, mtu=9000, addresses=["192.0.2.10/24", "2001:db8::10/64"],
                       routes=[{"dst": "198.51.100.0/24", "gateway": "192.0.2.1"},
                               {"dst": "203.0.113.0/24"}], qdisc="htb")  # fmt: skip
    before = _plan(desired)
    kinds = ["link_set_mtu", "link_up", "addr_add", "addr_add", "route_add", "route_add"]
    assert [s.kind for s in before.steps] == [*kinds, "qdisc_replace"]
    result = _apply(desired)
    assert len(result.applied) == 7 and result.after.in_sync
    link = next(x for x in _ip(netns, "link", "show", "va"))  # type: ignore[union-attr]
    assert link["mtu"] == 9000 and "UP" in link["flags"]
    addrs = {f"{a['local']}/{a['prefixlen']}" for x in _ip(netns, "addr", "show", "va")  # type: ignore[union-attr]
             for a in x["addr_info"]}  # fmt: skip
    assert {"192.0.2.10/24", "2001:db8::10/64"} <= addrs
    routes = {(r["dst"], r.get("gateway", "")) for r in _ip(netns, "route", "show")}  # type: ignore[union-attr]
    assert {("198.51.100.0/24", "192.0.2.1"), ("203.0.113.0/24", "")} <= routes
    out = subprocess.run(["tc", "-n", netns, "-j", "qdisc", "show", "dev", "va"],
                         capture_output=True, text=True, check=True)  # fmt: skip
    qdisc = json.loads(out.stdout)
    assert any(q["kind"] == "htb" and q.get("root") for q in qdisc)  # type: ignore[union-attr]
    assert not _apply(desired).applied  # idempotent


@can_netns
def test_gateway_change_is_a_replace_and_extra_addresses_are_kept(netns: str) -> None:
    _apply(_desired(netns, addresses=["192.0.2.10/24"],
                    routes=[{"dst": "198.51.100.0/24", "gateway": "192.0.2.1"}]))  # fmt: skip
    subprocess.run(["ip", "-n", netns, "addr", "add", "192.0.2.99/24", "dev", "va"], check=True)
    desired = _desired(netns, addresses=["192.0.2.10/24"],
                       routes=[{"dst": "198.51.100.0/24", "gateway": "192.0.2.2"}])  # fmt: skip
    p = _plan(desired)
    assert [s.kind for s in p.steps] == ["route_replace"]
    assert "va address 192.0.2.99/24" in p.unmanaged
    assert _apply(desired).after.in_sync
    assert ("198.51.100.0/24", "192.0.2.2") in {
        (r["dst"], r.get("gateway", ""))
        for r in _ip(netns, "route", "show")  # type: ignore[union-attr]
    }
    assert "192.0.2.99" in json.dumps(_ip(netns, "addr", "show", "va"))  # not removed


@can_netns
def test_missing_link_is_a_conflict_and_nothing_is_applied(netns: str) -> None:
    desired = net.parse_net({"netns": netns, "interfaces": [
        {"name": "va", "mtu": 9000}, {"name": "p0", "mtu": 9000}]})  # fmt: skip
    with pytest.raises(net.NetConflict, match="p0: no such link"):
        _apply(desired)
    assert next(iter(_ip(netns, "link", "show", "va")))["mtu"] == 1500  # type: ignore[call-overload]


@can_netns
def test_vlan_link_carries_addresses_or_the_kernel_refusal_stops_apply(netns: str) -> None:
    desired = _desired(netns, mtu=9000, vlan=100, addresses=["192.0.2.10/24"])
    assert [s.kind for s in _plan(desired).steps][:3] == ["link_set_mtu", "link_up", "vlan_add"]
    try:
        result = _apply(desired)
    except net.NetApplyError as e:  # a kernel without 802.1Q (this CI's): a clear stop
        assert e.step["kind"] == "vlan_add" and len(e.done) == 2, e
        assert "Operation not supported" in e.message or "netlink error" in e.message
        assert next(iter(_ip(netns, "link", "show", "va")))["mtu"] == 9000  # type: ignore[call-overload]
        return
    assert result.after.in_sync
    vlan = next(iter(_ip(netns, "-d", "link", "show", "va.100")))  # type: ignore[call-overload]
    assert vlan["linkinfo"]["info_data"]["id"] == 100


@can_netns
@pytest.mark.skipif(shutil.which("dcb") is None, reason="iproute2 dcb not installed")
def test_real_dcb_refuses_on_veth_and_plan_reports_a_conflict(netns: str) -> None:
    state = net.read_dcb("va", netns)
    assert state.pfc is None and "Operation not supported" in state.error
    with pytest.raises(net.DcbError, match="Operation not supported") as e:
        net.run_dcb(net.pfc_argv("va", (3,), netns))
    assert e.value.unsupported and e.value.returncode == 1
    desired = _desired(netns, mtu=9000, pfc_priorities=[3], trust="dscp", dscp_prio={"26": 3})
    p = _plan(desired)
    assert any("driver has no DCB" in c for c in p.conflicts)
    with pytest.raises(net.NetConflict):
        _apply(desired)
    assert next(iter(_ip(netns, "link", "show", "va")))["mtu"] == 1500  # type: ignore[call-overload]


@can_netns
def test_ecn_knobs_where_the_driver_has_them(netns: str, tmp_path: Path) -> None:
    """The DOCA driver's layout (/sys/class/net/X/ecn/roce_np/enable/<prio>, ...), laid out
    under a scratch root: this kernel's veth has none, which plan notes and skips."""
    for side in ("roce_np", "roce_rp"):
        for prio in range(8):
            f = tmp_path / "va" / "ecn" / side / "enable" / str(prio)
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text("0\n")
    (tmp_path / "va" / "ecn" / "roce_np" / "cnp_dscp").write_text("46\n")
    desired = _desired(netns, ecn={"np_priorities": [3], "rp_priorities": [3], "cnp_dscp": 48,
                                   "cnp_802p_prio": 6})  # fmt: skip
    p = _plan(desired, tmp_path)
    assert {s.params["knob"] for s in p.steps if s.kind == "sysfs_write"} == {
        "ecn/roce_np/enable/3", "ecn/roce_rp/enable/3", "ecn/roce_np/cnp_dscp"}  # fmt: skip
    assert any("cnp_802p_prio" in n for n in p.notes)
    assert _apply(desired, tmp_path).after.steps == ()
    assert (tmp_path / "va/ecn/roce_rp/enable/3").read_text().strip() == "1"
    assert (tmp_path / "va/ecn/roce_np/cnp_dscp").read_text().strip() == "48"
    assert any("no sysfs knob" in n for n in _plan(desired).notes)  # the real /sys: none


@can_netns
def test_cli_plan_apply_status_exit_codes(netns: str, tmp_path: Path) -> None:
    cfg = tmp_path / "agent.toml"
    cfg.write_text(f'[net]\nnetns = "{netns}"\n[[net.interfaces]]\nname = "va"\nmtu = 9000\n'
                   'addresses = ["192.0.2.10/24"]\n')  # fmt: skip
    run = CliRunner().invoke
    assert run(cli, ["net", "status", "--config", str(cfg)]).exit_code == 1
    r = run(cli, ["net", "plan", "--config", str(cfg), "--json"])
    assert r.exit_code == 0 and len(json.loads(r.output)["steps"]) == 3
    r = run(cli, ["net", "apply", "--config", str(cfg), "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["after"]["in_sync"]
    assert run(cli, ["net", "status", "--config", str(cfg)]).exit_code == 0
    r = run(cli, ["net", "plan", "--config", str(cfg), "--netns", "t16-no-such-ns", "--json"])
    assert r.exit_code == 3 and "no network namespace" in json.loads(r.output)["error"]
    assert not Path("/var/run/netns/t16-no-such-ns").exists()  # pyroute2 did not create it
    cfg.write_text('[net]\n[[net.interfaces]]\nname = "va"\nmtu = 5\n')
    r = run(cli, ["net", "plan", "--config", str(cfg), "--json"])
    assert r.exit_code == 4 and "mtu = 5" in json.loads(r.output)["error"]


@can_netns
def test_net_apply_exits_nonzero_when_it_skipped_a_knob(netns: str, tmp_path: Path) -> None:
    """ECN asked for on a driver without the knobs (a veth, an empty sysfs root): apply runs what
    it can, names the skipped knobs in notes, and does not say converged (exit 1)."""
    cfg = tmp_path / "agent.toml"
    cfg.write_text(f'[net]\nnetns = "{netns}"\n[[net.interfaces]]\nname = "va"\nmtu = 9000\n'
                   '[net.interfaces.ecn]\nnp_priorities = [3]\nrp_priorities = [3]\n')  # fmt: skip
    root = tmp_path / "sys"
    root.mkdir()
    r = CliRunner().invoke(cli, ["net", "apply", "--config", str(cfg), "--sysfs-root", str(root),
                                 "--json"])  # fmt: skip
    doc = json.loads(r.output)
    assert doc["after"]["in_sync"] and doc["applied"]  # the MTU step ran
    assert any("no sysfs knob" in n for n in doc["after"]["notes"])
    assert r.exit_code == 1
