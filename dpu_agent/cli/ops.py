"""Operator commands: agent run, status, stats, tenants, evict, checkpoint, backup, restore,
config show, doctor.

Human tables (rich) by default, ``--json`` for scripts. Exit codes:

- 0: done;
- 1: the operation failed (the agent answered with an error, or doctor found a problem);
- 2: usage error (bad option or argument; click's own code);
- 3: the agent is unreachable (not running, wrong address, or the connection broke);
- 4: the configuration is invalid (bad TOML, bad value, unreadable secret file).

Admin commands talk to the running agent over its control plane as tenant ``_admin`` with the
admin token from the data directory, over the Unix socket when there is one.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import json
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from dpu_agent.cli import LazyGroup
from dpu_agent.cli._common import fail as _fail
from dpu_agent.config import (
    DATA_DIR_ENV,
    EXIT_CONFIG,
    AgentConfig,
    ConfigError,
    load_config,
    read_secret,
)
from dpu_agent.units import SizeError, format_duration, format_size, format_timestamp, parse_size
from host_shim.control import (
    AgentUnreachable,
    ControlChannel,
    ControlError,
    parse_control_url,
)
from kvproto.control import (
    ADMIN_TENANT,
    KEY_BYTES,
    LocalProtocolError,
    token_problem,
    valid_tenant_name,
)

__all__ = ["EXIT_CONFIG", "EXIT_FAILED", "EXIT_OK", "EXIT_UNREACHABLE", "agent_group", "register"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3
# An agent answers its hello in milliseconds: no answer is an agent stopped (SIGSTOP, a hung
# host) or another program on its port, said at once rather than after the longest wait below.
HELLO_TIMEOUT_S = 10.0
REQUEST_TIMEOUT_S = 120.0  # status, stats, lists, tenant and host changes
ADMIN_TIMEOUT_S = 3600.0  # LONG_OPS: a large NVMe tier takes minutes; still bounded
LONG_OPS = frozenset({"checkpoint", "backup", "restore", "evict", "tenant_remove"})
F = TypeVar("F", bound=Callable[..., Any])
# Piped output (not a terminal) would be cut to rich's default 80 columns: tables are for people,
# so give them room; scripts use --json. Error lines are printed unwrapped (soft_wrap): a log or a
# script's grep gets one line per error, a terminal wraps them itself.
PIPED_WIDTH_COLUMNS = 200
_out = Console(width=None if sys.stdout.isatty() else PIPED_WIDTH_COLUMNS)
_err = Console(stderr=True)


# --- shared plumbing ----------------------------------------------------------------------


# Where an agent installed as a service keeps its data (scripts/ and the systemd unit use it)
SYSTEM_DATA_DIR = Path("/var/lib/dpukv")


class SizeParam(click.ParamType):
    """A size in bytes, written as people do: 4096, 512MiB, 10GiB, 2TB."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        try:
            return parse_size(value)
        except SizeError as e:
            self.fail(str(e), param, ctx)


SIZE = SizeParam()


def _check_tenant(name: str, as_json: bool) -> None:
    if not valid_tenant_name(name):
        _fail(
            EXIT_USAGE,
            f"tenant name {name!r} must match [a-z0-9][a-z0-9-]{{0,62}} "
            "(lowercase letters, digits, '-'; it becomes part of an NVMe NQN)",
            as_json,
        )


def _confirm(what: str, yes: bool, as_json: bool) -> None:
    """Destructive commands ask first; --yes answers for scripts (no terminal: --yes needed)."""
    if yes:
        return
    if not sys.stdin.isatty():
        _fail(EXIT_USAGE, f"{what}: add --yes to confirm (no terminal to ask on)", as_json)
    if not click.confirm(f"{what}?", default=False, err=True):
        _fail(EXIT_FAILED, f"{what}: not confirmed", as_json)


def yes_option(fn: F) -> F:
    return click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")(fn)


def common(fn: F) -> F:
    """--config and --json for every command."""
    fn = click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")(fn)
    return click.option(
        "--config",
        "config_path",
        type=click.Path(dir_okay=False),
        default=None,
        envvar="DPUKV_CONFIG",
        help="Agent TOML config (default: built-in defaults, ./var).",
    )(fn)


def config_of(
    config_path: str | None, as_json: bool = False, *, create: bool = True
) -> AgentConfig:
    """The configuration; `create` (the agent's start) also makes the data dir and tokens, read
    commands pass False and write nothing."""
    try:
        cfg = load_config(config_path)
        cfg.prepare(create=create)
    except (ConfigError, OSError) as e:
        _fail(EXIT_CONFIG, str(e), as_json)
    return cfg


def _state_pid(state: Any) -> int:
    """The pid a state file names; ValueError unless a plausible one (1e30 raised
    OverflowError in os.kill; 0 and -1 signalled a process group, "alive")."""
    pid = state["pid"]
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid < 1 << 22:
        raise ValueError(f"pid {pid!r}")
    return pid


def _live_state(cfg: AgentConfig) -> bool:
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        pid = _state_pid(json.loads(cfg.state_path.read_text()))
        try:
            os.kill(pid, 0)
        except PermissionError:
            return True  # alive, another user's process
        return True
    return False


