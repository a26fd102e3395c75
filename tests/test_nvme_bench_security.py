"""`dpuctl bench nvme --security`: auth/tls rows against the plain target of the same run."""

from __future__ import annotations

from click.testing import CliRunner

from dpu_agent.bench import nvme_security
from dpu_agent.bench.nvme_security import security_rows
from dpu_agent.cli import cli


def test_security_rows_shape() -> None:
    rows = security_rows(0.2)
    assert [(r["op"], r["auth"], r["tls"]) for r in rows] == [
        ("write", True, False),
        ("read", True, False),
        ("write", False, True),
        ("read", False, True),
        ("write", True, True),
        ("read", True, True),
    ]
    for r in rows:
        assert (r["io_kib"], r["qd"]) == (1024, 8)
        assert r["gbps"] > 0 and r["plain_gbps"] > 0 and r["vs_plain"] > 0
        assert r["connect_ms"] > 0 and r["plain_connect_ms"] > 0
    assert len(nvme_security.SECURITY_CONFIGS) == 3


def test_dpuctl_bench_nvme_has_security_flag() -> None:
    result = CliRunner().invoke(cli, ["bench", "nvme", "--help"])
    assert result.exit_code == 0 and "--security" in result.output
