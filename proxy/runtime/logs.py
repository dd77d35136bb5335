"""Log set-up: one line per event, with the process id (several workers share a log),
as text or as one JSON object per line (``--log-format json``).

Every line goes through ``redaction.redact`` as it is formatted (docs/architecture.md,
"Secrets never shown"): whatever a message or a traceback carries (an upstream URL with
credentials, a database URL, a header dump), no secret reaches the log. httpx's own
per-request INFO line is silenced: our fetch lines say the same, once, redacted. An
access line's one untrusted part, its path, is redacted when it is logged
(``http/access_log.py``), so the hit path pays for no regular expression here.
"""

from __future__ import annotations

import json
import logging
import sys

from proxy.redaction import redact

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(process)d] %(message)s"
# Libraries whose lines repeat ours: httpx's INFO line per request (with its full URL),
# asyncpg's pool retrying its connection floor with a traceback while the database is
# down (our catalog errors say so once per failed statement).
QUIET_LOGGERS = {"httpx": logging.WARNING, "httpcore": logging.WARNING, "asyncpg": logging.ERROR}
# The fields of an access-log record, in the order of its arguments (http/access_log.py).
ACCESS_LOGGER = "proxy.access"
ACCESS_FIELDS = ("client", "method", "path", "status", "bytes", "duration_ms", "cache")


# C0 controls and DEL: a newline in text from outside (a user name, an upstream's
# message) would start a line of its author's choosing, an escape sequence would
# rewrite the operator's terminal.
_CONTROLS = {code: f"\\x{code:02x}" for code in (*range(0x20), 0x7F)} | {
    0x0A: "\\n",
    0x0D: "\\r",
    0x09: "\\t",
}


class RedactingFormatter(logging.Formatter):
    """A formatter whose every line (message, exception, stack) is redacted, and whose
    message is one line: its control characters are escaped (a traceback after it
    keeps its lines)."""

    def format(self, record: logging.LogRecord) -> str:
        return _redacted(record, super().format(record))

    def formatMessage(self, record: logging.LogRecord) -> str:
        if record.name != ACCESS_LOGGER:  # its one untrusted field, the path, has none
            record.message = record.message.translate(_CONTROLS)
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, pid, message; an access-log
    line also carries its fields by name, so log pipelines need no parsing."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname.lower(),
            "logger": record.name,
            "pid": record.process,
            "message": _redacted(record, record.getMessage()),
        }
        if record.name == ACCESS_LOGGER and isinstance(record.args, tuple):
            line.update(zip(ACCESS_FIELDS, record.args, strict=False))
        if record.exc_info:
            line["exception"] = redact(self.formatException(record.exc_info))
        return json.dumps(line, default=str)


def _redacted(record: logging.LogRecord, text: str) -> str:
    return text if record.name == ACCESS_LOGGER else redact(text)


def configure_logging(level: str, log_format: str = "text", access_log: bool = False) -> None:
    """Root handler and level; the access log (INFO lines) is on or off by itself,
    whatever the level: ``--log-level warning`` keeps it."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter() if log_format == "json" else RedactingFormatter(LOG_FORMAT)
    )
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name, quiet_level in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(quiet_level)
    logging.getLogger(ACCESS_LOGGER).setLevel(logging.INFO if access_log else logging.WARNING)
