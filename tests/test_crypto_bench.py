"""`dpuctl bench crypto`: runs, reports every figure, and rejects out-of-range options."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from dpu_agent.bench.crypto import crypto_cmd


def test_bench_crypto_json_report() -> None:
    result = CliRunner().invoke(crypto_cmd, ["--json", "--chunk-mib", "1", "--repeats", "1"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["chunk_bytes"] == 1 << 20
    for field in ("sector_gbps", "openssl_gbps", "decrypt_sector_gbps", "evp_sector_gbps"):
        assert report[field] > 0, field
    ratio = report["sector_gbps"] / report["openssl_gbps"]
    assert report["vs_openssl"] == pytest.approx(ratio, rel=0.01)


def test_openssl_baseline_is_not_called_a_ceiling() -> None:
    """The engine's VAES sector loop runs at 0.93-0.99x one-call OpenSSL and can pass it: a
    figure that a row may exceed is a baseline, not a ceiling (no `*ceiling*` field)."""
    result = CliRunner().invoke(crypto_cmd, ["--json", "--chunk-mib", "1", "--repeats", "1"])
    assert result.exit_code == 0, result.output
    assert not [k for k in json.loads(result.output) if "ceiling" in k]


def test_bench_crypto_table_and_limits() -> None:
    runner = CliRunner()
    table = runner.invoke(crypto_cmd, ["--chunk-mib", "1", "--repeats", "1"])
    assert table.exit_code == 0, table.output
    assert "ratio" in table.output and "encrypt" in table.output
    bad = runner.invoke(crypto_cmd, ["--chunk-mib", "0"])
    assert bad.exit_code == 2
    assert "--chunk-mib 0" in bad.output
