"""`dpuctl bench lmcache` options: bad values are usage errors (exit 2) before anything starts
(no agent, no LMCache process)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from dpu_agent.cli import cli


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--io-queues", "0"], "--io-queues 0 outside [1, 32]"),
        (["--io-queues", "33"], "--io-queues 33 outside [1, 32]"),
        (["--mib", "8"], "--mib 8 outside [16, 4096]"),
        (["--repeats", "0"], "--repeats 0 outside [1, 20]"),
        (["--mib", "4096", "--repeats", "3"], "the agent's DRAM tier would need 15424 MiB"),
    ],
)
def test_bench_lmcache_bad_option_is_a_usage_error(args: list[str], message: str) -> None:
    result = CliRunner().invoke(cli, ["bench", "lmcache", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output
