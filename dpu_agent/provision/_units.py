"""What the DPU image gets besides the agent: systemd units and the service user.

`dpukv-agent.service` runs `dpuctl agent run` as the unprivileged user `dpukv` (created at
boot by systemd-sysusers): `Type=notify` (the agent sends READY=1 once it serves, then
WATCHDOG=1 pings from its event loop), `Restart=on-failure`, and a sandbox: nothing writable
but its state directory, no capabilities (ports above 1024, files it owns, loopback NVMe/TCP
to SPDK), only the address families and devices (RDMA verbs) it uses.
`dpukv-firstboot.service` applies the firmware profile to each physical function and the [net]
section once, as root (mlxconfig and netlink need it); exit 5 of `dpuctl firmware apply`
(written, waits for a power cycle) counts as success.

Units are data, not code: every value put into one (the profile name, device names, paths) is
checked against a strict pattern here, whoever called, and written as one systemd word
(`exec_arg`): double-quoted with C escapes where it is not plain, `%` and `$` doubled, control
characters (a newline would start a new directive) refused.
"""

from __future__ import annotations

import re

from dpu_agent.firmware._profile import PROFILE_NAME_RE

__all__ = [
    "AGENT_UNIT",
    "CONFIG_DIR",
    "DEVICE_RE",
    "FIRSTBOOT_FLAG",
    "FIRSTBOOT_UNIT",
    "PREFIX",
    "STATE_DIR",
    "SYSUSERS",
    "UnitValueError",
    "agent_unit",
    "exec_arg",
    "firstboot_unit",
    "sysusers",
]

PREFIX = "/opt/dpukv"  # venv at PREFIX/venv
CONFIG_DIR = "/etc/dpukv"
STATE_DIR = "/var/lib/dpukv"
FIRSTBOOT_FLAG = f"{CONFIG_DIR}/firstboot"
AGENT_UNIT = "dpukv-agent.service"
FIRSTBOOT_UNIT = "dpukv-firstboot.service"
SYSUSERS = "dpukv.conf"
# The agent checkpoints its index on SIGTERM: a large NVMe tier's checkpoint takes a while.
STOP_TIMEOUT_S = 300
# Missed pings before systemd restarts the agent: its loop pings every WatchdogSec/2.
WATCHDOG_S = 30
UNIT_ARG_BYTES_MAX = 4096  # a path or a device name; PATH_MAX, far above any real one
# What `mlxconfig -d` takes and a first-boot unit may name: an mst device, a PCI address
# ([domain:]bus:device.function) or an RDMA device name.
DEVICE_RE = re.compile(
    r"/dev/mst/[A-Za-z0-9][A-Za-z0-9_.]{0,63}"
    r"|(?:[0-9a-fA-F]{4}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]"
    r"|mlx5_[0-9]{1,3}"
)
_PLAIN_ARG_RE = re.compile(r"[A-Za-z0-9_./:@+,=-]+")  # a word systemd reads back as written


class UnitValueError(ValueError):
    """A value cannot go into a unit; the message names it and what is allowed."""


def exec_arg(value: str, *, command: bool = False) -> str:
    """`value` as one word of a unit's command line, read back by systemd exactly: as is when
    plain, else double-quoted with backslash escapes and `%` doubled (specifiers), `$` doubled
    in arguments (environment expansion; systemd does not expand the command itself, and
    refuses a command path holding a quote or a backslash: so do we). Control characters are
    refused, not escaped."""
    if not value or len(value.encode()) > UNIT_ARG_BYTES_MAX:
        raise UnitValueError(f"{value[:64]!r}: 1 to {UNIT_ARG_BYTES_MAX} bytes")
    if any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in value):
        raise UnitValueError(f"{value!r}: control characters (a newline, a tab) are refused")
    if _PLAIN_ARG_RE.fullmatch(value):
        return value
    if command and ('"' in value or "\\" in value):
        raise UnitValueError(f"{value!r}: systemd refuses a command path with a quote or '\\'")
    quoted = value.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
    return '"' + (quoted if command else quoted.replace("$", "$$")) + '"'


def _command(value: str, what: str) -> str:
    if not value.startswith("/"):
        raise UnitValueError(f"{what} {value!r}: an absolute path")
    return exec_arg(value, command=True)


