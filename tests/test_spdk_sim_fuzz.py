"""Fuzz invariants of the simulator: any byte stream splits into values, an incomplete rest,
or a syntax error; any schema-shaped request either answers or fails with an RpcFail."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from spdk_sim._sim_common import RpcFail, load_sim_data
from spdk_sim._sim_target import SimTarget
from spdk_sim.sim import _MALFORMED, _Rest, _split_values

DATA = load_sim_data()
SCALARS: dict[str, st.SearchStrategy[Any]] = {
    "string": st.sampled_from(["", "Malloc0", "lvs0", "lvs0/lvol0", "nqn.2016-06.io.spdk:c1"]),
    "boolean": st.booleans(),
    "uint8": st.integers(0, 255),
    "uint16": st.integers(0, 2**16 - 1),
    "uint32": st.sampled_from([0, 1, 7, 512, 4096, 2**32 - 1]),
    "uint64": st.sampled_from([0, 1, 8, 4096, 2**20, 2**64 - 1]),
    "int32": st.integers(-(2**31), 2**31 - 1),
    "uuid": st.uuids().map(str),
    "object": st.just({"bdev_name": "Malloc0", "nsid": 1}),
    "array": st.just([]),
}


def _value(p: dict[str, Any]) -> st.SearchStrategy[Any]:
    if p["schema_type"] == "enum":
        return st.sampled_from(p["enum_values"])
    if p["name"] == "listen_address":
        return st.just({"trtype": "TCP", "traddr": "127.0.0.1", "trsvcid": "4420"})
    return SCALARS[p["schema_type"]]


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    method = draw(st.sampled_from(sorted(m for m in DATA["params"] if m != "spdk_kill_instance")))
    params = {}
    for p in DATA["params"][method]["params"]:
        if p["required"] or draw(st.booleans()):
            params[p["name"]] = draw(_value(p))
    return method, params


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(requests(), min_size=1, max_size=12))
def test_any_schema_shaped_request_answers_or_fails_cleanly(seq) -> None:
    target = SimTarget(
        DATA,
        uuid_factory=None,
        file_sizes={"": 4096 * 64},
        nvme_devices={},
        features=frozenset(),
        wait_for_rpc=False,
    )
    target.dispatch("bdev_malloc_create", {"name": "Malloc0", "block_size": 512, "num_blocks": 64})
    for method, params in seq:
        try:
            json.dumps(target.dispatch(method, params))
        except RpcFail:
            pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_split_cleanly(data: bytes) -> None:
    items = list(_split_values(data.decode("utf-8", errors="replace")))
    for item in items[:-1]:  # an incomplete rest or a syntax error can only come last
        assert item is not _MALFORMED and not isinstance(item, _Rest)
