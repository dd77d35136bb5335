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

import asyncio
import atexit
import json
import logging
import os
import sys
import threading
import time
from typing import TextIO

from proxy.redaction import redact

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(process)d] %(message)s"
# Libraries whose lines repeat ours: httpx's INFO line per request (with its full URL),
# asyncpg's pool retrying its connection floor with a traceback while the database is
# down (our catalog errors say so once per failed statement).
QUIET_LOGGERS = {"httpx": logging.WARNING, "httpcore": logging.WARNING, "asyncpg": logging.ERROR}
# The fields of an access-log record, in the order of its arguments (http/access_log.py).
ACCESS_LOGGER = "proxy.access"
ACCESS_FIELDS = ("client", "method", "path", "status", "bytes", "duration_ms", "cache")
ACCESS_LINE = '%s "%s %s" %d %d %.1fms %s'  # those fields, as text


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


# The access log's lines wait this long at most, or until this many bytes are waiting
# (one write of whole lines, under a pipe's atomic size: several workers share stderr).
ACCESS_FLUSH_S = 0.1
ACCESS_BATCH_BYTES = 4000


class AccessLines:
    """The access log's lines, formatted here as the handler would format them and
    written in batches: one ``logging`` record, formatter pass and write per request
    cost a busy process half its hits (``bench/hits.py``). A line waits at most
    ``ACCESS_FLUSH_S``; any other log line is written after the access lines before it
    (``_FlushingHandler``); exit writes what is left (a SIGKILL loses up to
    ``ACCESS_FLUSH_S`` of them)."""

    def __init__(self, stream: TextIO, log_format: str) -> None:
        self.stream = stream
        self.json = log_format == "json"
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._lines: list[str] = []
        self._size = 0
        self._timer: asyncio.TimerHandle | None = None
        self._second = -1
        self._stamp = ""

    def write(
        self,
        client: str,
        method: str,
        path: str,
        status: int,
        sent: int,
        ms: float,
        cache: str,
    ) -> None:
        now = time.time()
        second = int(now)
        if second != self._second:
            self._second = second
            self._stamp = time.strftime(
                "%Y-%m-%dT%H:%M:%S" if self.json else "%Y-%m-%d %H:%M:%S",
                time.localtime(second),
            )
        msecs = int((now - second) * 1000)
        fields = (client, method, path, status, sent, ms, cache)
        message = ACCESS_LINE % fields
        if self.json:
            record: dict[str, object] = {
                "time": f"{self._stamp}.{msecs:03d}",
                "level": "info",
                "logger": ACCESS_LOGGER,
                "pid": self.pid,
                "message": message,
            }
            record.update(zip(ACCESS_FIELDS, fields, strict=True))
            line = json.dumps(record) + "\n"
        else:
            line = f"{self._stamp},{msecs:03d} INFO {ACCESS_LOGGER} [{self.pid}] {message}\n"
        with self._lock:
            if self._size + len(line) > ACCESS_BATCH_BYTES:
                self._write_locked()  # what waits, before this line would cross the limit
            self._lines.append(line)
            self._size += len(line)
            if self._size >= ACCESS_BATCH_BYTES:
                self._write_locked()  # a line of its own at the limit (a long query)
                return
            if self._timer is None:
                try:
                    loop = asyncio.get_running_loop()
                except RuntimeError:  # not on an event loop: no later to wait for
                    self._write_locked()
                    return
                self._timer = loop.call_later(ACCESS_FLUSH_S, self.flush)

    def flush(self) -> None:
        with self._lock:
            self._write_locked()

    def _write_locked(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._lines:
            return
        lines, self._lines, self._size = self._lines, [], 0
        try:
            self.stream.write("".join(lines))
            self.stream.flush()
        except (OSError, ValueError):  # a closed or broken stderr: as logging does, go on
            pass


# Set by configure_logging when the access log is on; None: lines go through logging.
ACCESS: AccessLines | None = None


class _FlushingHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The root handler: writes the access lines waiting before its own line."""

    def emit(self, record: logging.LogRecord) -> None:
        if ACCESS is not None:
            ACCESS.flush()
        super().emit(record)


def configure_logging(level: str, log_format: str = "text", access_log: bool = False) -> None:
    """Root handler and level; the access log (INFO lines) is on or off by itself,
    whatever the level: ``--log-level warning`` keeps it."""
    global ACCESS
    if ACCESS is not None:
        ACCESS.flush()
    handler = _FlushingHandler(sys.stderr)
    ACCESS = AccessLines(sys.stderr, log_format) if access_log else None
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


@atexit.register
def _flush_access_lines() -> None:
    if ACCESS is not None:
        ACCESS.flush()
