"""Request paths: decoded and validated once, from the raw bytes the client sent.

Validation works on the raw path because servers decode ``%2F`` and ``%2e%2e`` before
routing; a traversal spelled with escapes must be refused just like a literal one.
"""

from __future__ import annotations

from urllib.parse import unquote

from proxy.exceptions import BadRequest, HeadersTooLarge, UriTooLong

MAX_PATH_BYTES = 2048
MAX_HEADER_BYTES = 16 * 1024


def split_path(raw_path: bytes) -> tuple[str, str]:
    """``/repo/a/b/`` -> ``("repo", "a/b/")``; raises ``ClientError`` for unsafe paths."""
    if len(raw_path) > MAX_PATH_BYTES:
        raise UriTooLong(f"path longer than {MAX_PATH_BYTES} bytes")
    try:
        text = raw_path.decode("ascii")
    except UnicodeDecodeError:
        raise BadRequest("the path has raw non-ASCII bytes; percent-encode them") from None
    if not text.startswith("/"):
        raise BadRequest("the path must start with '/'")
    segments = text[1:].split("/")
    decoded = []
    last = len(segments) - 1
    for position, segment in enumerate(segments):
        if segment == "" and position != last:
            raise BadRequest("empty path segment ('//') is not allowed")
        try:
            value = unquote(segment, errors="strict")
        except UnicodeDecodeError:
            raise BadRequest(f"path segment {segment!r} is not valid UTF-8") from None
        if value in (".", "..") or any(c in value for c in "/\\") or not value.isprintable():
            raise BadRequest(f"path segment {segment!r} is not allowed (traversal or control)")
        decoded.append(value)
    return decoded[0], "/".join(decoded[1:])


def check_headers(headers: list[tuple[bytes, bytes]]) -> None:
    total = sum(len(name) + len(value) + 4 for name, value in headers)
    if total > MAX_HEADER_BYTES:
        raise HeadersTooLarge(
            f"request headers total {total} bytes, over the {MAX_HEADER_BYTES}-byte limit"
        )
