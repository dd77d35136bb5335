"""Durations and sizes (proxy/units.py) and the option types built on them. No server."""

from __future__ import annotations

import pytest

from proxy.config.options import Duration, Globs, Hosts, Integer, Size, Urls
from proxy.units import format_duration, format_size, parse_duration, parse_size


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("15s", 15),
        ("10m", 600),
        ("24h", 86400),
        ("250ms", 0.25),
        ("0", 0),
        ("1.5s", 1.5),
        ("2d", 172800),
        (" 3s ", 3),
        (30, 30),
        (0.5, 0.5),
    ],
)
def test_durations(text: object, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "text", ["15", "ten minutes", "-1s", "", "5 parsecs", True, -3, None, [], "1e3s", "s"]
)
def test_bad_durations(text: object) -> None:
    with pytest.raises(ValueError, match=r"duration|unit|negative"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("512MiB", 512 * 2**20),
        ("10GB", 10 * 10**9),
        ("100MB", 10**8),
        ("1KiB", 1024),
        ("1kb", 1000),
        ("1.5GiB", 3 * 2**29),
        (42, 42),
        ("7", 7),
        ("0", 0),
    ],
)
def test_sizes(text: object, size: int) -> None:
    assert parse_size(text) == size
    assert parse_size(format_size(size)) == size


@pytest.mark.parametrize("text", ["", "ten", "-1", "1PB", True, -1, 1.5, "MB"])
def test_bad_sizes(text: object) -> None:
    with pytest.raises(ValueError, match=r"size|negative"):
        parse_size(text)


def test_formatting_picks_the_largest_exact_unit() -> None:
    assert format_size(10**9) == "1GB" and format_size(2**30) == "1GiB"
    assert format_size(1234) == "1234B" and format_size(0) == "0B"
    assert format_duration(0) == "0" and format_duration(0.25) == "250ms"
    assert format_duration(90) == "90s" and format_duration(3600) == "1h"


class Collect:
    def __init__(self) -> None:
        self.errors: list[str] = []

    def error(self, key: str, message: str) -> None:
        self.errors.append(f"{key}: {message}")

    def expand(self, value: str, key: str) -> str:
        return value.replace("${HOST}", "up.example")


def test_option_types_report_with_the_key() -> None:
    report = Collect()
    assert Duration(positive=True).parse("0", "k.ttl", report) is None
    assert Size().parse("0", "k.size", report) is None
    assert Integer(1, 5).parse(9, "k.n", report) is None
    assert Integer().parse(True, "k.b", report) is None
    assert report.errors == [
        "k.ttl: '0' must be more than 0",
        "k.size: '0' must be more than 0 bytes",
        "k.n: 9 is out of range; use a number between 1 and 5",
        "k.b: True is not an integer",
    ]


def test_urls_hosts_and_globs() -> None:
    report = Collect()
    assert Urls().parse("https://${HOST}/simple", "u", report) == ("https://up.example/simple/",)
    assert Urls(max_count=1).parse(["http://a/", "http://b/"], "u", report) is None
    assert Urls().parse(["ftp://a/", "http://a/?q=1", "http://a:bad/", 3], "u", report) is None
    assert len(report.errors) == 5
    report = Collect()
    assert Hosts().parse(["Files.Example", "10.0.0.0/8", "::1", "*.cdn.example"], "h", report) == (
        "files.example",
        "10.0.0.0/8",
        "::1",
        "*.cdn.example",
    )
    assert Hosts().parse(["bad host!"], "h", report) is None
    assert Globs().parse(["*.json", "*/latest/*"], "g", report) == ("*.json", "*/latest/*")
    assert Globs().parse([""], "g", report) is None
    assert len(report.errors) == 2
