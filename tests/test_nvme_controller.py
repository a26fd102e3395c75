"""The target's controller logic without sockets: properties, Identify, log pages, features."""

from __future__ import annotations

import pytest

from dpu_agent.blockdev import MemoryBlockDevice
from dpu_agent.nvmf import Controller, Subsystem, TargetOptions, tenant_nqn
from kvproto.nvme import (
    Cns,
    DiscoveryLog,
    FeatureId,
    IdentifyController,
    IdentifyNamespace,
    LogPageId,
    Property,
    Status,
    async_event_request,
    get_features,
    get_log_page,
    identify,
    property_get,
    property_set,
    set_features,
)

NQN = tenant_nqn("acme")


def make_ctrl(*, discovery: bool = False, kato_ms: int = 0) -> Controller:
    sub = None if discovery else Subsystem(NQN, {"nqn.h"}, {1: MemoryBlockDevice(16)})
    log = DiscoveryLog(genctr=3, entries=()).pack()
    return Controller(
        cntlid=7,
        subsystem=sub,
        subnqn=NQN if sub else "nqn.2014-08.org.nvmexpress.discovery",
        hostnqn="nqn.h",
        hostid=bytes(16),
        kato_ms=kato_ms,
        options=TargetOptions(max_io_size=1 << 20, keep_alive_granularity_ms=1000),
        discovery_log=lambda host: log,
    )


def enable(ctrl: Controller) -> None:
    done, reset = ctrl.property_set(property_set(cid=1, prop=Property.CC, value=0x460001))
    assert done.status is Status.SUCCESS and not reset


def test_properties_and_enable() -> None:
    c = make_ctrl()
    cap = c.property_get(property_get(cid=1, prop=Property.CAP))
    assert (cap.cdw0 & 0xFFFF) == 127 and cap.cdw0 >> 16 & 1 and cap.cdw1 >> 5 & 1  # MQES, CQR, CSS
    assert c.property_get(property_get(cid=1, prop=Property.VS)).cdw0 == 0x00010300
    assert c.admin(identify(cid=1, cns=Cns.CONTROLLER), b"").status is Status.COMMAND_SEQUENCE_ERROR
    enable(c)
    assert c.property_get(property_get(cid=1, prop=Property.CSTS)).cdw0 & 1
    _, reset = c.property_set(property_set(cid=1, prop=Property.CC, value=0x460000))
    assert reset and not c.enabled


def test_identify_controller_and_namespace() -> None:
    c = make_ctrl()
    enable(c)
    ident = IdentifyController.unpack(c.admin(identify(cid=1, cns=Cns.CONTROLLER), b"").data or b"")
    assert ident.cntlid == 7 and ident.mdts == 8 and ident.subnqn == NQN and ident.nn == 32
    ns = IdentifyNamespace.unpack(
        c.admin(identify(cid=1, cns=Cns.NAMESPACE, nsid=1), b"").data or b""
    )
    assert ns.nsze == 16 and ns.block_size == 4096 and any(ns.nguid)
    assert c.admin(identify(cid=1, cns=Cns.NAMESPACE, nsid=5), b"").data == bytes(4096)
    assert (
        c.admin(identify(cid=1, cns=Cns.NAMESPACE, nsid=999), b"").status
        is Status.INVALID_NAMESPACE
    )
    active = c.admin(identify(cid=1, cns=Cns.ACTIVE_NAMESPACES), b"").data or b""
    assert active == (1).to_bytes(4, "little")  # the connection pads it to the SGL length
    assert c.admin(identify(cid=1, cns=0x10), b"").status is Status.INVALID_FIELD


def test_log_pages() -> None:
    d = make_ctrl(discovery=True)
    enable(d)
    page = d.admin(get_log_page(cid=1, lid=LogPageId.DISCOVERY, length=1024), b"").data or b""
    assert DiscoveryLog.record_count(page) == (3, 0)
    tail = d.admin(get_log_page(cid=1, lid=LogPageId.DISCOVERY, length=8, offset=1020), b"")
    assert tail.data == bytes(8)  # past the end: zeros
    c = make_ctrl()
    enable(c)
    assert (
        c.admin(get_log_page(cid=1, lid=LogPageId.DISCOVERY, length=1024), b"").status
        is Status.INVALID_LOG_PAGE
    )
    assert c.admin(get_log_page(cid=1, lid=LogPageId.SMART, length=512), b"").data == bytes(512)


def test_features_and_aer_limit() -> None:
    c = make_ctrl(kato_ms=1500)
    enable(c)
    assert c.kato_ms == 2000  # rounded up to the KAS granularity, as SPDK does
    nq = c.admin(set_features(cid=1, fid=FeatureId.NUMBER_OF_QUEUES, cdw11=0x00030003), b"")
    assert nq.cdw0 == 0x00030003
    assert c.admin(get_features(cid=1, fid=FeatureId.KEEP_ALIVE_TIMER), b"").cdw0 == 2000
    assert c.admin(get_features(cid=1, fid=0x7E), b"").status is Status.INVALID_FIELD
    held = [c.admin(async_event_request(cid=i), b"") for i in range(4)]
    assert all(h.hold for h in held)
    assert c.admin(async_event_request(cid=9), b"").status is Status.ASYNC_EVENT_LIMIT_EXCEEDED


def test_keep_alive_expiry() -> None:
    now = [0.0]
    c = make_ctrl(kato_ms=1000)
    c._clock = lambda: now[0]  # the clock is injected
    c.keep_alive()
    now[0] = 0.9
    assert not c.keep_alive_expired(now[0])
    now[0] = 1.2
    assert c.keep_alive_expired(now[0])


def test_subsystem_and_options_validation() -> None:
    with pytest.raises(ValueError):
        Subsystem("not-an-nqn", set(), {})
    with pytest.raises(ValueError):
        Subsystem("nqn.2014-08.org.nvmexpress.discovery", set(), {})
    with pytest.raises(ValueError):
        Subsystem(NQN, set(), {0: MemoryBlockDevice(1)})
    with pytest.raises(ValueError):
        TargetOptions(max_io_size=3 << 20)
    with pytest.raises(ValueError):
        tenant_nqn("two words")
    assert Subsystem(NQN, set(), {}, allow_any_host=True).host_allowed("nqn.anyone")
