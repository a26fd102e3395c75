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

import base64
import binascii
import contextlib
import dataclasses
import errno
import json
import math
import os
import secrets
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpu_agent.eviction import DEFAULT_POLICY, POLICY_NAMES
from dpu_agent.files import open_regular
from dpu_agent.net import NetConfigError, NetDesired, parse_net
from dpu_agent.units import SIZE_BYTES_MAX, SizeError, parse_size
from kvproto.control import (
    REPLICAS_MAX,
    STRING_BYTES_MAX,
    TENANTS_MAX,
    token_problem,
    valid_tenant_name,
)
from kvproto.nvme import BLOCK_BYTES
from kvproto.peer_auth import parse_peer_keys
from kvproto.tomlfile import CONFIG_BYTES_MAX, TomlFileError, load_toml

if TYPE_CHECKING:  # spdk_plugins loads its RPC client: imported only for an [spdk] section
    from spdk_plugins.desired import SpdkDesired
    from spdk_plugins.tiers import TierTarget

__all__ = [
    "ENV_PREFIX",
    "MODES",
    "AgentConfig",
    "AgentSection",
    "ClusterSection",
    "ConfigError",
    "ControlSection",
    "MetricsSection",
    "NvmfSection",
    "StorageSection",
    "TenantConfig",
    "load_config",
    "read_secret",
]

ENV_PREFIX = "DPUKV_"
# Where the agent keeps its data when no config says: DPUKV_DATA_DIR (what dpuctl reads to find a
# running agent too); DPUKV_AGENT_DATA_DIR, the generic form of [agent] data_dir, wins over it
DATA_DIR_ENV = "DPUKV_DATA_DIR"
REDACTED = "<redacted>"
DEFAULTS_SOURCE = "<defaults>"  # a configuration's source when no file was given
TOKEN_BYTES = 32  # 256-bit random tokens, URL-safe base64
MODES = ("embedded", "spdk")


EXIT_CONFIG = 4  # the exit code of dpuctl and `dpuctl agent run` for a ConfigError


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
    # TLS on the TCP listener (docs/NVME_AUTH.md): PEM server certificate and key; with
    # tls_client_ca, clients (hosts, other agents) must present a certificate it signed.
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""


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
    # Every host must pass DH-HMAC-CHAP on each queue; the agent issues each host's secret
    # (hello, `dpuctl hosts add`) and a host without it is refused (docs/NVME_AUTH.md).
    require_auth: bool = False
    # The listener speaks only TLS 1.3 with per-host PSKs the agent issues (TP 8011).
    secure_channel: bool = False


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
    # how often the eviction order is saved for a restart after a crash (docs/ENGINE.md)
    policy_order_save_s: float = 60.0  # at least POLICY_ORDER_SAVE_S_MIN


@dataclass(slots=True, kw_only=True)
class NixlSection:
    """The NIXL data path (docs/TRANSPORT.md). The agent's NIXL agent runs in a worker process
    that starts in 1-5 s here; `prestart` starts it with the agent, so that the first hosts'
    connects do not wait on it inside their 5 s call (false: on the first host that asks)."""

    prestart: bool = False


