"""Structured logging: structlog, readable on a terminal, JSON in production.

`STREAMD_LOG_FORMAT=json|console` wins over the config's `logging.format`; `auto` picks console on a TTY.
Everything logs through `get_logger(__name__)`; request and connection ids are bound with
`structlog.contextvars` by the server.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

_configured: tuple[str, str] | None = None


def configure_logging(level: str = "info", fmt: str = "auto") -> None:
    """Idempotent; later calls with other settings reconfigure."""
    global _configured
    fmt = os.environ.get("STREAMD_LOG_FORMAT", fmt).lower()
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    if _configured == (level, fmt):
        return
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    _configured = (level, fmt)


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    if _configured is None:
        configure_logging()
    return structlog.get_logger(name)
