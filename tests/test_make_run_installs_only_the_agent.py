"""`make run` installs the agent's extra only (no torch, transformers or benchmark baselines: a
1.9 GB venv became ~140 MB); `make demo` adds the `inference` extra, `make test` everything the
tests need. Read from `make -n` (what make would run), so nothing is installed here."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


def _extras(target: str, venv: Path) -> set[str]:
    """Every extra the pip installs of `make -n TARGET` name, for a venv that does not exist."""
    out = subprocess.run(["make", "-n", target, f"VENV={venv}"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True).stdout  # fmt: skip
    extras: set[str] = set()
    for line in out.splitlines():
        if " pip install" in line:
            for group in re.findall(r"\.\[([a-z,]+)\]", line):
                extras.update(group.split(","))
            extras.update(re.findall(r"--no-deps (\S+)", line))
    return extras


def test_make_run_installs_only_the_agent_extra(tmp_path: Path) -> None:
    assert _extras("run", tmp_path / "venv") == {"agent"}


def test_make_demo_adds_the_inference_extra_and_make_test_everything(tmp_path: Path) -> None:
    demo = _extras("demo", tmp_path / "venv")
    assert {"agent", "inference"} <= demo and "bench" not in demo and "dev" not in demo
    assert {"agent", "bench", "dev", "inference"} <= _extras("test", tmp_path / "venv")
