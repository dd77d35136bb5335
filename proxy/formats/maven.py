"""Maven repositories: ``/{repo}/{group/as/dirs}/{artifactId}/{version}/{file}``.

Release artifacts are immutable; ``maven-metadata.xml`` and non-unique SNAPSHOT files
are metadata with their TTLs. Every stored file keeps its md5/sha1/sha256/sha512,
computed from the bytes we serve, and checksum requests are answered from those, so a
checksum always matches the body served (for mutable metadata too). Artifacts are
verified against the upstream's checksum files before they are stored.

Several upstreams are tried in order; the answer is 404 only if every one of them
confirmed the miss, and an outage of one is never reported as a miss.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

from proxy.contract import (
    NOT_FOUND_STATUSES,
    BadRequest,
    Choice,
    Content,
    ContentMismatch,
    Digests,
    Duration,
    Fetched,
    FetchError,
    FetchSpec,
    FormatPlugin,
    Kind,
    MethodNotAllowed,
    Mirroring,
    MirrorVersions,
    NotFound,
    OriginContext,
    PackageRef,
    Packages,
    PackageVersion,
    ProxyContext,
    Proxying,
    PublishedAt,
    Releases,
    RepositorySettings,
    Request,
    Response,
    RetryLater,
    Status,
    UpstreamBusy,
    UpstreamClient,
    UpstreamResponse,
    UpstreamTimeout,
    UpstreamUnavailable,
    Validators,
    option,
)
from proxy.formats.maven_metadata import (
    ARTIFACT_METADATA,
    SEGMENT_RE,
    parse_metadata,
    select_versions,
)

log = logging.getLogger("proxy.maven")

CHECKSUM_EXTENSIONS = {".sha1": "sha1", ".md5": "md5", ".sha256": "sha256", ".sha512": "sha512"}
CHECKSUM_HEX_LENGTHS = {"sha1": 40, "md5": 32, "sha256": 64, "sha512": 128}
CHECKSUM_STRENGTH = ("sha512", "sha256", "sha1", "md5")  # verify with the first present
CHECKSUM_BODY_LIMIT_BYTES = 4096
ALL_DIGESTS = ("md5", "sha1", "sha256", "sha512")  # kept for every file (checksum requests)
# The X-Checksum-* headers of an answer: Resolver checks them against the body.
CHECKSUM_HEADER_DIGESTS = ("sha1", "md5", "sha256")
PREFIXES_FILE = ".meta/prefixes.txt"
METADATA_BODY_LIMIT_BYTES = 16 * 1024 * 1024
# Maven's `type` (a purl qualifier) -> (file extension, classifier it implies).
TYPE_FILES = {
    "test-jar": ("jar", "tests"),
    "maven-plugin": ("jar", None),
    "ejb": ("jar", None),
    "ejb-client": ("jar", "client"),
    "java-source": ("jar", "sources"),
    "javadoc": ("jar", "javadoc"),
    "bundle": ("jar", None),
}
ROOT_FILES = ("archetype-catalog.xml",)

_SEGMENT_RE = SEGMENT_RE
METADATA_FILE = "maven-metadata.xml"
# The one representation of an index document here; the engine renders it from its model.
XML = "xml"
_TIMESTAMPED_RE = re.compile(r"\d{8}\.\d{6}-\d+")
_CONTENT_TYPES = {
    ".pom": "text/xml",
    ".xml": "text/xml",
    ".jar": "application/java-archive",
    ".asc": "text/plain",
    ".module": "application/json",
}


@dataclass(frozen=True)
class MavenPath:
    """A validated path: the file to fetch, and the checksum asked for, if any."""

    path: str  # the file that is fetched and stored (checksum suffix removed)
    checksum: str | None  # "sha1", "md5", ... when a checksum file was asked for
    kind: Kind
    snapshot: bool


def parse_path(path: str) -> MavenPath:
    """Validate ``path`` against the Maven 2 layout; raises ``BadRequest``."""
    checksum = None
    for extension, name in CHECKSUM_EXTENSIONS.items():
        if path.endswith(extension):
            checksum, path = name, path[: -len(extension)]
            break
    segments = path.split("/")
    if not path or any(not _SEGMENT_RE.match(s) for s in segments):
        raise BadRequest(
            f"{path!r} is not a Maven repository path: segments are letters, digits and ._+~-"
        )
    filename = segments[-1]
    if len(segments) == 1:
        if filename in ROOT_FILES:
            return MavenPath(path, checksum, Kind.METADATA, snapshot=False)
        raise BadRequest(f"{path!r} is not a Maven repository path (group/artifact/version/file)")
    if filename == "maven-metadata.xml":
        snapshot = segments[-2].endswith("-SNAPSHOT")
        return MavenPath(path, checksum, Kind.METADATA, snapshot=snapshot)
    if len(segments) < 4:
        raise BadRequest(
            f"{path!r} is not a Maven artifact path: expected "
            "group/as/dirs/artifactId/version/artifactId-version[-classifier].ext"
        )
    artifact_id, version = segments[-3], segments[-2]
    snapshot = version.endswith("-SNAPSHOT")
    version_prefix = version[: -len("SNAPSHOT")] if snapshot else version
    if not filename.startswith(f"{artifact_id}-{version_prefix}"):
        raise BadRequest(
            f"{filename!r} does not belong in {artifact_id}/{version}/: Maven file names "
            f"start with {artifact_id}-{version_prefix}"
        )
    if snapshot:
        rest = filename[len(artifact_id) + 1 + len(version_prefix) :]
        # Timestamped snapshot files are unique names: immutable once published.
        kind = Kind.IMMUTABLE if _TIMESTAMPED_RE.match(rest) else Kind.METADATA
        return MavenPath(path, checksum, kind, snapshot=True)
    return MavenPath(path, checksum, Kind.IMMUTABLE, snapshot=False)


@dataclass(frozen=True)
class MavenOptions:
    metadata_ttl_s: float = option(Duration(), 1800.0, key="metadata_ttl")
    snapshot_ttl_s: float = option(Duration(), 60.0, key="snapshot_ttl")
    negative_ttl_s: float = option(Duration(), 300.0, key="negative_ttl")
    # "warn": an artifact whose upstream publishes no checksum at all (404) is stored and
    # logged as unverified; "require": it is refused (502). A checksum file that could
    # not be read (5xx, timeout) stores nothing in either case: a later request verifies.
    checksum_policy: str = option(Choice("warn", "require"), "warn")


class MavenRepository:
    def __init__(self, settings: RepositorySettings[MavenOptions], ctx: ProxyContext) -> None:
        self.options = settings.options
        self.upstreams = settings.upstreams  # tried in order
        self.name = settings.name
        self.cache = ctx.cache
        self.responses = ctx.responses

    async def handle(self, request: Request) -> Response:
        if request.method not in ("GET", "HEAD"):
            raise MethodNotAllowed(
                f"{request.method} is not allowed: this is a read-only proxy of upstream "
                "Maven repositories (deploy to your repository manager instead)",
                allowed=("GET", "HEAD"),
            )
        if request.path == PREFIXES_FILE:
            if len(self.upstreams) > 1:
                # One upstream's prefix list would hide every other upstream's artifacts.
                raise NotFound(
                    f"{PREFIXES_FILE} is not served by a repository with several upstreams"
                )
            spec = self._spec(MavenPath(PREFIXES_FILE, None, Kind.METADATA, snapshot=False))
            return await self.cache.respond(spec, request)
        maven_path = parse_path(request.path)
        spec = self._spec(maven_path)
        representation = XML if spec.model is not None else ""
        if maven_path.checksum is not None:
            return await self._checksum(request, spec, maven_path.checksum, representation)
        # A HEAD too: the engine decides whether the upstream is asked (docs/architecture.md,
        # "The request path of a miss"), so a HEAD miss fetches the file like a GET.
        return await self.cache.respond(
            spec, request, digest_headers=checksum_headers, representation=representation
        )

    def _spec(self, maven_path: MavenPath) -> FetchSpec:
        ttl_s = None
        if maven_path.kind is Kind.METADATA:
            ttl_s = (
                self.options.snapshot_ttl_s if maven_path.snapshot else self.options.metadata_ttl_s
            )
        # An artifact's metadata (not a SNAPSHOT version's) is an index document: the
        # engine serves it without the versions the release policy withholds.
        metadata = maven_path.path.endswith(METADATA_FILE) and "/" in maven_path.path
        document = metadata and not maven_path.snapshot
        return FetchSpec(
            key=maven_path.path,
            kind=maven_path.kind,
            origin=MavenOrigin(
                self.upstreams,
                maven_path.path,
                verify=maven_path.kind is Kind.IMMUTABLE,
                require_checksum=self.options.checksum_policy == "require",
            ),
            ttl_s=ttl_s,
            negative_ttl_s=self.options.negative_ttl_s,
            digests=ALL_DIGESTS,
            # A jar is a zip, a pom and maven-metadata.xml are XML: never a login page,
            # even when the upstream publishes no checksum to verify them with.
            content=Content.of_filename(maven_path.path),
            stream=not document,  # served rendered, once stored
            model=ARTIFACT_METADATA if document else None,
        )

    async def mirror(self, package: PackageRef, versions: MirrorVersions) -> list[FetchSpec]:
        """The pom and the artifact file (jar, or what the ``type`` and ``classifier``
        qualifiers say) of the version(s) a purl names; without a version, the versions
        are read from the artifact's maven-metadata.xml."""
        if not package.namespace:
            raise BadRequest(f"{package}: a Maven purl names the groupId as its namespace")
        base = f"{package.namespace.replace('.', '/')}/{package.name}"
        if package.version is not None:
            chosen = [package.version]
        else:
            metadata_spec = self._spec(parse_path(f"{base}/{METADATA_FILE}"))
            body = await self.cache.read(metadata_spec, METADATA_BODY_LIMIT_BYTES)
            chosen = select_versions(parse_metadata(body, metadata_spec.key), versions)
            if not chosen:
                raise NotFound(f"{package}: {metadata_spec.key} lists no release")
        extension, classifier = artifact_file(package)
        specs = []
        for version in chosen:
            stem = f"{base}/{version}/{package.name}-{version}"
            specs.append(self._spec(parse_path(f"{stem}.pom")))
            if extension != "pom":
                suffix = f"-{classifier}" if classifier else ""
                specs.append(self._spec(parse_path(f"{stem}{suffix}.{extension}")))
        return specs

    # -- the release policy's questions (contract.Releases) ----------------------------

    def published(self, version: PackageVersion) -> PublishedAt:
        """A version was published when its pom was (the upstream's Last-Modified)."""
        group, _, artifact = version.package.rpartition(":")
        assert version.version is not None
        stem = f"{group.replace('.', '/')}/{artifact}/{version.version}/{artifact}"
        return PublishedAt(self._spec(parse_path(f"{stem}-{version.version}.pom")))

    def releases_index(self, package: str) -> FetchSpec:
        group, _, artifact = package.rpartition(":")
        return self._spec(parse_path(f"{group.replace('.', '/')}/{artifact}/{METADATA_FILE}"))

    async def _checksum(
        self, request: Request, spec: FetchSpec, algorithm: str, representation: str
    ) -> Response:
        """A checksum file, computed from the very bytes we serve for its base file (for
        metadata: as rendered, without what the release policy withholds).

        An existing entry answers even if its TTL has run out: refreshing metadata here
        would give the checksum of bytes the client has not received. Only a missing
        base file is fetched.
        """
        digests = await self.cache.served_digests(spec, representation)
        if algorithm not in digests:
            raise RetryLater(f"{spec.key}: checksum not available yet; retry")
        body = digests[algorithm].encode()
        return self.responses.inline(request, body, "text/plain; charset=utf-8")


