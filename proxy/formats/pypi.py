"""PyPI (Simple Repository API) repositories: ``/{repo}/simple/`` and ``/{repo}/files/``.

Index pages are cached per (project, representation) as metadata; every file link is
rewritten to a relative ``files/{project}/{filename}`` URL and recorded, so a file
request can only reach an upstream URL that an index page this proxy fetched listed.
Files are immutable and verified against the listed digest before they are stored.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit, urlunsplit

from proxy import responses
from proxy.cache import Cache
from proxy.catalog import Entry, Link
from proxy.config import RepositorySettings
from proxy.exceptions import BadRequest, NotConfigured, NotFound, UpstreamUnavailable
from proxy.fetch import Fetched, FetchSpec, Status
from proxy.formats import ASGIResponse, Request
from proxy.formats import simple_index as si
from proxy.types import Kind
from proxy.upstream import Upstream, content_length, iter_body, read_body

log = logging.getLogger("proxy.pypi")

INDEX_BODY_LIMIT_BYTES = 256 * 1024 * 1024
NOT_FOUND_STATUSES = (404, 410)


class PypiRepository:
    def __init__(self, settings: RepositorySettings, cache: Cache, upstream: Upstream) -> None:
        self.settings = settings
        self.name = settings.name
        self.cache = cache
        self.upstream = upstream
        self.index_url = settings.upstreams[0] if settings.upstreams else None

    async def handle(self, request: Request) -> ASGIResponse:
        if request.method not in ("GET", "HEAD"):
            return responses.error(
                405,
                f"{request.method} is not allowed here; use GET or HEAD",
                {"allow": "GET, HEAD"},
            )
        parts = request.path.split("/")
        if parts[0] == "simple":
            if len(parts) == 1:
                return _redirect(f"{request.base_path}simple/")
            if len(parts) == 2 and parts[1] == "":
                return await self._root(request)
            if len(parts) in (2, 3) and (len(parts) == 2 or parts[2] == ""):
                return await self._project(request, parts[1], trailing_slash=len(parts) == 3)
        elif parts[0] == "files" and len(parts) == 3 and parts[2]:
            return await self._file(request, parts[1], parts[2])
        raise NotFound(
            f"/{request.repository}/{request.path}: no such path; a pypi repository serves "
            f"/{request.repository}/simple/ and the file links its pages list"
        )

    def _require_upstream(self) -> str:
        if self.index_url is None:
            raise NotConfigured(
                f"repository {self.name!r} has no upstream index configured; "
                f"set {self.settings.upstream_setting}"
            )
        return self.index_url

    # -- index pages -----------------------------------------------------------------

    async def _root(self, request: Request) -> ASGIResponse:
        chosen = si.negotiate(request.headers.get("accept"))
        if chosen is None:
            return _not_acceptable()
        representation, content_type = chosen
        spec = self._index_spec(None, representation)
        return await self.cache.respond(
            spec, request.method, request.headers, {"content-type": content_type, "vary": "Accept"}
        )

    async def _project(self, request: Request, name: str, trailing_slash: bool) -> ASGIResponse:
        if not si.is_valid_project_name(name):
            raise BadRequest(f"{name!r} is not a valid project name (PEP 508)")
        project = si.normalize(name)
        if project != name or not trailing_slash:
            return _redirect(f"{request.base_path}simple/{project}/")
        chosen = si.negotiate(request.headers.get("accept"))
        if chosen is None:
            return _not_acceptable()
        representation, content_type = chosen
        spec = self._index_spec(project, representation)
        return await self.cache.respond(
            spec, request.method, request.headers, {"content-type": content_type, "vary": "Accept"}
        )

    def _index_spec(self, project: str | None, representation: str) -> FetchSpec:
        index_url = self._require_upstream()
        url = index_url + (f"{project}/" if project else "")
        page = f"simple/{project}/" if project else "simple/"
        return FetchSpec(
            repository=self.name,
            format="pypi",
            key=f"{page}#{representation}",
            kind=Kind.METADATA,
            origin=IndexOrigin(self, url, project, representation),
            ttl_s=self.settings.metadata_ttl_s,
            negative_ttl_s=self.settings.negative_ttl_s,
            stream=False,
        )

    async def record_links(self, project: str, page: si.ProjectPage) -> None:
        links = []
        for f in page.files:
            key = f"files/{project}/{f.filename}"
            links.append(Link(self.name, key, f.url, f.hashes, f.size))
            if f.core_metadata:
                digests = f.core_metadata if isinstance(f.core_metadata, dict) else {}
                links.append(Link(self.name, key + ".metadata", _sidecar_url(f.url), digests))
        await self.cache.record_links(links)

    # -- files -----------------------------------------------------------------------

    async def _file(self, request: Request, name: str, filename: str) -> ASGIResponse:
        if not si.is_valid_project_name(name) or si.normalize(name) != name:
            raise BadRequest(f"{name!r} is not a normalized project name")
        if not si.is_safe_filename(filename):
            raise BadRequest(f"{filename!r} is not a valid file name")
        key = f"files/{name}/{filename}"
        entry = await self.cache.lookup(self.name, key)
        link = None
        if entry is None or not entry.is_fresh():
            self._require_upstream()
            link = await self._find_link(name, key)
        spec = FetchSpec(
            repository=self.name,
            format="pypi",
            key=key,
            kind=Kind.IMMUTABLE,
            origin=FileOrigin(self, name, key, link),
            negative_ttl_s=self.settings.negative_ttl_s,
        )
        return await self.cache.respond(spec, request.method, request.headers)

    async def _find_link(self, project: str, key: str) -> Link:
        link = await self.cache.find_link(self.name, key)
        if link is None:
            # Perhaps the page listing it was never fetched here: fetch it (if not fresh),
            # which records its links, and look again.
            await self.cache.get(self._index_spec(project, "json"))
            link = await self.cache.find_link(self.name, key)
        if link is None:
            raise NotFound(
                f"{key.split('/')[-1]} is not listed in the index page of project {project!r}; "
                "the proxy only fetches files its index pages list"
            )
        return link


class IndexOrigin:
    """Fetches one upstream index page, records its links, renders our page."""

    def __init__(
        self, repo: PypiRepository, url: str, project: str | None, representation: str
    ) -> None:
        self.repo = repo
        self.url = url
        self.project = project
        self.representation = representation

    @asynccontextmanager
    async def open(self, stale: Entry | None) -> AsyncIterator[Fetched]:
        headers = {"Accept": si.UPSTREAM_ACCEPT[self.representation]}
        if stale is not None and stale.etag:
            headers["If-None-Match"] = stale.etag
        if stale is not None and stale.last_modified:
            headers["If-Modified-Since"] = stale.last_modified
        async with self.repo.upstream.stream("GET", self.url, headers) as response:
            status = response.status_code
            validators = {
                "etag": response.headers.get("etag"),
                "last_modified": response.headers.get("last-modified"),
            }
            if status == 304:
                yield Fetched(Status.NOT_MODIFIED, **validators)
                return
            if status in NOT_FOUND_STATUSES:
                what = f"project {self.project!r}" if self.project else "the root index"
                yield Fetched(Status.NOT_FOUND, message=f"{what} not found on the upstream index")
                return
            if status != 200:
                raise UpstreamUnavailable(f"upstream index answered {status} for {self.url}")
            body = await read_body(response, INDEX_BODY_LIMIT_BYTES)
            content_type = response.headers.get("content-type", "text/html").lower()
            final_url = str(response.url)
            try:
                if self.project is None:
                    rendered = si.render_root(
                        si.parse_root(body, content_type), self.representation
                    )
                else:
                    page = si.parse_project(body, content_type, final_url, self.project)
                    page.files = [f for f in page.files if _keep_file(f, self.project)]
                    await self.repo.record_links(self.project, page)
                    rendered = si.render_project(page, self.project, self.representation)
            except si.IndexFormatError as exc:
                raise UpstreamUnavailable(
                    f"upstream page {self.url} is not a simple index: {exc}"
                ) from exc
            yield Fetched(
                Status.OK,
                body=_one_chunk(rendered),
                content_type=si.JSON_V1 if self.representation == "json" else si.HTML_V1,
                length=len(rendered),
                **validators,
            )


class FileOrigin:
    """Fetches a listed file (or its .metadata sidecar) from the URL its index gave."""

    def __init__(self, repo: PypiRepository, project: str, key: str, link: Link | None) -> None:
        self.repo = repo
        self.project = project
        self.key = key
        self.link = link

    @asynccontextmanager
    async def open(self, stale: Entry | None) -> AsyncIterator[Fetched]:
        link = self.link or await self.repo._find_link(self.project, self.key)
        async with self.repo.upstream.stream("GET", link.url) as response:
            status = response.status_code
            if status in NOT_FOUND_STATUSES:
                yield Fetched(
                    Status.NOT_FOUND, message=f"{link.url} is listed but not found upstream"
                )
                return
            if status != 200:
                raise UpstreamUnavailable(f"upstream answered {status} for {link.url}")
            yield Fetched(
                Status.OK,
                body=iter_body(response),
                content_type=_file_content_type(self.key, response.headers.get("content-type")),
                length=_known_length(content_length(response), link.size),
                etag=response.headers.get("etag"),
                last_modified=response.headers.get("last-modified"),
                expected=link.digests,
            )


def _known_length(upstream_length: int | None, listed_size: int | None) -> int | None:
    # The upstream's own Content-Length wins; the index's size covers chunked answers.
    return upstream_length if upstream_length is not None else listed_size


def _sidecar_url(url: str) -> str:
    """PEP 658: the metadata file is the distribution's URL path plus ".metadata"."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=parts.path + ".metadata"))


def _keep_file(f: si.FileLink, project: str) -> bool:
    if si.is_safe_filename(f.filename):
        return True
    log.warning("dropping unsafe file name %r from project %s", f.filename, project)
    return False


def _file_content_type(key: str, upstream_type: str | None) -> str:
    if key.endswith(".metadata"):
        return "text/plain; charset=utf-8"
    if upstream_type and upstream_type.split(";")[0].strip() not in ("binary/octet-stream", ""):
        return upstream_type
    return "application/octet-stream"


async def _one_chunk(body: bytes) -> AsyncIterator[bytes]:
    yield body


def _redirect(location: str) -> ASGIResponse:
    return responses.BodyResponse(
        301, [(b"location", location.encode()), (b"content-length", b"0")], b""
    )


def _not_acceptable() -> ASGIResponse:
    return responses.error(
        406,
        f"no acceptable representation; this index serves {si.JSON_V1}, {si.HTML_V1} and text/html",
        {"vary": "Accept"},
    )
