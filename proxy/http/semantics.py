"""HTTP request semantics, as pure functions: entity tags, dates, byte ranges and
Retry-After (RFC 9110 §8.8, §10.2.3, §13, §14). No I/O; ``http/responses.py`` applies them
to stored entries.
"""

from __future__ import annotations

import email.utils
import functools
import math
import re
from typing import Literal

HEADER_VALUE_MAX_CHARS = 8192
# Retry-After, read from upstreams and sent to clients: whole seconds in this range. An
# upstream that says "come back in 10^400 seconds" must not make us say it (or crash).
RETRY_AFTER_MIN_S = 1
RETRY_AFTER_MAX_S = 60
RETRY_AFTER_DEFAULT_S = 5
_HEADER_VALUE_RE = re.compile(r"^[\t\x20-\x7e]*$")


def header_value_ok(value: str) -> bool:
    """Can ``value`` be sent as a header value as it is? Visible ASCII, spaces and tabs
    only (RFC 9110 §5.5 without obs-text), and not absurdly long."""
    return len(value) <= HEADER_VALUE_MAX_CHARS and _HEADER_VALUE_RE.match(value) is not None


def etag_of(sha256: str) -> str:
    return f'"{sha256}"'


@functools.lru_cache(maxsize=4096)
def http_date(ms: int) -> str:
    # Cached: every hit on an entry without an upstream Last-Modified formats its time.
    return email.utils.formatdate(ms / 1000, usegmt=True)


def matches_etag(header: str | None, etag: str) -> bool:
    if not header:
        return False
    if header.strip() == "*":
        return True
    for candidate in header.split(","):
        candidate = candidate.strip()
        if candidate.startswith("W/"):
            candidate = candidate[2:]
        if candidate == etag:
            return True
    return False


def if_range_holds(if_range: str | None, etag: str, last_modified: str) -> bool:
    if not if_range:
        return True
    if_range = if_range.strip()
    if if_range.startswith('"') or if_range.startswith("W/"):
        return if_range == etag  # If-Range needs a strong match
    return if_range == last_modified


def _seconds_newer(last_modified: str, header: str | None) -> float | None:
    """How much newer ``last_modified`` is than the date in ``header`` (None: no date).

    Either may be anything a client or an upstream sent: a date that cannot be read
    (garbage, or a year no clock holds: OverflowError) means there is no date, so the
    condition is ignored (RFC 9110 §13.1.3)."""
    if not header:
        return None
    try:
        since_ts = email.utils.parsedate_to_datetime(header).timestamp()
        modified_ts = email.utils.parsedate_to_datetime(last_modified).timestamp()
    except (TypeError, ValueError, OverflowError, IndexError):
        return None
    return float(modified_ts - since_ts)


def not_modified_since(last_modified: str, header: str | None) -> bool:
    newer = _seconds_newer(last_modified, header)
    return newer is not None and newer <= 0


def modified_after(last_modified: str, header: str | None) -> bool:
    newer = _seconds_newer(last_modified, header)
    return newer is not None and newer > 0


def parse_retry_after(value: str | None, now_s: float) -> float | None:
    """The wait a Retry-After header asks for (delay-seconds or an HTTP date, RFC 9110
    §10.2.3), within ``RETRY_AFTER_MIN_S``..``RETRY_AFTER_MAX_S``; None if unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():
        seconds = float(RETRY_AFTER_MAX_S) if len(value) > 6 else float(value)
    else:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - now_s
        except (TypeError, ValueError, OverflowError, IndexError):
            return None
    return _clamp_retry_after(seconds)


def retry_after_header(seconds: float | None) -> str:
    """The Retry-After value we send for a wait of ``seconds`` (None: our default)."""
    if seconds is None or seconds != seconds:  # None or NaN
        return str(RETRY_AFTER_DEFAULT_S)
    return str(math.ceil(_clamp_retry_after(seconds)))


def _clamp_retry_after(seconds: float) -> float:
    if not seconds >= RETRY_AFTER_MIN_S:  # NaN too
        return float(RETRY_AFTER_MIN_S)
    return float(min(seconds, RETRY_AFTER_MAX_S))


UNSATISFIABLE: Literal["unsatisfiable"] = "unsatisfiable"
_RANGE_RE = re.compile(r"^\s*([0-9]*)\s*-\s*([0-9]*)\s*$")


def parse_range(header: str, size: int) -> tuple[int, int] | Literal["unsatisfiable"] | None:
    """A single ``bytes=`` range of a ``size``-byte body as ``(start, end)``, end included.

    ``UNSATISFIABLE`` means answer 416; None means ignore the header and send the whole
    body (another unit, several ranges, or a malformed spec, as RFC 9110 §14.2 allows).
    An empty body has no satisfiable range at all.
    """
    unit, _, spec = header.partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        return None
    match = _RANGE_RE.match(spec)
    if match is None:
        return None
    first, last = (_bounded_int(text) for text in match.groups())
    if first is None:
        if last is None:
            return None
        suffix = last
        if suffix == 0 or size == 0:
            return UNSATISFIABLE
        return max(0, size - suffix), size - 1
    start = first
    end = last if last is not None else size - 1
    if last is not None and end < start:
        return None  # "bytes=5-3" is invalid, not unsatisfiable: ignore it
    if start >= size:
        return UNSATISFIABLE
    return start, min(end, size - 1)


_POSITION_MAX = 10**18  # past any size we store; keeps int() clear of its digit limit


def _bounded_int(digits: str) -> int | None:
    """The number in ``digits`` (None if empty), clamped: "bytes=0-<5,000 digits>" is a
    valid range to the end, not an error."""
    if not digits:
        return None
    digits = digits.lstrip("0") or "0"
    return _POSITION_MAX if len(digits) > 18 else int(digits)
