"""`dpuctl config check [--production]`: what makes a configuration unfit to serve hosts.

Without --production it loads and validates the file (the agent's own checks). With it, it also
flags what the embedded default accepts but a production DPU must not: listeners on loopback
(no host can reach them), the control channel without TLS, NVMe/TCP without DH-HMAC-CHAP or
TLS, tiers larger than the memory and disks under them, and in SPDK mode an SPDK whose release
the driver does not speak. Exit 0 when nothing is flagged, 1 otherwise (docs/DEPLOY.md).
"""

from __future__ import annotations

import ipaddress
import shutil
from pathlib import Path

import click

from dpu_agent.cli.ops import EXIT_FAILED, common, config_of, emit
from dpu_agent.config import AgentConfig
from spdk_plugins import SpdkClient, SpdkError
from spdk_plugins.versions import check_target_version

__all__ = ["config_check"]

SPDK_CHECK_TIMEOUT_S = 5.0  # one version and one methods call to a local socket


def _loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: resolved by whoever connects


def _mem_total_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def production_findings(cfg: AgentConfig) -> list[dict[str, str]]:
    """What keeps `cfg` from serving hosts in production: one row per problem."""
    out: list[dict[str, str]] = []

    def flag(check: str, problem: str) -> None:
        out.append({"check": check, "problem": problem})

    if _loopback(cfg.control.host):
        flag("listeners", f"[control] host = {cfg.control.host!r} is loopback: no host reaches it")
    if not cfg.control.tls_cert:
        flag("tls", "[control] tls_cert is empty: tokens cross the network in clear")
    if cfg.spdk_mode:
        assert cfg.spdk is not None
        for s in cfg.spdk.subsystems:  # loopback is the agent's own; hosts need another
            if all(_loopback(li.traddr) for li in s.listeners):
                flag("listeners", f"[[spdk.subsystems]] {s.nqn}: only loopback listeners")
        out.extend(_spdk_version_findings(cfg))
    else:
        if _loopback(cfg.nvmf.host):
            flag("listeners", f"[nvmf] host = {cfg.nvmf.host!r} is loopback: no host reaches it")
        if not cfg.nvmf.require_auth:
            flag("auth", "[nvmf] require_auth = false: any host NQN may connect")
        if not cfg.nvmf.secure_channel:
            flag("tls", "[nvmf] secure_channel = false: KV travels NVMe/TCP in clear")
        tenants = max(1, len(cfg.tenants))
        mem = _mem_total_bytes()
        dram = cfg.storage.dram_bytes * tenants
        if mem is not None and dram > mem:
            flag("sizes", f"[storage] dram_bytes x {tenants} tenant(s) = {dram} B > {mem} B of RAM")
        nvme_dir = _existing(cfg.path(cfg.storage.nvme_dir))
        disk = shutil.disk_usage(nvme_dir).total
        nvme = cfg.storage.nvme_bytes * tenants
        if nvme > disk:
            flag(
                "sizes",
                f"[storage] nvme_bytes x {tenants} tenant(s) = {nvme} B > {disk} B of the "
                f"filesystem under {nvme_dir}",
            )
    return out


def _spdk_version_findings(cfg: AgentConfig) -> list[dict[str, str]]:
    assert cfg.spdk is not None
    try:
        with SpdkClient(cfg.spdk.socket, timeout_s=SPDK_CHECK_TIMEOUT_S) as client:
            check_target_version(client)
    except SpdkError as e:
        return [{"check": "spdk", "problem": str(e)}]
    return []


@click.command("check", help="Validate the config; --production flags what no host can use.")
@click.option(
    "--production", is_flag=True,
    help="Also flag loopback listeners, missing TLS or auth, oversized tiers, unsupported SPDK.",
)  # fmt: skip
@common
def config_check(production: bool, config_path: str | None, as_json: bool) -> None:
    cfg = config_of(config_path, as_json, create=False)
    findings = production_findings(cfg) if production else []

    def show(data: dict[str, object]) -> None:
        for f in findings:
            click.echo(f"{f['check']}: {f['problem']}")
        click.echo(f"{cfg.source}: {len(findings)} problem(s)" if findings else f"{cfg.source}: ok")

    emit({"source": str(cfg.source), "findings": findings, "ok": not findings}, as_json, show)
    if findings:
        raise SystemExit(EXIT_FAILED)