class MavenOrigin:
    """Tries each upstream in order; verifies artifacts against upstream checksums."""

    def __init__(
        self,
        upstreams: tuple[str, ...],
        path: str,
        verify: bool,
        require_checksum: bool = False,
    ) -> None:
        self.upstreams = upstreams
        self.path = path
        self.verify = verify
        self.require_checksum = require_checksum

    @asynccontextmanager
    async def open(self, ctx: OriginContext, stale: Validators | None) -> AsyncIterator[Fetched]:
        # Validators are only meaningful to the upstream that issued them; with several
        # upstreams we do not know which one that was, so we ask unconditionally.
        headers = stale.conditional_headers() if stale and len(self.upstreams) == 1 else {}
        errors: list[FetchError] = []
        async with AsyncExitStack() as stack:
            found: tuple[str, UpstreamResponse] | None = None
            for base in self.upstreams:
                # Each answer is opened in a stack of its own, closed at once unless used.
                attempt = AsyncExitStack()
                try:
                    response = await attempt.enter_async_context(
                        ctx.upstream.open("GET", base + self.path, headers)
                    )
                except FetchError as exc:
                    errors.append(exc)
                    continue
                if response.status in NOT_FOUND_STATUSES:
                    await attempt.aclose()
                    continue
                if response.status not in (200, 304):
                    errors.append(
                        UpstreamUnavailable(f"{base} answered {response.status} for {self.path}")
                    )
                    await attempt.aclose()
                    continue
                stack.push_async_callback(attempt.aclose)
                found = (base, response)
                break
            if found is None:
                if errors:
                    raise _outage(self.path, errors)
                yield Fetched(Status.NOT_FOUND, message=f"{self.path} not found in any upstream")
                return
            base, response = found
            validators = Validators.of(response.headers)
            if response.status == 304:
                yield Fetched(Status.NOT_MODIFIED, validators=validators)
                return
            checksums: asyncio.Task[Digests] | None = None
            if self.verify:
                # Fetched beside the body; awaited when the body is complete.
                checksums = asyncio.ensure_future(
                    self._upstream_checksums(ctx.upstream, base, response)
                )
                checksums.add_done_callback(_retrieve_exception)
                stack.callback(checksums.cancel)

            async def expected_later() -> Digests:
                return await checksums if checksums is not None else {}

            yield Fetched(
                Status.OK,
                body=response.body(),
                content_type=_content_type(self.path, response),
                length=response.length,
                expected_later=expected_later,
                validators=validators,
            )

    async def _upstream_checksums(
        self, upstream: UpstreamClient, base: str, artifact: UpstreamResponse
    ) -> Digests:
        """The strongest checksum the upstream publishes for the file, as Resolver uses it.

        The checksum files ride on the slot the ``artifact``'s transfer holds (``beside``):
        they are read while its body arrives, and must not wait for a slot it may hold.

        The strongest usable one wins, so a garbled .md5 beside a good .sha1 (old
        repositories carry some) does no harm. If none is usable: when one of them could
        not be read at all (5xx, timeout), or answered 200 with something that is not a
        checksum (a login or error page: the artifact is then most likely one too),
        nothing is stored, so a later request can still verify the file; when all are
        absent (404), the file is stored unverified (logged, and only if it passes its
        content check), unless the policy requires a checksum.
        """
        failures: list[str] = []
        garbled: list[str] = []

        async def one(extension: str, algorithm: str) -> str | None:
            url = base + self.path + extension
            try:
                async with upstream.open("GET", url, beside=artifact) as response:
                    if response.status in NOT_FOUND_STATUSES:
                        return None
                    if response.status != 200:
                        failures.append(f"{url} answered {response.status}")
                        return None
                    body = await response.read(CHECKSUM_BODY_LIMIT_BYTES)
            except FetchError as exc:
                failures.append(f"{url}: {exc}")
                return None
            value = parse_checksum(body, algorithm)
            if value is None:
                garbled.append(url)
            return value

        algorithms = list(CHECKSUM_EXTENSIONS.items())
        found = await asyncio.gather(*(one(ext, alg) for ext, alg in algorithms))
        by_algorithm = dict(zip((alg for _, alg in algorithms), found, strict=True))
        for algorithm in CHECKSUM_STRENGTH:
            value = by_algorithm.get(algorithm)
            if value is not None:
                if garbled:
                    log.warning("ignored checksum files that are not checksums: %s", garbled)
                return {algorithm: value}
        if garbled:
            raise ContentMismatch(
                f"{self.path}: {', '.join(garbled)} answered with something that is not a "
                "checksum (an HTML page?), and no other checksum is usable; nothing was stored"
            )
        if failures:
            raise UpstreamUnavailable(
                f"{self.path}: its checksum files could not be read ({'; '.join(failures)}); "
                "nothing was stored, retry later"
            )
        if self.require_checksum:
            raise UpstreamUnavailable(
                f"{self.path}: {base} publishes no checksum for it, and this repository's "
                "checksum_policy is 'require'"
            )
        log.warning("no upstream checksum for %s in %s; stored unverified", self.path, base)
        return {}