@dataclass(slots=True, kw_only=True)
class ClusterSection:
    """One tier across many agents (docs/CLUSTER.md). Off: the agent is a cluster of one."""

    enabled: bool = False
    serf_start: bool = True  # run our own `serf agent` child; false: use the one at serf_rpc
    serf_bin: str = "serf"
    serf_bind: str = "127.0.0.1:7946"  # gossip address (TCP and UDP) of our Serf child
    serf_rpc: str = "127.0.0.1:7373"  # Serf's RPC address (ours, or the operator's agent)
    serf_profile: str = "lan"  # Serf's timing profile: lan, wan or local
    # Serf's RPC auth key (0600); in cluster mode required, and generated when missing for
    # our own Serf child (an operator-run Serf needs the operator's key in this file)
    rpc_auth_file: str = "serf-rpc.key"
    # Serf's gossip keyring (JSON list of base64 keys, the first is primary, 0600): Serf
    # encrypts and authenticates gossip with it and rewrites it on `dpuctl cluster keys`.
    # Every node starts with the same keys, provisioned by the operator (docs/CLUSTER.md).
    keyring_file: str = "serf-keyring.json"
    # The cluster pre-shared key (0600; one key per line, the first signs): every agent-to-
    # agent connection and every member's auth tag is proved with it (kvproto.peer_auth).
    peer_key_file: str = "cluster-peer.key"
    # The CA that signed the other members' control certificates: what this agent verifies a
    # tls:// member against when it connects to it ("" = [control] tls_client_ca, the CA of a
    # cluster whose members present their control certificates to each other).
    peer_tls_ca: str = ""
    join: str = ""  # gossip addresses of other members, comma-separated
    zone: str = ""  # failure domain (rack, row): replicas go to distinct zones
    replicas: int = 1  # copies of each chunk (R); a tenant's own `replicas` overrides it
    refresh_interval_s: float = 5.0  # re-read the member list at least this often
    advertise_host: str = ""  # host in the published control/NVMe addresses ("" = bind host)
    rebalance_bytes_per_s: int = 64 << 20  # hand-off rate after a membership change
    # Cluster-wide tenants (docs/CLUSTER.md, "Tenants"): etcd client URLs, comma-separated;
    # "" = tenants are this node's own (config file and dpuctl on this node).
    etcd_endpoints: str = ""
    etcd_prefix: str = "/dpukv"  # this cluster's keys in etcd (one etcd may serve several)
    etcd_user: str = ""  # etcd user (etcd auth on); its password in etcd_password_file (0600)
    etcd_password_file: str = ""
    etcd_ca_file: str = ""  # CA that signed etcd's server certificate (https endpoints)
    # client certificate for etcd --client-cert-auth, and its key; without a CN: etcd's JSON
    # gateway refuses a certificate CN (the user comes from etcd_user)
    etcd_cert_file: str = ""
    etcd_key_file: str = ""
    # What this node accepts from all senders together (0: rebalance_bytes_per_s): a joiner
    # is sent to by every other node at once and must not take N times one sender's rate
    rebalance_receive_bytes_per_s: int = 0
    anti_entropy_interval_s: float = 30.0  # compare replicas' digests, drop surplus copies


@dataclass(slots=True, kw_only=True)
class TenantConfig:
    name: str
    token: str = field(default="", repr=False)
    token_file: str = ""
    quota_bytes: int = 0  # 0: no quota beyond the tiers' size
    replicas: int = 0  # cluster mode: copies of each chunk; 0 = [cluster] replicas


_SECTIONS: dict[str, type] = {
    "agent": AgentSection,
    "control": ControlSection,
    "nvmf": NvmfSection,
    "metrics": MetricsSection,
    "storage": StorageSection,
    "cluster": ClusterSection,
    "nixl": NixlSection,
}


