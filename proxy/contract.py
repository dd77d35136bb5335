"""The format contract: everything a format module may use, and what it must provide.

A format (``proxy/formats/<name>.py``) imports this module and nothing else of the
proxy. It provides a ``FORMAT = FormatPlugin(...)`` that declares its settings (a frozen
dataclass of ``option(...)`` fields) and what it provides: proxying upstreams
(``Proxying``), storing uploads (``Hosting``), listing a package's keys for mirrors
(``Mirroring``). It builds one ``Adapter`` per repository from the context of its kind
(``ProxyContext``, ``HostedContext``). A proxying adapter turns HTTP requests into calls
on its ``ProxyCache``; to fetch a key it describes it with a ``FetchSpec`` whose
``Origin`` knows how to ask the upstream. The engine decides whether to fetch
(freshness, single flight, leases), and stores, verifies and serves the bytes; an
origin only talks to the upstream, through the small ``OriginContext`` it is handed.
See docs/architecture.md.

The engine never imports a format: ``proxy/formats/__init__.py`` maps each
``format = "..."`` name to its module, one line per format.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, TypeVar

from proxy.config.options import (
    Choice,
    Duration,
    Flag,
    Globs,
    Hosts,
    Integer,
    OptionalSize,
    OptionType,
    Reporter,
    Size,
    Text,
    Urls,
    option,
    options_of,
    toml_key,
)
from proxy.config.settings import RepositorySettings
from proxy.exceptions import (
    BadRequest,
    ClientError,
    ContentMismatch,
    DigestMismatch,
    FetchError,
    Forbidden,
    InvalidPlugin,
    MethodNotAllowed,
    NotAcceptable,
    NotConfigured,
    NotFound,
    NotSupported,
    ParseFailed,
    PayloadTooLarge,
    RequestTimeout,
    RetryLater,
    TooManyRequests,
    Unauthorized,
    UpstreamBusy,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from proxy.http.paths import base_url, decode_path, decode_segment
from proxy.types import (
    KNOWN_DIGESTS,
    Content,
    Digests,
    Kind,
    Link,
    LinkBatch,
    PackageRef,
    Receive,
    Scope,
    Send,
    Validators,
)

# Upstream answers that mean "no such file" (cached as such); anything else that is not
# a success is an outage, never a 404.
NOT_FOUND_STATUSES = (404, 410)
# In a stored body, where the repository's absolute URL goes (``Request.base_url``): the
# engine puts the URL of the client's request in its place each time it serves a body
# whose spec says ``base_url_marks``, so what is stored never depends on a client's Host
# header. A NUL never occurs in JSON, XML or HTML a format renders (they escape control
# characters), so nothing else in such a body is mistaken for it.
BASE_URL_MARK = "\x00"
# Keys the engine gives every repository of a proxying format (``Proxying``); a format's
# own options must not use them.
ENGINE_REPOSITORY_KEYS = ("upstream", "allow_hosts", "retention", "max_file_size")
# Keys the engine gives every repository of a format whose releases the policy judges
# (``Releases``).
RELEASE_REPOSITORY_KEYS = ("cooldown",)

__all__ = [
    "BASE_URL_MARK",
    "ENGINE_REPOSITORY_KEYS",
    "KNOWN_DIGESTS",
    "NOT_FOUND_STATUSES",
    "RELEASE_REPOSITORY_KEYS",
    "Adapter",
    "AdapterT",
    "BadRequest",
    "Choice",
    "ClientError",
    "Content",
    "ContentMismatch",
    "DigestMismatch",
    "Digests",
    "Duration",
    "ErrorBodies",
    "FetchError",
    "FetchSpec",
    "Fetched",
    "Flag",
    "Forbidden",
    "FormatPlugin",
    "Globs",
    "HostedCache",
    "HostedContext",
    "Hosting",
    "Hosts",
    "IndexModel",
    "Integer",
    "InvalidPlugin",
    "Kind",
    "Link",
    "LinkBatch",
    "LinkStore",
    "ListedVersion",
    "Listing",
    "MethodNotAllowed",
    "MirrorVersions",
    "Mirroring",
    "NotAcceptable",
    "NotConfigured",
    "NotFound",
    "NotSupported",
    "OptionType",
    "OptionalSize",
    "Origin",
    "OriginContext",
    "PackageRef",
    "PackageVersion",
    "Packages",
    "ParseFailed",
    "PayloadTooLarge",
    "ProxyCache",
    "ProxyContext",
    "Proxying",
    "PublishedAt",
    "PublishedIn",
    "Releases",
    "Reporter",
    "RepositorySettings",
    "Request",
    "RequestTimeout",
    "Response",
    "Responses",
    "RetryLater",
    "Size",
    "Status",
    "Text",
    "Throttle",
    "TooManyRequests",
    "Unauthorized",
    "UpstreamBusy",
    "UpstreamClient",
    "UpstreamError",
    "UpstreamResponse",
    "UpstreamTimeout",
    "UpstreamUnavailable",
    "Urls",
    "Validators",
    "View",
    "WarmResult",
    "Withheld",
    "decode_path",
    "decode_segment",
    "option",
    "options_of",
    "toml_key",
]

OptionsT = TypeVar("OptionsT")

BODY_IDLE_TIMEOUT_S = 30.0

Response = Callable[[Scope, Receive, Send], Awaitable[None]]
"""What an adapter answers with: an ASGI callable (build one with the helpers below)."""

MirrorVersions = Literal["latest", "all"]
"""Which versions a mirror warms for a package named without a version."""


# -- requests ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Request:
    """What an adapter knows of a request.

    ``raw_path`` is the path after ``/{repository}/`` exactly as the client sent it
    (percent-encoded, not validated: ``@scope%2fname`` stays so); ``path`` is it decoded
    by the rules every format shares (``decode_path``). ``base_url`` is the absolute URL
    of the repository as clients reach it, for formats whose answers must name the proxy
    absolutely.
    """

    method: str
    repository: str
    raw_path: str  # after "/{repository}/", e.g. "simple/requests/" or "@s%2fn"
    headers: Mapping[str, str]  # lower-case names; a name sent twice: one "a, b" value
    base_path: str  # "/{repository}/", under the app's root path
    receive: Receive = field(repr=False)
    query: str = ""  # the query string as sent, without "?"
    scheme: str = "http"  # how the client reached this process
    public_url: str | None = None  # server.public_url, when a deployment sets it
    client: str = ""  # the peer's address (a load balancer's, behind one)
    # Set once the answer is built with something the client chose (the Host it sent,
    # through base_url): nothing may keep such an answer for other clients (the engine
    # marks it Vary: Host and keeps it out of the hit lane).
    named_by_client: list[bool] = field(default_factory=list, repr=False, compare=False)

    @property
    def segments(self) -> tuple[str, ...]:
        """The raw path's segments, still percent-encoded."""
        return tuple(self.raw_path.split("/"))

    @property
    def path(self) -> str:
        """The path decoded; ``BadRequest`` for a traversal, an escaped slash, an empty
        or control-character segment (``decode_path``)."""
        return decode_path(self.raw_path)

    @property
    def base_url(self) -> str:
        """``https://host/{repository}/``: from ``server.public_url`` when it is set (a
        deployment behind a load balancer), else from the request's own Host header
        (``BadRequest`` if it has none we would put in a URL). It depends on the client:
        never store a body built with it, build it per request."""
        if self.public_url is not None:
            return f"{self.public_url}/{self.repository}/"
        if not self.named_by_client:
            self.named_by_client.append(True)
        root_path = self.base_path[: -len(self.repository) - 2]
        return base_url(self.scheme, self.headers.get("host"), root_path, self.repository)

    async def body(self) -> AsyncIterator[bytes]:
        """The request body as it arrives; ``BadRequest`` if the client leaves first, or
        408 if it sends nothing for ``BODY_IDLE_TIMEOUT_S`` (a half-sent body)."""
        while True:
            try:
                async with asyncio.timeout(BODY_IDLE_TIMEOUT_S):
                    message = await self.receive()
            except TimeoutError:
                raise RequestTimeout(
                    f"the request body stalled for {BODY_IDLE_TIMEOUT_S:.0f} s"
                ) from None
            if message["type"] == "http.disconnect":
                raise BadRequest("the client went away before the body was complete")
            chunk = message.get("body", b"")
            if chunk:
                yield chunk
            if not message.get("more_body", False):
                return


