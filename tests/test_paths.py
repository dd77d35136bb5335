"""Request paths and header limits (proxy/http/paths.py), decoded from the raw bytes. No server."""

from __future__ import annotations

import pytest

from proxy.exceptions import ClientError
from proxy.http.errors import rule_for
from proxy.http.paths import MAX_HEADER_BYTES, MAX_PATH_BYTES, check_headers, split_path


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"/pypi/simple/", ("pypi", "simple/")),
        (b"/pypi", ("pypi", "")),
        (b"/pypi/", ("pypi", "")),
        (b"/maven/org/x/1.0/x-1.0.jar", ("maven", "org/x/1.0/x-1.0.jar")),
        (b"/raw/a%20b/c%2Bd.tar.gz", ("raw", "a b/c+d.tar.gz")),
        (b"/raw/caf%C3%A9", ("raw", "caf\u00e9")),
    ],
)
def test_split_path(raw: bytes, expected: tuple[str, str]) -> None:
    assert split_path(raw) == expected


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"/pypi/../etc/passwd", 400),
        (b"/pypi/%2e%2e/etc", 400),
        (b"/pypi/%2E%2E/etc", 400),
        (b"/pypi/a%2Fb", 400),  # an escaped slash would cross a segment
        (b"/pypi/a%5Cb", 400),
        (b"/pypi/./x", 400),
        (b"/pypi//x", 400),
        (b"/pypi/%00", 400),
        (b"/pypi/%0d%0a", 400),
        (b"/pypi/%ff", 400),  # not UTF-8
        (b"/pypi/\xc3\xa9", 400),  # raw non-ASCII bytes
        (b"pypi/x", 400),
        (b"/" + b"a" * MAX_PATH_BYTES, 414),
    ],
)
def test_split_path_refuses(raw: bytes, status: int) -> None:
    with pytest.raises(ClientError) as info:
        split_path(raw)
    assert rule_for(info.value).status == status


def test_header_limit() -> None:
    check_headers([(b"accept", b"*/*")])
    check_headers([(b"x", b"a" * (MAX_HEADER_BYTES - 10))])
    with pytest.raises(ClientError) as info:
        check_headers([(b"x", b"a" * MAX_HEADER_BYTES)])
    assert rule_for(info.value).status == 431
