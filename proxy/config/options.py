"""The vocabulary a format uses to declare its repository settings.

A format's settings are a frozen dataclass whose fields are made with ``option(...)``.
The config layer (``config/load.py``) walks those fields generically: it reads each TOML key,
expands ``${VAR}``, parses the value with the field's ``OptionType`` and reports every
bad value as ``repositories.<name>.<key>: <message>``; ``check-config`` prints them back
with ``render``. A format never parses TOML itself.

    @dataclass(frozen=True)
    class RawOptions:
        upstream: tuple[str, ...] = option(Urls(), ())
        metadata_ttl_s: float = option(Duration(), 600.0, key="metadata_ttl")
"""

from __future__ import annotations

import dataclasses
import fnmatch
import ipaddress
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar
from urllib.parse import urlsplit

from proxy.units import (
    format_duration,
    format_size,
    format_timestamp,
    parse_duration,
    parse_size,
    parse_timestamp,
)

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Reporter(Protocol):
    """What an option type may ask of the config layer while it parses a value."""

    def error(self, key: str, message: str) -> None: ...

    def expand(self, value: str, key: str) -> str:
        """``${VAR}`` and ``$$`` expanded from the environment (an error if VAR is unset)."""
        ...


class OptionType(Protocol[T]):
    def parse(self, value: object, key: str, report: Reporter) -> T | None:
        """The parsed value, or None after reporting why it is not valid."""
        ...

    def render(self, value: T) -> str:
        """``value`` as a TOML literal, for ``check-config``."""
        ...


@dataclass(frozen=True)
class Option(Generic[T]):
    kind: OptionType[T]
    key: str  # the TOML key


def option(kind: OptionType[T], default: T, *, key: str | None = None) -> T:
    """A dataclass field that the config layer fills from TOML key ``key`` (default: the
    field's name)."""
    metadata = {"option": (kind, key)}
    if isinstance(default, list | dict | set):
        raise TypeError("option defaults must be immutable (use a tuple)")
    field: T = dataclasses.field(default=default, metadata=metadata)
    return field


def options_of(cls: type[Any]) -> Iterator[tuple[str, Option[Any], Any]]:
    """``(field name, option, default)`` for every option field of a settings class."""
    for f in dataclasses.fields(cls):
        declared = f.metadata.get("option")
        if declared is None:
            continue
        kind, key = declared
        yield f.name, Option(kind, key or f.name), f.default


# -- option types ----------------------------------------------------------------------


def _expanded(value: object, key: str, report: Reporter) -> object:
    return report.expand(value, key) if isinstance(value, str) else value


class Duration:
    """``"250ms"``, ``"15s"``, ``"10m"``, ``"24h"``, ``"2d"``, ``"0"`` -> seconds.

    ``minimum_s``: the shortest value that can work (a lease of 1 ms is lost before its
    first renewal); shorter ones are an error naming the minimum and ``why``."""

    def __init__(self, positive: bool = False, minimum_s: float = 0.0, why: str = "") -> None:
        self.positive = positive or minimum_s > 0
        self.minimum_s = minimum_s
        self.why = why

    def parse(self, value: object, key: str, report: Reporter) -> float | None:
        raw = value
        try:
            seconds = parse_duration(_expanded(value, key, report))
        except ValueError as exc:
            report.error(key, str(exc))
            return None
        if self.positive and seconds <= 0:
            report.error(key, f"{raw!r} must be more than 0")
            return None
        if seconds < self.minimum_s:
            because = f" ({self.why})" if self.why else ""
            report.error(
                key, f"{raw!r} is too short: at least {format_duration(self.minimum_s)}{because}"
            )
            return None
        return seconds

    def render(self, value: float) -> str:
        return f'"{format_duration(value)}"'


class Size:
    """``"512MiB"``, ``"10GB"``, ``"100MB"`` or a number of bytes; more than 0."""

    def parse(self, value: object, key: str, report: Reporter) -> int | None:
        try:
            size = parse_size(_expanded(value, key, report))
        except ValueError as exc:
            report.error(key, str(exc))
            return None
        if size <= 0:
            report.error(key, f"{value!r} must be more than 0 bytes")
            return None
        return size

    def render(self, value: int) -> str:
        return f'"{format_size(value)}"'


