"""The agent's configuration: one TOML file, environment overrides, embedded defaults.

Precedence, lowest first: the defaults below (the embedded mode `make run` uses), the TOML file
(`dpuctl agent run --config FILE`), then environment variables ``DPUKV_<SECTION>_<KEY>`` (for
example ``DPUKV_CONTROL_PORT=7500``, ``DPUKV_STORAGE_DRAM_BYTES=1073741824``). Relative paths
are relative to the data directory (``./var`` by default), which `prepare()` creates together
with the secrets it needs: the admin token and each tenant's token, each in its own 0600 file.
Secrets never appear in `redacted()` (what `dpuctl config show` prints) or in logs.

Example::

    [agent]
    data_dir = "/var/lib/dpukv"
    [control]
    port = 7400
    [storage]
    dram_bytes = 4294967296
    [tenants.acme]
    token_file = "acme.token"    # or: token = "..."

Modes (``[agent] mode``): ``"embedded"`` (the default) keeps each tenant's tiers in the agent
(DRAM and a file, under AES-XTS) and serves them with the agent's own NVMe/TCP target.
``"spdk"`` takes the tiers from the ``[spdk]`` section (parsed by `spdk_plugins.parse_desired`,
the same parser `dpuctl spdk plan` uses): each tenant's tiers are namespaces of SPDK's nvmf
target, reached through the agent's own NVMe/TCP initiator on the loopback listener (see
docs/SPDK.md, "Agent in SPDK mode"). An ``[spdk]`` section alone does not switch modes.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpu_agent.eviction import DEFAULT_POLICY
from dpu_agent.net import NetConfigError, NetDesired, parse_net
from kvproto.control import valid_tenant_name
from spdk_plugins.desired import DesiredStateError, SpdkDesired, parse_desired
from spdk_plugins.tiers import TierTarget, agent_tiers

__all__ = [
    "ENV_PREFIX",
    "MODES",
    "AgentConfig",
    "AgentSection",
    "ConfigError",
    "ControlSection",
    "MetricsSection",
    "NvmfSection",
    "StorageSection",
    "TenantConfig",
    "load_config",
]

ENV_PREFIX = "DPUKV_"
REDACTED = "<redacted>"
TOKEN_BYTES = 32  # 256-bit random tokens, URL-safe base64
CONFIG_BYTES_MAX = 1 << 20  # a config file bigger than this is a mistake
TENANTS_MAX = 4096  # one NVMe-oF subsystem each; far above any DPU's real tenant count
MODES = ("embedded", "spdk")


class ConfigError(Exception):
    """The configuration is invalid; the message names the key, the value and the fix."""


@dataclass(slots=True, kw_only=True)
class AgentSection:
    data_dir: str = "./var"
    node_name: str = field(default_factory=socket.gethostname)
    log_level: str = "INFO"
    tick_interval_s: float = 0.5
    admin_token_file: str = "admin.token"
    state_file: str = "agent.json"  # where a running agent writes its addresses and pid
    mode: str = "embedded"  # or "spdk": tiers are SPDK namespaces ([spdk] section)
    # SPDK mode, at start: false = plan only and refuse to start unless SPDK already matches
    # [spdk]; true = apply the plan first (creates bdevs, keys, subsystems; never destroys data)
    spdk_apply_on_start: bool = False


@dataclass(slots=True, kw_only=True)
class ControlSection:
    host: str = "127.0.0.1"
    port: int = 7400
    unix_socket: str = "control.sock"  # "" disables the Unix socket
    connections_max: int = 1024


@dataclass(slots=True, kw_only=True)
class NvmfSection:
    host: str = "127.0.0.1"
    port: int = 4420
    # Large transfers: KV chunks are MiBs; one command moves up to this (MDTS). SPDK's default
    # of 128 KiB would cost 256 commands per 32 MiB chunk; 4 MiB took 20-35% less CPU per GB
    # than 1 MiB on both sides here (docs/BENCHMARKS.md, Data path).
    max_io_size: int = 4 << 20
    io_workers: int = 4  # threads doing device I/O and AES-XTS (the GIL is released)
    data_buffers_per_queue: int = 4  # x max_io_size: at most 16 MiB of buffers per I/O queue


@dataclass(slots=True, kw_only=True)
class MetricsSection:
    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = 9400


@dataclass(slots=True, kw_only=True)
class StorageSection:
    dram_bytes: int = 256 << 20
    nvme_bytes: int = 2 << 30
    nvme_dir: str = "nvme"  # file-backed NVMe tier: one file per tenant under here
    key_file: str = "keys.json"
    journal_dir: str = "journal"
    eviction_policy: str = DEFAULT_POLICY
    lease_ttl_s: float = 30.0
    reservation_ttl_s: float = 30.0


@dataclass(slots=True, kw_only=True)
class TenantConfig:
    name: str
    token: str = field(default="", repr=False)
    token_file: str = ""
    quota_bytes: int = 0  # 0: no quota beyond the tiers' size


_SECTIONS: dict[str, type] = {
    "agent": AgentSection,
    "control": ControlSection,
    "nvmf": NvmfSection,
    "metrics": MetricsSection,
    "storage": StorageSection,
}


@dataclass(slots=True, kw_only=True)
class AgentConfig:
    agent: AgentSection = field(default_factory=AgentSection)
    control: ControlSection = field(default_factory=ControlSection)
    nvmf: NvmfSection = field(default_factory=NvmfSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    storage: StorageSection = field(default_factory=StorageSection)
    tenants: dict[str, TenantConfig] = field(default_factory=dict)
    admin_token: str = field(default="", repr=False)
    source: str = "<defaults>"
    spdk: SpdkDesired | None = None  # the parsed [spdk] section, when the file has one
    spdk_doc: dict[str, Any] = field(default_factory=dict)  # that section as written
    net: NetDesired | None = None  # the parsed [net] section (dpuctl net), when present

    @property
    def spdk_mode(self) -> bool:
        return self.agent.mode == "spdk"

    def spdk_tiers(self) -> list[TierTarget]:
        """What the agent's initiator connects to, per tenant and tier (SPDK mode)."""
        assert self.spdk is not None, "not in SPDK mode"
        return agent_tiers(self.spdk)

    # --- paths -----------------------------------------------------------------------------
    @property
    def data_dir(self) -> Path:
        return Path(self.agent.data_dir).expanduser().absolute()

    def path(self, value: str) -> Path:
        """A configured path: absolute as given, else under the data directory."""
        p = Path(value).expanduser()
        return p if p.is_absolute() else self.data_dir / p

    @property
    def unix_socket_path(self) -> Path | None:
        return self.path(self.control.unix_socket) if self.control.unix_socket else None

    @property
    def state_path(self) -> Path:
        return self.path(self.agent.state_file)

    # --- secrets ---------------------------------------------------------------------------
    def prepare(self) -> None:
        """Create the data directory and any missing token files (0600); load the tokens."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.data_dir, 0o700)
        self.admin_token = _read_or_create_token(self.path(self.agent.admin_token_file))
        if not self.tenants:
            # SPDK mode: the tenants the [spdk] subsystems name; embedded: one "default"
            names = sorted({t.tenant for t in self.spdk_tiers()}) if self.spdk_mode else []
            for name in names or ["default"]:
                self.tenants[name] = TenantConfig(name=name)
        for t in self.tenants.values():
            if t.token:
                continue
            t.token_file = t.token_file or f"tenant-{t.name}.token"
            t.token = _read_or_create_token(self.path(t.token_file))

    def redacted(self) -> dict[str, Any]:
        """The effective configuration as a plain dict with every secret replaced."""
        out: dict[str, Any] = {name: dataclasses.asdict(getattr(self, name)) for name in _SECTIONS}
        out["tenants"] = {
            n: {**dataclasses.asdict(t), "token": REDACTED if t.token else ""}
            for n, t in self.tenants.items()
        }
        out["admin_token"] = REDACTED if self.admin_token else ""
        if self.spdk_doc:  # names key material, never holds it (parse_desired refuses keys)
            out["spdk"] = self.spdk_doc
        out["source"] = self.source
        return out


def _read_or_create_token(path: Path) -> str:
    """The token in `path`, created (random, mode 0600, never overwritten) when missing."""
    try:
        return _read_secret(path)
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(TOKEN_BYTES)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process created it first: use theirs
        return _read_secret(path)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def _read_secret(path: Path) -> str:
    st = path.stat()
    if st.st_mode & 0o077:
        raise ConfigError(
            f"secret file {path} has mode {st.st_mode & 0o777:o}; run: chmod 600 {path}"
        )
    value = path.read_text().strip()
    if not value:
        raise ConfigError(f"secret file {path} is empty; delete it to generate a new one")
    return value


def _coerce(section: str, key: str, value: Any, default: Any, source: str) -> Any:
    """`value` converted to the type of `default` (strings from the environment included)."""
    where = f"{source}: [{section}] {key}={value!r}"
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in (
            "1",
            "true",
            "yes",
            "on",
            "0",
            "false",
            "no",
            "off",
        ):
            return value.lower() in ("1", "true", "yes", "on")
        raise ConfigError(f"{where} must be a boolean (true/false)")
    if isinstance(default, int | float):
        try:
            number = type(default)(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} must be a {type(default).__name__}") from None
        if number < 0:
            raise ConfigError(f"{where} must not be negative")
        return number
    if not isinstance(value, str):
        raise ConfigError(f"{where} must be a string")
    return value


def _apply_section(cfg: AgentConfig, section: str, values: Mapping[str, Any], source: str) -> None:
    obj = getattr(cfg, section)
    known = {f.name: f for f in dataclasses.fields(obj)}
    for key, value in values.items():
        if key not in known:
            raise ConfigError(
                f"{source}: unknown key [{section}] {key}; known: {', '.join(sorted(known))}"
            )
        setattr(obj, key, _coerce(section, key, value, getattr(obj, key), source))


def _apply_tenants(cfg: AgentConfig, tenants: Any, source: str) -> None:
    if not isinstance(tenants, dict) or len(tenants) > TENANTS_MAX:
        raise ConfigError(f"{source}: [tenants] must be a table of at most {TENANTS_MAX} tenants")
    for name, values in tenants.items():
        if not valid_tenant_name(name):
            raise ConfigError(
                f"{source}: tenant name {name!r} must match [a-z0-9][a-z0-9-]{{0,62}}"
            )
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: [tenants.{name}] must be a table")
        t = TenantConfig(name=name)
        for key, value in values.items():
            if key not in ("token", "token_file", "quota_bytes"):
                raise ConfigError(f"{source}: unknown key [tenants.{name}] {key}")
            default = getattr(t, key)
            setattr(t, key, _coerce(f"tenants.{name}", key, value, default, source))
        cfg.tenants[name] = t


def _env_overrides(cfg: AgentConfig, environ: Mapping[str, str]) -> None:
    for var, value in sorted(environ.items()):
        if not var.startswith(ENV_PREFIX):
            continue
        rest = var[len(ENV_PREFIX) :].lower()
        section, _, key = rest.partition("_")
        if section not in _SECTIONS or not key:
            continue  # other DPUKV_* variables (keys, test knobs) belong to other modules
        _apply_section(cfg, section, {key: value}, f"environment {var}")


def load_config(
    path: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None
) -> AgentConfig:
    """Defaults, then the TOML file at `path` (if any), then DPUKV_* environment variables."""
    cfg = AgentConfig()
    if path is not None:
        p = Path(path)
        try:
            raw = p.read_bytes()
        except OSError as e:
            raise ConfigError(f"cannot read config {p}: {e.strerror}") from None
        if len(raw) > CONFIG_BYTES_MAX:
            raise ConfigError(f"config {p} is over {CONFIG_BYTES_MAX} bytes")
        try:
            doc = tomllib.loads(raw.decode())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"config {p} is not valid TOML: {e}") from None
        cfg.source = str(p)
        for section, values in doc.items():
            if section == "tenants":
                _apply_tenants(cfg, values, str(p))
            elif section == "spdk":
                _apply_spdk(cfg, doc, str(p))
            elif section == "net":  # the DPU's RoCE network (dpu_agent.net, dpuctl net)
                try:
                    cfg.net = parse_net(values, str(p))
                except NetConfigError as e:
                    raise ConfigError(str(e)) from None
            elif section in _SECTIONS and isinstance(values, dict):
                _apply_section(cfg, section, values, str(p))
            else:
                known = ", ".join([*_SECTIONS, "tenants", "spdk", "net"])
                raise ConfigError(f"{p}: unknown section [{section}]; known: {known}")
    _env_overrides(cfg, os.environ if environ is None else environ)
    _check_mode(cfg)
    return cfg


def _apply_spdk(cfg: AgentConfig, doc: dict[str, Any], source: str) -> None:
    """The [spdk] section through spdk_plugins' own parser (one parser for agent and dpuctl)."""
    try:
        cfg.spdk = parse_desired(doc)
    except DesiredStateError as e:
        raise ConfigError(f"{source}: [spdk] is invalid: {e}") from None
    cfg.spdk_doc = doc["spdk"]


