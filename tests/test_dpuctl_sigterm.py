"""A dpuctl command ended by SIGTERM (a timeout, a kill) goes through its cleanup: `bench nvme`
killed mid-run left its NVMe/TCP target, its socket-ceiling peer and spdk_tgt running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WAIT_S = 60  # bounds every wait below


def children(pid: int) -> set[int]:
    out = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.add(int(entry.name))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_sigterm_mid_benchmark_stops_what_it_started(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "SPDK_BIN": ""}
    tiers = tmp_path / "tiers"
    tiers.mkdir()
    err = (tmp_path / "stderr").open("w+")  # not a pipe: children left running would hold it
    proc = subprocess.Popen(
        [sys.executable, "-c", "from dpu_agent.cli import main; main()",
         "bench", "nvme", "--no-spdk", "--seconds", "30", "--dir", str(tiers)],
        env=env, stdout=subprocess.DEVNULL, stderr=err,
    )  # fmt: skip
    started: set[int] = set()
    try:
        deadline = time.monotonic() + WAIT_S
        while len(started) < 2 and time.monotonic() < deadline:  # ceiling peer + target
            started |= children(proc.pid)
            time.sleep(0.1)
        assert len(started) >= 2, f"the benchmark started {started} within {WAIT_S} s"
        time.sleep(1.0)  # into the measurement
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(WAIT_S)
        err.seek(0)
        assert rc == 128 + signal.SIGTERM, (rc, err.read()[-2000:])
        deadline = time.monotonic() + WAIT_S
        while any(alive(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in started if alive(p)], "children left running after SIGTERM"
        assert not list(tiers.iterdir()), "tier files left behind"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in started:
            if alive(p):
                os.kill(p, signal.SIGKILL)
        err.close()