@dataclass(slots=True, kw_only=True)
class AgentConfig:
    agent: AgentSection = field(default_factory=AgentSection)
    control: ControlSection = field(default_factory=ControlSection)
    nvmf: NvmfSection = field(default_factory=NvmfSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    storage: StorageSection = field(default_factory=StorageSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)
    nixl: NixlSection = field(default_factory=NixlSection)
    tenants: dict[str, TenantConfig] = field(default_factory=dict)
    admin_token: str = field(default="", repr=False)
    # cluster mode, loaded by prepare(): Serf's RPC key and the cluster peer keys
    serf_rpc_key: str = field(default="", repr=False)
    peer_keys: tuple[bytes, ...] = field(default=(), repr=False)
    source: str = DEFAULTS_SOURCE  # the configuration file, or DEFAULTS_SOURCE without one
    # where each set value came from ("section.key" -> the file or "environment VAR"): an
    # error names what set the value, not the file (or <defaults>) of the whole configuration
    origins: dict[str, str] = field(default_factory=dict)
    spdk: SpdkDesired | None = None  # the parsed [spdk] section, when the file has one
    spdk_doc: dict[str, Any] = field(default_factory=dict)  # that section as written
    net: NetDesired | None = None  # the parsed [net] section (dpuctl net), when present

    def origin(self, key: str) -> str:
        """What set `key` ("section.key"): its file or environment variable, else `source`."""
        return self.origins.get(key, self.source)

    @property
    def spdk_mode(self) -> bool:
        return self.agent.mode == "spdk"

    def spdk_tiers(self) -> list[TierTarget]:
        """What the agent's initiator connects to, per tenant and tier (SPDK mode)."""
        from spdk_plugins.tiers import agent_tiers

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
    def prepare(self, *, create: bool = True) -> None:
        """Load the tokens. `create`: also make the data directory and any missing token file
        (0600), as the agent does at start; without it (what read-only commands use) nothing is
        written and a missing token stays empty."""
        if self.data_dir.exists() and not self.data_dir.is_dir():  # was "[Errno 17] File exists"
            raise ConfigError(f"{self.source}: [agent] data_dir {self.data_dir} is not a directory")
        if create:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            os.chmod(self.data_dir, 0o700)
        load = _read_or_create_token if create else _read_token_if_any
        self.admin_token = load(self.path(self.agent.admin_token_file))
        if not self.tenants:
            # SPDK mode: the tenants the [spdk] subsystems name; embedded: one "default"
            names = sorted({t.tenant for t in self.spdk_tiers()}) if self.spdk_mode else []
            for name in names or ["default"]:
                self.tenants[name] = TenantConfig(name=name)
        for t in self.tenants.values():
            if t.token:
                continue
            t.token_file = t.token_file or f"tenant-{t.name}.token"
            t.token = load(self.path(t.token_file))
        if create:  # the agent's start: a guessable token would open a tenant's data to anyone
            self._check_tokens()
        if self.cluster.enabled:
            self._prepare_cluster(create=create)

    def _check_tokens(self) -> None:
        """ConfigError naming the first token (the admin's, a tenant's) that token_problem
        refuses; read-only commands skip it (they only talk to an agent that started)."""
        named = [(f"[agent] admin_token_file {self.path(self.agent.admin_token_file)}",
                  self.admin_token)]  # fmt: skip
        for t in self.tenants.values():
            where = (f"tenant {t.name!r} token_file {self.path(t.token_file)}" if t.token_file
                     else f"[tenants.{t.name}] token")  # fmt: skip
            named.append((where, t.token))
        for where, token in named:
            why = token_problem(token)
            if why is not None:
                raise ConfigError(
                    f"{self.source}: {where}: the token {why}; generated tokens have 43 "
                    "(delete a token file to have one generated)"
                )

    def _prepare_cluster(self, *, create: bool) -> None:
        """Cluster secrets: the Serf RPC key (generated for our own Serf child), the gossip
        keyring and the peer keys (provisioned by the operator: never generated, since every
        node must hold the same ones). Missing or group/world-readable: ConfigError."""
        c = self.cluster
        rpc = self.path(c.rpc_auth_file)
        if create and c.serf_start:
            self.serf_rpc_key = _read_or_create_token(rpc)
        else:
            self.serf_rpc_key = _read_token_if_any(rpc)
            if create and not self.serf_rpc_key:
                raise ConfigError(
                    f"{self.source}: [cluster] rpc_auth_file {rpc} is missing: an operator-run "
                    "Serf (serf_start = false) needs its rpc_auth key in that file (0600)"
                )
        if not create:  # read-only commands: what exists, nothing required
            with contextlib.suppress(FileNotFoundError):
                self.peer_keys = _read_peer_keys(self.path(c.peer_key_file), self.source)
            return
        if c.serf_start:
            check_keyring(self.path(c.keyring_file), self.source)
        self.peer_keys = _read_peer_keys(self.path(c.peer_key_file), self.source)

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


def _read_token_if_any(path: Path) -> str:
    try:
        return _read_secret(path)
    except FileNotFoundError:
        return ""


SECRET_FILE_BYTES_MAX = STRING_BYTES_MAX  # a token: longer, no client could send it


def check_secret_mode(path: Path, mode: int | None = None) -> None:
    """ConfigError when `path` (a secret) is group- or world-accessible (`mode`: its st_mode
    when the caller has it already, from the descriptor it reads)."""
    mode = path.stat().st_mode if mode is None else mode
    if mode & 0o077:
        raise ConfigError(f"secret file {path} has mode {mode & 0o777:o}; run: chmod 600 {path}")


def _read_secret(path: Path) -> str:
    try:  # a FIFO in its place blocked the start; a directory got "chmod 600 /etc" advice
        fd = open_regular(path)
    except OSError as e:
        if e.errno == errno.EINVAL:
            raise ConfigError(f"secret file {path} is not a regular file") from None
        raise
    with os.fdopen(fd, "rb") as f:
        check_secret_mode(path, os.fstat(fd).st_mode)
        raw = f.read(SECRET_FILE_BYTES_MAX + 3)  # the value, then a line end ("\r\n")
    # a token no client could send (the protocol's limit); the line end a writer adds is not
    # the token's (a 4,096-byte token was taken, written with "\n", then refused at restart)
    if len(raw.rstrip(b"\r\n")) > SECRET_FILE_BYTES_MAX:
        raise ConfigError(f"secret file {path} is over {SECRET_FILE_BYTES_MAX} bytes")
    try:
        value = raw.decode().strip()
    except UnicodeDecodeError:
        raise ConfigError(
            f"secret file {path} is not text (UTF-8): damaged? restore it, or delete it to "
            "generate a new one"
        ) from None
    if not value:
        raise ConfigError(f"secret file {path} is empty; delete it to generate a new one")
    if not value.isprintable():  # NULs of a zeroed file were accepted as a token
        raise ConfigError(
            f"secret file {path} holds control characters: damaged? restore it, or delete it "
            "to generate a new one"
        )
    return value


# Keys one keyring holds: a rotation has two at once (new and old); Serf itself has no cap.
KEYRING_KEYS_MAX = 8
SERF_KEY_LENGTHS = (16, 24, 32)  # AES-128/192/256: what Serf accepts


def serf_key_problem(key: str) -> str | None:
    """Why `key` is not a Serf gossip key (base64 of 16, 24 or 32 bytes), or None."""
    try:
        raw = base64.b64decode(key, validate=True)
    except (binascii.Error, ValueError):
        return "is not base64"
    if len(raw) not in SERF_KEY_LENGTHS:
        return f"decodes to {len(raw)} bytes, not 16, 24 or 32 (make one with: serf keygen)"
    return None


def check_keyring(path: Path, source: str = "") -> None:
    """The gossip keyring: exists, 0600, a JSON list of 1..KEYRING_KEYS_MAX Serf keys."""
    where = f"{source}: [cluster] keyring_file {path}"
    try:
        check_secret_mode(path)
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"{where} is missing: cluster mode encrypts gossip; write the cluster's keyring "
            f"there (the same on every node, mode 0600): "
            f'umask 077; echo "[\\"$(serf keygen)\\"]" > {path}'
        ) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where} is not JSON: {e}") from None
    if not isinstance(doc, list) or not 1 <= len(doc) <= KEYRING_KEYS_MAX:
        raise ConfigError(f"{where} must be a JSON list of 1 to {KEYRING_KEYS_MAX} keys")
    for i, key in enumerate(doc):
        problem = serf_key_problem(key) if isinstance(key, str) else "is not a string"
        if problem:
            raise ConfigError(f"{where}: key {i + 1} {problem}")