class Responses(Protocol):
    """The answers a format builds itself (the engine implements them; see
    ``FormatContext.responses``). Errors are not among them: a format raises
    (``NotFound``, ``BadRequest``...) and the engine decides the answer."""

    def redirect(self, location: str, status: int = 301) -> Response:
        """A redirect that holds whatever the upstream does (a name normalized, a slash
        added), so shared caches may keep it (docs/architecture.md, "Caching by others")."""
        ...

    def empty(self, status: int, headers: Mapping[str, str] | None = None) -> Response:
        """A body-less answer (201 after an upload, 200 to a HEAD probe), kept by no cache."""
        ...

    def inline(self, request: Request, body: bytes, content_type: str) -> Response:
        """A small computed body (e.g. a checksum file), with ETag/304 and HEAD."""
        ...


# -- upstreams ----------------------------------------------------------------------------


class UpstreamResponse(Protocol):
    """An upstream answer whose body has not been read yet."""

    @property
    def status(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]:
        """Case-insensitive; values that are not valid in HTTP are already dropped."""
        ...

    @property
    def url(self) -> str:
        """The final URL, after redirects."""
        ...

    @property
    def length(self) -> int | None:
        """The body size, when the upstream stated it for the bytes we will read."""
        ...

    def body(self) -> AsyncIterator[bytes]:
        """The body; raises ``UpstreamError`` if it breaks off, stalls or lies about its size."""
        ...

    async def read(self, limit: int) -> bytes:
        """The whole body; ``UpstreamError`` past ``limit`` bytes."""
        ...


