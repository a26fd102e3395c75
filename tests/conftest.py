"""Turns a skip for a missing peer into a failure where that peer is supposed to be present.

Tests that need an outside peer (SPDK, Serf, NIXL, the real engines, network namespaces, etcd)
skip with a reason naming it, so a newcomer's `make test` passes without them. CI, where the
peers are provided, sets ``DPUKV_REQUIRE`` (comma-separated peer names, or ``all``): a skip whose
reason names a required peer then fails, naming the peer, instead of passing silently.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

import pytest

# A skip reason names its peer; each pattern matches the reasons the suite's skips give.
PEER_REASONS: dict[str, re.Pattern[str]] = {
    "spdk": re.compile(r"\bSPDK", re.IGNORECASE),
    "serf": re.compile(r"\bserf\b", re.IGNORECASE),
    "nixl": re.compile(r"\bNIXL\b"),
    "engines": re.compile(r"test-engines|\.venv-vllm|\.venv-lmcache"),
    "netns": re.compile(r"network namespace|netns", re.IGNORECASE),
    "etcd": re.compile(r"\betcd\b", re.IGNORECASE),
}


def required_peers(value: str | None = None) -> frozenset[str]:
    """The peers named by ``DPUKV_REQUIRE``; an unknown name is an error, not a silent pass."""
    raw = os.environ.get("DPUKV_REQUIRE", "") if value is None else value
    names = {n.strip().lower() for n in raw.split(",") if n.strip()}
    if "all" in names:
        return frozenset(PEER_REASONS)
    unknown = names - set(PEER_REASONS)
    if unknown:
        raise pytest.UsageError(
            f"DPUKV_REQUIRE names unknown peers {sorted(unknown)}; known: {sorted(PEER_REASONS)}"
        )
    return frozenset(names)


def missing_required_peer(reason: str, required: frozenset[str]) -> str | None:
    """The required peer a skip reason names, if any."""
    for peer in sorted(required):
        if PEER_REASONS[peer].search(reason):
            return peer
    return None


def _skip_reason(longrepr: object) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def _required_skip(report: pytest.TestReport | pytest.CollectReport) -> str | None:
    """What to say when a report is a skip for a required peer; None when it is not."""
    if not report.skipped:
        return None
    reason = _skip_reason(report.longrepr)
    peer = missing_required_peer(reason, required_peers())
    if peer is None:
        return None
    return (
        f"DPUKV_REQUIRE includes {peer!r}, but {report.nodeid} skipped for it: {reason} "
        f"(install or start {peer}, or drop it from DPUKV_REQUIRE where it is not provided)"
    )


# Module-level skips for a required peer: a failed collection would interrupt the whole run,
# so they stay skipped, are listed at the end, and fail the session.
_MODULE_SKIPS: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    required_peers()  # an unknown peer name stops the run before any test


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    message = _required_skip(report)
    if message is not None:
        report.outcome = "failed"
        report.longrepr = message


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    message = _required_skip(outcome.get_result())
    if message is not None:
        _MODULE_SKIPS.append(message)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _MODULE_SKIPS and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for message in _MODULE_SKIPS:
        terminalreporter.write_line(f"FAILED (required peer) {message}", red=True)