def find_agent(config_path: str | None, as_json: bool) -> AgentConfig:
    """The configuration of the agent to talk to, with its admin token; nothing is created.

    Where it looks: the data dir that --config / DPUKV_CONFIG, DPUKV_DATA_DIR or
    DPUKV_AGENT_DATA_DIR name; else ./var, then /var/lib/dpukv (an agent installed as a
    service): the first with a running agent, else the first with an admin token."""
    explicit = bool(config_path or os.environ.get(DATA_DIR_ENV)
                    or os.environ.get("DPUKV_AGENT_DATA_DIR"))  # fmt: skip
    first = config_of(config_path, as_json, create=False)
    candidates = [first]
    if not explicit:
        system = config_of(config_path, as_json, create=False)
        system.agent.data_dir = str(SYSTEM_DATA_DIR)
        system.tenants.clear()
        system.prepare(create=False)
        candidates.append(system)
    chosen = next((c for c in candidates if _live_state(c)), None)
    chosen = chosen or next((c for c in candidates if c.admin_token), None)
    if chosen is None or not chosen.admin_token:
        looked = ", ".join(str(c.data_dir) for c in candidates)
        _fail(
            EXIT_UNREACHABLE,
            f"agent unreachable: no agent data found (looked in {looked}: "
            "no agent.json of a running agent, no admin.token); start one with 'dpuctl agent "
            f"run', or name its data dir with --config or {DATA_DIR_ENV}=DIR",
            as_json,
        )
    return chosen


def control_url(cfg: AgentConfig) -> str:
    """The running agent's control URL: its state file first, then the configuration."""
    try:
        state = json.loads(cfg.state_path.read_text())
        with contextlib.suppress(PermissionError):  # alive, another user's process
            os.kill(_state_pid(state), 0)  # a state file left by a killed agent does not count
        url = str(state["control"]["unix"] or state["control"]["tcp"])
        parse_control_url(url)  # a damaged file's URL is no address: use the configuration's
        return url
    except (OSError, ValueError, KeyError, TypeError):
        pass
    sock = cfg.unix_socket_path
    if sock is not None and sock.exists():
        return f"unix://{sock}"
    return f"tcp://{cfg.control.host}:{cfg.control.port}"


def admin_call(
    config_path: str | None, as_json: bool, op: str, progress: str = "", **fields: Any
) -> dict[str, Any]:
    """One admin request to the running agent; exits with 3 or 1 on failure."""
    return admin_session(
        config_path, as_json, op, lambda ch: ch.call(op, **fields), progress,
        timeout_s=ADMIN_TIMEOUT_S if op in LONG_OPS else REQUEST_TIMEOUT_S,
    )  # fmt: skip


def admin_session(
    config_path: str | None,
    as_json: bool,
    what: str,
    requests: Callable[[ControlChannel], dict[str, Any]],
    progress: str = "",
    *,
    timeout_s: float = REQUEST_TIMEOUT_S,
) -> dict[str, Any]:
    """`requests` on an admin session of the running agent (`what`: how a failure names
    them), each read waiting at most `timeout_s` (the hello HELLO_TIMEOUT_S); exits with 3
    or 1 on failure."""
    cfg = find_agent(config_path, as_json)
    url = control_url(cfg)
    try:
        with ControlChannel(
            url, ADMIN_TENANT, cfg.admin_token, timeout_s=HELLO_TIMEOUT_S, client="dpuctl"
        ) as ch:
            ch.connect()
            ch.set_timeout(timeout_s)
            if not progress or as_json:
                return requests(ch)
            with Progress(
                SpinnerColumn(),
                TextColumn(progress),
                TimeElapsedColumn(),
                console=_err,
                transient=True,
            ) as bar:
                bar.add_task(progress, total=None)
                return requests(ch)
    except AgentUnreachable as e:
        _fail(
            EXIT_UNREACHABLE,
            f"{e.message} ({url}, data dir {cfg.data_dir}); is the agent "
            "running? (dpuctl agent run)",
            as_json,
        )
    except LocalProtocolError as e:  # a value the protocol refuses before sending: usage
        _fail(EXIT_USAGE, str(e), as_json)
    except ControlError as e:
        _fail(EXIT_FAILED, f"{what}: {e}", as_json)
    except (KeyError, TypeError, AttributeError) as e:  # a reply of another shape: no traceback
        _fail(EXIT_FAILED, f"{what}: {url} answered in a shape this dpuctl does not know "
              f"({type(e).__name__}: {e}); is it this version's agent?", as_json)  # fmt: skip


def emit(data: Any, as_json: bool, human: Callable[[Any], None]) -> None:
    if as_json:
        click.echo(json.dumps(data, indent=1, sort_keys=True, default=_json_default))
    else:
        human(data)