def _read_peer_keys(path: Path, source: str) -> tuple[bytes, ...]:
    where = f"{source}: [cluster] peer_key_file {path}"
    try:
        check_secret_mode(path)
        return tuple(parse_peer_keys(path.read_text()))
    except FileNotFoundError:
        raise ConfigError(
            f"{where} is missing: every agent-to-agent connection is proved with the cluster "
            f"key; write the same key on every node (mode 0600): "
            f"umask 077; head -c 32 /dev/urandom | base64 > {path}"
        ) from None
    except ValueError as e:
        raise ConfigError(f"{where} {e}") from None


SECRET_KEYS = frozenset({"token", "password"})  # values a configuration error names, not shows


def _coerce(section: str, key: str, value: Any, default: Any, source: str) -> Any:
    """`value` converted to the type of `default` (strings from the environment included);
    ``*_bytes`` and ``*_size`` keys also take sizes such as ``"4GiB"``."""
    shown = "<redacted>" if key in SECRET_KEYS else repr(value)  # an error must not echo it
    where = f"{source}: [{section}] {key}={shown}"
    if key.endswith(("_bytes", "_size")) and isinstance(default, int) and isinstance(value, str):
        try:
            return parse_size(value)
        except SizeError as e:
            raise ConfigError(f"{where}: {e}") from None
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
        if isinstance(value, bool):  # a bool is an int to Python: `port = true` was port 1
            raise ConfigError(f"{where} must be a number, not true/false")
        if isinstance(default, int) and isinstance(value, float):
            if not (math.isfinite(value) and value.is_integer()):  # `port = 3.9` was port 3
                raise ConfigError(f"{where} must be a whole number")
            value = int(value)
        try:
            number = type(default)(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} must be a {type(default).__name__}") from None
        if not math.isfinite(number):  # nan passes every comparison below; inf never ends
            raise ConfigError(f"{where} must be a finite number")
        if number < 0:
            raise ConfigError(f"{where} must not be negative")
        if key.endswith(("_bytes", "_size")) and number > SIZE_BYTES_MAX:
            raise ConfigError(f"{where} is out of range (0 .. {SIZE_BYTES_MAX} bytes)")
        return number
    if not isinstance(value, str):
        raise ConfigError(f"{where} must be a string")
    if "\0" in value:  # no path, name or address holds one; a path with one raised at mkdir
        raise ConfigError(f"{where} must not contain a NUL character")
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
        cfg.origins[f"{section}.{key}"] = source


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
            if key not in ("token", "token_file", "quota_bytes", "replicas"):
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
            doc = load_toml(p, max_bytes=CONFIG_BYTES_MAX)
        except TomlFileError as e:
            raise ConfigError(str(e)) from None
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
            elif section in _SECTIONS:  # `control = 5`: a known name, not a table
                raise ConfigError(
                    f"{p}: {section} must be a table ([{section}] and its keys), "
                    f"not {type(values).__name__} {values!r}"
                )
            else:
                known = ", ".join([*_SECTIONS, "tenants", "spdk", "net"])
                raise ConfigError(f"{p}: unknown section [{section}]; known: {known}")
    env = os.environ if environ is None else environ
    if env.get(DATA_DIR_ENV):
        cfg.agent.data_dir = _coerce("agent", "data_dir", env[DATA_DIR_ENV], "", DATA_DIR_ENV)
        cfg.origins["agent.data_dir"] = f"environment {DATA_DIR_ENV}"
    _env_overrides(cfg, env)
    _check_values(cfg)
    _check_mode(cfg)
    _check_security(cfg)
    _check_cluster(cfg)
    _check_etcd(cfg)
    return cfg


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
PORT_MAX = 65535
TICK_INTERVAL_S_MIN = 0.01  # the tick fsyncs and expires leases; 0 would spin a core
TICK_INTERVAL_S_MAX = 60.0  # leases and reservations expire on ticks: keep them timely
POLICY_ORDER_SAVE_S_MIN = 1.0  # each save orders and writes every tenant's NVMe policy order
IO_SIZE_MAX = 64 << 20  # one command's buffer; KV chunks are a few MiB
IO_WORKERS_MAX = 256


