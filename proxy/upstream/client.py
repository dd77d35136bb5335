"""Talking to upstreams: the engine's ``contract.UpstreamClient`` (docs/architecture.md,
"Upstream safety").

One httpx client serves every repository; ``UpstreamPool.for_repository`` gives each
repository an ``Upstream`` with that repository's SSRF policy (``upstream/ssrf.py``). What a
hostile or broken upstream cannot do here:

- hold a transfer forever: the response head must arrive within connect + read
  timeout, the whole transfer (redirect hops and retries included) within
  ``upstream.transfer_timeout``, and a body that
  trickles below ``upstream.min_rate`` over a window fails (a per-read timeout alone
  is reset by every byte);
- starve other upstreams: concurrent transfers are bounded per upstream host
  (``upstream.max_connections``); when a host's slots are full the request gets a 503
  with Retry-After instead of queueing behind stuck transfers;
- hand us header values that are not valid HTTP (they are dropped), bodies larger than
  the caller's limit, or more buffered bytes than the process budget;
- send us somewhere internal: every URL and every redirect hop is vetted.

httpx errors are translated here, once, into ``UpstreamError`` subclasses. Only
idempotent requests are sent, so connection failures and 429/5xx answers are retried
with backoff; a read timeout is not (a hanging upstream must cost one timeout, not
several), and nothing is retried once body bytes have been handed on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import zlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager
from contextvars import ContextVar
from urllib.parse import urljoin, urlsplit

import httpcore
import httpx

from proxy import __version__
from proxy.config.settings import UpstreamSettings
from proxy.contract import UpstreamResponse
from proxy.exceptions import (
    RetryLater,
    UpstreamBusy,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from proxy.http.semantics import RETRY_AFTER_DEFAULT_S, header_value_ok, parse_retry_after
from proxy.runtime import metrics
from proxy.runtime.blocking import run_blocking
from proxy.units import format_duration, format_size
from proxy.upstream.circuit import Circuit, State
from proxy.upstream.health import UpstreamHealth
from proxy.upstream.ssrf import AddressPolicy

log = logging.getLogger("proxy.upstream")

BACKOFF_BASE_S = 0.25
BACKOFF_MAX_S = 4.0
RETRY_AFTER_MAX_S = 5.0
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
MAX_REDIRECTS = 10
# Upstream hosts remembered at once (circuits, health) and named in metrics labels: a
# redirect may name any host, and an upstream that names a new one each time must not
# grow them without end.
MAX_HOSTS = 256
LOCATION_EXTENSION = "proxy.location"  # where a redirect's Location is kept (see below)
# Bodies read whole into memory (index pages, checksum files), all requests together:
# past this, readers wait for each other instead of growing the process.
BUFFERED_BODIES_MAX_BYTES = 256 * 1024 * 1024
# A body read whole is held until its answer is closed, with what the caller makes of it
# meanwhile: for an index page, our rendering (about as large) and its links (larger
# still), which wait their turn to be recorded. So it counts three times its size.
BUDGET_BYTES_PER_BODY_BYTE = 3
USER_AGENT = f"artifact-proxy/{__version__}"


# httpcore reads an HTTP/1.1 body 64 KiB at a time, and every read costs a timeout scope
# and a trip through h11, httpcore and httpx: a fast upstream is then limited by the
# number of reads, not by bytes. Reads of up to 1 MiB take what the socket already holds
# (a slow upstream still arrives in small pieces, as soon as it is there).
UPSTREAM_READ_BYTES = 1024 * 1024
if hasattr(httpcore.AsyncHTTP11Connection, "READ_NUM_BYTES"):
    httpcore.AsyncHTTP11Connection.READ_NUM_BYTES = UPSTREAM_READ_BYTES


# The URLs answers came from, for the fetch that is running (``traced``): a fetch's log
# line and its entry name the upstream URL whatever the format asked for.
_TRACE: ContextVar[list[str] | None] = ContextVar("proxy_upstream_trace", default=None)


@contextlib.contextmanager
def traced() -> Iterator[list[str]]:
    """Collect the final URL (after redirects, without credentials) of every upstream
    request opened in this block (checksum requests riding ``beside`` excepted), in
    order. Tasks started inside it (another key fetched through the cache) trace their
    own block; requests they make outside one land here."""
    urls: list[str] = []
    token = _TRACE.set(urls)
    try:
        yield urls
    finally:
        _TRACE.reset(token)


def build_client(settings: UpstreamSettings) -> httpx.AsyncClient:
    timeout = httpx.Timeout(
        connect=settings.connect_timeout_s,
        read=settings.read_timeout_s,
        write=settings.read_timeout_s,
        pool=settings.connect_timeout_s,
    )
    # No total limit in httpx: transfers are bounded per upstream host by UpstreamPool,
    # so a stuck host can fill only its own slots.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=100)
    return httpx.AsyncClient(
        timeout=timeout,
        limits=limits,
        follow_redirects=False,  # followed here, so every hop is vetted
        headers={"User-Agent": USER_AGENT, "Accept-Encoding": "identity"},
        event_hooks={"response": [_set_location_aside]},
    )


async def _set_location_aside(response: httpx.Response) -> None:
    """Move a redirect's Location out of httpx's sight, into ``LOCATION_EXTENSION``.

    Even when it does not follow redirects, httpx parses the Location to offer
    ``next_request``, and a value like ``data:x`` or an invalid IDNA name raises there
    (``InvalidURL``, ``idna.IDNAError``: not ``httpx.HTTPError``). We follow redirects
    ourselves (``Upstream.open``), with every hop vetted, and refuse a bad one by name.
    """
    if response.status_code in REDIRECT_STATUSES and "location" in response.headers:
        response.extensions[LOCATION_EXTENSION] = response.headers["location"]
        del response.headers["location"]


class ByteBudget:
    """Bytes that may be held in memory at once by bodies read whole."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.available = capacity
        self._given = asyncio.Event()  # set (and replaced) whenever bytes are given back

    async def take(self, n_bytes: int, timeout_s: float) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                while self.available < n_bytes:
                    await self._given.wait()
        except TimeoutError:
            raise RetryLater(
                "too many large upstream pages are being read or parsed at once; retry",
                retry_after_s=RETRY_AFTER_DEFAULT_S,  # stated: _outage keeps the longest wait
            ) from None
        self.available -= n_bytes

    def give(self, n_bytes: int) -> None:
        """Not a coroutine, so that giving back in a ``finally`` cannot be cancelled."""
        self.available += n_bytes
        given, self._given = self._given, asyncio.Event()
        given.set()