class UpstreamClient(Protocol):
    def open(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str] | None = None,
        *,
        beside: UpstreamResponse | None = None,
    ) -> AbstractAsyncContextManager[UpstreamResponse]:
        """Send ``method url`` (retried on connection errors and 429/5xx).

        Raises ``UpstreamError`` for outages; any other status is returned as is.
        ``beside``: this small request belongs to the transfer of that open response
        (a checksum file beside its artifact) and rides on its upstream slot instead of
        waiting for one of its own, so a transfer never waits for itself.
        """
        ...


class LinkStore(Protocol):
    """The upstream URLs a repository's index pages listed (one repository's view)."""

    async def record(self, links: Iterable[Link] | LinkBatch) -> None:
        """Remember ``links`` (a ``LinkBatch`` when they were encoded where the page was
        parsed, e.g. in ``OriginContext.compute``)."""
        ...

    async def get(self, key: str) -> Link | None: ...


# -- fetching -------------------------------------------------------------------------------


class Status(enum.Enum):
    OK = "ok"
    NOT_MODIFIED = "not_modified"
    NOT_FOUND = "not_found"


@dataclass
class Fetched:
    """What an origin got from upstream: a body to store, a 304, or a confirmed miss."""

    status: Status
    body: AsyncIterator[bytes] | None = None
    content_type: str | None = None
    length: int | None = None  # the body size, when known before reading it
    validators: Validators = field(default_factory=Validators)  # for later conditional GETs
    expected: Digests = field(default_factory=dict)  # digests the body must match
    # Digests learnt while the body downloads (e.g. Maven's .sha1 files), awaited at the
    # end; raising UpstreamError there fails the fetch and stores nothing.
    expected_later: Callable[[], Awaitable[Digests]] | None = None
    message: str = ""  # for NOT_FOUND: what was missing, for the client


@dataclass(frozen=True)
class WarmResult:
    """What getting a key through the cache did, without serving it."""

    outcome: Literal["cached", "fetched", "missing"]
    size: int = 0


@dataclass(frozen=True)
class OriginContext:
    """All an origin may use while it fetches one key.

    ``get`` fetches *another* key through the cache (with its own lease). Use it only for
    keys that never need the key being fetched (a file may need its index page; an index
    page never needs a file), so two fetches can never wait on each other.

    ``compute(fn, *args)`` runs CPU-heavy work on what the upstream sent (parsing and
    rendering a page) off the event loop, in a child process for all but tiny inputs,
    within ``upstream.parse_timeout``; ``fn`` and its arguments must be picklable. It
    raises ``UpstreamError`` when the work took too long (502) or its process died (503).
    """

    upstream: UpstreamClient
    links: LinkStore
    get: Callable[[FetchSpec], Awaitable[WarmResult]]
    compute: Callable[..., Awaitable[Any]]


class Origin(Protocol):
    """How to get one key from upstream. It talks to the upstream only, never to storage."""

    def open(
        self, ctx: OriginContext, stale: Validators | None
    ) -> AbstractAsyncContextManager[Fetched]:
        """Ask the upstream (conditionally, if ``stale`` has validators).

        Raises ``UpstreamError`` for outages; a confirmed miss is ``Status.NOT_FOUND``.
        """
        ...