def _json_default(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


TIMESTAMP_KEYS = ("started_at", "created", "created_at", "timestamp", "time")
# Keys whose numbers are bytes or seconds without saying so in a suffix: `evict` answers the
# bytes it freed; a checkpoint the seconds it took
BYTES_KEYS = ("bytes", "evicted")
SECONDS_KEYS = ("seconds",)
# Where 0 means "no limit" rather than zero bytes
NONE_WHEN_ZERO = ("quota_bytes",)
UNIT_SUFFIXES = ("_bytes_per_s", "_bytes", "_unix", "_s")


def _kind(name: str, value: Any) -> str:
    """What a value is, by its key: rate, bytes, seconds, time, or plain."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return "plain"
    if name.endswith("_bytes_per_s"):
        return "rate"
    if name.endswith("_bytes") or name in BYTES_KEYS:
        return "bytes"
    if name.endswith("_s") or name in SECONDS_KEYS:
        return "seconds"
    if (name in TIMESTAMP_KEYS or name.endswith("_unix")) and value > 1e9:  # not a counter
        return "time"
    return "plain"


def human(key: str, value: Any) -> str:
    """A value as a person reads it, by what its key says it is (--json keeps the raw one)."""
    name = key.rsplit(".", 1)[-1]
    kind = _kind(name, value)
    if name in NONE_WHEN_ZERO and value == 0:
        return "none"
    if kind == "rate":
        return f"{format_size(value) if abs(value) >= 1024 else f'{value} B'}/s"
    if kind == "bytes":
        return format_size(value) if abs(value) >= 1024 else f"{value} B"
    if kind == "seconds":
        return format_duration(float(value))
    if kind == "time":
        return format_timestamp(float(value))
    if isinstance(value, dict | list):
        return json.dumps(value, default=_json_default)
    return str(value)


def label(key: str, value: Any) -> str:
    """The key as a row label: without the unit suffix its humanised value already shows
    (`uptime_s` 2.5 s -> `uptime`)."""
    head, _, name = key.rpartition(".")
    if _kind(name, value) != "plain":
        for suffix in UNIT_SUFFIXES:
            if name.endswith(suffix) and len(name) > len(suffix):
                name = name.removesuffix(suffix)
                break
    return f"{head}.{name}" if head else name


def _kv_table(title: str, rows: dict[str, Any]) -> None:
    table = Table(title=escape(title), show_header=False)
    table.add_column(overflow="fold")
    table.add_column(overflow="fold")  # addresses and keys wrap, never cut with "..."
    for key, value in rows.items():
        table.add_row(escape(label(str(key), value)), escape(human(str(key), value)))
    _out.print(table)


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> dict[str, Any]:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = value
    return out


# --- human renderings -------------------------------------------------------------------------


def _rows_table(title: str, rows: list[dict[str, Any]]) -> None:
    table = Table(title=escape(title))
    columns = list(dict.fromkeys(k for row in rows for k in row))
    for col in columns:
        sample = next((row[col] for row in rows if col in row), None)
        table.add_column(escape(label(col, sample)), overflow="fold")
    for row in rows:
        table.add_row(*(escape(human(c, row[c])) if c in row else "" for c in columns))
    _out.print(table)


def show_status(data: dict[str, Any]) -> None:
    # one small table per member: ten columns of addresses do not fit a terminal side by side
    for member in data.get("members", []):
        # "restore" says something only when one was interrupted: no empty row otherwise
        shown = {k: v for k, v in member.items() if not (k == "restore" and not v)}
        _kv_table(f"dpukv agent {member.get('name', '?')}", shown)


def show_stats(data: dict[str, Any]) -> None:
    """Grouped: the totals, then one row per tenant and tier, then the last recovery."""
    stats = dict(data.get("stats", data))
    tenants = stats.pop("tenants", {})
    recovery = stats.pop("recovery", {})
    _kv_table("stats (all tenants)", stats)
    tiers: list[dict[str, Any]] = []
    for name, t in tenants.items():
        counters = {k: v for k, v in t.items() if k not in ("tiers", "tenant")}
        _kv_table(f"tenant {name}", counters)
        tiers += [{"tenant": name, "tier": tier, **row} for tier, row in t.get("tiers", {}).items()]
    if tiers:
        _rows_table("tiers", tiers)
    if recovery:
        _kv_table("last start's recovery", recovery)


def show_tenants(data: dict[str, Any]) -> None:
    _rows_table("tenants", data.get("tenants", []))


def show_done(what: str) -> Callable[[Any], None]:
    def show(data: Any) -> None:
        _kv_table(what, _flatten("", data, {}) or {"result": "ok"})

    return show


# --- doctor -------------------------------------------------------------------------------


_PYVERBS_PROBE = (
    "import pyverbs.device as d\n"
    "try:\n    print(' '.join(x.name.decode() for x in d.get_device_list()) or '-')\n"
    "except Exception as e:\n    print('!' + type(e).__name__ + ': ' + str(e))\n"
)


def _probe_rdma() -> tuple[str, str]:
    """RDMA devices through pyverbs: this interpreter's, else Debian's python3-pyverbs (it is
    built for the system python3), in a child so nothing here changes our sys.path."""
    sysfs = sorted(p.name for p in Path("/sys/class/infiniband").glob("*")) or ["none"]
    for python in (sys.executable, "/usr/bin/python3"):
        if not Path(python).exists():
            continue
        try:
            out = subprocess.run([python, "-c", _PYVERBS_PROBE], capture_output=True,
                                 text=True, timeout=20)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as e:
            return "fallback", f"pyverbs probe failed ({e}); NVMe/TCP over TCP"
        line = out.stdout.strip()
        if out.returncode != 0 or not line:
            continue  # pyverbs not importable by this interpreter
        if line.startswith("!"):
            return (
                "fallback",
                f"pyverbs ({python}) lists no devices ({line[1:]}); NVMe/TCP over TCP",
            )
        if line == "-":
            return "fallback", f"no RDMA devices (sysfs: {', '.join(sysfs)}); NVMe/TCP over TCP"
        return "ok", f"RDMA devices: {line} (pyverbs of {python})"
    return "fallback", "pyverbs not importable (apt-get install python3-pyverbs); NVMe/TCP over TCP"


def _probe_hugepages() -> tuple[str, str]:
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    except OSError as e:
        return "missing", f"cannot read /proc/meminfo: {e}"
    total = int(info.get("HugePages_Total", "0").strip() or 0)
    size = info.get("Hugepagesize", "?").strip()
    if total == 0:
        return "fallback", f"no hugepages ({size} each); SPDK needs some, embedded mode not"
    return "ok", f"{total} hugepages of {size}, {info.get('HugePages_Free', '?').strip()} free"


def _probe_spdk() -> tuple[str, str]:
    for path in ("/var/tmp/spdk.sock", os.environ.get("SPDK_RPC_SOCKET", "")):
        if path and Path(path).is_socket():
            return "ok", f"SPDK RPC socket at {path}"
    return "fallback", "no SPDK RPC socket (/var/tmp/spdk.sock); embedded NVMe/TCP target used"


def _probe_aesni() -> tuple[str, str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError as e:
        return "missing", f"cannot read /proc/cpuinfo: {e}"
    flags = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags = set(line.split(":", 1)[1].split())
            break
    have = [f for f in ("aes", "vaes", "pclmulqdq", "avx512f", "pmull") if f in flags]
    if "aes" in flags or "pmull" in flags:
        return "ok", f"CPU AES instructions: {', '.join(have)} ({platform.machine()})"
    return "fallback", "no AES instructions: software AES-XTS will be slow"


def _probe_gpu() -> tuple[str, str]:
    devs = sorted(glob.glob("/dev/nvidia[0-9]*"))
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10)
            if out.returncode == 0 and out.stdout.strip():
                return "ok", out.stdout.strip().splitlines()[0]
        except (OSError, subprocess.TimeoutExpired) as e:
            return "fallback", f"nvidia-smi failed: {e}"
    if devs:
        return "ok", f"GPU device nodes: {', '.join(devs)} (no nvidia-smi)"
    return "fallback", "no NVIDIA GPU (no nvidia-smi, no /dev/nvidia*); chunks go to host memory"


def _probe_nvme_tcp() -> tuple[str, str]:
    if Path("/sys/module/nvme_tcp").exists():
        return "ok", "kernel nvme-tcp module loaded"
    release = platform.release()
    found = glob.glob(f"/lib/modules/{release}/**/nvme-tcp.ko*", recursive=True)
    if found:
        return "fallback", "nvme-tcp module available but not loaded (modprobe nvme-tcp)"
    return "fallback", "no kernel nvme-tcp; the shim's userspace NVMe/TCP initiator is used"


def _probe_binary(name: str, version_args: list[str], why: str) -> tuple[str, str]:
    path = shutil.which(name)
    if not path:
        return "missing", f"{name} not installed ({why}); apt-get install {name}"
    try:
        out = subprocess.run([path, *version_args], capture_output=True, text=True, timeout=10)
        first = (out.stdout or out.stderr).strip().splitlines()
        return "ok", f"{path}: {first[0] if first else 'present'}"
    except (OSError, subprocess.TimeoutExpired) as e:
        return "missing", f"{path} does not run: {e}"


def _probe_crypto() -> tuple[str, str]:
    try:
        import dpu_agent.crypto  # noqa: F401  (needs the compiled sector loop)
    except (ImportError, OSError) as e:
        return "missing", f"AES-XTS loop not built ({e}); python -m dpu_agent.crypto._build"
    return "ok", "AES-XTS sector loop (dpu_agent.crypto) built"


BLUEFIELD_DEVICE_IDS = {"0xa2d6": "BlueField-2", "0xa2dc": "BlueField-3", "0xa2df": "BlueField-4"}
MELLANOX_VENDOR = "0x15b3"


def _mellanox_devices() -> dict[str, str]:
    """PCI address -> device id of every NVIDIA/Mellanox function (sysfs, no tool needed)."""
    found = {}
    for dev in sorted(Path("/sys/bus/pci/devices").glob("*")):
        with contextlib.suppress(OSError):
            if (dev / "vendor").read_text().strip() == MELLANOX_VENDOR:
                found[dev.name] = (dev / "device").read_text().strip()
    return found


def _probe_bluefield() -> tuple[str, str]:
    devs = _mellanox_devices()
    bf = {a: BLUEFIELD_DEVICE_IDS[d] for a, d in devs.items() if d in BLUEFIELD_DEVICE_IDS}
    if bf:
        first = next(iter(bf.items()))
        return "ok", f"{first[1]} at {first[0]}: SPDK's mlx5 accel module can run AES-XTS " + (
            "(crypto-enabled SKU and DATA_CRYPTO_ENGINE=ENABLED needed: dpuctl doctor cannot "
            "tell the SKU; check mlxconfig query)"
        )
    return "fallback", (
        "no BlueField (no PCI function 15b3:a2d6/a2dc/a2df): AES-XTS runs in software here; "
        "on a DPU the crypto vbdev offloads it to the NIC's crypto engine"
    )


def _probe_mlxconfig() -> tuple[str, str]:
    tool = shutil.which("mlxconfig") or shutil.which("mstconfig")
    devs = _mellanox_devices()
    if tool is None:
        return "fallback", (
            "no mlxconfig/mstconfig (apt-get install mstflint): firmware profiles cannot be "
            "read or applied here"
        )
    if not devs:
        return "fallback", f"{tool} present, but no NVIDIA/Mellanox device to configure"
    return "ok", f"{tool}; devices: {', '.join(devs)}"


def _probe_gpudirect() -> tuple[str, str]:
    if Path("/sys/module/nvidia_peermem").exists():
        return "ok", "nvidia-peermem loaded: GPU memory registers with the NIC (GPUDirect RDMA)"
    if glob.glob("/dev/nvidia[0-9]*"):
        return "fallback", (
            "GPU present, nvidia-peermem not loaded: NIXL (UCX) registers GPU memory by dma-buf "
            "where the RDMA driver supports it"
        )
    return "fallback", "no GPU: no GPUDirect RDMA; chunks land in host memory"


def _probe_nixl() -> tuple[str, str]:
    """NIXL for the agent-driven data path (host_shim.transport); NVMe/TCP without it."""
    from host_shim.transport import nixl_status

    st = nixl_status()
    if not st["available"]:
        return "fallback", f"{st['reason']}; clients use NVMe/TCP"
    return "ok", f"NIXL ({st['module']}, UCX): KVClient(transport='nixl'|'auto')"


def probe_rdma_select(sysfs: Path = Path("/sys")) -> tuple[str, str]:
    """What NIXL's UCX gets for DPUKV_RDMA_ADDRESS (device, port, GID index, PFC), or why
    the RDMA transport is refused; PFC from mlx5's sysfs qos/, else from `dcb`."""
    from host_shim.rdma import RdmaRefused, select_rdma
    from host_shim.transport._lib import RDMA_ADDRESS_ENV

    address = os.environ.get(RDMA_ADDRESS_ENV, "").strip()
    if not address:
        return "fallback", f"{RDMA_ADDRESS_ENV} unset: UCX picks devices and GID index itself"

    def pfc_of(netdev: str) -> tuple[int, ...] | None:
        from dpu_agent.net import read_dcb

        return read_dcb(netdev).pfc

    try:
        sel = select_rdma(address, sysfs=sysfs, pfc_of=pfc_of)
    except RdmaRefused as e:
        return "missing", f"RDMA transport refused: {e}"
    env = " ".join(f"{k}={v}" for k, v in sel.ucx_env().items())
    return "ok", f"{address}: {sel.netdev} {sel.state} {sel.link_layer}, PFC {list(sel.pfc)}; {env}"


def doctor_report() -> list[dict[str, str]]:
    from dpu_agent.cli._storage_probe import probe_agent_storage  # doctor's imports, not status's
    from dpu_agent.cluster._ops import probe_serf

    probes: list[tuple[str, Callable[[], tuple[str, str]]]] = [
        ("rdma", _probe_rdma),
        ("rdma-select", probe_rdma_select),
        ("hugepages", _probe_hugepages),
        ("spdk", _probe_spdk),
        ("aes", _probe_aesni),
        ("crypto", _probe_crypto),
        ("gpu", _probe_gpu),
        ("gpudirect", _probe_gpudirect),
        ("bluefield-crypto", _probe_bluefield),
        ("mlxconfig", _probe_mlxconfig),
        ("nvme-tcp", _probe_nvme_tcp),
        ("nixl", _probe_nixl),
        ("agent-storage", probe_agent_storage),
        ("serf", functools.partial(_probe_binary, "serf", ["version"], "cluster membership")),
        ("serf-rpc", probe_serf),
        (
            "redis-server",
            functools.partial(
                _probe_binary, "redis-server", ["--version"], "datapath benchmark baseline"
            ),
        ),
    ]
    return [{"check": name, "status": s, "detail": d} for name, fn in probes for s, d in [fn()]]


def show_doctor(rows: list[dict[str, str]]) -> None:
    table = Table(title="dpuctl doctor: what this machine offers")
    for col in ("check", "status", "detail"):
        table.add_column(col)
    colour = {"ok": "green", "fallback": "yellow", "missing": "red"}
    for r in rows:
        table.add_row(r["check"], f"[{colour[r['status']]}]{r['status']}[/]", r["detail"])
    _out.print(table)


def doctor_exit(rows: list[dict[str, str]]) -> int:
    return EXIT_FAILED if any(r["status"] == "missing" for r in rows) else EXIT_OK


# --- commands -----------------------------------------------------------------------------


@click.group("agent", help="Run the agent.")
def agent_group() -> None:
    pass


@agent_group.command("run", help="Run the agent in the foreground (Ctrl-C stops it cleanly).")
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    default=None,
    envvar="DPUKV_CONFIG",
    help="Agent TOML config (default: built-in defaults, ./var).",
)
def agent_run(config_path: str | None) -> None:
    from dpu_agent.service import run_agent  # the agent's imports only when it runs

    sys.exit(run_agent(config_of(config_path)))