class UpstreamPool:
    """The httpx client, and the transfer slots of every upstream host."""

    def __init__(self, settings: UpstreamSettings, client: httpx.AsyncClient | None = None):
        self.settings = settings
        self.client = client or build_client(settings)
        self.budget = ByteBudget(BUFFERED_BODIES_MAX_BYTES)
        self.health = UpstreamHealth(MAX_HOSTS)
        # Only hosts with a transfer in progress or waiting for one (with how many).
        self._slots: dict[str, tuple[asyncio.Semaphore, int]] = {}
        self.circuits: OrderedDict[str, Circuit] = OrderedDict()  # least recently used first
        self._labelled: set[str] = set()

    def circuit(self, host: str) -> Circuit:
        """The outage memory of ``host`` (upstream/circuit.py), shared by repositories.
        At most ``MAX_HOSTS`` are kept: a closed one is forgotten first (it remembers
        nothing), else the one least recently used."""
        circuit = self.circuits.get(host)
        if circuit is not None:
            self.circuits.move_to_end(host)
            return circuit
        if len(self.circuits) >= MAX_HOSTS:
            closed = (h for h, c in self.circuits.items() if c.state is State.CLOSED)
            self.circuits.pop(next(closed, next(iter(self.circuits)))).forget()
        circuit = self.circuits[host] = Circuit(host)
        return circuit

    def label(self, host: str) -> str:
        """``host`` as a metrics label: the first ``MAX_HOSTS`` hosts seen by name, any
        later one as "other" (a label value lives as long as the process)."""
        if host in self._labelled:
            return host
        if len(self._labelled) < MAX_HOSTS:
            self._labelled.add(host)
            return host
        return "other"

    def outages(self) -> list[str]:
        """One line per upstream host that is down now (for /readyz)."""
        return [line for c in self.circuits.values() if (line := c.describe()) is not None]

    def for_repository(
        self, repository: str, upstreams: tuple[str, ...], allow_hosts: tuple[str, ...] = ()
    ) -> Upstream:
        return Upstream(self, AddressPolicy(repository, upstreams, allow_hosts))

    @asynccontextmanager
    async def slot(self, host: str) -> AsyncIterator[None]:
        """One of ``host``'s transfer slots for as long as the transfer runs."""
        limit = self.settings.max_connections
        semaphore, users = self._slots.get(host) or (asyncio.Semaphore(limit), 0)
        self._slots[host] = (semaphore, users + 1)
        try:
            try:
                async with asyncio.timeout(self.settings.connect_timeout_s):
                    await semaphore.acquire()
            except TimeoutError:
                metrics.UPSTREAM_ERRORS.labels(host=self.label(host), reason="busy").inc()
                raise RetryLater(
                    f"upstream {host} already has {limit} transfers in progress "
                    "(upstream.max_connections); retry",
                    retry_after_s=RETRY_AFTER_DEFAULT_S,  # stated: _outage keeps the longest
                ) from None
            try:
                yield
            finally:
                semaphore.release()
        finally:
            self._leave_slots(host)

    def _leave_slots(self, host: str) -> None:
        """One user fewer of ``host``'s slots; with none left they are forgotten (a new
        semaphore is the same as an idle one), so the table holds busy hosts only."""
        semaphore, users = self._slots[host]
        if users > 1:
            self._slots[host] = (semaphore, users - 1)
        else:
            del self._slots[host]

    async def aclose(self) -> None:
        await self.client.aclose()