class Rate:
    """A transfer rate: ``"4KiB/s"`` (or a size, per second) -> bytes per second.

    ``minimum``: the slowest rate that can work; slower ones are an error naming it."""

    def __init__(self, minimum: int = 0, why: str = "") -> None:
        self.minimum = minimum
        self.why = why

    def parse(self, value: object, key: str, report: Reporter) -> int | None:
        text = _expanded(value, key, report)
        if isinstance(text, str) and text.strip().endswith("/s"):
            text = text.strip()[:-2]
        try:
            rate = parse_size(text)
        except ValueError:
            report.error(key, f'{value!r} is not a rate; use e.g. "4KiB/s" or "1MB/s"')
            return None
        if rate < self.minimum:
            because = f" ({self.why})" if self.why else ""
            report.error(
                key, f"{value!r} is too slow: at least {format_size(self.minimum)}/s{because}"
            )
            return None
        return rate

    def render(self, value: int) -> str:
        return f'"{format_size(value)}/s"'


class OptionalSize(Size):
    """A size that may be left out (None): e.g. a limit that is off unless set."""

    def render(self, value: int | None) -> str:
        return '""' if value is None else super().render(value)


class Percent:
    """``"90%"`` -> 0.9; more than 0%, at most 100%."""

    _RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")

    def parse(self, value: object, key: str, report: Reporter) -> float | None:
        match = self._RE.match(value) if isinstance(value, str) else None
        if match is None or not 0 < float(match.group(1)) <= 100:
            report.error(key, f'{value!r} is not a share; use a percentage, e.g. "90%"')
            return None
        return float(match.group(1)) / 100

    def render(self, value: float) -> str:
        return f'"{round(value * 100, 2):g}%"'


class Timestamp:
    """A point in time with its offset: ``"2026-11-01T00:00:00Z"`` or a TOML offset
    date-time (unquoted) -> Unix milliseconds."""

    def parse(self, value: object, key: str, report: Reporter) -> int | None:
        try:
            return parse_timestamp(_expanded(value, key, report))
        except ValueError as exc:
            report.error(key, str(exc))
            return None

    def render(self, value: int) -> str:
        return toml_string(format_timestamp(value))


class Text:
    def parse(self, value: object, key: str, report: Reporter) -> str | None:
        if not isinstance(value, str):
            report.error(key, f"{value!r} is not a string")
            return None
        return report.expand(value, key)

    def render(self, value: str) -> str:
        return toml_string(value)


class Choice:
    def __init__(self, *choices: str) -> None:
        self.choices = choices

    def parse(self, value: object, key: str, report: Reporter) -> str | None:
        text = Text().parse(value, key, report)
        if text is None:
            return None
        if text not in self.choices:
            report.error(key, f"{text!r} is not one of {', '.join(self.choices)}")
            return None
        return text

    def render(self, value: str) -> str:
        return toml_string(value)


class Flag:
    def parse(self, value: object, key: str, report: Reporter) -> bool | None:
        if not isinstance(value, bool):
            report.error(key, f"{value!r} is not true or false")
            return None
        return value

    def render(self, value: bool) -> str:
        return "true" if value else "false"


class Integer:
    def __init__(self, minimum: int = 0, maximum: int | None = None) -> None:
        self.minimum = minimum
        self.maximum = maximum

    def parse(self, value: object, key: str, report: Reporter) -> int | None:
        if isinstance(value, bool) or not isinstance(value, int):
            report.error(key, f"{value!r} is not an integer")
            return None
        if value < self.minimum or (self.maximum is not None and value > self.maximum):
            bound = (
                f"between {self.minimum} and {self.maximum}"
                if self.maximum is not None
                else f">= {self.minimum}"
            )
            report.error(key, f"{value} is out of range; use a number {bound}")
            return None
        return value

    def render(self, value: int) -> str:
        return str(value)


class Urls:
    """One http(s) URL or a list of them, tried in order; each ends in ``/``.

    Under the key ``upstream``, the config layer also takes them from
    ``PROXY_UPSTREAM_<NAME>`` (comma-separated).
    """

    def __init__(self, max_count: int | None = None) -> None:
        self.max_count = max_count

    def parse(self, value: object, key: str, report: Reporter) -> tuple[str, ...] | None:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not value:
            report.error(key, "must be a URL or a non-empty list of URLs")
            return None
        if self.max_count is not None and len(value) > self.max_count:
            report.error(key, f"takes at most {self.max_count} URL(s), not {len(value)}")
            return None
        urls: list[str] = []
        for i, item in enumerate(value):
            item_key = key if len(value) == 1 else f"{key}[{i}]"
            if not isinstance(item, str):
                report.error(item_key, f"{item!r} is not a URL")
                continue
            item = report.expand(item, item_key)
            try:
                parts = urlsplit(item)
                parts.port  # noqa: B018 - raises ValueError for a bad port
            except ValueError:
                report.error(item_key, f"{item!r} is not a valid URL")
                continue
            if parts.scheme not in ("http", "https") or not parts.hostname:
                report.error(item_key, f"{item!r} is not an http(s) URL")
                continue
            if parts.query or parts.fragment:
                report.error(item_key, f"{item!r} must not have a query or fragment")
                continue
            urls.append(item if item.endswith("/") else item + "/")
        return tuple(urls) if len(urls) == len(value) else None

    def render(self, value: tuple[str, ...]) -> str:
        return "[" + ", ".join(toml_string(u) for u in value) + "]"