def checksum_headers(digests: Digests) -> dict[str, str]:
    """``X-Checksum-Sha1`` and friends, from the digests of the very bytes served."""
    return {
        f"x-checksum-{name}": digests[name] for name in CHECKSUM_HEADER_DIGESTS if name in digests
    }


def _retrieve_exception(task: asyncio.Task[Digests]) -> None:
    # The body may fail first, leaving nobody to await this task's own error.
    if not task.cancelled():
        task.exception()


def artifact_file(package: PackageRef) -> tuple[str, str | None]:
    """(extension, classifier) from the purl's ``type`` and ``classifier`` qualifiers."""
    maven_type = package.qualifier("type") or "jar"
    extension, implied = TYPE_FILES.get(maven_type, (maven_type, None))
    if not _SEGMENT_RE.match(extension):
        raise BadRequest(f"{package}: {maven_type!r} is not a Maven type")
    classifier = package.qualifier("classifier") or implied
    if classifier is not None and not _SEGMENT_RE.match(classifier):
        raise BadRequest(f"{package}: {classifier!r} is not a Maven classifier")
    return extension, classifier


def parse_checksum(body: bytes, algorithm: str) -> str | None:
    """The hex digest in a checksum file (``hex``, ``hex  name`` or ``name: hex`` forms)."""
    length = CHECKSUM_HEX_LENGTHS[algorithm]
    text = body.decode("ascii", errors="replace")
    for token in re.split(r"[\s:=]+", text):
        if len(token) == length and re.fullmatch(r"[0-9a-fA-F]+", token):
            return token.lower()
    return None


