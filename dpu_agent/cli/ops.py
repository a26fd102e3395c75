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
from typing import Any, NoReturn, TypeVar

import click
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from dpu_agent.cli._storage_probe import probe_agent_storage
from dpu_agent.config import AgentConfig, ConfigError, load_config
from host_shim.client import AgentUnreachable, ControlChannel, ControlError
from kvproto.control import ADMIN_TENANT

__all__ = ["EXIT_CONFIG", "EXIT_FAILED", "EXIT_OK", "EXIT_UNREACHABLE", "agent_group", "register"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_CONFIG = 0, 1, 2, 3, 4
ADMIN_TIMEOUT_S = 3600.0  # backups of a large NVMe tier take minutes; still bounded
F = TypeVar("F", bound=Callable[..., Any])
# Piped output (not a terminal) would be cut to rich's default 80 columns: tables are for people,
# so give them room; scripts use --json
PIPED_WIDTH_COLUMNS = 200
_out = Console(width=None if sys.stdout.isatty() else PIPED_WIDTH_COLUMNS)
_err = Console(stderr=True)


# --- shared plumbing ----------------------------------------------------------------------


def _fail(code: int, message: str, as_json: bool) -> NoReturn:
    if as_json:
        click.echo(json.dumps({"ok": False, "error": message, "exit_code": code}))
    else:
        _err.print(f"[red]error:[/red] {message}", highlight=False)
    sys.exit(code)


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


def config_of(config_path: str | None, as_json: bool = False) -> AgentConfig:
    try:
        cfg = load_config(config_path)
        cfg.prepare()
    except (ConfigError, OSError) as e:
        _fail(EXIT_CONFIG, str(e), as_json)
    return cfg


def control_url(cfg: AgentConfig) -> str:
    """The running agent's control URL: its state file first, then the configuration."""
    try:
        state = json.loads(cfg.state_path.read_text())
        with contextlib.suppress(PermissionError):  # alive, another user's process
            os.kill(int(state["pid"]), 0)  # a state file left by a killed agent does not count
        return str(state["control"]["unix"] or state["control"]["tcp"])
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
    cfg = config_of(config_path, as_json)
    url = control_url(cfg)
    try:
        with ControlChannel(
            url, ADMIN_TENANT, cfg.admin_token, timeout_s=ADMIN_TIMEOUT_S, client="dpuctl"
        ) as ch:
            ch.connect()
            if not progress or as_json:
                return ch.call(op, **fields)
            with Progress(
                SpinnerColumn(),
                TextColumn(progress),
                TimeElapsedColumn(),
                console=_err,
                transient=True,
            ) as bar:
                bar.add_task(progress, total=None)
                return ch.call(op, **fields)
    except AgentUnreachable as e:
        _fail(EXIT_UNREACHABLE, f"{e.message}; is the agent running? (dpuctl agent run)", as_json)
    except ControlError as e:
        _fail(EXIT_FAILED, f"{op}: {e}", as_json)


def emit(data: Any, as_json: bool, human: Callable[[Any], None]) -> None:
    if as_json:
        click.echo(json.dumps(data, indent=1, sort_keys=True, default=_json_default))
    else:
        human(data)


def _json_default(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


def _kv_table(title: str, rows: dict[str, Any]) -> None:
    table = Table(title=title, show_header=False)
    for key, value in rows.items():
        shown = value
        if isinstance(value, dict | list):
            shown = json.dumps(value, default=_json_default)
        table.add_row(str(key), str(shown))
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
    table = Table(title=title)
    columns = list(dict.fromkeys(k for row in rows for k in row))
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*(str(row.get(c, "")) for c in columns))
    _out.print(table)


def show_status(data: dict[str, Any]) -> None:
    _rows_table("dpukv agent: members", data.get("members", []))


def show_stats(data: dict[str, Any]) -> None:
    _kv_table("stats", _flatten("", data.get("stats", data), {}))


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


def doctor_report() -> list[dict[str, str]]:
    probes: list[tuple[str, Callable[[], tuple[str, str]]]] = [
        ("rdma", _probe_rdma),
        ("hugepages", _probe_hugepages),
        ("spdk", _probe_spdk),
        ("aes", _probe_aesni),
        ("crypto", _probe_crypto),
        ("gpu", _probe_gpu),
        ("nvme-tcp", _probe_nvme_tcp),
        ("agent-storage", probe_agent_storage),
        ("serf", functools.partial(_probe_binary, "serf", ["version"], "cluster membership")),
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


@click.command("status", help="Is the agent up, what does it serve.")
@common
def status(config_path: str | None, as_json: bool) -> None:
    emit(admin_call(config_path, as_json, "members"), as_json, show_status)


@click.command("stats", help="Engine statistics over all tenants.")
@common
def stats(config_path: str | None, as_json: bool) -> None:
    emit(admin_call(config_path, as_json, "stats"), as_json, show_stats)


@click.group("tenants", help="List, add and remove tenants.")
def tenants() -> None:
    pass


@tenants.command("list", help="Tenants and their usage.")
@common
def tenants_list(config_path: str | None, as_json: bool) -> None:
    emit(admin_call(config_path, as_json, "tenants_list"), as_json, show_tenants)


@tenants.command("add", help="Add a tenant; prints its token once (stored 0600 in the data dir).")
@click.argument("name")
@common
def tenants_add(name: str, config_path: str | None, as_json: bool) -> None:
    emit(
        admin_call(config_path, as_json, "tenant_add", tenant=name),
        as_json,
        show_done(f"tenant {name} added"),
    )


@tenants.command("remove", help="Remove a tenant and drop its chunks.")
@click.argument("name")
@common
def tenants_remove(name: str, config_path: str | None, as_json: bool) -> None:
    emit(
        admin_call(config_path, as_json, "tenant_remove", tenant=name),
        as_json,
        show_done(f"tenant {name} removed"),
    )


@click.command("evict", help="Evict at least BYTES of a tenant's chunks (coldest first).")
@click.option("--tenant", required=True)
@click.argument("nbytes", type=click.IntRange(min=1))
@common
def evict(tenant: str, nbytes: int, config_path: str | None, as_json: bool) -> None:
    emit(
        admin_call(config_path, as_json, "evict", tenant=tenant, bytes=nbytes),
        as_json,
        show_done("evicted"),
    )


@click.command("checkpoint", help="Write an index checkpoint now (truncates the journal).")
@common
def checkpoint(config_path: str | None, as_json: bool) -> None:
    emit(
        admin_call(config_path, as_json, "checkpoint", progress="checkpoint"),
        as_json,
        show_done("checkpoint"),
    )


@click.group("backup", help="Full and incremental backups.")
def backup() -> None:
    pass


@backup.command("create", help="Back up to DIR (on the agent's machine).")
@click.option("--incremental", is_flag=True, help="Only what changed since the last backup.")
@click.argument("directory", type=click.Path(file_okay=False))
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


@click.command("restore", help="Restore a full backup DIR then its incrementals, in order.")
@click.argument("directories", nargs=-1, required=True, type=click.Path(file_okay=False))
@common
def restore(directories: tuple[str, ...], config_path: str | None, as_json: bool) -> None:
    emit(
        admin_call(
            config_path,
            as_json,
            "restore",
            progress="restore",
            dirs=[os.path.abspath(d) for d in directories],
        ),
        as_json,
        show_done("restore"),
    )


@click.group("config", help="The agent's configuration.")
def config_group() -> None:
    pass


@config_group.command("show", help="The effective configuration, secrets redacted.")
@common
def config_show(config_path: str | None, as_json: bool) -> None:
    emit(
        config_of(config_path, as_json).redacted(),
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
        restore,
        config_group,
        doctor,
    ):
        cli.add_command(command)