# -- index documents ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ListedVersion:
    """A version an index document lists: when it was published, if the document says
    (npm's ``time``; for PyPI the earliest ``upload-time`` of its files), and the keys of
    its files the document gives no time for (the engine records when it first saw them)."""

    version: str
    published_at_ms: int | None = None
    unstated: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Listing:
    """What an index document lists, as its format reads it: the versions, where their
    times come from (for messages: ``upload-time``, ``time``), and a time no version of
    the document was published after, if it states one (Maven's ``lastUpdated``)."""

    versions: tuple[ListedVersion, ...]
    time_source: str = "upload-time"
    updated_at_ms: int | None = None


@dataclass(frozen=True)
class Withheld:
    """Why one version is left out of a rendering: ``hold`` (until ``until_ms``) or
    ``deny``, and the policy's reason in words."""

    action: Literal["hold", "deny"]
    reason: str
    until_ms: int | None = None


@dataclass(frozen=True)
class View:
    """What the engine decided for one rendering of an index document: the versions
    to leave out, whether the package is quarantined (every version denied; the reason),
    and the publish times the engine knows of files the document states none for
    (key -> Unix ms: when this fleet first saw them listed). The format renders it; it
    never decides what is withheld (docs/architecture.md, "Release policy")."""

    withheld: Mapping[str, Withheld] = field(default_factory=dict)
    quarantined: str | None = None
    published: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class IndexModel:
    """An index document (a PyPI project page, maven-metadata.xml, a packument) stored
    once as the format's own model and rendered per request (docs/architecture.md,
    "Index documents"): ``listing(body)`` says what it lists, ``render(body, view,
    representation)`` renders it as ``view`` says. Both are pure, picklable functions run
    in ``compute`` (a child process for all but tiny documents); a rendering may hold
    ``BASE_URL_MARK`` where an absolute URL of the proxy goes."""

    listing: Callable[[bytes], Listing]
    render: Callable[[bytes, View, str], bytes]


@dataclass(frozen=True)
class FetchSpec:
    """One key of a repository and how to get it."""

    key: str
    kind: Kind  # IMMUTABLE or METADATA
    origin: Origin
    ttl_s: float | None = None  # METADATA: seconds fresh; 0 = never stored
    negative_ttl_s: float = 0.0
    digests: tuple[str, ...] = ()  # extra digests to compute and keep (e.g. sha1, md5)
    stream: bool = True  # may clients read the body while it downloads?
    # The body holds BASE_URL_MARK where the repository's absolute URL goes; it is filled
    # in per request (no byte ranges then: offsets differ by client). Such a body is
    # never streamed while it downloads: its marks are not filled in yet.
    base_url_marks: bool = False
    # What the body must look like when no digest the index or the upstream gave
    # verified it (a jar is a zip archive, never a login page): checked before storing.
    content: Content = Content.NOT_HTML
    # An index document stored as a model: served rendered (``ProxyCache.respond`` with a
    # representation), filtered by the release policy, never as stored.
    model: IndexModel | None = None

    def __post_init__(self) -> None:
        if self.base_url_marks and self.stream:
            raise ValueError(f"{self.key}: a body with base-URL marks cannot stream (stream=False)")

    @property
    def storable(self) -> bool:
        return self.kind is not Kind.METADATA or bool(self.ttl_s)

    def expires_at_ms(self, fetched_at_ms: int) -> int | None:
        if self.kind is Kind.METADATA and self.ttl_s is not None:
            return fetched_at_ms + int(self.ttl_s * 1000)
        return None


