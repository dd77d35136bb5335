"""npm registries: ``/{repo}/{package}`` (packuments) and the tarballs they list.

A packument is cached once, as our neutral model of the upstream's full document
(``npm_packument.py``), and rendered per request full (``application/json``) or
abbreviated (``application/vnd.npm.install-v1+json``, what ``npm install`` asks for),
so the publish times (``time``) are always at hand and the release policy can leave
versions out of both. Each tarball URL is rewritten to point back at the proxy; what is
stored names the proxy only by ``BASE_URL_MARK``, which the engine fills in with each
request's own URL (``server.public_url``, else its Host), so no client changes what
another gets. The
upstream URL of every tarball is recorded (``LinkStore``): a tarball request can only
make the proxy fetch a URL a packument it fetched listed, verified against that
packument's ``dist.integrity`` (SRI, e.g. sha512), else its ``dist.shasum`` (sha1).

Scoped packages are named either way: ``/@scope%2fname`` (what npm sends) and
``/@scope/name``. Publishing, login, audit and search are not offered (501).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from proxy.contract import (
    BASE_URL_MARK,
    NOT_FOUND_STATUSES,
    BadRequest,
    Content,
    Duration,
    Fetched,
    FetchError,
    FetchSpec,
    FormatPlugin,
    Kind,
    Link,
    LinkBatch,
    MethodNotAllowed,
    Mirroring,
    MirrorVersions,
    NotAcceptable,
    NotFound,
    NotSupported,
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
    RetryLater,
    Size,
    Status,
    UpstreamUnavailable,
    Validators,
    decode_segment,
    option,
)
from proxy.formats.npm_packument import (
    PACKUMENT,
    Representation,
    dist_digests,
    dist_tags_of,
    manifest_of,
    neutral,
    tarball_key,
    versions_to_mirror,
)

log = logging.getLogger("proxy.npm")

FULL = "application/json"
ABBREVIATED = "application/vnd.npm.install-v1+json"
# Re-exported for the tests that read them here.
__all__ = ["dist_digests", "negotiate", "render_packument"]
CONTENT_TYPES: dict[Representation, str] = {"full": FULL, "abbreviated": ABBREVIATED}
DEFAULT_MAX_PACKUMENT_SIZE = 128 * 2**20  # the largest public packuments are tens of MB
PACKAGE_NAME_MAX_CHARS = 214
# Look-ups in stored packuments (versions, dist-tags) reading one at once: as many as
# the engine's parser processes (two), since more would only hold their copy waiting;
# one that waits longer than a parse may take is told to retry.
LOOK_UPS_AT_ONCE = 2
LOOK_UP_WAIT_S = 30.0
_PART_RE = re.compile(r"^[A-Za-z0-9~-][A-Za-z0-9._~-]*$")
_TARBALL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+~-]{0,300}\.tgz$")
_SCOPE_SEPARATOR_RE = re.compile("%2f", re.IGNORECASE)
_ESCAPED_AT_RE = re.compile("^%40", re.IGNORECASE)
# Answers that refuse are 4xx: npm retries a 5xx (twice, 10 s then 60 s apart), so a
# 501 would keep `npm publish` or `npm search` waiting minutes for the same refusal.
READ_ONLY = ("GET", "HEAD")
# Endpoints of npm's protocol the proxy does not offer, and why (``/-/...`` paths): 404.
UNSUPPORTED = {
    "npm/v1/security": "audit is not offered by this proxy (it would send your dependency "
    "tree upstream); run npm with --no-audit or set audit=false",
    "v1/search": "search is not offered by this proxy; search the upstream registry itself",
    "user": "login is not offered by this proxy: it serves public packages read-only",
    "v1/login": "login is not offered by this proxy: it serves public packages read-only",
    "whoami": "login is not offered by this proxy, so there is nobody to be",
    "npm/v1/tokens": "tokens are not offered by this proxy: it has no accounts",
}


@dataclass(frozen=True)
class NpmOptions:
    metadata_ttl_s: float = option(Duration(), 300.0, key="metadata_ttl")
    negative_ttl_s: float = option(Duration(), 60.0, key="negative_ttl")
    max_packument_size: int = option(Size(), DEFAULT_MAX_PACKUMENT_SIZE)


@dataclass(frozen=True)
class PackageName:
    """A valid package name: ``left-pad`` or ``@scope/name``."""

    name: str

    @property
    def unscoped(self) -> str:
        return self.name.rpartition("/")[2]

    @property
    def upstream_path(self) -> str:
        """How registries spell it in a URL: the scope's slash escaped."""
        return quote(self.name, safe="@")

    def tarball_key(self, filename: str) -> str:
        return f"{self.name}{TARBALL_SEPARATOR}{filename}"

    def purl(self) -> PackageRef:
        """``pkg:npm/left-pad``, ``pkg:npm/%40scope/name``: the purl of the package."""
        scope, slash, bare = self.name.rpartition("/")
        namespace = scope if slash else None
        encoded = f"%40{scope[1:]}/{bare}" if slash else bare
        return PackageRef("npm", bare, namespace=namespace, purl=f"pkg:npm/{encoded}")

    @classmethod
    def parse(cls, name: str) -> PackageName:
        scope, slash, bare = name.rpartition("/")
        valid = _PART_RE.match(bare) is not None and len(name) <= PACKAGE_NAME_MAX_CHARS
        if slash:
            valid = valid and scope.startswith("@") and _PART_RE.match(scope[1:]) is not None
        if not valid:
            raise BadRequest(
                f"{name!r} is not an npm package name (name or @scope/name: letters, digits "
                f"and -._~, at most {PACKAGE_NAME_MAX_CHARS} characters)"
            )
        return cls(name)