def _check_mode(cfg: AgentConfig) -> None:
    """SPDK mode: [spdk] present, every tenant has both tiers, the agent's NQN is allowed."""
    where = f"{cfg.source}: [agent] mode={cfg.agent.mode!r}"
    if cfg.agent.mode not in MODES:
        raise ConfigError(f"{where} must be one of {', '.join(MODES)}")
    if not cfg.spdk_mode:
        return
    if cfg.spdk is None:
        raise ConfigError(f"{where} needs an [spdk] section (see spdk_plugins/examples)")
    try:
        tiers = cfg.spdk_tiers()  # checks agent_hostnqn is in each tiered subsystem's hosts
    except DesiredStateError as e:
        raise ConfigError(f"{cfg.source}: SPDK mode: {e}") from None
    have: dict[str, set[str]] = {}
    for t in tiers:
        have.setdefault(t.tenant, set()).add(t.tier)
    if not have:
        raise ConfigError(
            f"{where}: no [[spdk.subsystems]] has a tenant and namespaces with a tier; give "
            'each tenant\'s subsystem nsid 1 tier = "dram" and nsid 2 tier = "nvme"'
        )
    for name in cfg.tenants or have:  # no [tenants]: the agent serves every SPDK tenant
        missing = {"dram", "nvme"} - have.get(name, set())
        if missing:
            raise ConfigError(
                f"{cfg.source}: tenant {name!r} has no SPDK namespace for tier "
                f"{', '.join(sorted(missing))}; add a [[spdk.subsystems]] with tenant = "
                f'{name!r} and namespaces nsid 1 tier = "dram", nsid 2 tier = "nvme"'
            )
