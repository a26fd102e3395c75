"""Logging for spdk_plugins without importing the agent (spdk_plugins never imports dpu_agent).

structlog as the agent configures it (dpu_agent.log) when the agent runs; used on its own (the
rpc.py plugin, a script) and before anyone configured structlog, JSON lines on stderr, never on
stdout, where rpc.py and `--json` print their results.
"""

from __future__ import annotations

import sys

import structlog

__all__ = ["get_logger"]


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    if not structlog.is_configured():
        structlog.configure(
            processors=[
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                structlog.processors.JSONRenderer(),
            ],
            logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
            cache_logger_on_first_use=False,
        )
    logger: structlog.typing.FilteringBoundLogger = structlog.get_logger(name)
    return logger
