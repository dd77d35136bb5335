"""Content checks before storing (docs/architecture.md, "Content checks before storing").

A body that no digest from the index or the upstream verified is stored only if it looks
like what its key holds (``types.Content``, named by the format): a jar or a wheel is a
zip archive, an sdist a compressed stream, metadata well-formed XML, a checksum or a
signature text, and nothing is an HTML page unless the key says it may be. This is what
stops an upstream that redirects to a login page, or answers 200 with an error page,
from having that page stored as an immutable artifact (and its checksums computed from
it, so that the client's own check passes).

``problem(path, content)`` reads the temp file (blocking: run it in the I/O pool) and
returns why it fails, or None. It reads the head and the tail of archives, not all of
them; XML and JSON documents are parsed whole, up to ``PARSED_MAX_BYTES``.
"""

from __future__ import annotations

import json
import os
import re
from typing import BinaryIO

from defusedxml import DefusedXmlException
from defusedxml import ElementTree as SafeXml

from proxy.types import Content

HEAD_BYTES = 1024
# The end of central directory record is 22 bytes plus a comment of up to 65,535.
ZIP_TAIL_BYTES = 22 + 65_535
PARSED_MAX_BYTES = 64 * 1024 * 1024
_ZIP_START = (b"PK\x03\x04", b"PK\x05\x06")  # a first entry, or an empty archive
_ZIP_END = b"PK\x05\x06"
_GZIP = b"\x1f\x8b\x08"
_COMPRESSED = (_GZIP, b"BZh", b"\xfd7zXZ\x00", b"\x28\xb5\x2f\xfd")  # gzip bzip2 xz zstd
_HTML_START = re.compile(
    rb"^\s*(<!--.*?-->\s*)*<(!doctype\s+html|html[\s>]|head[\s>]|body[\s>])", re.I | re.S
)


def head_problem(head: bytes, content: Content) -> str | None:
    """What the first ``HEAD_BYTES`` (or the whole body, if shorter) already show to be
    wrong; None if they look right so far. Pure: the fetcher asks it before any byte
    reaches a client, when nothing else can verify the body."""
    if content is Content.ANY:
        return None
    if looks_like_html(head) and content is not Content.XML:
        return f"it is an HTML page ({_shown(head)}), not {_described(content)}"
    if content is Content.ZIP and not head.startswith(_ZIP_START):
        return f"it is not a zip archive ({_shown(head)})"
    if content is Content.GZIP and not head.startswith(_GZIP):
        return f"it is not gzip data ({_shown(head)})"
    if content is Content.ARCHIVE and not head.startswith((*_COMPRESSED, *_ZIP_START)):
        return f"it is not an archive: no gzip, bzip2, xz, zstd or zip data ({_shown(head)})"
    return None


def problem(path: str, content: Content) -> str | None:
    """Why the file at ``path`` is not ``content``; None if it is."""
    if content is Content.ANY:
        return None
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = fh.read(HEAD_BYTES)
        found = head_problem(head, content)
        if found is not None:
            return found
        if content is Content.ZIP or (content is Content.ARCHIVE and head.startswith(_ZIP_START)):
            return _zip_problem(fh, head, size)
        if content in (Content.XML, Content.JSON, Content.TEXT):
            if size > PARSED_MAX_BYTES:
                return f"it is {size} bytes, more than a {_described(content)} document may be"
            fh.seek(0)
            return _document_problem(fh.read(), content)
    return None  # NOT_HTML, and it is not HTML


def looks_like_html(head: bytes) -> bool:
    """Does a body beginning with ``head`` start like an HTML page?"""
    return bool(_HTML_START.match(head.removeprefix(b"\xef\xbb\xbf")))


def _zip_problem(fh: BinaryIO, head: bytes, size: int) -> str | None:
    tail_bytes = min(size, ZIP_TAIL_BYTES)
    fh.seek(size - tail_bytes)
    if _ZIP_END not in fh.read(tail_bytes):
        return "it is a zip archive cut short (no end of central directory)"
    return None


def _document_problem(body: bytes, content: Content) -> str | None:
    if content is Content.XML:
        try:
            root = SafeXml.fromstring(body)
        except (SafeXml.ParseError, DefusedXmlException, ValueError) as exc:
            return f"it is not well-formed XML ({exc})"
        if root.tag.rsplit("}", 1)[-1].lower() == "html":
            return "it is an (X)HTML page, not an XML document of its own"
        return None
    if content is Content.JSON:
        try:
            json.loads(body)
        except (ValueError, RecursionError) as exc:
            return f"it is not JSON ({exc})"
        return None
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return "it is not text (not UTF-8)"
    return None


def _described(content: Content) -> str:
    return {
        Content.ZIP: "a zip archive",
        Content.GZIP: "gzip data",
        Content.ARCHIVE: "an archive",
        Content.XML: "an XML",
        Content.JSON: "a JSON",
        Content.TEXT: "a text",
        Content.NOT_HTML: "this file",
    }.get(content, str(content))


def _shown(head: bytes) -> str:
    """The first bytes, printable, for the message."""
    text = head[:40].decode("latin-1")
    return "starts with " + repr("".join(c if c.isprintable() else "." for c in text))