def split_name(segments: tuple[str, ...]) -> tuple[PackageName, tuple[str, ...]]:
    """The package a path names, and the segments after it: ``@scope%2fname/...``,
    ``@scope/name/...`` or ``name/...`` (the ``@`` escaped or not, as clients that escape
    the whole name send it); ``BadRequest`` for anything else."""
    first = _ESCAPED_AT_RE.sub("@", segments[0], count=1)
    if first.startswith("@") and _SCOPE_SEPARATOR_RE.search(first):
        scope, bare = _SCOPE_SEPARATOR_RE.split(first, maxsplit=1)
        name, rest = f"{decode_segment(scope)}/{decode_segment(bare)}", segments[1:]
    elif first.startswith("@") and len(segments) > 1:
        name, rest = f"{decode_segment(first)}/{decode_segment(segments[1])}", segments[2:]
    else:
        name, rest = decode_segment(first), segments[1:]
    return PackageName.parse(name), rest


def negotiate(accept: str | None) -> Representation | None:
    """The abbreviated form when the client prefers it (``npm install``), else the full
    one; None when the client takes neither (406). Each type's weight is that of the
    most specific range naming it (the type itself, then ``application/*``, then
    ``*/*``: RFC 9110, 12.5.1), so ``application/json;q=0, */*`` refuses the full form;
    on a tie the full one wins unless the abbreviated one was named."""
    # (specificity, weight) of the best-matching range so far, per representation.
    best: dict[Representation, tuple[int, float]] = {"abbreviated": (-1, 0.0), "full": (-1, 0.0)}
    for part in (accept or "*/*").split(","):
        media, *params = [p.strip() for p in part.split(";")]
        weight = 1.0
        for param in params:
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    weight = float(value)
                except ValueError:
                    weight = 0.0
                weight = 0.0 if math.isnan(weight) else min(max(weight, 0.0), 1.0)
        media = media.lower()
        for representation, content_type in CONTENT_TYPES.items():
            if media == content_type:
                specificity = 2
            elif media == "application/*":
                specificity = 1
            elif media == "*/*":
                specificity = 0
            else:
                continue
            seen, seen_weight = best[representation]
            if specificity > seen or (specificity == seen and weight > seen_weight):
                best[representation] = (specificity, weight)
    (abbreviated_named, abbreviated), (_, full) = best["abbreviated"], best["full"]
    if abbreviated > full or (abbreviated == full > 0 and abbreviated_named == 2):
        return "abbreviated"
    return "full" if full > 0 else None


