"""Tenant series on /metrics: a removed tenant's series go (they stayed, frozen, until a
restart), and the integrity-failure counters have a 0 sample from the tenant's start (dashboard
panels said "No data" until the first failure). A real agent, its real /metrics endpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from dpu_agent.testing import spawn_agent

DEADLINE_S = 20.0  # the gauges refresh on the agent's tick (0.5 s); generous for a loaded box


def _metrics(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return str(r.read().decode())


def _dpuctl(data_dir: Path, *args: str) -> dict:
    env = {**os.environ, "DPUKV_AGENT_DATA_DIR": str(data_dir)}
    out = subprocess.run([sys.executable, "-c", "from dpu_agent.cli import main; main()", *args,
                          "--json"], env=env, capture_output=True, text=True, timeout=120,
                         stdin=subprocess.DEVNULL)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)


def _wait_for(url: str, present: bool, needle: str) -> str:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        text = _metrics(url)
        if (needle in text) == present or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


def test_removed_tenant_series_go_and_integrity_counters_start_at_zero(tmp_path: Path) -> None:
    a = spawn_agent(tmp_path / "var")
    try:
        state = json.loads((a.data_dir / "agent.json").read_text())
        url = state["metrics"]
        _dpuctl(a.data_dir, "tenants", "add", "gone")
        text = _wait_for(url, True, 'tenant="gone"')
        for tier in ("dram", "nvme"):
            line = f'kvtier_engine_integrity_failures_total{{tenant="gone",tier="{tier}"}} 0.0'
            assert line in text, text[:2000]
        assert 'kvtier_client_integrity_failures_total{tenant="gone"} 0.0' in text
        _dpuctl(a.data_dir, "tenants", "remove", "gone", "--yes")
        text = _wait_for(url, False, 'tenant="gone"')
        assert 'tenant="gone"' not in text, [x for x in text.splitlines() if '"gone"' in x]
        assert 'tenant="default"' in text
    finally:
        a.stop()
