"""`dpuctl cluster members|status|join|leave`: the cluster this agent belongs to."""

from __future__ import annotations

from typing import Any

import click

from dpu_agent.cli import ops
from dpu_agent.cluster._ops import drain_and_leave, serf_join

__all__ = ["cluster_group"]

LEAVE_TIMEOUT_S = 600.0  # a drain hands off every chunk at [cluster] rebalance_bytes_per_s


def _show_members(data: dict[str, Any]) -> None:
    ops._rows_table(f"cluster members (epoch {data.get('epoch', '-')})", data.get("members", []))


def _show_status(data: dict[str, Any]) -> None:
    summary = {k: v for k, v in data.items() if k != "members"}
    ops._kv_table("cluster status", ops._flatten("", summary, {}))


def _status(data: dict[str, Any]) -> dict[str, Any]:
    members = data.get("members", [])
    alive = [m for m in members if m.get("status", "alive") == "alive"]
    return {
        **data,
        "clustered": "epoch" in data,
        "alive": len(alive),
        "serving": data.get("serving", len(alive)),
        "failed": sorted(m["name"] for m in members if m.get("status") in ("failed", "left")),
    }


def _serf(config_path: str | None, as_json: bool) -> tuple[str, str]:
    cfg = ops.config_of(config_path, as_json)
    if not cfg.cluster.enabled:
        ops._fail(ops.EXIT_FAILED, "not in a cluster: set [cluster] enabled = true", as_json)
    key = (
        cfg.path(cfg.cluster.rpc_auth_file).read_text().strip() if cfg.cluster.rpc_auth_file else ""
    )
    return cfg.cluster.serf_rpc, key


@click.group("cluster", help="Cluster membership (Serf), placement epoch and rebalancing.")
def cluster_group() -> None:
    pass


@cluster_group.command("members", help="Members as this agent sees them, with the epoch.")
@ops.common
def members(config_path: str | None, as_json: bool) -> None:
    ops.emit(ops.admin_call(config_path, as_json, "members"), as_json, _show_members)


@cluster_group.command("status", help="Epoch, serving members, failed members, rebalancing.")
@ops.common
def status(config_path: str | None, as_json: bool) -> None:
    ops.emit(_status(ops.admin_call(config_path, as_json, "members")), as_json, _show_status)


@cluster_group.command("join", help="Join the cluster of another member's Serf ADDRESS.")
@click.argument("addresses", nargs=-1, required=True)
@ops.common
def join(addresses: tuple[str, ...], config_path: str | None, as_json: bool) -> None:
    rpc, key = _serf(config_path, as_json)
    try:
        ops.emit(serf_join(rpc, key, addresses), as_json, ops.show_done("cluster join"))
    except Exception as e:  # SerfError, unreachable: a message, not a traceback
        ops._fail(ops.EXIT_FAILED, f"join: {e}", as_json)


@cluster_group.command("leave", help="Hand every chunk to its new owners, then leave.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=1), default=LEAVE_TIMEOUT_S,
              show_default=True, help="Seconds the drain may take.")  # fmt: skip
@click.option("--no-drain", is_flag=True, help="Leave at once; this node's chunks are lost.")
@ops.common
def leave(timeout_s: float, no_drain: bool, config_path: str | None, as_json: bool) -> None:
    rpc, key = _serf(config_path, as_json)

    def view() -> dict[str, Any]:
        return ops.admin_call(config_path, as_json, "members")

    try:
        result = drain_and_leave(rpc, key, view, timeout_s=timeout_s, drain=not no_drain)
    except Exception as e:
        ops._fail(ops.EXIT_FAILED, f"leave: {e}", as_json)
    ops.emit(result, as_json, ops.show_done("cluster leave (stop the agent now)"))