# What the unit's sandbox hides from the service (PrivateTmp=yes: /tmp, /var/tmp; ProtectHome=yes:
# /home, /root, /run/user): an agent installed there cannot see its own executable or package.
HIDDEN_FROM_UNIT = ("/tmp", "/var/tmp", "/home", "/root", "/run/user")
PRODUCTION_VENV = "/opt/dpukv/venv"


def _hidden_from_unit(path: Path) -> str | None:
    """The sandboxed directory `path` lies under, or None."""
    for top in HIDDEN_FROM_UNIT:
        if path == Path(top) or Path(top) in path.parents:
            return top
    return None


@agent_group.command(
    "unit",
    help="Print a systemd unit running this dpuctl's agent as a service "
    "(embedded default or SPDK mode, config in /etc/dpukv/agent.toml).",
)
@click.option("--dpuctl", "dpuctl_path", default=None, metavar="PATH",
              help="The dpuctl the unit runs (default: this one).")  # fmt: skip
def agent_unit_cmd(dpuctl_path: str | None) -> None:
    from dpu_agent.provision import agent_unit  # the same unit a provisioned DPU gets
    from dpu_agent.provision._units import UnitValueError

    exe = dpuctl_path or shutil.which("dpuctl") or str(Path(sys.executable).parent / "dpuctl")
    exe = str(Path(exe).absolute())
    where = [("ExecStart " + exe, _hidden_from_unit(Path(exe)))]
    if dpuctl_path is None:  # this dpuctl's own package (an editable install from a clone)
        package = Path(__file__).resolve().parents[1]
        where.append((f"its package {package}", _hidden_from_unit(package)))
    for what, top in where:
        if top is not None:
            _fail(
                EXIT_USAGE,
                f"{what} is under {top}, which the unit's sandbox (PrivateTmp=yes, "
                "ProtectHome=yes) hides from the service: install the agent where systemd "
                f"lets it see it: python3 -m venv {PRODUCTION_VENV} && {PRODUCTION_VENV}/bin/pip "
                f"install 'dpu-kvtier[agent]', then {PRODUCTION_VENV}/bin/dpuctl agent unit",
                False,
            )
    try:
        unit = agent_unit(dpuctl=exe)
    except UnitValueError as e:
        _fail(EXIT_USAGE, f"--dpuctl: {e}", False)
    click.echo(unit, nl=False)
    _err.print(
        "install: dpuctl agent unit > /etc/systemd/system/dpukv-agent.service; "
        "write /etc/dpukv/agent.toml (0600) for this DPU from docs/examples/dpu-production.toml "
        "(real listeners, TLS, require_auth, tier sizes from dpuctl plan capacity; the embedded "
        "default listens on loopback only, which no host can reach); "
        "useradd --system --home /var/lib/dpukv dpukv; "
        "systemctl daemon-reload && systemctl enable --now dpukv-agent "
        "(data in /var/lib/dpukv, which dpuctl finds by itself)",
        highlight=False,
        soft_wrap=True,
    )