def agent_unit(prefix: str = PREFIX, dpuctl: str = "") -> str:
    """The agent's unit; `dpuctl` names the executable where it is not PREFIX/venv/bin/dpuctl
    (an install from a clone: `dpuctl agent unit`)."""
    dpuctl = _command(dpuctl or f"{prefix}/venv/bin/dpuctl", "dpuctl")
    return f"""\
[Unit]
Description=dpu-kvtier context-memory agent (KV-cache tier on the BlueField DPU)
Documentation=https://github.com/dpu-kvtier/dpu-kvtier/blob/main/docs/OPERATIONS.md
After=network-online.target {FIRSTBOOT_UNIT}
Wants=network-online.target

[Service]
Type=notify
NotifyAccess=main
ExecStart={dpuctl} agent run --config {CONFIG_DIR}/agent.toml
Environment=DPUKV_AGENT_DATA_DIR={STATE_DIR}
Restart=on-failure
RestartSec=2
WatchdogSec={WATCHDOG_S}
TimeoutStartSec=300
TimeoutStopSec={STOP_TIMEOUT_S}
User=dpukv
Group=dpukv
StateDirectory=dpukv
StateDirectoryMode=0700
ConfigurationDirectory=dpukv
LimitNOFILE=65536
UMask=0077
# Sandbox: no capabilities, read-only system, private /tmp; of the devices only RDMA verbs
# (NVMe-oF/RDMA, NIXL), whose memory registration pins pages (MEMLOCK) and whose library asks
# the kernel through netlink (AF_NETLINK)
CapabilityBoundingSet=
AmbientCapabilities=
NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome=yes
PrivateTmp=yes
DevicePolicy=closed
DeviceAllow=char-infiniband_verbs rw
DeviceAllow=/dev/infiniband/rdma_cm rw
LimitMEMLOCK=infinity
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK
RestrictNamespaces=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
LockPersonality=yes
MemoryDenyWriteExecute=yes
SystemCallArchitectures=native
SystemCallFilter=@system-service
SystemCallErrorNumber=EPERM

[Install]
WantedBy=multi-user.target
"""


def firstboot_unit(
    profile: str, devices: tuple[str, ...], with_net: bool, prefix: str = PREFIX
) -> str:
    """At least one of a firmware profile and a [net] section (else no first-boot unit)."""
    assert profile or with_net, "nothing to do at first boot"
    assert devices or not profile, "a profile needs the devices to apply it to"
    if profile and not PROFILE_NAME_RE.fullmatch(profile):
        raise UnitValueError(f"firmware profile name {profile!r}: letters, digits, '_.-'")
    bad = [d for d in devices if not DEVICE_RE.fullmatch(d)]
    if bad:
        raise UnitValueError(
            f"firmware devices {bad}: an mst device (/dev/mst/NAME), a PCI address "
            "([domain:]bus:dev.fn) or an RDMA device (mlx5_N)"
        )
    dpuctl = _command(f"{prefix}/venv/bin/dpuctl", "prefix")
    steps = ""
    if profile:  # the mst driver gives /dev/mst/* names; PCI addresses work without it
        steps += "ExecStartPre=-/usr/bin/mst start\n"
        toml = exec_arg(f"{CONFIG_DIR}/firmware_profiles/{profile}.toml")
        for device in devices:
            steps += (f"ExecStart={dpuctl} firmware apply --device {exec_arg(device)} "
                      f"--profile {toml}\n")  # fmt: skip
    if with_net:
        steps += f"ExecStart={dpuctl} net apply --config {CONFIG_DIR}/agent.toml\n"
    return f"""\
[Unit]
Description=dpu-kvtier first boot: firmware profile and RoCE network
After=network-pre.target
Before={AGENT_UNIT}
ConditionPathExists={FIRSTBOOT_FLAG}

[Service]
Type=oneshot
RemainAfterExit=yes
{steps}ExecStartPost=/bin/rm -f {FIRSTBOOT_FLAG}
SuccessExitStatus=5
ProtectHome=yes
PrivateTmp=yes

[Install]
WantedBy=multi-user.target
"""


def sysusers() -> str:
    return f'u dpukv - "dpu-kvtier agent" {STATE_DIR}\n'
