"""SPDK mode: the agent's tiers are namespaces of SPDK's nvmf target (docs/SPDK.md).

SPDK owns the drive, the DRAM bdevs and the encryption (its crypto vbdev); the agent keeps the
index, leases and placement, and moves data between tiers (demotion DRAM -> NVMe) the way a
host would: through its own NVMe/TCP initiator on SPDK's loopback listener. Hosts read the
extents a lookup returns from the same namespaces, through SPDK's listeners, so the agent runs
no NVMe/TCP target of its own and does not wrap the tiers in AES-XTS.

    check_spdk(desired, keystore, apply_on_start=False)   # plan (or apply) at start
    devices = SpdkDevices.connect(agent_tiers(desired))   # one controller per subsystem
    engine = Engine(config, device_factory=devices)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from dpu_agent.blockdev import BlockDeviceError
from dpu_agent.crypto import KeyStore
from dpu_agent.engine import TierDevices, TierSpec
from dpu_agent.log import get_logger
from host_shim.nvme import NvmeError, NvmeTcpBlockDevice, NvmeTcpController
from spdk_plugins import (
    ApplyError,
    PlanConflict,
    SpdkClient,
    SpdkConnectionError,
    SpdkDesired,
    SpdkError,
    TierTarget,
    apply,
    keystore_provider,
    plan,
)
from spdk_plugins.versions import SpdkVersionError, check_target_version

__all__ = [
    "NVME_CONNECT_TIMEOUT_S",
    "SpdkDevices",
    "SpdkModeError",
    "SpdkNamespace",
    "check_spdk",
    "listener_for",
]

log = get_logger(__name__)

# Connecting to a loopback listener takes milliseconds; 10 s covers a target still starting.
NVME_CONNECT_TIMEOUT_S = 10.0
# The agent's own I/O is demotion copies and in-process reads: two queues keep one copy from
# waiting behind another; hosts have their own connections.
NVME_IO_QUEUES = 2
PLAN_STEPS_SHOWN_MAX = 5  # the refusal message lists this many pending steps, then a count


class SpdkModeError(Exception):
    """SPDK mode cannot start: the message names the socket or address and what to do."""


def check_spdk(
    desired: SpdkDesired, keystore: KeyStore, *, apply_on_start: bool, source: str = "FILE"
) -> int:
    """Plan against SPDK's RPC socket; refuse to start unless in sync, or apply first.

    Returns the number of steps applied. Key material comes from `keystore` (never logged);
    `source` is the config file, for the commands the refusal suggests.
    """
    provider = keystore_provider(desired, keystore)
    try:
        with SpdkClient(desired.socket, timeout_s=desired.rpc_timeout_s) as client:
            release = check_target_version(client)  # before any plan: names differ by release
            log.info("spdk_release", socket=desired.socket, release=release)
            if apply_on_start:
                result = apply(desired, client, provider)
                todo = result.after
                applied = len(result.applied)
            else:
                todo = plan(desired, client, provider)
                applied = 0
    except (PlanConflict, ApplyError) as e:
        raise SpdkModeError(f"SPDK at {desired.socket}: {e}") from None
    except SpdkVersionError as e:
        raise SpdkModeError(f"SPDK at {desired.socket}: {e}") from None
    except SpdkConnectionError as e:
        raise SpdkModeError(f"{e} (or fix [spdk] socket in {source})") from None
    except SpdkError as e:
        raise SpdkModeError(f"SPDK at {desired.socket} failed: {e}") from None
    if not todo.in_sync:
        raise SpdkModeError(_out_of_sync(desired.socket, todo.to_json(), apply_on_start, source))
    log.info("spdk_in_sync", socket=desired.socket, steps_applied=applied)
    return applied


def _out_of_sync(socket: str, todo: dict[str, Any], applied: bool, source: str) -> str:
    whys = [s["why"] for s in todo["steps"]]
    shown = "; ".join(whys[:PLAN_STEPS_SHOWN_MAX])
    hidden = len(whys) - PLAN_STEPS_SHOWN_MAX
    more = f" (+{hidden} more)" if hidden > 0 else ""
    conflicts = "; ".join(todo["conflicts"])
    what = f"{len(whys)} step(s) pending: {shown}{more}" if whys else ""
    if conflicts:
        what = f"{what}; conflicts: {conflicts}" if what else f"conflicts: {conflicts}"
    fix = (
        f"Apply did not converge; see dpuctl spdk status --config {source}"
        if applied
        else f"Run dpuctl spdk apply --config {source}, or set [agent] spdk_apply_on_start = true"
    )
    return f"SPDK at {socket} does not match [spdk]: {what}. {fix}"


class SpdkNamespace:
    """An SPDK namespace as the engine's BlockDevice: initiator errors become BlockDeviceError.

    A dead connection makes every later call fail with BlockDeviceError naming the subsystem
    (a demotion gives its chunk back, a control request replies FAILED, which clients count
    as a miss); the agent reconnects when restarted.
    """

    # I/O traits (BlockDevice): every I/O is a round trip to SPDK's target.
    in_memory = lends_memory = mapped_reads = buffered_writes = False

    def __init__(self, target: TierTarget, device: NvmeTcpBlockDevice) -> None:
        self.target = target
        self._dev = device
        self._where = f"{target.subnqn} nsid {target.nsid} at {target.traddr}:{target.trsvcid}"

    def __repr__(self) -> str:
        return f"SpdkNamespace({self._where})"

    @property
    def block_size(self) -> int:
        return self._dev.block_size

    @property
    def block_count(self) -> int:
        return self._dev.block_count

    def read_into(self, lba: int, buf: memoryview) -> None:
        try:
            self._dev.read_into(lba, buf)
        except (NvmeError, OSError) as e:
            raise BlockDeviceError(f"read {self._where} LBA {lba}: {e}") from e

    def write(self, lba: int, data: memoryview | bytes) -> None:
        try:
            self._dev.write(lba, data)
        except (NvmeError, OSError) as e:
            raise BlockDeviceError(f"write {self._where} LBA {lba}: {e}") from e

    def flush(self) -> None:
        try:
            self._dev.flush()
        except (NvmeError, OSError) as e:
            raise BlockDeviceError(f"flush {self._where}: {e}") from e

    def deallocate(self, lba: int, block_count: int) -> None:
        try:
            self._dev.deallocate(lba, block_count)
        except (NvmeError, OSError) as e:
            raise BlockDeviceError(f"deallocate {self._where} LBA {lba}+{block_count}: {e}") from e

    def close(self) -> None:
        """The controller is shared by the subsystem's tiers; SpdkDevices.close() closes it."""


