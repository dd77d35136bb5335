"""PyPI (Simple Repository API) repositories: ``/{repo}/simple/`` and ``/{repo}/files/``.

A project page is cached once, as our model of it (``simple_model.py``), asked of the
upstream as JSON whatever the client asked (the JSON form has the publish times), and
rendered as HTML or JSON per request; the root page is cached per representation.
Every file link is rewritten to a relative ``files/{project}/{filename}`` URL and
recorded, so a file request can only reach an upstream URL that an index page this
proxy fetched listed; so are a file's PEP 658 metadata and PEP 740 provenance. Files
are immutable and verified against the listed digest before they are stored.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from packaging.version import InvalidVersion, Version

from proxy.contract import (
    NOT_FOUND_STATUSES,
    BadRequest,
    Content,
    Duration,
    Fetched,
    FetchError,
    FetchSpec,
    FormatPlugin,
    IndexModel,
    Kind,
    Link,
    LinkBatch,
    MethodNotAllowed,
    Mirroring,
    MirrorVersions,
    NotAcceptable,
    NotFound,
    OriginContext,
    PackageRef,
    Packages,
    PackageVersion,
    ProxyContext,
    Proxying,
    PublishedIn,
    Releases,
    RepositorySettings,
    Request,
    Response,
    Size,
    Status,
    UpstreamUnavailable,
    Validators,
    option,
)
from proxy.formats import simple_index as si
from proxy.formats import simple_model as sm

log = logging.getLogger("proxy.pypi")

# A real index's root page lists ~600,000 projects (tens of MB); project pages are far
# smaller. Larger pages are refused (502) before they are read whole.
DEFAULT_MAX_INDEX_SIZE = 64 * 2**20


@dataclass(frozen=True)
class PypiOptions:
    metadata_ttl_s: float = option(Duration(), 600.0, key="metadata_ttl")
    negative_ttl_s: float = option(Duration(), 60.0, key="negative_ttl")
    max_index_size: int = option(Size(), DEFAULT_MAX_INDEX_SIZE)


class PypiRepository:
    def __init__(self, settings: RepositorySettings[PypiOptions], ctx: ProxyContext) -> None:
        self.options = settings.options
        self.name = settings.name
        self.cache = ctx.cache
        self.compute = ctx.compute
        self.responses = ctx.responses
        # The engine answers 503 for a repository without an upstream, before we are asked.
        self.index_url = settings.upstreams[0] if settings.upstreams else ""  # a PEP 503/691 index
        self.max_index_size = settings.options.max_index_size

    async def handle(self, request: Request) -> Response:
        if request.method not in ("GET", "HEAD"):
            raise MethodNotAllowed(
                f"{request.method} is not allowed here; use GET or HEAD", allowed=("GET", "HEAD")
            )
        parts = request.path.split("/")
        if parts[0] == "simple":
            if len(parts) == 1:
                return self.responses.redirect(f"{request.base_path}simple/")
            if len(parts) == 2 and parts[1] == "":
                return await self._index(request, None)
            if len(parts) in (2, 3) and (len(parts) == 2 or parts[2] == ""):
                return await self._project(request, parts[1], trailing_slash=len(parts) == 3)
        elif parts[0] == "files" and len(parts) == 3 and parts[2]:
            return await self._file(request, parts[1], parts[2])
        raise NotFound(
            f"/{request.repository}/{request.path}: no such path; a pypi repository serves "
            f"/{request.repository}/simple/ and the file links its pages list"
        )

    # -- index pages -----------------------------------------------------------------

    async def _project(self, request: Request, name: str, trailing_slash: bool) -> Response:
        if not si.is_valid_project_name(name):
            raise BadRequest(f"{name!r} is not a valid project name (PEP 508)")
        project = si.normalize(name)
        if project != name or not trailing_slash:
            return self.responses.redirect(f"{request.base_path}simple/{project}/")
        return await self._index(request, project)

    async def _index(self, request: Request, project: str | None) -> Response:
        chosen = si.negotiate(request.headers.get("accept"))
        if chosen is None:
            raise NotAcceptable(
                f"no acceptable representation; this index serves {si.JSON_V1}, "
                f"{si.HTML_V1} and text/html"
            )
        representation, content_type = chosen
        headers = {"content-type": content_type, "vary": "Accept"}
        if project is None:
            return await self.cache.respond(self.root_spec(representation), request, headers)
        spec = self.index_spec(project)
        return await self.cache.respond(spec, request, headers, representation=representation)

    def index_spec(self, project: str) -> FetchSpec:
        """A project's page: one stored model, served as HTML or JSON."""
        return FetchSpec(
            key=f"simple/{project}/",
            kind=Kind.METADATA,
            origin=IndexOrigin(
                self.name, self.index_url + f"{project}/", project, "json", self.max_index_size
            ),
            ttl_s=self.options.metadata_ttl_s,
            negative_ttl_s=self.options.negative_ttl_s,
            stream=False,
            model=PROJECT_PAGE,
        )

    def root_spec(self, representation: str) -> FetchSpec:
        """The root page (no versions, nothing to withhold): one rendering per
        representation, as the upstream's page of 600,000 names is too large to render
        per request."""
        return FetchSpec(
            key=f"simple/#{representation}",
            kind=Kind.METADATA,
            origin=IndexOrigin(
                self.name, self.index_url, None, representation, self.options.max_index_size
            ),
            ttl_s=self.options.metadata_ttl_s,
            negative_ttl_s=self.options.negative_ttl_s,
            stream=False,
            content=Content.ANY,  # parsed and rendered here: what is stored is ours
        )

    # -- files -----------------------------------------------------------------------

    async def _file(self, request: Request, name: str, filename: str) -> Response:
        if not si.is_valid_project_name(name) or si.normalize(name) != name:
            raise BadRequest(f"{name!r} is not a normalized project name")
        if not si.is_safe_filename(filename):
            raise BadRequest(f"{filename!r} is not a valid file name")
        return await self.cache.respond(self.file_spec(name, filename), request)

    def file_spec(self, project: str, filename: str) -> FetchSpec:
        key = sm.file_key(project, filename)
        return FetchSpec(
            key=key,
            kind=Kind.IMMUTABLE,
            origin=FileOrigin(key, lambda: self.index_spec(project)),
            negative_ttl_s=self.options.negative_ttl_s,
            content=Content.of_filename(filename),  # for a file listed without a hash
        )

    # -- mirrors ---------------------------------------------------------------------

    async def mirror(self, package: PackageRef, versions: MirrorVersions) -> list[FetchSpec]:
        """Every file of the version(s) a purl names, from the project's index page."""
        if not si.is_valid_project_name(package.name) or package.namespace:
            raise BadRequest(f"{package}: not a PyPI project name")
        project = si.normalize(package.name)
        spec = self.index_spec(project)
        body = await self.cache.read(spec, self.options.max_index_size)
        chosen = await self.compute(_files_to_mirror, body, package.version, versions)
        if not chosen:
            wanted = f"version {package.version}" if package.version else "a release"
            raise NotFound(f"{package}: the index of {project!r} lists no file of {wanted}")
        specs = []
        for f in chosen:
            specs.append(self.file_spec(project, f.filename))
            if f.core_metadata:  # PEP 658: what resolvers fetch before the file
                specs.append(self.file_spec(project, f.filename + sm.METADATA_SUFFIX))
        return specs

    # -- the release policy's questions (contract.Releases) ----------------------------

    def published(self, version: PackageVersion) -> PublishedIn:
        """A version's files state their upload times on the project's page."""
        return PublishedIn(self.index_spec(version.package))

    def releases_index(self, project: str) -> FetchSpec:
        return self.index_spec(project)