def _check_values(cfg: AgentConfig) -> None:
    """Every value that would only fail at `agent run` fails here, at load (exit 4)."""

    def bad(section: str, key: str, value: Any, why: str) -> ConfigError:
        return ConfigError(f"{cfg.origin(f'{section}.{key}')}: [{section}] {key}={value!r} {why}")

    for section in ("control", "nvmf", "metrics"):
        port = getattr(cfg, section).port
        if not 0 <= port <= PORT_MAX:
            raise bad(section, "port", port, f"must be 0..{PORT_MAX} (0 picks a free port)")
    a, st, nv = cfg.agent, cfg.storage, cfg.nvmf
    if not a.data_dir.strip():  # "" was the working directory, made 0700 and filled
        raise bad("agent", "data_dir", a.data_dir, "is empty: name a directory (default ./var)")
    for key in ("admin_token_file", "state_file"):  # "" named the data directory itself
        if not str(getattr(a, key)).strip():
            raise bad("agent", key, getattr(a, key), "is empty: name a file")
    if a.log_level.upper() not in LOG_LEVELS:
        raise bad("agent", "log_level", a.log_level, f"must be one of {', '.join(LOG_LEVELS)}")
    if not TICK_INTERVAL_S_MIN <= a.tick_interval_s <= TICK_INTERVAL_S_MAX:
        raise bad("agent", "tick_interval_s", a.tick_interval_s,
                  f"must be {TICK_INTERVAL_S_MIN}..{TICK_INTERVAL_S_MAX} seconds")  # fmt: skip
    if not a.node_name.strip():
        raise bad("agent", "node_name", a.node_name, "must not be empty")
    if st.eviction_policy not in POLICY_NAMES:
        raise bad("storage", "eviction_policy", st.eviction_policy,
                  f"is unknown; choose one of {', '.join(POLICY_NAMES)}")  # fmt: skip
    for key in ("dram_bytes", "nvme_bytes"):
        value = getattr(st, key)
        if value < BLOCK_BYTES or value % BLOCK_BYTES:
            raise bad("storage", key, value, f"must be a multiple of {BLOCK_BYTES} (a block)")
    for key in ("lease_ttl_s", "reservation_ttl_s"):
        if getattr(st, key) <= 0:
            raise bad("storage", key, getattr(st, key), "must be more than 0 seconds")
    if st.policy_order_save_s < POLICY_ORDER_SAVE_S_MIN:  # a save costs ~0.1 s per 131k items
        raise bad("storage", "policy_order_save_s", st.policy_order_save_s,
                  f"must be at least {POLICY_ORDER_SAVE_S_MIN} s")  # fmt: skip
    if not 1 <= nv.io_workers <= IO_WORKERS_MAX:
        raise bad("nvmf", "io_workers", nv.io_workers, f"must be 1..{IO_WORKERS_MAX}")
    if nv.data_buffers_per_queue < 1:
        raise bad("nvmf", "data_buffers_per_queue", nv.data_buffers_per_queue, "must be >= 1")
    if not BLOCK_BYTES <= nv.max_io_size <= IO_SIZE_MAX or nv.max_io_size % BLOCK_BYTES:
        raise bad("nvmf", "max_io_size", nv.max_io_size,
                  f"must be a multiple of {BLOCK_BYTES} up to {IO_SIZE_MAX}")  # fmt: skip
    if cfg.control.connections_max < 1:
        raise bad("control", "connections_max", cfg.control.connections_max, "must be >= 1")