class SpdkDevices:
    """The engine's DeviceFactory in SPDK mode: (tenant, tier) -> the connected namespace."""

    def __init__(
        self, namespaces: dict[tuple[str, str], SpdkNamespace], controllers: list[Any]
    ) -> None:
        self._namespaces = namespaces
        self._controllers = controllers

    @classmethod
    def connect(
        cls, tiers: Iterable[TierTarget], *, timeout_s: float = NVME_CONNECT_TIMEOUT_S
    ) -> SpdkDevices:
        """One controller per subsystem, with the agent's host NQN; a clear error if refused."""
        ctrls: dict[str, NvmeTcpController] = {}
        namespaces: dict[tuple[str, str], SpdkNamespace] = {}
        try:
            for t in tiers:
                where = f"SPDK NVMe/TCP listener {t.traddr}:{t.trsvcid} (subsystem {t.subnqn})"
                try:
                    if t.subnqn not in ctrls:
                        ctrls[t.subnqn] = NvmeTcpController.connect(
                            t.traddr, int(t.trsvcid), t.subnqn, t.hostnqn,
                            io_queues=NVME_IO_QUEUES, timeout_s=timeout_s,
                        )  # fmt: skip
                    dev = NvmeTcpBlockDevice(ctrls[t.subnqn], t.nsid, owns_controller=False)
                except (NvmeError, OSError) as e:
                    raise SpdkModeError(
                        f"cannot reach {where} as host {t.hostnqn}: {e}; is spdk_tgt running "
                        "and the subsystem applied (dpuctl spdk status)?"
                    ) from None
                namespaces[(t.tenant, t.tier)] = SpdkNamespace(t, dev)
                log.info("spdk_tier_connected", tenant=t.tenant, tier=t.tier, nsid=t.nsid,
                         address=f"{t.traddr}:{t.trsvcid}", blocks=dev.block_count)  # fmt: skip
        except BaseException:
            for c in ctrls.values():
                c.close()
            raise
        return cls(namespaces, list(ctrls.values()))

    def __call__(self, tenant: str, spec: TierSpec) -> TierDevices:
        ns = self._namespaces.get((tenant, spec.name))
        if ns is None:
            raise SpdkModeError(
                f"tenant {tenant!r} has no SPDK namespace for tier {spec.name} (nsid "
                f"{spec.nsid}); add it to the tenant's [[spdk.subsystems]] and restart"
            )
        # SPDK's crypto vbdev encrypts: what the agent writes is what it stores (raw = device)
        return TierDevices(device=ns, raw=ns, key_generation=0)

    def tenants(self) -> set[str]:
        return {tenant for tenant, _ in self._namespaces}

    def close(self) -> None:
        for c in self._controllers:
            c.close()
        self._controllers = []


def listener_for(desired: SpdkDesired, tenant: str, local_host: str) -> dict[str, Any] | None:
    """The TCP listener a host should use for `tenant`'s subsystem: the one on the address the
    host reached the agent at, else the first non-loopback one, else the first one."""
    for s in desired.subsystems:
        if s.tenant != tenant:
            continue
        tcp = [x for x in s.listeners if x.trtype == "TCP"]
        if not tcp:
            return None
        same = [x for x in tcp if x.traddr == local_host]
        remote = [x for x in tcp if not x.traddr.startswith("127.") and x.traddr != "::1"]
        best = (same or remote or tcp)[0]
        return {
            "host": best.traddr,
            "port": int(best.trsvcid),
            "subnqn": s.nqn,
            "listeners": [x.address() for x in s.listeners],
        }
    return None