@click.command("status", help="Is the agent up, what does it serve.")
@common
def status(config_path: str | None, as_json: bool) -> None:
    emit(admin_call(config_path, as_json, "members"), as_json, show_status)


@click.command("stats", help="Engine statistics over all tenants.")
@common
def stats(config_path: str | None, as_json: bool) -> None:
    emit(admin_session(config_path, as_json, "stats", ControlChannel.admin_stats), as_json,
         show_stats)  # fmt: skip


@click.group("tenants", help="List, add, rotate and remove tenants.")
def tenants() -> None:
    pass


@tenants.command("list", help="Tenants and their usage.")
@common
def tenants_list(config_path: str | None, as_json: bool) -> None:
    emit(admin_call(config_path, as_json, "tenants_list"), as_json, show_tenants)


@tenants.command(
    "add",
    help="Add a tenant; prints its token once. With [cluster] "
    "etcd_endpoints: on every node, same token (docs/CLUSTER.md, Tenants).",
)
@click.argument("name")
@click.option("--quota", type=SIZE, default=None, help="Most bytes it may hold: 512MiB, 10GiB.")
@click.option("--token-file", type=click.Path(dir_okay=False), default=None,
              help="Use the token in this file (0600) instead of a generated one.")  # fmt: skip
@common
def tenants_add(
    name: str, quota: int | None, token_file: str | None, config_path: str | None, as_json: bool
) -> None:
    _check_tenant(name, as_json)
    token = _token_from(token_file, as_json)
    emit(
        admin_call(config_path, as_json, "tenant_add", tenant=name, quota_bytes=quota, token=token),
        as_json,
        show_done(f"tenant {name} added"),
    )


