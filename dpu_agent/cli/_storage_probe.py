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
        state = json.loads(cfg.state_path.read_text())
        os.kill(int(state["pid"]), 0)
        cfg.prepare()
        url = str(state["control"]["unix"] or state["control"]["tcp"])
    except (ConfigError, OSError, ValueError, KeyError, TypeError):
        return "ok", "no agent running here (nothing to check)"
    try:
        with ControlChannel(url, ADMIN_TENANT, cfg.admin_token, timeout_s=PROBE_TIMEOUT_S,
                            client="dpuctl doctor") as ch:  # fmt: skip
            ch.connect()
            stats = ch.call("stats")["stats"]
    except (AgentUnreachable, ControlError, OSError) as e:
        return "missing", f"agent pid {state['pid']} does not answer: {e}"
    fenced = stats.get("journal_fenced") or ""
    if fenced:
        return "missing", f"journal refuses writes: {fenced}"
    r = stats.get("recovery") or {}
    dropped = {k: r.get(k, 0) for k in ("damaged_frames", "checkpoints_damaged", "dropped_records")}
    if any(dropped.values()):
        detail = ", ".join(f"{k}={v}" for k, v in dropped.items())
        return "fallback", (f"started after damage ({detail}; checkpoint used: "
                            f"{r.get('checkpoint_used')}); see the agent log")  # fmt: skip
    return "ok", f"journal writable; last start clean ({stats.get('records', 0)} records)"