def _content_type(path: str, response: UpstreamResponse) -> str:
    upstream_type: str = response.headers.get("content-type", "").split(";")[0].strip()
    if upstream_type and upstream_type not in ("application/octet-stream", "binary/octet-stream"):
        return upstream_type
    for extension, content_type in _CONTENT_TYPES.items():
        if path.endswith(extension):
            return content_type
    return "application/octet-stream"


def _outage(path: str, errors: list[FetchError]) -> FetchError:
    """One error for every upstream having failed: a timeout if all timed out; "come
    back later" (with the longest wait any of them stated) if any asked for it or our
    own limit was reached; else the upstreams are unavailable."""
    detail = "; ".join(str(e) for e in errors)
    if all(isinstance(e, UpstreamTimeout) for e in errors):
        return UpstreamTimeout(f"{path}: upstreams timed out ({detail})")
    later = [e for e in errors if isinstance(e, UpstreamBusy | RetryLater)]
    if later:
        waits = [e.retry_after_s for e in later if e.retry_after_s]
        wait_s = max(waits) if waits else None
        message = f"{path}: no upstream could answer now ({detail})"
        if all(isinstance(e, RetryLater) for e in later) and len(later) == len(errors):
            return RetryLater(message, retry_after_s=wait_s)
        return UpstreamBusy(message, retry_after_s=wait_s)
    return UpstreamUnavailable(f"{path}: no upstream could answer ({detail})")