class NpmRepository:
    def __init__(self, settings: RepositorySettings[NpmOptions], ctx: ProxyContext) -> None:
        self.name = settings.name
        self.options = settings.options
        self.cache = ctx.cache
        self.compute = ctx.compute
        self.responses = ctx.responses
        # The engine answers 503 for a repository without an upstream, before we are asked.
        self.registry = settings.upstreams[0] if settings.upstreams else ""
        self._look_ups = asyncio.Semaphore(LOOK_UPS_AT_ONCE)

    async def handle(self, request: Request) -> Response:
        segments = request.segments
        if segments[0] == "-":
            return await self._special(request, segments[1:])
        if request.method in ("PUT", "DELETE"):
            raise MethodNotAllowed(
                "publishing and unpublishing are not offered by this proxy: it serves "
                "public packages read-only; publish to the registry itself",
                READ_ONLY,
            )
        if request.method not in READ_ONLY:
            raise MethodNotAllowed(f"{request.method} is not allowed here", READ_ONLY)
        if segments == ("",):
            raise NotFound(
                f"/{request.repository}/: name a package, e.g. /{request.repository}/left-pad"
            )
        package, rest = split_name(segments)
        if rest in ((), ("",)):
            return await self._packument(request, package)
        if len(rest) == 2 and rest[0] == "-":
            return await self._tarball(request, package, decode_segment(rest[1]))
        if len(rest) == 1:
            return await self._manifest(request, package, decode_segment(rest[0]))
        raise NotFound(f"/{request.repository}/{request.raw_path}: no such npm registry path")

    async def _special(self, request: Request, rest: tuple[str, ...]) -> Response:
        """``/-/...``: npm's endpoints that are not a package."""
        path = "/".join(rest)
        if path == "ping":
            return self.responses.inline(request, b"{}", FULL)
        if len(rest) >= 3 and rest[0] == "package" and "dist-tags" in rest:
            if request.method not in READ_ONLY:
                raise MethodNotAllowed("changing dist-tags is not offered by this proxy", READ_ONLY)
            package, left = split_name(rest[1:])
            if left != ("dist-tags",):
                raise NotFound(f"/{request.repository}/-/{path}: no such npm registry endpoint")
            tags = await self._look_up(package, dist_tags_of)
            return self.responses.inline(request, tags, FULL)
        for prefix, why in UNSUPPORTED.items():
            if path == prefix or path.startswith(prefix + "/"):
                raise NotSupported(why)
        raise NotFound(f"/{request.repository}/-/{path}: no such npm registry endpoint")

    # -- packuments --------------------------------------------------------------------

    def packument_spec(self, package: PackageName) -> FetchSpec:
        """A package's packument: one stored model, served full or abbreviated."""
        return FetchSpec(
            key=f"{PACKUMENT_PREFIX}{package.name}",
            kind=Kind.METADATA,
            origin=PackumentOrigin(
                self.name,
                self.registry + package.upstream_path,
                package,
                self.options.max_packument_size,
            ),
            ttl_s=self.options.metadata_ttl_s,
            negative_ttl_s=self.options.negative_ttl_s,
            stream=False,
            content=Content.ANY,  # parsed and rendered here: what is stored is ours
            model=PACKUMENT,
        )

    async def _packument(self, request: Request, package: PackageName) -> Response:
        representation = negotiate(request.headers.get("accept"))
        if representation is None:
            raise NotAcceptable(
                f"no acceptable representation; this registry serves {ABBREVIATED} and {FULL}"
            )
        spec = self.packument_spec(package)
        headers = {"content-type": CONTENT_TYPES[representation], "vary": "Accept"}
        return await self.cache.respond(spec, request, headers, representation=representation)

    async def _look_up(
        self,
        package: PackageName,
        question: Callable[..., Any],
        *args: Any,
        representation: Representation | None = "full",
    ) -> Any:
        """``question(body, *args)`` on our full packument of ``package`` as clients get
        it (without what the release policy withholds; ``representation`` None: as
        stored), in ``compute`` (a child process for all but tiny ones): only its small
        answer comes back, never a parsed document of maybe millions of objects for the
        server to rebuild. The body is read only once a parser is ours: clients waiting
        for one would each hold a copy of a packument of tens of MB meanwhile."""
        spec = self.packument_spec(package)
        try:
            async with asyncio.timeout(LOOK_UP_WAIT_S):
                await self._look_ups.acquire()
        except TimeoutError:
            raise RetryLater(
                f"the packument parsers stayed busy for {LOOK_UP_WAIT_S:.0f} s; retry"
            ) from None
        try:
            body = await self.cache.read(
                spec, self.options.max_packument_size, representation or ""
            )
            return await self.compute(question, body, *args)
        finally:
            self._look_ups.release()

    async def _manifest(self, request: Request, package: PackageName, wanted: str) -> Response:
        """``/{package}/{version or dist-tag}``: one version's document (``npm view``)."""
        manifest: bytes | None = await self._look_up(package, manifest_of, wanted)
        if manifest is None:
            raise NotFound(f"{package.name} has no version or dist-tag {wanted!r}")
        body = manifest.replace(BASE_URL_MARK.encode(), request.base_url.encode())
        return self.responses.inline(request, body, FULL)

    # -- tarballs ---------------------------------------------------------------------------

    def tarball_spec(self, package: PackageName, filename: str) -> FetchSpec:
        key = package.tarball_key(filename)
        return FetchSpec(
            key=key,
            kind=Kind.IMMUTABLE,
            origin=TarballOrigin(key, lambda: self.packument_spec(package)),
            negative_ttl_s=self.options.negative_ttl_s,
            content=Content.GZIP,  # checked only if the packument gave no integrity
        )

    async def _tarball(self, request: Request, package: PackageName, filename: str) -> Response:
        if not _TARBALL_RE.match(filename):
            raise BadRequest(f"{filename!r} is not a tarball name (name-version.tgz)")
        return await self.cache.respond(self.tarball_spec(package, filename), request)

    # -- mirrors -------------------------------------------------------------------------------

    async def mirror(self, package: PackageRef, versions: MirrorVersions) -> list[FetchSpec]:
        """The tarballs of the version(s) a purl names: the version given, else the one
        the ``latest`` dist-tag names, or every version."""
        full_name = f"{package.namespace}/{package.name}" if package.namespace else package.name
        name = PackageName.parse(full_name)
        chosen, missing = await self._look_up(
            name, versions_to_mirror, package.version, versions, representation=None
        )
        if missing or not chosen:
            raise NotFound(
                f"{package}: {name.name} lists no version {', '.join(missing) or 'latest'}"
            )
        return [self.tarball_spec(name, tarball_file(name, version)) for version in chosen]

    # -- the release policy's questions (contract.Releases) ----------------------------

    def published(self, version: PackageVersion) -> PublishedIn:
        """A version's publish time is its packument's ``time``."""
        return PublishedIn(self.packument_spec(PackageName(version.package)))

    def releases_index(self, package: str) -> FetchSpec:
        return self.packument_spec(PackageName(package))