@tenants.command("rotate", help="Give a tenant a new token (printed once); its sessions end. "
                 "With [cluster] etcd_endpoints: on every node.")  # fmt: skip
@click.argument("name")
@click.option("--token-file", type=click.Path(dir_okay=False), default=None,
              help="Use the token in this file (0600) instead of a generated one.")  # fmt: skip
@common
def tenants_rotate(
    name: str, token_file: str | None, config_path: str | None, as_json: bool
) -> None:
    _check_tenant(name, as_json)
    token = _token_from(token_file, as_json)
    emit(
        admin_call(config_path, as_json, "tenant_rotate", tenant=name, token=token),
        as_json,
        show_done(f"tenant {name}: new token"),
    )


def _token_from(path: str | None, as_json: bool) -> str | None:
    """The token in `path` (a secret file: 0600, not empty), or None (the agent makes one)."""
    if path is None:
        return None
    try:
        token = read_secret(Path(path))
    except (OSError, ConfigError) as e:
        _fail(EXIT_USAGE, f"--token-file {path}: {e}", as_json)
    why = token_problem(token)
    if why is not None:
        _fail(EXIT_USAGE, f"--token-file {path}: the token {why}", as_json)
    return token


@tenants.command("remove", help="Remove a tenant: its token, sessions, key and chunks go.")
@click.argument("name")
@yes_option
@common
def tenants_remove(name: str, yes: bool, config_path: str | None, as_json: bool) -> None:
    _check_tenant(name, as_json)
    _confirm(f"remove tenant {name} and all its chunks", yes, as_json)
    emit(
        admin_call(config_path, as_json, "tenant_remove", tenant=name),
        as_json,
        show_done(f"tenant {name} removed"),
    )