def package_of(key: str) -> PackageVersion | None:
    """``group/dirs/artifact/version/file`` -> ``group.dirs:artifact`` and the version;
    an artifact's ``maven-metadata.xml`` -> the artifact (no version), a SNAPSHOT
    version's -> the artifact and that version."""
    segments = key.split("/")
    if segments[-1] == METADATA_FILE:
        if len(segments) >= 4 and segments[-2].endswith("-SNAPSHOT"):
            return PackageVersion(_coordinates(segments[:-3], segments[-3]), segments[-2])
        if len(segments) >= 3:
            return PackageVersion(_coordinates(segments[:-2], segments[-2]))
        return None
    if len(segments) < 4:
        return None
    return PackageVersion(_coordinates(segments[:-3], segments[-3]), segments[-2])


def _coordinates(group: list[str], artifact: str) -> str:
    return f"{'.'.join(group)}:{artifact}"


def purl_of(package: str) -> PackageRef:
    group, _, artifact = package.rpartition(":")
    return PackageRef("maven", artifact, namespace=group, purl=f"pkg:maven/{group}/{artifact}")


def coordinates_of(package: PackageRef) -> str:
    if not package.namespace:
        raise BadRequest(f"{package}: a Maven purl names the groupId as its namespace")
    for part in (*package.namespace.split("."), package.name):
        if not _SEGMENT_RE.match(part):
            raise BadRequest(f"{package}: {part!r} is not a Maven groupId or artifactId part")
    return f"{package.namespace}:{package.name}"


FORMAT = FormatPlugin(
    name="maven",
    options=MavenOptions,
    proxying=Proxying(build=MavenRepository),
    mirroring=Mirroring(purl_types=("maven",), keys=MavenRepository.mirror),
    default_repository={"name": "maven", "format": "maven"},
    packages=Packages(of=package_of),
    releases=Releases(
        purl_type="maven",
        purl=purl_of,
        package=coordinates_of,
        index=MavenRepository.releases_index,
        published=MavenRepository.published,
    ),
)
