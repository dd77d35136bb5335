"""Log set-up: one line per event, with the process id (several workers share a log).

Every line goes through ``redaction.redact`` as it is formatted (docs/architecture.md,
"Secrets never shown"): whatever a message or a traceback carries (an upstream URL with
credentials, a database URL, a header dump), no secret reaches the log. httpx's own
per-request INFO line is silenced: our fetch lines say the same, once, redacted.
"""

from __future__ import annotations

import logging

from proxy.redaction import redact

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(process)d] %(message)s"
# Libraries whose lines repeat ours: httpx's INFO line per request (with its full URL),
# asyncpg's pool retrying its connection floor with a traceback while the database is
# down (our catalog errors say so once per failed statement).
QUIET_LOGGERS = {"httpx": logging.WARNING, "httpcore": logging.WARNING, "asyncpg": logging.ERROR}


class RedactingFormatter(logging.Formatter):
    """A formatter whose every line (message, exception, stack) is redacted."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(RedactingFormatter(LOG_FORMAT))
    for name, quiet_level in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(quiet_level)
