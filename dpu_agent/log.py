"""structlog configured once for the whole agent and CLI.

JSON lines on stderr by default (what a DPU's journald or Fluent Bit ingests); `console=True`
gives a human rendering for `make run`. Never log secrets or bulk data.
"""

from __future__ import annotations

import logging
import sys

import structlog

_configured = False


def configure_logging(*, level: str = "INFO", console: bool = False) -> None:
    """Configure structlog and the stdlib root logger. Safe to call more than once."""
    global _configured
    numeric_level = logging.getLevelNamesMapping()[level.upper()]
    renderer: structlog.typing.Processor = (
        structlog.dev.ConsoleRenderer(colors=False)
        if console
        else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=numeric_level, stream=sys.stderr, format="%(name)s %(message)s")
    _configured = True


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    if not _configured:
        configure_logging()
    logger: structlog.typing.FilteringBoundLogger = structlog.get_logger(name)
    return logger