def _files_to_mirror(
    body: bytes, version: str | None, versions: MirrorVersions
) -> list[si.FileLink]:
    """The files to warm, from our stored page (runs in ``compute``)."""
    return select_files(sm.load_page(body).files, version, versions)


file_version = sm.file_version


def select_files(
    files: list[si.FileLink], version: str | None, versions: MirrorVersions
) -> list[si.FileLink]:
    """The files of ``version``; without one, of the latest release or of every version.

    The latest is the highest version with a file that is not yanked, preferring final
    releases over pre-releases (as pip does). A pinned version is taken even if yanked.
    """
    dated = [(f, file_version(f.filename)) for f in files]
    if version is not None:
        try:
            wanted = Version(version)
        except InvalidVersion:
            raise BadRequest(f"{version!r} is not a valid PyPI version (PEP 440)") from None
        return [f for f, v in dated if v == wanted]
    live = [(f, v) for f, v in dated if v is not None and not f.yanked]
    if versions == "all":
        return [f for f, _ in live]
    found = {v for _, v in live}
    releases = {v for v in found if not v.is_prerelease}
    if not found:
        return []
    latest = max(releases or found)
    return [f for f, v in live if v == latest]


class IndexOrigin:
    """Fetches one upstream index page, records its links, renders our page.

    Parsing and rendering run in ``ctx.compute`` (a child process for all but tiny
    pages, with a deadline): a root page of 600,000 projects or a project page of
    100,000 files must not stall the event loop, a hostile page must not take forever.
    """

    def __init__(
        self,
        repository: str,
        url: str,
        project: str | None,
        representation: str,
        max_size: int,
    ) -> None:
        self.repository = repository
        self.url = url
        self.project = project
        self.representation = representation
        self.max_size = max_size

    @asynccontextmanager
    async def open(self, ctx: OriginContext, stale: Validators | None) -> AsyncIterator[Fetched]:
        headers = {"Accept": si.UPSTREAM_ACCEPT[self.representation]}
        if stale is not None:
            headers.update(stale.conditional_headers())
        async with ctx.upstream.open("GET", self.url, headers) as response:
            status = response.status
            validators = Validators.of(response.headers)
            if status == 304:
                yield Fetched(Status.NOT_MODIFIED, validators=validators)
                return
            if status in NOT_FOUND_STATUSES:
                what = f"project {self.project!r}" if self.project else "the root index"
                yield Fetched(Status.NOT_FOUND, message=f"{what} not found on the upstream index")
                return
            if status != 200:
                raise UpstreamUnavailable(f"upstream index answered {status} for {self.url}")
            body = await response.read(self.max_size)
            content_type = response.headers.get("content-type", "text/html").lower()
            links = None
            try:
                if self.project is None:
                    rendered = await ctx.compute(
                        _root_page, body, content_type, self.representation
                    )
                else:
                    rendered, links = await ctx.compute(
                        _project_page,
                        body,
                        content_type,
                        response.url,
                        self.repository,
                        self.project,
                    )
            except si.IndexFormatError as exc:
                raise UpstreamUnavailable(
                    f"upstream page {self.url} is not a simple index: {exc}"
                ) from exc
            except FetchError:
                raise  # the parse itself failed (took too long, its process died)
            except Exception as exc:
                # Input the parser or renderer did not foresee (e.g. CPython's HTMLParser
                # asserts on "<![foo["): the page is refused, and the traceback logged,
                # since it may be a bug of ours.
                log.exception("cannot parse or render upstream page %s", self.url)
                raise UpstreamUnavailable(
                    f"upstream page {self.url} is not a simple index we can read "
                    f"({type(exc).__name__}: {exc})"
                ) from exc
            if links is not None:
                await ctx.links.record(links)
            yield Fetched(
                Status.OK,
                body=_one_chunk(rendered),
                # A project's model is JSON; it is served rendered, with the type asked for.
                content_type=si.JSON_V1 if self.representation == "json" else si.HTML_V1,
                length=len(rendered),
                validators=validators,
            )