def tarball_file(package: PackageName, version: str) -> str:
    return tarball_key(package.name, version).rpartition("/")[2]


def render_packument(
    body: bytes, page_url: str, repository: str, name: str
) -> tuple[bytes, LinkBatch]:
    """Our stored model of an upstream packument (``npm_packument.neutral``)."""
    return neutral(body, page_url, repository, name)


class PackumentOrigin:
    """Fetches one upstream packument (always the full document), records the tarball
    links it lists and makes our neutral model of it (``npm_packument``). Parsing runs
    in ``ctx.compute`` (a child process for all but tiny documents)."""

    def __init__(self, repository: str, url: str, package: PackageName, max_size: int) -> None:
        self.repository = repository
        self.url = url
        self.package = package
        self.max_size = max_size

    @asynccontextmanager
    async def open(self, ctx: OriginContext, stale: Validators | None) -> AsyncIterator[Fetched]:
        headers = {"Accept": FULL}
        if stale is not None:
            headers.update(stale.conditional_headers())
        async with ctx.upstream.open("GET", self.url, headers) as response:
            validators = Validators.of(response.headers)
            if response.status == 304:
                yield Fetched(Status.NOT_MODIFIED, validators=validators)
                return
            if response.status in NOT_FOUND_STATUSES:
                message = f"package {self.package.name!r} not found on the upstream registry"
                yield Fetched(Status.NOT_FOUND, message=message)
                return
            if response.status != 200:
                raise UpstreamUnavailable(
                    f"upstream registry answered {response.status} for {self.url}"
                )
            body = await response.read(self.max_size)
            try:
                model, links = await ctx.compute(
                    neutral, body, response.url, self.repository, self.package.name
                )
            except FetchError:
                raise  # the parse itself failed (took too long, its process died)
            except ValueError as exc:  # not JSON, or not a packument
                raise UpstreamUnavailable(
                    f"upstream document {self.url} is not a packument: {exc}"
                ) from exc
            except Exception as exc:
                # Input the renderer did not foresee: the document is refused, and the
                # traceback logged, since it may be a bug of ours.
                log.exception("cannot render upstream packument %s", self.url)
                raise UpstreamUnavailable(
                    f"upstream document {self.url} is not a packument we can read "
                    f"({type(exc).__name__}: {exc})"
                ) from exc
            await ctx.links.record(links)
            yield Fetched(
                Status.OK,
                body=_one_chunk(model),
                content_type=FULL,
                length=len(model),
                validators=validators,
            )