def _check_cluster(cfg: AgentConfig) -> None:
    """[cluster] replicas (and each tenant's) within 1..REPLICAS_MAX; profile one of Serf's."""
    c = cfg.cluster
    if not 1 <= c.replicas <= REPLICAS_MAX:
        raise ConfigError(
            f"{cfg.origin('cluster.replicas')}: [cluster] replicas={c.replicas} "
            f"must be 1..{REPLICAS_MAX}"
        )
    for t in cfg.tenants.values():
        if t.replicas > REPLICAS_MAX:
            raise ConfigError(
                f"{cfg.source}: [tenants.{t.name}] replicas={t.replicas} must be 0..{REPLICAS_MAX}"
            )
    if c.serf_profile not in ("lan", "wan", "local"):
        raise ConfigError(
            f"{cfg.origin('cluster.serf_profile')}: [cluster] serf_profile={c.serf_profile!r}: "
            "lan, wan or local"
        )


def _check_etcd(cfg: AgentConfig) -> None:
    """[cluster] etcd_*: URLs, a prefix, and credentials: etcd holds the tenants' tokens, so an
    etcd anyone can read is refused."""
    c = cfg.cluster
    if not c.etcd_endpoints:
        return
    where = f"{cfg.source}: [cluster]"
    for url in (u.strip() for u in c.etcd_endpoints.split(",")):
        if url and not url.startswith(("http://", "https://")):
            raise ConfigError(f"{where} etcd_endpoints: {url!r} must be http(s)://HOST:PORT")
    if not c.etcd_prefix.startswith("/") or len(c.etcd_prefix) < 2:
        raise ConfigError(f"{where} etcd_prefix={c.etcd_prefix!r} must be /NAME")
    if not (c.etcd_user and c.etcd_password_file):
        # the agent speaks etcd's JSON gateway, which ignores a client certificate's CN (and
        # refuses one that has it): etcd's user/password auth is what scopes the agent
        raise ConfigError(
            f"{where} etcd_endpoints needs etcd_user and etcd_password_file (etcd auth on: "
            "it holds the tenants' tokens); a client certificate (etcd_cert_file) adds mTLS"
        )
    if bool(c.etcd_cert_file) != bool(c.etcd_key_file):
        raise ConfigError(f"{where} etcd_cert_file and etcd_key_file go together")
    if cfg.spdk_mode:
        raise ConfigError(
            f"{where} etcd_endpoints: SPDK mode takes its tenants from [spdk] subsystems"
        )


