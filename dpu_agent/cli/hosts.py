"""`dpuctl hosts add`: allow a host on a tenant's subsystem, with keys the agent issues.

With `[nvmf] require_auth` the reply carries the host's DH-HMAC-CHAP secret (`DHHC-1:`), with
`[nvmf] secure_channel` its TLS PSK (`NVMeTLSkey-1:`): printed once, for a host that does not
use the shim's hello (a kernel initiator: `nvme connect --dhchap-secret ... --tls-key ...`).
The agent keeps them (0600) in its data directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shlex
import stat
from pathlib import Path
from typing import Any

import click

from dpu_agent.cli.ops import EXIT_USAGE, _fail, admin_call, common, emit, find_agent, show_done
from dpu_agent.config import AgentConfig, ConfigError, TenantConfig
from dpu_agent.files import read_small_file
from dpu_agent.tenant_store import TENANTS_FILE, TenantStore, apply_saved
from host_shim.control import parse_client_url
from host_shim.integrations.credentials import (
    CREDENTIALS_VERSION,
    Credentials,
    load_credentials,
    parse_salt,
)
from kvproto.nvme import NQN_BYTES_MAX

__all__ = ["hosts"]

SALT_BYTES = 32  # BLAKE2b keys up to 64 bytes; 32 is its full strength at 256 bits


def _nqn(ctx: click.Context, param: click.Parameter, value: str) -> str:
    if not value.startswith("nqn.") or not 0 < len(value.encode()) <= NQN_BYTES_MAX:
        raise click.BadParameter(f"must start with 'nqn.' and be at most {NQN_BYTES_MAX} bytes")
    if any(c.isspace() for c in value):
        raise click.BadParameter("must not contain spaces")
    return value


@click.group("hosts", help="Hosts allowed on tenants' NVMe/TCP subsystems, with issued keys.")
def hosts() -> None:
    pass


@hosts.command("add", help="Allow host NQN on TENANT's subsystem; prints its issued keys once.")
@click.option("--tenant", required=True)
@click.option("--nqn", required=True, callback=_nqn, help="The host's NQN.")
@common
def hosts_add(tenant: str, nqn: str, config_path: str | None, as_json: bool) -> None:
    emit(
        admin_call(config_path, as_json, "host_add", tenant=tenant, nqn=nqn),
        as_json,
        show_done(f"host added to {tenant}"),
    )


def _tcp_control_urls(cfg: AgentConfig) -> list[str]:
    """The running agent's TCP control URL (its state file), else the configured listener."""
    scheme = "tls" if cfg.control.tls_cert else "tcp"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        tcp = json.loads(cfg.state_path.read_text())["control"]["tcp"]
        if tcp:  # the running agent's own URL says tls:// when its listener has TLS
            return [str(tcp) if "://" in str(tcp) else f"{scheme}://{tcp}"]
    return [f"{scheme}://{cfg.control.host}:{cfg.control.port}"]


def tenant_salt(cfg: AgentConfig, tenant: str) -> str:
    """The tenant's salt (hex), shared by every host of the tenant so that they share chunks:
    var/tenant-<name>.salt, made on the first enrolment (0600)."""
    path = cfg.path(f"tenant-{tenant}.salt")
    with contextlib.suppress(FileNotFoundError):
        return parse_salt(path.read_text()).hex()
    salt = secrets.token_hex(SALT_BYTES)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(salt + "\n")
    return salt