def _root_page(body: bytes, content_type: str, representation: str) -> bytes:
    return si.render_root(si.parse_root(body, content_type), representation)


def _project_page(
    body: bytes,
    content_type: str,
    page_url: str,
    repository: str,
    project: str,
) -> tuple[bytes, LinkBatch]:
    """Our model of an upstream project page, and the links to record (runs in
    ``ctx.compute``: a thread for a tiny page, else a child process)."""
    page = si.parse_project(body, content_type, page_url, project)
    page.files = [f for f in page.files if _keep_file(f, project)]
    links = []
    for f in page.files:
        key = sm.file_key(project, f.filename)
        links.append(Link(repository, key, f.url, f.hashes, f.size))
        if f.core_metadata:
            digests = f.core_metadata if isinstance(f.core_metadata, dict) else {}
            links.append(Link(repository, key + sm.METADATA_SUFFIX, _sidecar_url(f.url), digests))
        if f.provenance:
            links.append(Link(repository, key + sm.PROVENANCE_SUFFIX, f.provenance, {}))
    return sm.dump(page, project), LinkBatch.encode(links)


class FileOrigin:
    """Fetches a listed file (or its .metadata sidecar) from the URL its index gave.

    If the link is not known yet (the page was never fetched here, or it changed), the
    project's index page is fetched through the cache first: a file needs its page,
    a page never needs a file, so the two fetches can never wait on each other.
    """

    def __init__(self, key: str, index_spec: Callable[[], FetchSpec]) -> None:
        self.key = key
        self.index_spec = index_spec

    async def _link(self, ctx: OriginContext) -> Link:
        link = await ctx.links.get(self.key)
        if link is None:
            await ctx.get(self.index_spec())
            link = await ctx.links.get(self.key)
        if link is None:
            _, project, filename = self.key.split("/", 2)
            raise NotFound(
                f"{filename} is not listed in the index page of project {project!r}; "
                "the proxy only fetches files its index pages list"
            )
        return link

    @asynccontextmanager
    async def open(self, ctx: OriginContext, stale: Validators | None) -> AsyncIterator[Fetched]:
        link = await self._link(ctx)
        async with ctx.upstream.open("GET", link.url) as response:
            status = response.status
            if status in NOT_FOUND_STATUSES:
                yield Fetched(
                    Status.NOT_FOUND, message=f"{link.url} is listed but not found upstream"
                )
                return
            if status != 200:
                raise UpstreamUnavailable(f"upstream answered {status} for {link.url}")
            yield Fetched(
                Status.OK,
                body=response.body(),
                content_type=_file_content_type(self.key, response.headers.get("content-type")),
                # The upstream's own Content-Length wins; the index's size covers chunked.
                length=response.length if response.length is not None else link.size,
                validators=Validators.of(response.headers),
                expected=link.digests,
            )


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
    if key.endswith(sm.METADATA_SUFFIX):
        return "text/plain; charset=utf-8"
    if key.endswith(sm.PROVENANCE_SUFFIX):
        return "application/json"
    if upstream_type and upstream_type.split(";")[0].strip() not in ("binary/octet-stream", ""):
        return upstream_type
    return "application/octet-stream"


