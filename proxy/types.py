"""Type aliases and small value types shared across modules (engine and formats)."""

from __future__ import annotations

import enum
import json
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from proxy.http.semantics import header_value_ok

Digests = dict[str, str]
"""Digest name (``sha256``, ``sha1``, ``md5``, ``sha512``) -> lower-case hex."""

KNOWN_DIGESTS = frozenset(
    {"md5", "sha1", "sha224", "sha256", "sha384", "sha512", "sha3_224", "sha3_256"}
    | {"sha3_384", "sha3_512", "blake2b", "blake2s"}
)
"""The digest names the proxy verifies; others an upstream lists (shake_128 has no fixed
length, "foo" does not exist) are ignored, never an error."""

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class Kind(enum.StrEnum):
    """What kind of thing an entry is; decides whether and when it is refetched."""

    IMMUTABLE = "immutable"  # wheels, sdists, release jars: never refetched
    METADATA = "metadata"  # index pages, maven-metadata.xml, SNAPSHOTs: fresh for a TTL
    NEGATIVE = "negative"  # a confirmed upstream 404, for a short TTL
    HOSTED = "hosted"  # written by clients (a hosted repository's uploads)


class Content(enum.StrEnum):
    """What a body must look like to be stored when no digest the index or the upstream
    gave verified it (docs/architecture.md, "Content checks before storing"). A format
    names it per key; the engine checks it on the downloaded file before anyone gets
    the last byte."""

    ZIP = "zip"  # wheels, jars, wars: a zip archive
    GZIP = "gzip"  # .tar.gz, .tgz: a gzip stream
    ARCHIVE = "archive"  # an sdist or a tarball: gzip, bzip2, xz or zstd, or a zip archive
    XML = "xml"  # maven-metadata.xml, a pom: well-formed XML whose root is not <html>
    JSON = "json"  # a JSON document
    TEXT = "text"  # UTF-8 text that is not an HTML page (a signature, a checksum)
    NOT_HTML = "not-html"  # anything but an HTML page (a login or error page)
    ANY = "any"  # no check: the format parsed and rendered the body itself, or it may be HTML

    @classmethod
    def of_filename(cls, name: str) -> Content:
        """The check a file's name calls for, by its extension (``NOT_HTML`` when the
        name says nothing; ``ANY`` for an HTML file)."""
        lower = name.lower()
        for suffixes, content in _CONTENT_BY_SUFFIX:
            if lower.endswith(suffixes):
                return content
        return cls.NOT_HTML


_CONTENT_BY_SUFFIX: tuple[tuple[tuple[str, ...], Content], ...] = (
    ((".tar.gz", ".tgz"), Content.GZIP),
    ((".tar.bz2", ".tar.xz", ".tar.zst", ".tbz2", ".txz"), Content.ARCHIVE),
    (
        (".whl", ".zip", ".jar", ".war", ".ear", ".aar", ".egg", ".nupkg", ".apk", ".hpi"),
        Content.ZIP,
    ),
    ((".pom", ".xml"), Content.XML),
    ((".json", ".module"), Content.JSON),
    ((".asc", ".sha1", ".sha256", ".sha512", ".md5", ".txt"), Content.TEXT),
    ((".html", ".htm", ".xhtml"), Content.ANY),
)


@dataclass(frozen=True, slots=True)
class Link:
    """A file an index listed (a PyPI project page, an npm packument): the only URLs a
    file request may make us fetch."""

    repository: str
    key: str
    url: str
    digests: Digests
    size: int | None = None  # as the index page stated it, when it did


@dataclass(frozen=True, slots=True)
class LinkBatch:
    """Links already encoded for the catalog (one JSON text), so a page of 100,000 files
    can be turned into links where it is parsed (a child process) and recorded without
    rebuilding 100,000 objects in the server."""

    json_text: str
    count: int
    repositories: tuple[str, ...] = ()  # those the links name (a store checks them)

    @classmethod
    def encode(cls, links: Iterable[Link]) -> LinkBatch:
        # One row per key, the last listing winning: the same key twice in one batch
        # would be an error on Postgres ("cannot affect row a second time"), not on SQLite.
        unique = {(link.repository, link.key): link for link in links}
        rows = [
            {
                "repository": link.repository,
                "key": link.key,
                "url": link.url,
                "digests": link.digests,
                "size": link.size,
            }
            for link in unique.values()
        ]
        named = tuple(sorted({repository for repository, _key in unique}))
        return cls(json.dumps(rows), len(rows), named)


@dataclass(frozen=True, slots=True)
class PackageRef:
    """A package named by a purl (``pkg:type/namespace/name@version?qualifiers``).

    The engine parses purls (``proxy/mirror/purls.py``) and hands formats this value, so a
    format never parses one itself. ``version`` None means "latest or all versions".
    """

    type: str
    name: str
    namespace: str | None = None
    version: str | None = None
    qualifiers: tuple[tuple[str, str], ...] = ()
    purl: str = ""  # the canonical purl, for messages

    def qualifier(self, name: str) -> str | None:
        return next((value for key, value in self.qualifiers if key == name), None)

    def __str__(self) -> str:
        return self.purl or f"pkg:{self.type}/{self.name}"


@dataclass(frozen=True, slots=True)
class Validators:
    """What a stale copy tells the upstream in a conditional GET."""

    etag: str | None = None
    last_modified: str | None = None

    @classmethod
    def of(cls, headers: Mapping[str, str]) -> Validators:
        """The ETag and Last-Modified of an upstream answer."""
        return cls(headers.get("etag"), headers.get("last-modified"))

    def conditional_headers(self) -> dict[str, str]:
        """If-None-Match / If-Modified-Since, leaving out a value that is not valid HTTP
        (one stored before upstream headers were checked)."""
        headers = {}
        if self.etag and header_value_ok(self.etag):
            headers["If-None-Match"] = self.etag
        if self.last_modified and header_value_ok(self.last_modified):
            headers["If-Modified-Since"] = self.last_modified
        return headers