class PublicUrl:
    """Where clients reach the proxy, when that is not the address they connect to
    (a load balancer, a path prefix): ``https://proxy.example/base``. Only characters
    that need no escaping in an answer's body (JSON, XML, HTML) are taken, since formats
    write it into the bodies they render; kept without a trailing ``/``."""

    _PATH_RE = re.compile(r"^[A-Za-z0-9._~/%-]*$")

    def parse(self, value: object, key: str, report: Reporter) -> str | None:
        if not isinstance(value, str):
            report.error(key, f"{value!r} is not a URL")
            return None
        text = report.expand(value, key).strip()
        example = 'use e.g. "https://proxy.example.com" or "https://lb.example/artifacts"'
        try:
            parts = urlsplit(text)
            parts.port  # noqa: B018 - raises ValueError for a bad port
        except ValueError:
            report.error(key, f"{text!r} is not a valid URL; {example}")
            return None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            report.error(key, f"{text!r} is not an http(s) URL; {example}")
        elif parts.username is not None or parts.password is not None:
            report.error(key, "must not hold credentials")
        elif parts.query or parts.fragment or "?" in text or "#" in text:
            report.error(key, f"{text!r} must not have a query or fragment")
        elif not self._PATH_RE.match(parts.path) or not _plain_host(parts.hostname):
            report.error(key, f"{text!r} has characters a URL in a page cannot carry as is")
        else:
            return f"{parts.scheme}://{parts.netloc}{parts.path}".rstrip("/")
        return None

    def render(self, value: str) -> str:
        return toml_string(value)


def _plain_host(host: str) -> bool:
    """A DNS name (no wildcard) or an IP address."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return not host.startswith("*") and Hosts._NAME_RE.match(host) is not None


class Globs:
    """A list of shell-style path patterns (``*``, ``?``, ``[...]``), e.g. ``"*/latest/*"``."""

    def parse(self, value: object, key: str, report: Reporter) -> tuple[str, ...] | None:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            report.error(key, 'must be a list of path patterns, e.g. ["*.json", "*/latest/*"]')
            return None
        patterns = tuple(report.expand(v, key) for v in value)
        for pattern in patterns:
            try:
                re.compile(fnmatch.translate(pattern))
            except re.error as exc:
                report.error(key, f"{pattern!r} is not a valid pattern ({exc})")
                return None
        return patterns

    def render(self, value: tuple[str, ...]) -> str:
        return "[" + ", ".join(toml_string(p) for p in value) + "]"


class Hosts:
    """Host names, IP addresses or networks (CIDR), e.g. ``["files.internal", "10.1.0.0/16"]``."""

    _NAME_RE = re.compile(r"^(\*\.)?[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")

    def parse(self, value: object, key: str, report: Reporter) -> tuple[str, ...] | None:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            report.error(key, 'must be a list of host names or networks, e.g. ["10.1.0.0/16"]')
            return None
        hosts = []
        for item in value:
            item = report.expand(item, key).strip().lower()
            try:
                ipaddress.ip_network(item, strict=False)
            except ValueError:
                if not self._NAME_RE.match(item):
                    report.error(key, f"{item!r} is not a host name, address or network")
                    return None
            hosts.append(item)
        return tuple(hosts)

    def render(self, value: tuple[str, ...]) -> str:
        return "[" + ", ".join(toml_string(h) for h in value) + "]"


class Networks:
    """IP addresses or networks (CIDR), e.g. ``["10.0.0.0/8", "::1"]``: what a peer's
    address is compared with (no names: a peer has only an address)."""

    def parse(self, value: object, key: str, report: Reporter) -> tuple[str, ...] | None:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            report.error(key, 'must be a list of addresses or networks, e.g. ["10.0.0.0/8"]')
            return None
        networks = []
        for item in value:
            item = report.expand(item, key).strip()
            try:
                networks.append(str(ipaddress.ip_network(item, strict=False)))
            except ValueError:
                report.error(key, f"{item!r} is not an IP address or network (CIDR)")
                return None
        return tuple(networks)

    def render(self, value: tuple[str, ...]) -> str:
        return "[" + ", ".join(toml_string(n) for n in value) + "]"


def toml_string(text: str) -> str:
    """``text`` as a TOML basic string (escapes included), so check-config output loads."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def toml_key(name: str) -> str:
    """A bare key when TOML allows one, else a quoted key."""
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else toml_string(name)
