"""`dpuctl doctor`'s storage row: asks a running agent whether its journal takes writes and
whether it started after damage (what it dropped), so an operator sees why writes are refused."""

from __future__ import annotations

import json
import os

from dpu_agent.config import ConfigError, load_config
from host_shim.control import AgentUnreachable, ControlChannel, ControlError
from kvproto.control import ADMIN_TENANT

__all__ = ["probe_agent_storage"]

PROBE_TIMEOUT_S = 5.0  # a live agent answers stats in milliseconds


def probe_agent_storage() -> tuple[str, str]:
    """(status, detail): missing while writes are fenced, fallback after a lossy start."""
    try:
        cfg = load_config(None)
        cfg.prepare(create=False)
    except (ConfigError, OSError):
        return "ok", "no agent running here (nothing to check)"
    try:
        state = json.loads(cfg.state_path.read_text())
        os.kill(int(state["pid"]), 0)
        url = str(state["control"]["unix"] or state["control"]["tcp"])
        who = f"agent pid {state['pid']}"
        stale_ok = False
    except (OSError, ValueError, KeyError, TypeError):
        # no agent.json (an agent started on a full disk cannot write one): its Unix socket
        sock = cfg.unix_socket_path
        if sock is None or not sock.exists() or not cfg.admin_token:
            return "ok", "no agent running here (nothing to check)"
        url, who = f"unix://{sock}", f"the agent on {sock}"
        stale_ok = True  # a socket left by a killed agent is no agent
    try:
        with ControlChannel(url, ADMIN_TENANT, cfg.admin_token, timeout_s=PROBE_TIMEOUT_S,
                            client="dpuctl doctor") as ch:  # fmt: skip
            ch.connect()
            stats = ch.call("stats", tenants_limit=0)["stats"]  # the totals: no tenant rows
    except (AgentUnreachable, ControlError, OSError) as e:
        if stale_ok:
            return "ok", "no agent running here (nothing to check)"
        return "missing", f"{who} does not answer: {e}"
    marker = stats.get("restore_interrupted")
    if marker:
        dirs = ", ".join(marker.get("dirs") or ["?"])
        return "missing", (f"a restore of {dirs} was interrupted: dpuctl backup restore "
                           "--resume (start it over) or --rollback")  # fmt: skip
    fenced = stats.get("journal_fenced") or ""
    if fenced:
        full = " (disk full; reads are served)" if stats.get("journal_full") else ""
        return "missing", f"journal refuses writes{full}: {fenced}"
    tiers_full = int(stats.get("tiers_full") or 0)
    if tiers_full:
        return "missing", (
            f"{tiers_full} tier file(s) refused their last write for want of space (the file "
            "system under [storage] nvme_dir is full; reads are served): free space there; "
            "`dpuctl stats` names the tenants"
        )
    r = stats.get("recovery") or {}
    losses = ("damaged_frames", "missing_segments", "checkpoints_damaged", "dropped_records")
    dropped = {k: r.get(k, 0) for k in losses}
    if any(dropped.values()):
        detail = ", ".join(f"{k}={v}" for k, v in dropped.items())
        return "fallback", (f"started after damage ({detail}; checkpoint used: "
                            f"{r.get('checkpoint_used')}); see the agent log")  # fmt: skip
    records = stats.get("records", 0)
    if r.get("previous_stop") == "unclean":
        return "ok", (f"journal writable; the last start followed an unclean stop (killed or "
                      f"power lost): the journal was replayed, nothing damaged ({records} "
                      "records)")  # fmt: skip
    return "ok", f"journal writable; last start clean ({records} records)"