@hosts.command(
    "enrol", help="Write the credentials file a GPU server of TENANT needs (0600), to --out."
)
@click.option("--tenant", required=True)
@click.option(
    "--nqn", callback=lambda c, p, v: _nqn(c, p, v) if v else "", default="",
    help="The host's NQN: also allow it on the subsystem and add its issued keys.",
)  # fmt: skip
@click.option(
    "--control-url", "control_urls", multiple=True,
    help="URL the host reaches the agent at (repeat for a cluster's nodes); default: "
    "the agent's own TCP listener.",
)  # fmt: skip
@click.option(
    "--control-ca", "control_ca", default=None, type=click.Path(exists=True, dir_okay=False),
    help="PEM the host verifies the agents' TLS certificates against (the CA that signed "
    "them); default: [control] tls_cert itself (a self-signed certificate or a full chain).",
)  # fmt: skip
@click.option(
    "--out", "out", required=True, type=click.Path(dir_okay=False),
    help="The credentials file to write (copy it to the GPU server, e.g. /etc/dpukv/T.json).",
)  # fmt: skip
@common
def hosts_enrol(
    tenant: str,
    nqn: str,
    control_urls: tuple[str, ...],
    control_ca: str | None,
    out: str,
    config_path: str | None,
    as_json: bool,
) -> None:
    cfg = find_agent(config_path, as_json)
    t = cfg.tenants.get(tenant) or _runtime_tenant(cfg, tenant)
    if t is None or not t.token:
        _fail(EXIT_USAGE, f"no tenant {tenant!r} in {cfg.source} or added at run time; see "
              "dpuctl tenants list", as_json)  # fmt: skip
    for url in control_urls:  # a garbage URL was written, failing only on the GPU server
        try:
            parse_client_url(url)
        except ValueError as e:
            _fail(EXIT_USAGE, f"--control-url: {e}", as_json)
    creds: dict[str, object] = {
        "version": CREDENTIALS_VERSION,
        "control": list(control_urls) or _tcp_control_urls(cfg),
        "tenant": tenant,
        "token": t.token,
        "salt": tenant_salt(cfg, tenant),
    }
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        creds["nvmf"] = str(json.loads(cfg.state_path.read_text())["nvmf"] or "")
    ca = Path(control_ca) if control_ca is not None else None
    if ca is None and cfg.control.tls_cert:
        ca = cfg.path(cfg.control.tls_cert)
    if ca is not None:
        try:
            creds["control_ca"] = read_small_file(ca, CA_FILE_BYTES_MAX).decode()
        except (OSError, UnicodeDecodeError) as e:
            _fail(EXIT_USAGE, f"cannot read the CA {ca}: {getattr(e, 'strerror', e)}", as_json)
    fd = _open_out(out, as_json)  # before the host is allowed: a path that cannot be written
    if nqn:  # left the host allowed and its keys printed nowhere
        reply = admin_call(config_path, as_json, "host_add", tenant=tenant, nqn=nqn)
        creds.update({k: v for k, v in reply.items() if k != "tenant"})
    os.ftruncate(fd, 0)
    os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
    with os.fdopen(fd, "w") as f:
        json.dump(creds, f, indent=2)
        f.write("\n")
    emit(
        {"tenant": tenant, "file": out, "control": creds["control"], "hostnqn": nqn or None},
        as_json,
        show_done(f"credentials of a {tenant} host written to {out} (0600)"),
    )


CA_FILE_BYTES_MAX = 1 << 20  # a certificate chain


def _runtime_tenant(cfg: AgentConfig, tenant: str) -> TenantConfig | None:
    """A tenant added at run time (`dpuctl tenants add`: tenants.json, its token file), with
    its token; None when there is none (the configuration's tenants were all `enrol` saw)."""
    apply_saved(cfg.tenants, TenantStore(cfg.path(TENANTS_FILE)).load(set_aside=False))
    if tenant not in cfg.tenants:
        return None
    try:
        cfg.prepare(create=False)  # reads its token file
    except (ConfigError, OSError):
        return None
    return cfg.tenants.get(tenant)


def _open_out(out: str, as_json: bool) -> int:
    """A descriptor to write `out` (a regular file, created 0600), opened without blocking:
    a FIFO there held `hosts enrol` for good, a missing directory raised a traceback."""
    try:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError as e:
        _fail(EXIT_USAGE, f"cannot write {out}: {e.strerror}", as_json)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        _fail(EXIT_USAGE, f"{out} is not a regular file", as_json)
    os.set_blocking(fd, True)
    return fd


