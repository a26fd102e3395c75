"""Doctor and stats tell a start after kill -9 from a start after a clean stop.

Before, `dpuctl doctor` said "last start clean" after a kill -9 (the journal replayed without
damage looked like any other start). The engine writes `journal/clean-stop` when close()
finishes and removes it at start; a start without it is `previous_stop: unclean`.
Real agents, killed for real.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dpu_agent.testing import spawn_agent
from host_shim.control import ControlChannel


def _doctor_storage(data_dir: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", "from dpu_agent.cli import main; main()", "doctor", "--json"],
        env={**os.environ, "DPUKV_AGENT_DATA_DIR": str(data_dir)},
        capture_output=True, text=True, timeout=120, check=False, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    rows = {r["check"]: r for r in json.loads(out.stdout)}
    return rows["agent-storage"]


def test_unclean_stop_is_reported_and_a_clean_one_is_not(tmp_path: Path) -> None:
    data = tmp_path / "var"
    a = spawn_agent(data)
    try:
        assert "last start clean" in _doctor_storage(a.data_dir)["detail"]  # a first start
        with ControlChannel(a.control_url, "default", a.token) as ch:
            ch.connect()
            r = ch.call("reserve", key=b"k" * 16, length=4096)
            ch.call("commit", reservation_id=r["reservation_id"], checksum=bytes(16))
    finally:
        a.kill()  # SIGKILL: no close(), no marker
    a = spawn_agent(data)
    try:
        row = _doctor_storage(a.data_dir)
        assert row["status"] == "ok" and "unclean stop" in row["detail"], row
        assert "last start clean" not in row["detail"]
    finally:
        assert a.stop() == 0
    a = spawn_agent(data)
    try:
        row = _doctor_storage(a.data_dir)
        assert "last start clean" in row["detail"], row
    finally:
        a.stop()
