"""Request paths and the proxy's own address: pure functions, shared by the app and
every format (through the contract).

The app only splits off the repository (``split_path``) and leaves the rest of the path
as the client sent it, percent-encoded: what an escape means is the format's business
(npm names a scoped package ``@scope%2fname``). Formats decode their paths with
``decode_path``, which keeps the rules every format had before: no traversal, no
escaped slash or backslash, no empty or control-character segment. Validation works on
the raw path because servers decode ``%2F`` and ``%2e%2e`` before routing; a traversal
spelled with escapes must be refused just like a literal one.
"""

from __future__ import annotations

import re
from urllib.parse import quote, unquote

from proxy.exceptions import BadRequest, HeadersTooLarge, UriTooLong

MAX_PATH_BYTES = 2048
MAX_HEADER_BYTES = 16 * 1024
# A Host header we build URLs from: a DNS name or an IP literal, and a port.
_HOST_RE = re.compile(
    r"^(?:[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
    r"(?:\.[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?"
    r"|\[[0-9A-Fa-f:.]{2,45}\])(?::[0-9]{1,5})?$"
)


def split_path(raw_path: bytes) -> tuple[str, str]:
    """``/repo/a%2Fb/`` -> ``("repo", "a%2Fb/")``: the repository's name, decoded and
    checked, and the rest of the path as sent. ``UriTooLong``/``BadRequest`` for a path
    that is too long, not ASCII, or names no valid repository segment."""
    if len(raw_path) > MAX_PATH_BYTES:
        raise UriTooLong(f"path longer than {MAX_PATH_BYTES} bytes")
    try:
        text = raw_path.decode("ascii")
    except UnicodeDecodeError:
        raise BadRequest("the path has raw non-ASCII bytes; percent-encode them") from None
    if not text.startswith("/"):
        raise BadRequest("the path must start with '/'")
    first, _, rest = text[1:].partition("/")
    if not first and rest:
        raise BadRequest("empty path segment ('//') is not allowed")
    return decode_segment(first), rest


def decode_path(raw: str) -> str:
    """``a/b%20c/`` -> ``a/b c/``, refusing (``BadRequest``) what no format serves: an
    empty segment but the last (``//``), ``.`` or ``..`` (also escaped), an escaped
    ``/`` or ``\\``, control characters, and escapes that are not UTF-8."""
    segments = raw.split("/")
    last = len(segments) - 1
    decoded = []
    for position, segment in enumerate(segments):
        if segment == "" and position != last:
            raise BadRequest("empty path segment ('//') is not allowed")
        decoded.append(decode_segment(segment))
    return "/".join(decoded)


def decode_segment(segment: str) -> str:
    """One raw path segment, decoded; ``BadRequest`` if it is a traversal, holds a slash
    or backslash once decoded, a control character, or an escape that is not UTF-8."""
    try:
        value = unquote(segment, errors="strict")
    except UnicodeDecodeError:
        raise BadRequest(f"path segment {segment!r} is not valid UTF-8") from None
    if value in (".", "..") or any(c in value for c in "/\\") or not value.isprintable():
        raise BadRequest(f"path segment {segment!r} is not allowed (traversal or control)")
    return value


# What a path segment may hold unescaped (RFC 3986's pchar, but "%").
_PCHAR_SAFE = "!$&'()*+,;=:@-._~"


def escapes_only_what_it_must(raw_path: bytes) -> bool:
    """Does ``raw_path`` escape nothing a segment may hold as is? ``/a%2Db`` does not
    (``-`` needs no escape); ``/@scope%2fname`` does (its slash must be escaped). Every
    other spelling of a path names the same thing to the formats (they decode it), so a
    cache keyed by the raw path keeps this one only (``http/lane.py``). The case of an
    escape's hex digits is not judged."""
    try:
        text = raw_path.decode("ascii")
    except UnicodeDecodeError:
        return False
    if "%" not in text:
        return True
    for segment in text.split("/"):
        if "%" in segment:
            canonical = quote(unquote(segment, errors="replace"), safe=_PCHAR_SAFE)
            if canonical.lower() != segment.lower():
                return False
    return True


def base_url(scheme: str, host: str | None, root_path: str, repository: str) -> str:
    """The absolute URL of ``/{repository}/`` as the client named us (its Host header):
    ``BadRequest`` when there is no Host, or one we would not put in a URL."""
    if not host or not _HOST_RE.match(host):
        raise BadRequest(
            f"the Host header {host!r} is not a host name and port; a deployment behind a "
            "proxy or load balancer sets server.public_url"
        )
    return f"{scheme}://{host}{root_path}/{repository}/"


def request_headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """The request's header fields by (lower-case) name. A name sent on several lines
    is one comma-separated list (RFC 9110, 5.3), as if sent once; ``BadRequest`` for
    more than one Host (RFC 9112, 3.2): absolute URLs are built from it, and a load
    balancer or cache in front may have routed or keyed the request by another one."""
    headers: dict[str, str] = {}
    for name_bytes, value_bytes in raw:
        name, value = name_bytes.decode("latin-1").lower(), value_bytes.decode("latin-1")
        if name not in headers:
            headers[name] = value
        elif name == "host":
            raise BadRequest("more than one Host header")
        else:
            headers[name] = f"{headers[name]}, {value}"
    return headers


def check_headers(headers: list[tuple[bytes, bytes]]) -> None:
    total = sum(len(name) + len(value) + 4 for name, value in headers)
    if total > MAX_HEADER_BYTES:
        raise HeadersTooLarge(
            f"request headers total {total} bytes, over the {MAX_HEADER_BYTES}-byte limit"
        )