class Upstream:
    """``contract.UpstreamClient`` of one repository: its policy, the shared pool."""

    def __init__(self, pool: UpstreamPool, policy: AddressPolicy) -> None:
        self.pool = pool
        self.policy = policy
        self.settings = pool.settings

    @asynccontextmanager
    async def open(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str] | None = None,
        *,
        beside: UpstreamResponse | None = None,
    ) -> AsyncIterator[UpstreamAnswer]:
        """Send ``method url``, following redirects (each hop vetted); retried on
        connection errors and 429/5xx. Other statuses are returned as is; the caller
        reads the body (or not) within the transfer deadline, which starts here: every
        hop's head, retry and wait for a slot counts against it.

        ``beside`` (a checksum file beside its artifact): the request takes no slot of
        its own, since that transfer holds one; were it to wait for one, an artifact
        holding the host's last slot would wait for its own checksums until it failed.
        """
        deadline = time.monotonic() + self.settings.transfer_timeout_s
        url = self.policy.without_credentials(url)
        for _hop in range(MAX_REDIRECTS + 1):
            host = host_of(url)
            slot = self.pool.slot(host) if beside is None else contextlib.nullcontext()
            circuit = self.pool.circuit(host)
            probe = circuit.admit()  # fails at once while the host is known to be down
            async with slot:
                try:
                    response = await self._send(method, url, headers, deadline, circuit, probe)
                except UpstreamError as exc:
                    self.pool.health.failed(host, str(exc))
                    raise
                finally:
                    circuit.release(probe)  # a probe that got no verdict (refused, cancelled)
                self.pool.health.answered(host)
                location = response.extensions.get(LOCATION_EXTENSION)
                if response.status_code in REDIRECT_STATUSES and location:
                    await response.aclose()
                    try:
                        url = self.policy.without_credentials(urljoin(url, location))
                    except ValueError:
                        raise UpstreamUnavailable(
                            f"upstream {host} redirected to a malformed URL {location!r}"
                        ) from None
                    if response.status_code == 303 and method != "HEAD":
                        method = "GET"
                    continue
                answer = UpstreamAnswer(response, url, self, deadline)
                trace = _TRACE.get()
                if trace is not None and beside is None:
                    trace.append(url)
                try:
                    yield answer
                finally:
                    answer.release()
                    await response.aclose()
                return
        raise UpstreamUnavailable(f"upstream redirected more than {MAX_REDIRECTS} times: {url}")

    async def _send(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str] | None,
        deadline: float,
        circuit: Circuit,
        probe: bool,
    ) -> httpx.Response:
        """One hop, retried; its outcome is told to the host's circuit: an answer head
        (``succeeded``), or an outage (``failed``, as the error is raised)."""

        def down(error: UpstreamError) -> UpstreamError:
            circuit.failed(str(error), probe)
            return error

        host = host_of(url)
        label = self.pool.label(host)  # in metrics
        attempt = 0
        while True:
            try:
                async with asyncio.timeout_at(_loop_deadline(deadline)):
                    target = await self.policy.vet(url)  # may resolve a name
            except TimeoutError:
                raise down(self.past_deadline(host, "resolving its name")) from None
            request_headers = dict(headers or {})
            if target.host_header is not None:
                request_headers["Host"] = target.host_header
            authorization = self.policy.authorization(url)
            if authorization is not None:
                request_headers["Authorization"] = authorization
            extensions = {"sni_hostname": target.sni_hostname} if target.sni_hostname else {}
            try:
                request = self.pool.client.build_request(
                    method, target.url, headers=request_headers, extensions=extensions
                )
            except (httpx.HTTPError, httpx.InvalidURL, ValueError) as exc:
                # e.g. a header or a name we cannot encode (UnicodeError is a ValueError)
                raise UpstreamUnavailable(f"cannot ask upstream {host}: {exc}") from exc
            head_timeout_s = self.settings.connect_timeout_s + self.settings.read_timeout_s
            head_deadline = min(time.monotonic() + head_timeout_s, deadline)
            try:
                # The whole response head, however slowly it trickles in.
                async with asyncio.timeout_at(_loop_deadline(head_deadline)):
                    response = await self.pool.client.send(request, stream=True)
            except TimeoutError as exc:
                if head_deadline >= deadline:
                    raise down(self.past_deadline(host, "waiting for a response head")) from exc
                metrics.UPSTREAM_ERRORS.labels(host=label, reason="timeout").inc()
                raise down(
                    UpstreamTimeout(
                        f"upstream {host} sent no complete response head within "
                        f"{format_duration(head_timeout_s)}"
                    )
                ) from exc
            except httpx.TimeoutException as exc:
                metrics.UPSTREAM_ERRORS.labels(host=label, reason="timeout").inc()
                if isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout) and attempt < (
                    self.settings.retries
                ):
                    attempt += 1
                    await self._pause(_backoff_s(attempt), host, deadline, down)
                    continue
                raise down(
                    UpstreamTimeout(f"upstream {host} timed out ({type(exc).__name__})")
                ) from exc
            except httpx.TransportError as exc:
                metrics.UPSTREAM_ERRORS.labels(host=label, reason="connect").inc()
                if isinstance(exc, httpx.ConnectError | httpx.RemoteProtocolError) and attempt < (
                    self.settings.retries
                ):
                    attempt += 1
                    await self._pause(_backoff_s(attempt), host, deadline, down)
                    continue
                raise down(UpstreamUnavailable(f"upstream {host} unreachable: {exc!r}")) from exc
            except (httpx.HTTPError, httpx.InvalidURL, ValueError) as exc:
                # httpx.InvalidURL is no HTTPError; idna's errors are ValueErrors.
                metrics.UPSTREAM_ERRORS.labels(host=label, reason="protocol").inc()
                raise down(UpstreamUnavailable(f"upstream {host}: {exc}")) from exc
            if response.status_code not in RETRY_STATUSES:
                circuit.succeeded(probe)
                return response
            metrics.UPSTREAM_ERRORS.labels(host=label, reason=str(response.status_code)).inc()
            retry_after = parse_retry_after(response.headers.get("retry-after"), time.time())
            await response.aclose()
            if attempt < self.settings.retries:
                attempt += 1
                wait_s = min(retry_after or _backoff_s(attempt), RETRY_AFTER_MAX_S)
                await self._pause(wait_s, host, deadline, down)
                continue
            message = f"upstream {host} answered {response.status_code} for {url}"
            if response.status_code in (429, 503):
                raise down(UpstreamBusy(message, retry_after_s=retry_after))
            raise down(UpstreamUnavailable(message))

    async def _pause(
        self,
        wait_s: float,
        host: str,
        deadline: float,
        down: Callable[[UpstreamError], UpstreamError],
    ) -> None:
        """Wait before a retry, unless the transfer deadline comes first."""
        if time.monotonic() + wait_s >= deadline:
            raise down(self.past_deadline(host, "retrying"))
        await asyncio.sleep(wait_s)

    def past_deadline(self, host: str, doing: str) -> UpstreamTimeout:
        """The error (counted) for a transfer past ``upstream.transfer_timeout``."""
        metrics.UPSTREAM_ERRORS.labels(host=self.pool.label(host), reason="deadline").inc()
        return UpstreamTimeout(
            f"upstream {host} did not finish within upstream.transfer_timeout "
            f"({format_duration(self.settings.transfer_timeout_s)}): still {doing}"
        )