class ProxyCache(Protocol):
    """The engine, as the adapter of a proxying repository sees it."""

    async def respond(
        self,
        spec: FetchSpec,
        request: Request,
        headers: Mapping[str, str] | None = None,
        digest_headers: Callable[[Digests], Mapping[str, str]] | None = None,
        representation: str = "",
    ) -> Response:
        """Serve ``spec.key``: from the cache if fresh, else through the miss path (a
        HEAD too: it makes the same upstream requests a GET would). A key of a release
        the policy withholds is refused (403) whatever its path; an index document
        (``spec.model``) is served rendered in ``representation``, stale or not.

        ``headers`` are added to the answer (they win over the stored Content-Type).
        ``digest_headers`` turns the digests of the very bytes served (those of
        ``spec.digests`` and sha256) into more headers, when the answer is a stored
        copy; an answer still downloading has no digests yet and gets none, nor does a
        body with base-URL marks (the bytes sent differ from those stored).
        """
        ...

    async def served_digests(self, spec: FetchSpec, representation: str = "") -> Digests:
        """The digests (``spec.digests`` and sha256) of the bytes this repository serves
        for ``spec.key`` (of its rendering in ``representation``, for an index document);
        refused (403) like ``respond`` for a release the policy withholds.

        A stored copy answers even if expired (its checksum must match what clients
        have); only a missing key is fetched. ``NotFound`` for a confirmed miss.
        """
        ...

    async def warm(self, spec: FetchSpec) -> WarmResult:
        """Make sure ``spec.key`` is cached and fresh, sharing any fetch in progress."""
        ...

    async def read(self, spec: FetchSpec, limit: int, representation: str = "") -> bytes:
        """The body of ``spec.key`` (warmed first, like ``warm``), for a small document a
        format must look into (an index page, maven-metadata.xml): as stored, or, given a
        ``representation``, an index document's rendering as clients get it (what the
        policy withholds left out, base-URL marks still in place).

        ``NotFound`` for a confirmed miss; ``UpstreamError`` past ``limit`` bytes.
        """
        ...


class Throttle(Protocol):
    """Failures counted per key (``runtime.throttle.FailureThrottle`` in the engine)."""

    def retry_after(self, *keys: str) -> float | None:
        """Seconds until every one of ``keys`` may try again; None if none is locked."""
        ...

    def failed(self, *keys: str) -> None: ...

    def succeeded(self, *keys: str) -> None: ...


class HostedCache(Protocol):
    """The engine, as the adapter of a hosted repository (one that stores what clients
    upload, like a build cache) sees it. The engine counts uploads, stored and refused."""

    async def store(
        self, key: str, body: AsyncIterator[bytes], max_size: int, content_type: str | None
    ) -> None:
        """Store a client's upload; durable on return. ``PayloadTooLarge`` past ``max_size``."""
        ...

    async def serve(self, key: str, request: Request, content_type: str) -> Response:
        """Serve a stored upload (a GET counts as a use, a HEAD does not); ``NotFound``."""
        ...


# -- the plugin -------------------------------------------------------------------------------


class Adapter(Protocol):
    async def handle(self, request: Request) -> Response: ...


AdapterT = TypeVar("AdapterT", bound=Adapter)


@dataclass(frozen=True)
class ProxyContext:
    """What the engine hands a proxying format when it builds one repository's adapter.

    ``compute(fn, *args)`` runs CPU-heavy work off the event loop (as in OriginContext);
    ``responses`` builds the answers that are not errors (errors are raised). There is
    no upstream client here: the format's Origin, opened by the engine on a miss, is its
    only way upstream, so single flight, leases and negative entries cannot be skipped.
    """

    cache: ProxyCache
    compute: Callable[..., Awaitable[Any]]
    responses: Responses


@dataclass(frozen=True)
class HostedContext:
    """What the engine hands a hosting format when it builds one repository's adapter.

    ``throttle`` remembers failed credential checks (wrong passwords) per key (a user, a
    client address) and locks a key out for a while after a few."""

    store: HostedCache
    responses: Responses
    throttle: Throttle


@dataclass(frozen=True)
class Proxying(Generic[OptionsT, AdapterT]):
    """The format fetches from upstreams and caches what it gets.

    Its repositories get the engine's keys ``upstream`` (one URL, or a list tried in
    order, up to ``max_upstreams``; also from ``PROXY_UPSTREAM_<NAME>``), ``allow_hosts``
    (the SSRF policy's exceptions) and ``retention``; ``RepositorySettings.upstreams``
    holds the URLs. Until an upstream is set the engine answers 503 naming the setting,
    before the adapter is asked.
    """

    build: Callable[[RepositorySettings[OptionsT], ProxyContext], AdapterT]
    max_upstreams: int | None = None  # None: any number


@dataclass(frozen=True)
class Hosting(Generic[OptionsT, AdapterT]):
    """The format stores what clients upload (nothing is fetched from an upstream)."""

    build: Callable[[RepositorySettings[OptionsT], HostedContext], AdapterT]
    # A total the engine keeps each repository under (least recently used go first).
    max_size: Callable[[OptionsT], int | None] | None = None


