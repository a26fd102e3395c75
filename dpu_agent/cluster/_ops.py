"""What `dpuctl cluster ...` does beyond a control-plane call: Serf RPC joins, keyring changes,
force-leave and the drained leave, and the doctor's Serf round trip. The CLI
(dpu_agent/cli/cluster.py) only parses and prints."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from dpu_agent.cluster._serf_client import SerfClient
from dpu_agent.cluster._serf_process import SerfProcess, free_port
from dpu_agent.config import serf_key_problem

__all__ = [
    "DRAIN_POLL_S",
    "MembersFailed",
    "drain_and_leave",
    "probe_serf",
    "serf_force_leave",
    "serf_join",
    "serf_keys",
]

DRAIN_POLL_S = 0.5
# A keyring command is a Serf query: under load a live member's answer can miss the query's
# timeout ("2/3 nodes reported success", none refusing; seen on a loaded 2-core box right
# after members left). Asked again up to this many times: installing a key held, using the
# primary and removing a key gone are no-ops in Serf's keyring, so a repeat changes nothing.
KEY_QUERY_TRIES = 3


def serf_join(rpc_addr: str, auth_key: str, addrs: Sequence[str], node: str) -> dict[str, Any]:
    """Join the cluster of `addrs`. A node that left (`cluster leave`: its agent restarted
    Serf alone, still `leaving`) serves again once joined; a node draining inside the
    cluster stays `leaving` (a join must not cancel a drain)."""
    with SerfClient(rpc_addr, auth_key=auth_key) as c:
        before = c.members()
        me = next((m for m in before if m.name == node), None)
        alone = not any(m.name != node and m.status == "alive" for m in before)
        joined = c.join(list(addrs))
        back = me is not None and alone and me.tags.get("state") == "leaving" and joined > 0
        if back:
            c.tags({"state": "serving"})
    return {"joined": joined, "addresses": list(addrs), "serving_again": back}


class MembersFailed(Exception):
    """A keyring change refused while members are `failed` (serf_keys says why)."""


def serf_keys(
    rpc_addr: str, auth_key: str, command: str, key: str = "", *, force: bool = False
) -> dict[str, Any]:
    """One keyring command across the cluster; a malformed key is refused here, before Serf
    sees it (ValueError naming what is wrong, never echoing the key). A change (install, use,
    remove) is refused while any member is `failed` (MembersFailed naming them), unless
    `force`: Serf's key query reaches live members only, so a member cut off by a partition
    missed the change, and once the network healed it could not read the others' gossip
    (nor they its): the cluster stayed split, and every step had reported success."""
    if command != "list-keys":
        problem = serf_key_problem(key)
        if problem:
            raise ValueError(f"the key {problem}")
    with SerfClient(rpc_addr, auth_key=auth_key) as c:
        if command != "list-keys" and not force:
            failed = sorted(m.name for m in c.members() if m.status == "failed")
            if failed:
                raise MembersFailed(
                    f"refused while {len(failed)} member(s) are failed: {', '.join(failed)}. "
                    "A key change reaches live members only: these would keep the old "
                    "keyring and stay cut off once back. Bring them back first, or remove "
                    "each (`dpuctl cluster force-leave NODE`; give it the new keyring file "
                    "before it rejoins), or pass --force"
                )
        reply = c.keys(command, key)
        for _ in range(KEY_QUERY_TRIES - 1):  # each command is idempotent: asked again, a
            if reply.errors or reply.responses >= reply.nodes:  # member that has it is unmoved
                break
            reply = c.keys(command, key)
        return reply.as_dict()


def serf_force_leave(rpc_addr: str, auth_key: str, node: str) -> dict[str, Any]:
    """Mark a `failed` member `left` (Serf's force-leave): it no longer counts as a member
    that must come back (key changes, the members list)."""
    with SerfClient(rpc_addr, auth_key=auth_key) as c:
        known = {m.name: m.status for m in c.members()}
        if node not in known:
            raise ValueError(f"no member named {node!r} (members: {', '.join(sorted(known))})")
        if known[node] == "alive":
            raise ValueError(f"{node} is alive: force-leave is for failed members; on that "
                             "node run `dpuctl cluster leave`")  # fmt: skip
        c.force_leave(node)
    return {"node": node, "was": known[node]}


def drain_and_leave(
    rpc_addr: str,
    auth_key: str,
    view: Callable[[], dict[str, Any]],
    *,
    timeout_s: float,
    drain: bool = True,
) -> dict[str, Any]:
    """Mark this node `leaving` (it owns nothing from the next epoch on), wait until its
    rebalancer has handed every chunk to the new owners, then leave Serf gracefully.
    TimeoutError (nothing left yet) when the drain does not finish in `timeout_s`."""
    with SerfClient(rpc_addr, auth_key=auth_key) as c:
        c.tags({"state": "leaving"})
        t0 = time.monotonic()
        last: dict[str, Any] = {}
        while drain:
            v = view()
            r = v.get("rebalance") or {}
            last = r
            leaving = any(m["name"] == v.get("node") and m["state"] == "leaving"
                          for m in v.get("members", []))  # fmt: skip
            if leaving and r.get("epoch") == v.get("epoch") and not r.get("running") \
                    and r.get("pending") == 0 and r.get("failed") == 0:  # fmt: skip
                break
            if time.monotonic() - t0 > timeout_s:
                c.tags({"state": "serving"})  # give up: back to serving, nothing lost
                raise TimeoutError(
                    f"drain not finished after {timeout_s} s (pending {r.get('pending')}, "
                    f"failed {r.get('failed')}); the node is serving again. Retry with a "
                    "longer --timeout or check the other members (dpuctl cluster status)"
                )
            time.sleep(DRAIN_POLL_S)
        c.leave()
    return {"left": True, "drain_s": round(time.monotonic() - t0, 2),
            "moved_chunks": last.get("moved_chunks", 0),
            "moved_bytes": last.get("moved_bytes", 0)}  # fmt: skip


def probe_serf(serf_bin: str = "serf") -> tuple[str, str]:
    """Start a throwaway Serf agent on loopback and talk RPC to it: the binary runs and
    speaks the protocol kvproto.serf implements."""
    if shutil.which(serf_bin) is None:
        return "missing", f"{serf_bin} not installed (cluster membership); apt-get install serf"
    with tempfile.TemporaryDirectory(prefix="dpukv-doctor-") as d:
        p = SerfProcess("dpukv-doctor", bind=f"127.0.0.1:{free_port()}",
                        rpc_addr=f"127.0.0.1:{free_port()}", serf_bin=serf_bin,
                        log_path=f"{d}/serf.log")  # fmt: skip
        try:
            with p.wait_ready(timeout_s=10.0) as c:
                members = c.members()
            return "ok", f"serf agent starts; RPC handshake and members ({len(members)}) work"
        except (RuntimeError, OSError) as e:
            return "missing", f"serf agent does not start or answer RPC: {e}"
        finally:
            p.kill()