class UpstreamAnswer:
    """``contract.UpstreamResponse`` over an httpx response whose body is unread."""

    def __init__(
        self, response: httpx.Response, url: str, upstream: Upstream, deadline: float
    ) -> None:
        self._response = response
        self._url = url
        self._upstream = upstream
        self._deadline = deadline
        self._headers = clean_headers(response.headers)
        self._held = 0  # bytes of the process's budget this answer's body holds

    @property
    def status(self) -> int:
        return self._response.status_code

    @property
    def headers(self) -> Mapping[str, str]:
        return self._headers

    @property
    def url(self) -> str:
        return self._url

    @property
    def length(self) -> int | None:
        return content_length(self._response)

    @property
    def host(self) -> str:
        return host_of(self._url)

    async def body(self) -> AsyncIterator[bytes]:
        """The body as it arrives; ``UpstreamError`` if it breaks off, stalls, trickles
        below ``upstream.min_rate``, outlives ``upstream.transfer_timeout`` or is not as
        long as its Content-Length said: each the host's fault, told to its circuit."""
        try:
            async for chunk in self._chunks():
                yield chunk
        except UpstreamError as exc:
            self._upstream.pool.circuit(self.host).failed(str(exc), probe=False)
            raise

    async def _chunks(self) -> AsyncIterator[bytes]:
        settings = self._upstream.settings
        host = self.host
        label = self._upstream.pool.label(host)  # in metrics
        expected = self.length
        received = 0
        window_s = settings.min_rate_window_s
        window_start = time.monotonic()
        window_bytes = 0
        # As sent: a Content-Encoding is never undone here. A ".tar.gz" served with
        # "Content-Encoding: gzip" is the tarball, and its digests are of these bytes; a
        # decoded body could be a thousand times larger (docs/architecture.md, "Upstream
        # safety").
        chunks = self._response.aiter_raw()
        while True:
            try:
                async with asyncio.timeout_at(_loop_deadline(self._deadline)):
                    chunk = await anext(chunks)
            except StopAsyncIteration:
                break
            except TimeoutError as exc:
                doing = f"sending the body ({received} bytes so far)"
                raise self._upstream.past_deadline(host, doing) from exc
            except httpx.TimeoutException as exc:
                metrics.UPSTREAM_ERRORS.labels(host=label, reason="timeout").inc()
                raise UpstreamTimeout(
                    f"upstream {host} stopped sending ({type(exc).__name__})"
                ) from exc
            except httpx.HTTPError as exc:
                metrics.UPSTREAM_ERRORS.labels(host=label, reason="truncated").inc()
                raise UpstreamUnavailable(f"upstream {host} broke off the body: {exc!r}") from exc
            received += len(chunk)
            window_bytes += len(chunk)
            if expected is not None and received > expected:
                metrics.UPSTREAM_ERRORS.labels(host=label, reason="truncated").inc()
                raise UpstreamUnavailable(
                    f"upstream {host} sent more than the {expected} bytes it announced"
                )
            now = time.monotonic()
            if now - window_start >= window_s:
                if window_bytes < settings.min_rate * (now - window_start):
                    metrics.UPSTREAM_ERRORS.labels(host=label, reason="too_slow").inc()
                    raise UpstreamTimeout(
                        f"upstream {host} sent {window_bytes} bytes in "
                        f"{now - window_start:.0f} s, under upstream.min_rate "
                        f"({format_size(settings.min_rate)}/s)"
                    )
                window_start, window_bytes = now, 0
            yield chunk
        if expected is not None and received != expected:
            metrics.UPSTREAM_ERRORS.labels(host=label, reason="truncated").inc()
            raise UpstreamUnavailable(
                f"upstream {host} sent {received} of {expected} bytes for {self._url}"
            )

    async def read(self, limit: int) -> bytes:
        """The whole body, refusing more than ``limit`` bytes. It is held against the
        process's budget for bodies in memory until this answer is closed (its ``open``
        ends), so what the caller does with it meanwhile (an index page waiting for its
        parse, and parsed) counts as well (``BUDGET_BYTES_PER_BODY_BYTE``): a burst of
        big pages waits to be read instead of piling up in memory."""
        expected = self.length
        if expected is not None and expected > limit:
            raise UpstreamUnavailable(
                f"upstream body for {self._url} is {expected} bytes, over the "
                f"{format_size(limit)} limit"
            )
        budget = self._upstream.pool.budget
        wait_s = self._upstream.settings.read_timeout_s
        received = 0
        chunks = []
        try:
            if expected is not None:
                # All at once: readers that each hold part of what they need could
                # wait for each other until they all fail.
                wanted = min(expected * BUDGET_BYTES_PER_BODY_BYTE, budget.capacity)
                await budget.take(wanted, wait_s)
                self._held = wanted
            async for chunk in self.body():  # never more than ``expected``
                received += len(chunk)
                if received > limit:
                    raise UpstreamUnavailable(
                        f"upstream body for {self._url} exceeds the {format_size(limit)} limit"
                    )
                if expected is None:
                    await self._hold(len(chunk) * BUDGET_BYTES_PER_BODY_BYTE, wait_s)
                chunks.append(chunk)
            body = b"".join(chunks)
            encoding = self._response.headers.get("content-encoding", "").strip().lower()
            if encoding not in ("", "identity"):
                # A document we parse (an index page, a checksum file) must be read as its
                # text: undone here, within ``limit`` however well it compresses.
                body = await run_blocking(_decoded, body, encoding, limit, self._url)
                await self._hold(len(body) * BUDGET_BYTES_PER_BODY_BYTE - self._held, wait_s)
        except BaseException:
            self.release()
            raise
        return body

    async def _hold(self, n_bytes: int, wait_s: float) -> None:
        """Take ``n_bytes`` more of the budget (at most what is left of its capacity)."""
        budget = self._upstream.pool.budget
        more = min(n_bytes, budget.capacity - self._held)
        if more > 0:
            await budget.take(more, wait_s)
            self._held += more

    def release(self) -> None:
        """Give the body's bytes back to the budget (when the answer is closed)."""
        held, self._held = self._held, 0
        self._upstream.pool.budget.give(held)