@click.command("evict", help="Evict at least SIZE of a tenant's chunks, coldest first "
               "(bytes, or 512MiB, 10GiB).")  # fmt: skip
@click.option("--tenant", required=True)
@click.argument("nbytes", metavar="SIZE", type=SIZE)
@common
def evict(tenant: str, nbytes: int, config_path: str | None, as_json: bool) -> None:
    _check_tenant(tenant, as_json)
    if nbytes < 1:
        _fail(EXIT_USAGE, "SIZE must be at least 1 byte", as_json)
    emit(
        admin_call(config_path, as_json, "evict", tenant=tenant, bytes=nbytes),
        as_json,
        show_done("evicted"),
    )


@click.group("chunks", help="What is cached: list and inspect a tenant's chunks.")
def chunks() -> None:
    pass


def _key_arg(text: str, as_json: bool) -> bytes:
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        _fail(
            EXIT_USAGE,
            f"key {text!r} must be {2 * KEY_BYTES} hex digits (as dpuctl chunks ls prints it)",
            as_json,
        )
    return key


@chunks.command("ls", help="A tenant's chunks in key order: key, tier, size, idle time, uses.")
@click.option("--tenant", required=True)
@click.option("--limit", type=click.IntRange(1, 100_000), default=100, show_default=True,
              help="At most this many chunks.")  # fmt: skip
@click.option("--after", default=None, metavar="KEY", help="Start after this key (paging).")
@common
def chunks_ls(
    tenant: str, limit: int, after: str | None, config_path: str | None, as_json: bool
) -> None:
    _check_tenant(tenant, as_json)
    start = _key_arg(after, as_json) if after else None
    rows: list[dict[str, Any]] = []
    while len(rows) < limit:  # pages of at most the agent's page size, bounded by --limit
        page = admin_call(config_path, as_json, "chunks_list", tenant=tenant,
                          limit=limit - len(rows), after=start)["chunks"]  # fmt: skip
        rows += page
        if not page:
            break
        start = bytes.fromhex(page[-1]["key"])
    more = False
    if rows and len(rows) >= limit:  # one more key after the last shown?
        peek = admin_call(config_path, as_json, "chunks_list", tenant=tenant, limit=1, after=start)
        more = bool(peek["chunks"])
    listed = admin_call(config_path, as_json, "tenants_list")["tenants"]
    total = next((int(t.get("records", 0)) for t in listed if t["name"] == tenant), None)
    emit({"tenant": tenant, "chunks": rows, "total": total,
          "next_after": rows[-1]["key"] if more else None}, as_json, _show_chunks)  # fmt: skip


def _show_chunks(data: dict[str, Any]) -> None:
    cols = ("key", "tier", "length_bytes", "idle_s", "access_count", "pins", "leases")
    total = "?" if data["total"] is None else f"{data['total']:,}"
    _rows_table(f"chunks of {data['tenant']} ({len(data['chunks']):,} shown of {total})",
                [{c: r[c] for c in cols} for r in data["chunks"]])  # fmt: skip
    if data["next_after"]:
        _out.print(
            f"more: dpuctl chunks ls --tenant {data['tenant']} --after {data['next_after']}",
            highlight=False,
            soft_wrap=True,
        )


