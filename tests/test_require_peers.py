"""DPUKV_REQUIRE turns a skip for a missing required peer into a failure that names the peer."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import PEER_REASONS, missing_required_peer, required_peers

ROOT = Path(__file__).resolve().parent.parent


def test_every_peer_matches_the_reasons_the_suite_gives() -> None:
    reasons = {
        "spdk": 'SPDK_BIN is not set: the SPDK v26.05 peer is not installed (README: "...")',
        "serf": "needs the serf binary",
        "nixl": "NIXL not installed: pip install --no-deps nixl-cu12",
        "engines": "vLLM's venv (.venv-vllm) or the converted model (.engines/) is missing: run "
        "`make test-engines`",
        "netns": "cannot make a network namespace here: b'...'",
        "etcd": "etcd-server is not installed (apt-get install etcd-server)",
    }
    assert set(reasons) == set(PEER_REASONS)
    for peer, reason in reasons.items():
        assert missing_required_peer(reason, frozenset(PEER_REASONS)) == peer
    assert missing_required_peer("no CUDA GPU on this machine", frozenset(PEER_REASONS)) is None
    assert missing_required_peer("needs the serf binary", frozenset({"spdk"})) is None


def test_unknown_peer_name_is_a_usage_error() -> None:
    assert required_peers("spdk, Serf") == {"spdk", "serf"}
    assert required_peers("all") == set(PEER_REASONS)
    with pytest.raises(pytest.UsageError, match="unknown peers"):
        required_peers("spdk,gpu")


def _run(tmp_path: Path, require: str | None) -> subprocess.CompletedProcess[str]:
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "test_peers.py").write_text(
        textwrap.dedent(
            """
            import pytest
            def test_needs_serf():
                pytest.skip("needs the serf binary")
            @pytest.mark.skipif(True, reason="no CUDA GPU on this machine")
            def test_needs_gpu():
                pass
            """
        )
    )
    (tmp_path / "test_module_skip.py").write_text(
        'import pytest\npytest.skip("NIXL not installed", allow_module_level=True)\n'
    )
    env = {k: v for k, v in os.environ.items() if k != "DPUKV_REQUIRE"}
    if require is not None:
        env["DPUKV_REQUIRE"] = require
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
         str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_without_require_a_missing_peer_skips(tmp_path: Path) -> None:
    r = _run(tmp_path, None)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3 skipped" in r.stdout


def test_required_missing_peer_fails_naming_it(tmp_path: Path) -> None:
    r = _run(tmp_path, "serf,nixl")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "DPUKV_REQUIRE includes 'serf'" in r.stdout
    assert "FAILED (required peer) DPUKV_REQUIRE includes 'nixl'" in r.stdout
    # the GPU test names no required peer and still skips; the module skip is listed and fails
    assert "1 failed, 2 skipped" in r.stdout