@dataclass(frozen=True)
class Mirroring(Generic[AdapterT]):
    """The format can list the keys that make up a package a purl names
    (docs/architecture.md, "Mirrors"); only a proxying format can mirror."""

    purl_types: tuple[str, ...]  # ``pkg:<type>/...`` this format takes
    # ``keys(adapter, package, versions)``: for a versioned package, that version's
    # files; otherwise the latest or every version's. The engine warms each one. It may
    # read small documents through the cache (``ProxyCache.read``) to find them;
    # ``NotFound`` if the package or version does not exist upstream, ``BadRequest`` if
    # the purl cannot name anything in this format.
    keys: Callable[[AdapterT, PackageRef, MirrorVersions], Awaitable[list[FetchSpec]]]


@dataclass(frozen=True)
class PackageVersion:
    """Which package (and version) a key belongs to, as the format names them: e.g.
    ``requests`` / ``2.32.3`` for ``files/requests/requests-2.32.3.tar.gz``, or
    ``org.slf4j:slf4j-api`` / None for its ``maven-metadata.xml``."""

    package: str
    version: str | None = None


def as_given(name: str) -> str:
    return name


@dataclass(frozen=True)
class Packages:
    """The format knows which package each stored key belongs to (docs/architecture.md,
    "Operating: console, API and logs"): its repositories are browsed, searched and
    purged by package. ``of(key)`` is a pure function of the key, called when an entry
    is stored (None: the key belongs to no package, e.g. a root index page).
    ``name(text)`` is the stored spelling of a name (or a name's prefix) a person typed,
    for formats whose names are equal in several spellings (PyPI's, PEP 503); as given
    by default. The release policy judges the keys it names a version of (``Releases``)."""

    of: Callable[[str], PackageVersion | None]
    name: Callable[[str], str] = as_given


ErrorBodies = Literal["text", "json"]


@dataclass(frozen=True)
class PublishedIn:
    """A version's publish time is what this index document's listing says of it."""

    spec: FetchSpec


@dataclass(frozen=True)
class PublishedAt:
    """A version's publish time is the upstream's ``Last-Modified`` of this key (a
    Maven pom); the engine asks for it through the cache, once per version."""

    spec: FetchSpec


@dataclass(frozen=True)
class Releases(Generic[AdapterT]):
    """The release policy can judge this format's releases (docs/architecture.md,
    "Release policy"); the format needs ``packages`` too, and its repositories get the
    engine's key ``cooldown``. The format describes, the engine decides:

    - ``purl(package)``: the purl (type ``purl_type``, no version) of a package as the
      format names it (``PackageVersion.package``); ``package(ref)`` the other way
      round (``BadRequest`` if the purl names nothing this format serves);
    - ``index(adapter, package)``: the index document listing the package's versions
      (a spec with a ``model``);
    - ``published(adapter, version)``: where the engine learns when a version was
      published.
    """

    purl_type: str
    purl: Callable[[str], PackageRef]
    package: Callable[[PackageRef], str]
    index: Callable[[AdapterT, str], FetchSpec]
    published: Callable[[AdapterT, PackageVersion], PublishedIn | PublishedAt]


@dataclass(frozen=True)
class FormatPlugin(Generic[OptionsT, AdapterT]):
    """A format, as the registry knows it: its settings and what it provides.

    It declares exactly one way of serving a repository, ``proxying`` or ``hosting``,
    and may declare ``mirroring``; the registry checks the declaration when the format is
    first loaded and names the format and what is missing (``formats.verify``).
    """

    name: str  # the value of `format = "..."`
    options: type[OptionsT]  # a frozen dataclass of option(...) fields
    proxying: Proxying[OptionsT, AdapterT] | None = None
    hosting: Hosting[OptionsT, AdapterT] | None = None
    mirroring: Mirroring[AdapterT] | None = None
    packages: Packages | None = None  # browsing and purging by package
    releases: Releases[AdapterT] | None = None  # the release policy judges its releases
    # How the protocol's clients read an error answer's message: "text" (the body), or
    # "json" (``{"error": message}``: npm shows a JSON body's ``error`` after the status,
    # and nothing of a text one). The status is the error table's either way.
    error_bodies: ErrorBodies = "text"
    # Served when the config has no [[repositories]] at all (None: not served by default):
    # its table, or a function of the listen host giving it (what is safe on loopback
    # may not be on every address).
    default_repository: Mapping[str, Any] | Callable[[str], Mapping[str, Any]] | None = None
    # Checks across options: (key, message) pairs, key relative to the repository.
    validate: Callable[[OptionsT], Iterable[tuple[str, str]]] | None = None
    # Start-up warnings for an operator: (repository, listen host) -> messages.
    warnings: Callable[[RepositorySettings[OptionsT], str], Iterable[str]] | None = None
