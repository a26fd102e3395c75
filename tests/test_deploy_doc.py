"""docs/DEPLOY.md's blocks marked `<!-- ci -->` run, in order, against an agent on the embedded
default started here, with `dpuctl` and `python` on the path: the walkthrough's commands work as
written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dpu_agent.testing import AgentProcess, spawn_agent

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "DEPLOY.md"
BLOCK = re.compile(r"<!-- ci -->\n```sh\n(.*?)```", re.S)
BLOCK_TIMEOUT_S = 120  # each block is a few dpuctl calls; generous for a loaded box


def ci_blocks() -> list[str]:
    return BLOCK.findall(DOC.read_text())


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    a = spawn_agent(tmp_path_factory.mktemp("deploy") / "var")
    yield a
    a.stop()


def test_deploy_doc_has_ci_blocks() -> None:
    assert len(ci_blocks()) >= 4


def test_deploy_doc_ci_blocks_run_against_the_embedded_default(
    agent: AgentProcess, tmp_path: Path
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "dpuctl").write_text(
        f'#!/bin/sh\nexec "{sys.executable}" -c "from dpu_agent.cli import main; main()" "$@"\n'
    )
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    (work / "docs").symlink_to(ROOT / "docs")
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "DPUKV_AGENT_DATA_DIR": str(agent.data_dir),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    for i, block in enumerate(ci_blocks()):
        r = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block],
            cwd=work, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S,
            check=False,
        )  # fmt: skip
        assert r.returncode == 0, f"block {i}:\n{block}\n{r.stdout}\n{r.stderr}"
    assert "tier ok" in r.stdout
