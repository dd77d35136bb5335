"""Human-written durations ("15s", "10m", "250ms"), sizes ("512MiB", "10GB") and
points in time ("2026-11-01T00:00:00Z").

The parsers raise ``ValueError`` with a message that shows an accepted spelling;
``config/load.py`` prefixes it with the key that held the value.
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime

MAX_DURATION_S = 100 * 365 * 86400.0  # a century: longer is a typo, and overflows timestamps
MAX_SIZE_BYTES = 2**62

_DURATION_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|h|d)?\s*$")
_DURATION_UNITS_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}

_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_duration(value: object) -> float:
    """Seconds from ``"15s"``, ``"10m"``, ``"24h"``, ``"250ms"``, ``"0"`` or a number of
    seconds; at most a century."""
    seconds: float | None = None
    if isinstance(value, bool):
        pass
    elif isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"{value!r} is negative; a duration is 0 or more")
        seconds = float(value)
    elif isinstance(value, str):
        match = _DURATION_RE.match(value)
        if match:
            number, unit = match.groups()
            if unit is None and float(number) != 0:
                raise ValueError(f'{value!r} has no unit; use e.g. "{number}s" or "{number}m"')
            seconds = float(number) * _DURATION_UNITS_S[unit or "s"]
    if seconds is None or not math.isfinite(seconds):
        raise ValueError(f'{value!r} is not a duration; use e.g. "15s", "10m" or "24h"')
    if seconds > MAX_DURATION_S:
        raise ValueError(f"{value!r} is longer than a century; use a shorter duration")
    return seconds


def parse_size(value: object) -> int:
    """Bytes from ``"512MiB"``, ``"10GB"``, ``"100MB"`` or an integer number of bytes."""
    if isinstance(value, bool):
        raise ValueError(f'{value!r} is not a size; use e.g. "10GB" or "512MiB"')
    size: int | None = None
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{value!r} is negative; a size is 0 or more")
        size = value
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match:
            number, unit = match.groups()
            size = int(float(number) * _SIZE_UNITS[(unit or "b").lower()])
    if size is None:
        raise ValueError(f'{value!r} is not a size; use e.g. "10GB" or "512MiB"')
    if size > MAX_SIZE_BYTES:
        raise ValueError(f"{value!r} is too large")
    return size


def format_size(n_bytes: int) -> str:
    """The largest exact unit, binary or decimal, for messages and `check-config`."""
    units = (
        ("TiB", 2**40), ("TB", 10**12), ("GiB", 2**30), ("GB", 10**9),
        ("MiB", 2**20), ("MB", 10**6), ("KiB", 2**10), ("KB", 10**3),
    )  # fmt: skip
    for unit, factor in units:
        if n_bytes >= factor and n_bytes % factor == 0:
            return f"{n_bytes // factor}{unit}"
    return f"{n_bytes}B"


def human_size(n_bytes: int) -> str:
    """A rounded size for summaries and logs: ``"1.5 GiB"``, ``"812 KiB"``, ``"0 B"``."""
    size = float(n_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def format_duration(seconds: float) -> str:
    for unit, factor in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= factor and seconds % factor == 0:
            return f"{int(seconds // factor)}{unit}"
    if seconds == 0:
        return "0"
    return f"{seconds * 1000:g}ms"


def parse_timestamp(value: object) -> int:
    """Unix milliseconds from an RFC 3339 date and time with its offset
    (``"2026-11-01T00:00:00Z"``), or a TOML offset date-time (a ``datetime`` with tzinfo)."""
    moment: datetime | None = None
    if isinstance(value, datetime):
        moment = value
    elif isinstance(value, str):
        try:
            moment = datetime.fromisoformat(value.strip())
        except ValueError:
            moment = None
    if moment is None or moment.tzinfo is None or moment.utcoffset() is None:
        raise ValueError(
            f'{value!r} is not a date and time with its offset; use e.g. "2026-11-01T00:00:00Z"'
        )
    return int(moment.timestamp() * 1000)


def format_timestamp(at_ms: int) -> str:
    """``"2026-11-01T00:00:00Z"`` (RFC 3339, UTC; milliseconds only when there are some)."""
    moment = datetime.fromtimestamp(at_ms / 1000, UTC)
    if at_ms % 1000:
        return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{at_ms % 1000:03d}Z"
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")
