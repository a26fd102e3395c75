"""The composite operations behind `dpuctl net ...`: each returns plain JSON-able data."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pyroute2 import IPRoute

from dpu_agent.net._desired import NetDesired, check_netns, load_net
from dpu_agent.net._live import SYSFS_NET, open_ipr, read_live
from dpu_agent.net._reconcile import apply, plan

__all__ = ["NETNS_DIR", "NetnsMissing", "net_session", "run_apply", "run_plan", "run_status"]

NETNS_DIR = Path("/var/run/netns")


class NetnsMissing(Exception):
    """The named network namespace does not exist (pyroute2 would create it: refuse)."""


@contextlib.contextmanager
def net_session(config: str, netns: str | None) -> Iterator[tuple[NetDesired, IPRoute]]:
    desired = load_net(config)
    if netns is not None:
        desired = dataclasses.replace(desired, netns=check_netns(netns, "--netns"))
    if desired.netns and not (NETNS_DIR / desired.netns).exists():
        raise NetnsMissing(f"no network namespace {desired.netns!r} (ip netns list)")
    with open_ipr(desired.netns) as ipr:
        yield desired, ipr


def run_plan(config: str, netns: str | None = None, sysfs_root: Path = SYSFS_NET) -> Any:
    with net_session(config, netns) as (desired, ipr):
        return plan(desired, read_live(desired, ipr, sysfs_root)).to_json()


def run_status(config: str, netns: str | None = None, sysfs_root: Path = SYSFS_NET) -> Any:
    """The plan as a drift report: what differs, what is outside [net]."""
    return run_plan(config, netns, sysfs_root)


def run_apply(config: str, netns: str | None = None, sysfs_root: Path = SYSFS_NET) -> Any:
    with net_session(config, netns) as (desired, ipr):
        return apply(desired, ipr, sysfs_root).to_json()
