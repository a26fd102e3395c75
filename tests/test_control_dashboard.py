"""docs/grafana-dashboard.json only charts metrics the agent registers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import dpu_agent.control  # registers the control-plane metrics
import dpu_agent.engine  # registers the engine's metrics
import dpu_agent.service  # noqa: F401  (registers the process collector)
from dpu_agent.metrics import REGISTRY
from dpu_agent.telemetry import COLLECTED_METRICS  # collectors installed when the agent starts

DASHBOARD = Path(__file__).resolve().parent.parent / "docs" / "grafana-dashboard.json"


def test_dashboard_metrics_exist() -> None:
    doc = json.loads(DASHBOARD.read_text())
    assert doc["panels"] and doc["title"]
    exprs = [t["expr"] for p in doc["panels"] for t in p["targets"]]
    used = {re.sub(r"_(total|bucket|sum|count)$", "", n) for e in exprs
            for n in re.findall(r"\b(?:kvtier|process)_[a-z0-9_]+", e)}  # fmt: skip
    registered = {m.name for m in REGISTRY.collect()} | COLLECTED_METRICS
    missing = sorted(used - registered)
    assert not missing, f"dashboard uses unregistered metrics: {missing}"
    assert {"kvtier_hit_ratio", "kvtier_control_request_seconds"} <= used