@chunks.command("inspect", help="One chunk's record: tier, extent, checksum, times, uses.")
@click.option("--tenant", required=True)
@click.argument("key")
@common
def chunks_inspect(tenant: str, key: str, config_path: str | None, as_json: bool) -> None:
    _check_tenant(tenant, as_json)
    raw = _key_arg(key, as_json)
    result = admin_call(config_path, as_json, "chunk_inspect", tenant=tenant, key=raw)
    emit(result, as_json, lambda d: _kv_table(f"chunk {key}", d["chunk"]))


@click.command("checkpoint", help="Write an index checkpoint now (truncates the journal).")
@common
def checkpoint(config_path: str | None, as_json: bool) -> None:
    emit(
        admin_call(config_path, as_json, "checkpoint", progress="checkpoint"),
        as_json,
        show_done("checkpoint"),
    )


@click.group("backup", help="Full and incremental backups, and restoring them.")
def backup() -> None:
    pass


def _named(_ctx: click.Context, _param: click.Parameter, value: Any) -> Any:
    """An empty DIR ('') is refused: it was the current directory (a backup written there)."""
    for v in value if isinstance(value, tuple) else (value,):
        if not str(v).strip():
            raise click.BadParameter("an empty name; give the backup's directory")
    return value


@backup.command("create", help="Back up to DIR (on the agent's machine).")
@click.option("--incremental", is_flag=True, help="Only what changed since the last backup.")
@click.argument("directory", type=click.Path(file_okay=False), callback=_named)
@common
def backup_create(
    incremental: bool, directory: str, config_path: str | None, as_json: bool
) -> None:
    emit(
        admin_call(
            config_path,
            as_json,
            "backup",
            progress=f"backup to {directory}",
            dir=os.path.abspath(directory),
            incremental=incremental,
        ),
        as_json,
        show_done("backup"),
    )


@backup.command("restore", help="Restore a full backup DIR then its incrementals, in order, "
                "into an agent that holds no chunks yet; --resume or --rollback finishes one "
                "that was interrupted (dpuctl status shows it).")  # fmt: skip
@click.argument("directories", nargs=-1, type=click.Path(file_okay=False), callback=_named)
@click.option(
    "--resume", is_flag=True, help="Start an interrupted restore over (what it placed is replaced)."
)
@click.option("--rollback", is_flag=True,
              help="Drop every chunk an interrupted restore placed and forget it.")  # fmt: skip
@yes_option
@common
def backup_restore(
    directories: tuple[str, ...],
    resume: bool,
    rollback: bool,
    yes: bool,
    config_path: str | None,
    as_json: bool,
) -> None:
    if resume and rollback:
        _fail(EXIT_USAGE, "give --resume or --rollback, not both", as_json)
    mode = "resume" if resume else "rollback" if rollback else "start"
    if mode == "start" and not directories:
        _fail(EXIT_USAGE, "give the full backup DIR, then its incrementals in order", as_json)
    if mode == "rollback" and directories:
        _fail(EXIT_USAGE, "--rollback takes no DIR (it drops what the restore placed)", as_json)
    what = {"start": f"restore {len(directories)} backup(s) into the running agent",
            "resume": "start the interrupted restore over",
            "rollback": "drop every chunk the interrupted restore placed"}[mode]  # fmt: skip
    _confirm(what, yes, as_json)
    fields: dict[str, Any] = {"dirs": [os.path.abspath(d) for d in directories] or None}
    if mode != "start":
        fields["mode"] = mode
    emit(
        admin_call(config_path, as_json, "restore", progress="restore", **fields),
        as_json,
        _show_restore,
    )


def _show_restore(data: dict[str, Any]) -> None:
    _kv_table("restore", _flatten("", data.get("restore", {}), {}))
    added = data.get("tenants_added", {})
    _kv_table(
        "tenants_added (new tokens: give each to its hosts)",
        {name: f"token in {path}" for name, path in added.items()} or {"tenants_added": "none"},
    )


@click.group(
    "config",
    help="The agent's configuration.",
    cls=LazyGroup,
    lazy={"check": ("dpu_agent.cli.config_check", "config_check",
                    "Validate the config; --production flags what no host can use.")},
)  # fmt: skip
def config_group() -> None:
    pass


@config_group.command("show", help="The effective configuration, secrets redacted.")
@common
def config_show(config_path: str | None, as_json: bool) -> None:
    emit(
        config_of(config_path, as_json, create=False).redacted(),
        as_json,
        lambda d: _kv_table("effective configuration", _flatten("", d, {})),
    )


@click.command("doctor", help="What this machine offers and what falls back (exit 1: missing).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def doctor(as_json: bool) -> None:
    emit(rows := doctor_report(), as_json, show_doctor)
    sys.exit(doctor_exit(rows))


def register(cli: click.Group) -> None:
    """Add the operator commands to dpuctl."""
    for command in (
        agent_group,
        status,
        stats,
        tenants,
        evict,
        checkpoint,
        backup,
        chunks,
        config_group,
        doctor,
    ):
        cli.add_command(command)
