"""`dpuctl hosts add`: allow a host on a tenant's subsystem, with keys the agent issues.

With `[nvmf] require_auth` the reply carries the host's DH-HMAC-CHAP secret (`DHHC-1:`), with
`[nvmf] secure_channel` its TLS PSK (`NVMeTLSkey-1:`): printed once, for a host that does not
use the shim's hello (a kernel initiator: `nvme connect --dhchap-secret ... --tls-key ...`).
The agent keeps them (0600) in its data directory.
"""

from __future__ import annotations

import click

from dpu_agent.cli.ops import admin_call, common, emit, show_done
from kvproto.nvme import NQN_BYTES_MAX

__all__ = ["hosts"]


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
