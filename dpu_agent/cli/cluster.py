"""`dpuctl cluster members|status|join|leave|force-leave|keys`: the cluster this agent belongs
to."""

from __future__ import annotations

from typing import Any

import click

from dpu_agent.cli import ops
from dpu_agent.cluster._ops import drain_and_leave, serf_force_leave, serf_join, serf_keys

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
        # listed by gossip, refused for bad tags or no proof of the cluster key (CLUSTER.md)
        "refused": sorted(m["name"] for m in members if m.get("status") == "refused"),
    }


def _serf(config_path: str | None, as_json: bool) -> tuple[str, str]:
    """Serf's RPC address and key (read as every secret file is: 0600 or refused)."""
    cfg = ops.config_of(config_path, as_json, create=False)
    if not cfg.cluster.enabled:
        ops._fail(ops.EXIT_FAILED, "not in a cluster: set [cluster] enabled = true", as_json)
    return cfg.cluster.serf_rpc, cfg.serf_rpc_key


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
    node = ops.config_of(config_path, as_json, create=False).agent.node_name
    try:
        ops.emit(serf_join(rpc, key, addresses, node), as_json, ops.show_done("cluster join"))
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
    ops.emit(
        result,
        as_json,
        ops.show_done(
            "cluster leave (stop the agent now, or `dpuctl cluster join ADDR` to serve again)"
        ),
    )


@cluster_group.command("force-leave", help="Remove a failed member NODE from the cluster.")
@click.argument("node")
@ops.common
def force_leave(node: str, config_path: str | None, as_json: bool) -> None:
    rpc, key = _serf(config_path, as_json)
    try:
        result = serf_force_leave(rpc, key, node)
    except Exception as e:  # SerfError, unreachable, no such member: a message
        ops._fail(ops.EXIT_FAILED, f"force-leave: {e}", as_json)
    ops.emit(result, as_json, ops.show_done(f"cluster force-leave {node}"))


# a keyring change while members are failed: they keep the old key (serf_keys)
FORCE = click.option(
    "--force", is_flag=True, help="Even while members are failed (they keep the old key)."
)


@cluster_group.group("keys", help="The gossip keyring, cluster-wide (Serf's key commands).")
def keys_group() -> None:
    pass


def _show_keys(data: dict[str, Any]) -> None:
    rows = [{"key": k, "members": n} for k, n in sorted(data.get("keys", {}).items())]
    if rows:
        ops._rows_table(f"gossip keys ({data.get('nodes', 0)} members)", rows)
    ops._kv_table("keyring", ops._flatten("", {k: v for k, v in data.items() if k != "keys"}, {}))


def _keys(
    command: str, key: str, config_path: str | None, as_json: bool, force: bool = False
) -> None:
    rpc, auth = _serf(config_path, as_json)
    try:
        result = serf_keys(rpc, auth, command, key, force=force)
    except Exception as e:  # SerfError, unreachable, a bad key: a message, not a traceback
        ops._fail(ops.EXIT_FAILED, f"keys {command}: {e}", as_json)
    if result["error"]:
        ops._fail(ops.EXIT_FAILED, f"keys {command}: {result['error']}; {result['messages']}",
                  as_json)  # fmt: skip
    ops.emit(result, as_json, _show_keys)


@keys_group.command("list", help="Every gossip key and how many members hold it.")
@ops.common
def keys_list(config_path: str | None, as_json: bool) -> None:
    _keys("list-keys", "", config_path, as_json)


@keys_group.command("install", help="Add KEY (serf keygen) to every member's keyring.")
@click.argument("key")
@FORCE
@ops.common
def keys_install(key: str, force: bool, config_path: str | None, as_json: bool) -> None:
    _keys("install-key", key, config_path, as_json, force)


@keys_group.command("use", help="Make KEY (installed everywhere first) the primary key.")
@click.argument("key")
@FORCE
@ops.common
def keys_use(key: str, force: bool, config_path: str | None, as_json: bool) -> None:
    _keys("use-key", key, config_path, as_json, force)


@keys_group.command("remove", help="Remove KEY (not the primary) from every member.")
@click.argument("key")
@FORCE
@ops.common
def keys_remove(key: str, force: bool, config_path: str | None, as_json: bool) -> None:
    _keys("remove-key", key, config_path, as_json, force)
