"""What `dpuctl cluster ...` does beyond a control-plane call: Serf RPC joins and the drained
leave, and the doctor's Serf round trip. The CLI (dpu_agent/cli/cluster.py) only parses and
prints."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from dpu_agent.cluster._serf_client import SerfClient
from dpu_agent.cluster._serf_process import SerfProcess, free_port
from dpu_agent.config import serf_key_problem

__all__ = ["DRAIN_POLL_S", "drain_and_leave", "probe_serf", "serf_join", "serf_keys"]

DRAIN_POLL_S = 0.5


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


def serf_keys(rpc_addr: str, auth_key: str, command: str, key: str = "") -> dict[str, Any]:
    """One keyring command across the cluster; a malformed key is refused here, before Serf
    sees it (ValueError naming what is wrong, never echoing the key)."""
    if command != "list-keys":
        problem = serf_key_problem(key)
        if problem:
            raise ValueError(f"the key {problem}")
    with SerfClient(rpc_addr, auth_key=auth_key) as c:
        return c.keys(command, key).as_dict()


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