async def _one_chunk(body: bytes) -> AsyncIterator[bytes]:
    yield body


PROJECT_PAGE = IndexModel(listing=sm.listing, render=sm.render)


def package_of(key: str) -> PackageVersion | None:
    """``simple/<project>/`` -> the project; ``files/<project>/<file>`` (and its
    ``.metadata`` and ``.provenance``) -> the project and the version its file name
    states (none for a name we cannot read)."""
    parts = key.split("/")
    if len(parts) == 3 and parts[0] == "simple" and parts[1]:
        return PackageVersion(parts[1])
    if len(parts) == 3 and parts[0] == "files" and parts[1]:
        filename = parts[2].removesuffix(sm.METADATA_SUFFIX).removesuffix(sm.PROVENANCE_SUFFIX)
        version = file_version(filename)
        return PackageVersion(parts[1], str(version) if version is not None else None)
    return None


def purl_of(project: str) -> PackageRef:
    return PackageRef("pypi", project, purl=f"pkg:pypi/{project}")


def project_of(package: PackageRef) -> str:
    if not si.is_valid_project_name(package.name) or package.namespace:
        raise BadRequest(f"{package}: not a PyPI project name")
    return si.normalize(package.name)


FORMAT = FormatPlugin(
    name="pypi",
    options=PypiOptions,
    proxying=Proxying(build=PypiRepository, max_upstreams=1),
    mirroring=Mirroring(purl_types=("pypi",), keys=PypiRepository.mirror),
    default_repository={"name": "pypi", "format": "pypi"},
    packages=Packages(of=package_of, name=si.normalize),
    releases=Releases(
        purl_type="pypi",
        purl=purl_of,
        package=project_of,
        index=PypiRepository.releases_index,
        published=PypiRepository.published,
    ),
)
