"""Raw repositories: any file under the upstream's prefix, ``/{repo}/{path}``.

For release tarballs, installers and static assets. A file is immutable once fetched,
unless its path matches one of the repository's ``mutable`` patterns: those are
metadata, revalidated after ``metadata_ttl`` (with the upstream's ETag and
Last-Modified). Patterns are shell-style and ``*`` also matches ``/``
(``"*/latest/*"``, ``"*.json"``). A confirmed 404 is remembered for ``negative_ttl``.
"""

from __future__ import annotations

import fnmatch
import mimetypes
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from urllib.parse import quote

from proxy.contract import (
    NOT_FOUND_STATUSES,
    Content,
    Duration,
    Fetched,
    FetchSpec,
    FormatPlugin,
    Globs,
    Kind,
    MethodNotAllowed,
    NotFound,
    OriginContext,
    ProxyContext,
    Proxying,
    RepositorySettings,
    Request,
    Response,
    Status,
    UpstreamUnavailable,
    Validators,
    option,
)

# A .tar.gz is served as the compressed file it is, never as a tar to be decompressed.
_COMPRESSED_TYPES = {
    "gzip": "application/gzip",
    "bzip2": "application/x-bzip2",
    "xz": "application/x-xz",
    "br": "application/x-brotli",
    "compress": "application/x-compress",
}
mimetypes.init()  # reads the system's type files once, at import, not on a request
_PATH_SAFE = "-._~!$&'()*+,;=:@"  # RFC 3986 pchar, kept as is in upstream URLs


@dataclass(frozen=True)
class RawOptions:
    mutable: tuple[str, ...] = option(Globs(), ())
    metadata_ttl_s: float = option(Duration(), 600.0, key="metadata_ttl")
    negative_ttl_s: float = option(Duration(), 60.0, key="negative_ttl")


class RawRepository:
    def __init__(self, settings: RepositorySettings[RawOptions], ctx: ProxyContext) -> None:
        self.settings = settings
        self.options = settings.options
        self.cache = ctx.cache

    async def handle(self, request: Request) -> Response:
        if request.method not in ("GET", "HEAD"):
            raise MethodNotAllowed(
                f"{request.method} is not allowed; use GET or HEAD", allowed=("GET", "HEAD")
            )
        path = request.path
        if not path or path.endswith("/"):
            raise NotFound(
                f"/{request.repository}/{path}: a raw repository serves files, not folders"
            )
        mutable = any(fnmatch.fnmatchcase(path, pattern) for pattern in self.options.mutable)
        url = self.settings.upstreams[0] + quote(path, safe="/" + _PATH_SAFE)
        spec = FetchSpec(
            key=path,
            kind=Kind.METADATA if mutable else Kind.IMMUTABLE,
            origin=RawOrigin(url, path),
            ttl_s=self.options.metadata_ttl_s if mutable else None,
            negative_ttl_s=self.options.negative_ttl_s,
            content=Content.of_filename(path),  # nothing verifies a raw file but its kind
        )
        return await self.cache.respond(spec, request)


class RawOrigin:
    def __init__(self, url: str, path: str) -> None:
        self.url = url
        self.path = path

    @asynccontextmanager
    async def open(self, ctx: OriginContext, stale: Validators | None) -> AsyncIterator[Fetched]:
        headers = stale.conditional_headers() if stale is not None else {}
        async with ctx.upstream.open("GET", self.url, headers) as response:
            validators = Validators.of(response.headers)
            if response.status == 304:
                yield Fetched(Status.NOT_MODIFIED, validators=validators)
                return
            if response.status in NOT_FOUND_STATUSES:
                yield Fetched(Status.NOT_FOUND, message=f"{self.path} not found upstream")
                return
            if response.status != 200:
                raise UpstreamUnavailable(f"upstream answered {response.status} for {self.url}")
            yield Fetched(
                Status.OK,
                body=response.body(),
                content_type=_content_type(self.path, response.headers.get("content-type")),
                length=response.length,
                validators=validators,
            )


def _content_type(path: str, upstream_type: str | None) -> str:
    if upstream_type and upstream_type.split(";")[0].strip() not in (
        "",
        "application/octet-stream",
        "binary/octet-stream",
    ):
        return upstream_type
    guessed, encoding = mimetypes.guess_type(path, strict=False)
    if encoding is not None:
        return _COMPRESSED_TYPES.get(encoding, "application/octet-stream")
    return guessed or "application/octet-stream"


FORMAT = FormatPlugin(
    name="raw", options=RawOptions, proxying=Proxying(build=RawRepository, max_upstreams=1)
)
