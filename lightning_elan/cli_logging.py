"""The ``elan`` command's log format: ``elan: message`` on stderr (``elan: warning: …``, ``elan: error: …``)."""

from __future__ import annotations

import logging
import sys

__all__ = ["configure_logging"]


def configure_logging(level: int = logging.INFO) -> None:
    """Log to stderr as ``elan: message`` (``elan: warning: …`` / ``elan: error: …`` above INFO)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_ElanFormatter())
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h.formatter, _ElanFormatter)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)


class _ElanFormatter(logging.Formatter):
    """``elan: `` before each line, and the level's name above INFO."""

    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        if record.levelno >= logging.WARNING:
            return f"elan: {record.levelname.lower()}: {message}"
        return f"elan: {message}"
