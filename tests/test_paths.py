"""Request paths, header limits and the proxy's own address (proxy/http/paths.py),
from the raw bytes. No server."""

from __future__ import annotations

import pytest

from proxy.exceptions import BadRequest, ClientError
from proxy.http.errors import rule_for
from proxy.http.paths import (
    MAX_HEADER_BYTES,
    MAX_PATH_BYTES,
    base_url,
    check_headers,
    decode_path,
    decode_segment,
    split_path,
)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"/pypi/simple/", ("pypi", "simple/")),
        (b"/pypi", ("pypi", "")),
        (b"/pypi/", ("pypi", "")),
        (b"/", ("", "")),
        (b"/maven/org/x/1.0/x-1.0.jar", ("maven", "org/x/1.0/x-1.0.jar")),
        # The rest is left as sent: what an escape means is the format's business.
        (b"/raw/a%20b/c%2Bd.tar.gz", ("raw", "a%20b/c%2Bd.tar.gz")),
        (b"/npm/@scope%2fname", ("npm", "@scope%2fname")),
        (b"/npm/@scope%2Fname/-/name-1.0.0.tgz", ("npm", "@scope%2Fname/-/name-1.0.0.tgz")),
        (b"/my%2Drepo/x", ("my-repo", "x")),
    ],
)
def test_split_path_names_the_repository_and_keeps_the_rest_raw(
    raw: bytes, expected: tuple[str, str]
) -> None:
    assert split_path(raw) == expected


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"/pypi\xc3\xa9/x", 400),  # raw non-ASCII bytes
        (b"pypi/x", 400),
        (b"//x", 400),
        (b"/%2e%2e/etc", 400),  # the repository segment is checked like any other
        (b"/a%2Fb/x", 400),
        (b"/" + b"a" * MAX_PATH_BYTES, 414),
    ],
)
def test_split_path_refuses(raw: bytes, status: int) -> None:
    with pytest.raises(ClientError) as info:
        split_path(raw)
    assert rule_for(info.value).status == status


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("simple/", "simple/"),
        ("", ""),
        ("a%20b/c%2Bd.tar.gz", "a b/c+d.tar.gz"),
        ("caf%C3%A9", "caf\u00e9"),
        ("org/x/1.0/x-1.0.jar", "org/x/1.0/x-1.0.jar"),
    ],
)
def test_decode_path(raw: str, expected: str) -> None:
    assert decode_path(raw) == expected


@pytest.mark.parametrize(
    "raw",
    [
        "../etc/passwd",
        "%2e%2e/etc",
        "%2E%2E/etc",
        "a%2Fb",  # an escaped slash would cross a segment
        "a%2fb",
        "a%5Cb",
        "./x",
        "x/./y",
        "x/../y",
        "/x",  # an empty first segment
        "x//y",
        "%00",
        "%0d%0a",
        "%ff",  # not UTF-8
        "a%e9b",
    ],
)
def test_decode_path_keeps_the_refusals_every_format_had(raw: str) -> None:
    with pytest.raises(BadRequest):
        decode_path(raw)


def test_a_segment_is_decoded_alone() -> None:
    assert decode_segment("@scope") == "@scope"
    assert decode_segment("name%2B1") == "name+1"
    with pytest.raises(BadRequest):
        decode_segment("@scope%2fname")


def test_header_limit() -> None:
    check_headers([(b"accept", b"*/*")])
    check_headers([(b"x", b"a" * (MAX_HEADER_BYTES - 10))])
    with pytest.raises(ClientError) as info:
        check_headers([(b"x", b"a" * MAX_HEADER_BYTES)])
    assert rule_for(info.value).status == 431


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("proxy.example:8080", "http://proxy.example:8080/npm/"),
        ("127.0.0.1:41234", "http://127.0.0.1:41234/npm/"),
        ("[::1]:8080", "http://[::1]:8080/npm/"),
        ("proxy_1", "http://proxy_1/npm/"),  # a compose service name
        ("proxy.example.", "http://proxy.example./npm/"),
    ],
)
def test_base_url_from_the_host_header(host: str, url: str) -> None:
    assert base_url("http", host, "", "npm") == url


@pytest.mark.parametrize(
    "host",
    [
        None,
        "",
        'evil.example/"><script>',
        "evil.example/path",
        "user@evil.example",
        "evil.example:80:80",
        "evil example",
        "evil.example\\x",
        "[::1",
        "a" * 64 + ".example",
    ],
)
def test_a_host_header_we_would_not_put_in_a_url_is_refused(host: str | None) -> None:
    with pytest.raises(BadRequest, match=r"server\.public_url"):
        base_url("http", host, "", "npm")
