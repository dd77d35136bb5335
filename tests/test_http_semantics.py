"""Pure HTTP semantics (proxy/http/semantics.py): ranges, entity tags, dates. No server."""

from __future__ import annotations

import pytest

from proxy.http.semantics import (
    UNSATISFIABLE,
    etag_of,
    http_date,
    if_range_holds,
    matches_etag,
    modified_after,
    not_modified_since,
    parse_range,
    parse_retry_after,
    retry_after_header,
)


@pytest.mark.parametrize(
    ("header", "size", "expected"),
    [
        ("bytes=0-9", 100, (0, 9)),
        ("bytes=10-", 100, (10, 99)),
        ("bytes=90-200", 100, (90, 99)),  # an end past the body is cut to the body
        ("bytes=-5", 100, (95, 99)),
        ("bytes=-500", 100, (0, 99)),  # a suffix longer than the body is the whole body
        ("bytes=99-99", 100, (99, 99)),
        ("BYTES = 1-2", 100, (1, 2)),  # the unit is case-insensitive
        ("bytes= 1 - 2 ", 100, (1, 2)),
        ("bytes=100-", 100, UNSATISFIABLE),
        ("bytes=100-200", 100, UNSATISFIABLE),
        ("bytes=-0", 100, UNSATISFIABLE),
        # An empty body has no satisfiable range (was 206 "bytes 0--1/0").
        ("bytes=-1", 0, UNSATISFIABLE),
        ("bytes=0-", 0, UNSATISFIABLE),
        ("bytes=0-0", 0, UNSATISFIABLE),
        # Ignored (whole body): invalid specs, other units, several ranges.
        ("bytes=5-3", 100, None),
        ("bytes=-", 100, None),
        ("bytes=a-b", 100, None),
        ("bytes=1-2-3", 100, None),
        ("bytes=0-1,5-6", 100, None),
        ("items=0-1", 100, None),
        ("bytes", 100, None),
        ("bytes=\u0661-", 100, None),  # non-ASCII digits are not digits here
        ("bytes=99999999999999999999999-", 100, UNSATISFIABLE),
    ],
)
def test_parse_range(header: str, size: int, expected: object) -> None:
    assert parse_range(header, size) == expected


def test_entity_tags() -> None:
    etag = etag_of("ab" * 32)
    assert etag == f'"{"ab" * 32}"'
    assert matches_etag(etag, etag)
    assert matches_etag(f'"x", W/{etag}', etag)  # If-None-Match compares weakly
    assert matches_etag(" * ", etag)
    assert not matches_etag('"x"', etag)
    assert not matches_etag("", etag)
    assert not matches_etag(None, etag)


def test_if_range_needs_a_strong_match_or_the_exact_date() -> None:
    etag, date = '"abc"', "Mon, 01 Jan 2024 00:00:00 GMT"
    assert if_range_holds(None, etag, date)
    assert if_range_holds('"abc"', etag, date)
    assert not if_range_holds('W/"abc"', etag, date)
    assert not if_range_holds('"other"', etag, date)
    assert if_range_holds(date, etag, date)
    assert not if_range_holds("Tue, 02 Jan 2024 00:00:00 GMT", etag, date)


def test_dates() -> None:
    stamp = http_date(1_700_000_000_000)
    assert stamp == "Tue, 14 Nov 2023 22:13:20 GMT"
    later = "Wed, 15 Nov 2023 00:00:00 GMT"
    assert not_modified_since(stamp, later) and not_modified_since(stamp, stamp)
    assert not not_modified_since(later, stamp)
    assert modified_after(later, stamp) and not modified_after(stamp, stamp)
    for garbage in (
        None,
        "",
        "yesterday",
        "Mon, 99 Foo 2024",
        ABSURD_DATE,
        "Mon, 01 Jan 99999 0:0:0",
    ):
        assert not not_modified_since(stamp, garbage)
        assert not modified_after(stamp, garbage)
        # A stored Last-Modified that came from an upstream is no better.
        assert not not_modified_since(str(garbage), later)
        assert not modified_after(str(garbage), later)


# A year past what a C time_t holds: parsedate_to_datetime raises OverflowError.
ABSURD_DATE = "Mon, 01 Jan 9999999999 00:00:00 GMT"


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (None, None),
        ("", None),
        ("soon", None),
        ("0", 1.0),
        ("7", 7.0),
        ("99999999999", 60.0),
        ("9" * 400, 60.0),  # float() of it is inf
        ("Sat, 01 Jan 2000 00:00:00 GMT", 1.0),  # in the past
        ("Sat, 01 Jan 2000 00:00:30 GMT", 30.0),
        (ABSURD_DATE, None),  # unreadable: ignored
    ],
)
def test_retry_after_is_read_within_a_sane_range(header: str | None, expected: object) -> None:
    now_s = 946_684_800.0  # 2000-01-01 00:00:00
    assert parse_retry_after(header, now_s) == expected


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [(None, "5"), (0.0, "1"), (2.5, "3"), (59.9, "60"), (1e12, "60"), (float("inf"), "60")],
)
def test_retry_after_sent_is_whole_seconds_within_a_sane_range(
    seconds: float | None, expected: str
) -> None:
    assert retry_after_header(seconds) == expected
    assert retry_after_header(float("nan")) == "5"