def _connect_args(c: Credentials) -> list[str]:
    """nvme-cli's `connect` arguments for the enrolled host (nvme-cli >= 2.0 spellings)."""
    addr, _, port = c.nvmf.rpartition(":")
    args = ["--transport=tcp", f"--traddr={addr}", f"--trsvcid={port}", f"--nqn={c.subnqn}"]
    args.append(f"--hostnqn={c.hostnqn}")
    if c.dhchap_key:
        args.append(f"--dhchap-secret={c.dhchap_key}")
    if c.psk:  # nvme-cli >= 2.5 with a TLS-capable kernel; older ones lack --tls
        args += ["--tls", f"--tls_key={c.psk}"]
    return args


def nvme_config_json(c: Credentials) -> list[dict[str, Any]]:
    """libnvme's JSON configuration (/etc/nvme/config.json) for the enrolled host."""
    addr, _, port = c.nvmf.rpartition(":")
    port_entry: dict[str, Any] = {"transport": "tcp", "traddr": addr, "trsvcid": port}
    if c.psk:
        port_entry |= {"tls": True, "tls_key": c.psk}
    host: dict[str, Any] = {"hostnqn": c.hostnqn}
    if c.dhchap_key:
        host["dhchap_key"] = c.dhchap_key
    host["subsystems"] = [{"nqn": c.subnqn, "ports": [port_entry]}]
    return [host]


@hosts.command(
    "connect-config",
    help="For a kernel initiator: print the `nvme connect` line of an enrolled host's "
    "credentials file, and write /etc/nvme/config.json and discovery.conf entries.",
)
@click.option("--credentials", "creds_file", required=True, type=click.Path(dir_okay=False))
@click.option("--config-out", type=click.Path(dir_okay=False), help="Write config.json here.")
@click.option("--discovery-out", type=click.Path(dir_okay=False), help="Write discovery.conf.")
def hosts_connect_config(
    creds_file: str, config_out: str | None, discovery_out: str | None
) -> None:
    try:
        c = load_credentials(creds_file)
    except ValueError as e:
        _fail(EXIT_USAGE, str(e), False)
    if not (c.hostnqn and c.subnqn and c.nvmf):
        _fail(
            EXIT_USAGE,
            f"{creds_file}: no host NQN or NVMe/TCP address; enrol the host with --nqn",
            False,
        )
    args = _connect_args(c)
    for path, text in (
        (config_out, json.dumps(nvme_config_json(c), indent=2) + "\n"),
        (discovery_out, " ".join(a for a in args if not a.startswith("--nqn=")) + "\n"),
    ):
        if path:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.fchmod(fd, 0o600)  # it holds the host's secrets
            with os.fdopen(fd, "w") as f:
                f.write(text)
    click.echo(shlex.join(["nvme", "connect", *args]))


@hosts.command("list", help="TENANT's hosts: issued keys, allowed, control sessions.")
@click.option("--tenant", required=True)
@common
def hosts_list(tenant: str, config_path: str | None, as_json: bool) -> None:
    data = admin_call(config_path, as_json, "host_list", tenant=tenant)

    def show(d: dict[str, Any]) -> None:
        for h in d["hosts"]:
            keys = ",".join(h["keys"]) or "-"
            click.echo(
                f"{h['hostnqn']}  keys={keys}  allowed={h['allowed']}  sessions={h['sessions']}"
            )
        if not d["hosts"]:
            click.echo(f"no hosts on {tenant}")

    emit(data, as_json, show)


@hosts.command("remove", help="Remove host NQN from TENANT: revoke its keys, end its sessions.")
@click.option("--tenant", required=True)
@click.option("--nqn", required=True, callback=_nqn, help="The host's NQN.")
@common
def hosts_remove(tenant: str, nqn: str, config_path: str | None, as_json: bool) -> None:
    emit(
        admin_call(config_path, as_json, "host_remove", tenant=tenant, nqn=nqn),
        as_json,
        show_done(f"host removed from {tenant}"),
    )