def read_secret(path: Path) -> str:
    """A secret file's content; ConfigError when it is group/world readable or empty."""
    return _read_secret(path)


def _apply_spdk(cfg: AgentConfig, doc: dict[str, Any], source: str) -> None:
    """The [spdk] section through spdk_plugins' own parser (one parser for agent and dpuctl)."""
    from spdk_plugins.desired import DesiredStateError, parse_desired

    try:
        cfg.spdk = parse_desired(doc)
    except DesiredStateError as e:
        raise ConfigError(f"{source}: [spdk] is invalid: {e}") from None
    cfg.spdk_doc = doc["spdk"]


def _check_security(cfg: AgentConfig) -> None:
    """[nvmf] require_auth / secure_channel are the embedded target's (docs/NVME_AUTH.md)."""
    if cfg.spdk_mode and (cfg.nvmf.require_auth or cfg.nvmf.secure_channel):
        raise ConfigError(
            f"{cfg.source}: [nvmf] require_auth/secure_channel apply to the embedded target; in "
            "SPDK mode SPDK's subsystems authenticate (nvmf_subsystem_add_host --dhchap-key, "
            "--psk with keyring_file_add_key)"
        )
    if (cfg.control.tls_key or cfg.control.tls_client_ca) and not cfg.control.tls_cert:
        raise ConfigError(f"{cfg.source}: [control] tls_key/tls_client_ca need tls_cert")


def _check_mode(cfg: AgentConfig) -> None:
    """SPDK mode: [spdk] present, every tenant has both tiers, the agent's NQN is allowed."""
    where = f"{cfg.origin('agent.mode')}: [agent] mode={cfg.agent.mode!r}"
    if cfg.agent.mode not in MODES:
        raise ConfigError(f"{where} must be one of {', '.join(MODES)}")
    if not cfg.spdk_mode:
        return
    if cfg.spdk is None:
        raise ConfigError(f"{where} needs an [spdk] section (see spdk_plugins/examples)")
    from spdk_plugins.desired import DesiredStateError

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