class TarballOrigin:
    """Fetches a listed tarball from the URL its packument gave. Unknown yet (the
    packument was never fetched here, as for ``npm ci`` from a lock file): the full
    packument is fetched through the cache first; a packument never needs a tarball, so
    the two fetches can never wait on each other."""

    def __init__(self, key: str, packument_spec: Callable[[], FetchSpec]) -> None:
        self.key = key
        self.packument_spec = packument_spec

    async def _link(self, ctx: OriginContext) -> Link:
        link = await ctx.links.get(self.key)
        if link is None:
            await ctx.get(self.packument_spec())
            link = await ctx.links.get(self.key)
        if link is None:
            name, _, filename = self.key.partition("/-/")
            raise NotFound(
                f"{filename} is not listed in the packument of {name!r}; the proxy only "
                "fetches tarballs its packuments list"
            )
        return link

    @asynccontextmanager
    async def open(self, ctx: OriginContext, stale: Validators | None) -> AsyncIterator[Fetched]:
        link = await self._link(ctx)
        async with ctx.upstream.open("GET", link.url) as response:
            if response.status in NOT_FOUND_STATUSES:
                yield Fetched(
                    Status.NOT_FOUND, message=f"{link.url} is listed but not found upstream"
                )
                return
            if response.status != 200:
                raise UpstreamUnavailable(f"upstream answered {response.status} for {link.url}")
            yield Fetched(
                Status.OK,
                body=response.body(),
                content_type="application/octet-stream",
                length=response.length,
                validators=Validators.of(response.headers),
                expected=link.digests,
            )


async def _one_chunk(body: bytes) -> AsyncIterator[bytes]:
    yield body


TARBALL_SEPARATOR = "/-/"
PACKUMENT_PREFIX = "packument/"


def package_of(key: str) -> PackageVersion | None:
    """``packument/<name>`` -> the package; ``<name>/-/<unscoped>-<version>.tgz`` ->
    the package and the version its file name states."""
    if key.startswith(PACKUMENT_PREFIX):
        # (stored before the packument was one model: "packument/<name>#<form>")
        name = key[len(PACKUMENT_PREFIX) :].partition("#")[0]
        return PackageVersion(name) if name else None
    name, separator, filename = key.partition(TARBALL_SEPARATOR)
    if not separator or not name:
        return None
    prefix = name.rpartition("/")[2] + "-"
    version = None
    if filename.startswith(prefix) and filename.endswith(".tgz"):
        version = filename[len(prefix) : -len(".tgz")] or None
    return PackageVersion(name, version)


def purl_of(package: str) -> PackageRef:
    return PackageName(package).purl()


def name_of(package: PackageRef) -> str:
    full_name = f"{package.namespace}/{package.name}" if package.namespace else package.name
    return PackageName.parse(full_name).name


FORMAT = FormatPlugin(
    name="npm",
    options=NpmOptions,
    proxying=Proxying(build=NpmRepository, max_upstreams=1),
    mirroring=Mirroring(purl_types=("npm",), keys=NpmRepository.mirror),
    packages=Packages(of=package_of),
    releases=Releases(
        purl_type="npm",
        purl=purl_of,
        package=name_of,
        index=NpmRepository.releases_index,
        published=NpmRepository.published,
    ),
    error_bodies="json",  # npm shows the message of a JSON error only
    default_repository={"name": "npm", "format": "npm"},
)