def clean_headers(headers: httpx.Headers) -> dict[str, str]:
    """Lower-case names -> values, without any value that is not valid HTTP (control
    characters, non-ASCII text): such a value would be refused when we send it on."""
    cleaned: dict[str, str] = {}
    for raw_name, raw_value in headers.raw:
        try:
            name = raw_name.decode("ascii").lower()
            value = raw_value.decode("ascii")
        except UnicodeDecodeError:
            continue
        if not header_value_ok(value):
            continue
        cleaned[name] = f"{cleaned[name]}, {value}" if name in cleaned else value
    return cleaned


def host_of(url: str) -> str:
    """The host (and port) a URL names, lowercased and without credentials: the key of
    its connection slots, its metrics label and what error messages name."""
    return urlsplit(url).netloc.rsplit("@", 1)[-1].lower()


def _decoded(body: bytes, encoding: str, limit: int, url: str) -> bytes:
    """``body`` with its Content-Encoding undone, refusing more than ``limit`` bytes
    (blocking: run it in the I/O pool)."""
    if encoding in ("gzip", "x-gzip"):
        decoder = zlib.decompressobj(16 + zlib.MAX_WBITS)
    elif encoding == "deflate":
        decoder = zlib.decompressobj()
    else:
        raise UpstreamUnavailable(
            f"upstream body for {url} has Content-Encoding {encoding!r}, which the proxy "
            "does not decode (it asks for identity)"
        )
    try:
        text = decoder.decompress(body, limit + 1)
    except zlib.error as exc:
        raise UpstreamUnavailable(
            f"upstream body for {url} is not valid {encoding}: {exc}"
        ) from exc
    if len(text) > limit or decoder.unconsumed_tail:
        raise UpstreamUnavailable(
            f"upstream body for {url} decodes to more than the {format_size(limit)} limit"
        )
    return text


def content_length(response: httpx.Response) -> int | None:
    """The body size the upstream stated: of the bytes as sent (we never decode them)."""
    value = response.headers.get("content-length")
    if value is None or not value.isascii() or not value.isdigit():
        return None
    return int(value)


def _loop_deadline(monotonic_deadline: float) -> float:
    loop = asyncio.get_running_loop()
    return loop.time() + (monotonic_deadline - time.monotonic())


def _backoff_s(attempt: int) -> float:
    base_s: float = min(BACKOFF_BASE_S * 2.0 ** (attempt - 1), BACKOFF_MAX_S)
    return base_s * random.uniform(0.5, 1.0)


__all__ = ["Upstream", "UpstreamAnswer", "UpstreamError", "UpstreamPool", "build_client"]
