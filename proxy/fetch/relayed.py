"""Following another replica's download through its relay (docs/architecture.md,
"Streaming across replicas on object storage"): the waiter's side of ``relay.py``.

A ``RelayedFile`` GETs ``<relay_url>/relay/<fence>`` with the token from the lease row
and writes what arrives into a temp file of its own, hashed as written; this replica's
clients read that file (a ``transfer.Source`` beside ``LocalFile`` and ``SharedFile``).
A local copy, because the prefix proof of ``Transfer.replace`` compares the bytes
already sent with a successor's, and the finished file becomes this replica's copy in
the local tier. Its last byte is released only when the whole body arrived and its
sha256 is the stored entry's (``is_stored``): never a full body nobody verified.

The URL comes from a database row, so it is checked before any connection: plain
``http://host:port`` with no user, path, query or fragment, and not an address a relay
can never have (unspecified, multicast, link-local, cloud metadata). The path is ours,
redirects are never followed, and the answer's bytes are taken only if its head proves
the relay holds the token (``X-Relay-Proof``) and states the range asked for: a forged
row cannot make us read, and serve, anything else. A relay that breaks off, stalls or
trickles below ``upstream.min_rate`` only stops the file growing: the lease decides
what comes next (an entry, a takeover), as when a shared file stops growing.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import time
from collections.abc import Awaitable, Callable

import httpx

from proxy.catalog import StreamInfo
from proxy.config.settings import UpstreamSettings
from proxy.fetch.relay import PROOF_HEADER, RELAY_PATH, proof
from proxy.fetch.transfer import Spawn, StoredBlob
from proxy.fetch.transfer import _digest as file_digest
from proxy.runtime import metrics
from proxy.storage.blobs import BlobStore, TempBlob
from proxy.upstream.ssrf import relay_target

log = logging.getLogger("proxy.relayed")

RECONNECTS = 2  # a connection that breaks while the relay lives is resumed this often
RECONNECT_PAUSE_S = 0.2
MAX_CONNECTIONS = 256

Adopt = Callable[[TempBlob, str], Awaitable[None]]


class RelayClient:
    """The one HTTP client of this process for relays, and how to follow one."""

    def __init__(self, files: BlobStore, settings: UpstreamSettings, adopt: Adopt) -> None:
        self.files = files
        self.settings = settings
        self.adopt = adopt
        timeout = httpx.Timeout(
            connect=settings.connect_timeout_s,
            read=settings.read_timeout_s,
            write=settings.read_timeout_s,
            pool=settings.connect_timeout_s,
        )
        self.client = httpx.AsyncClient(
            timeout=timeout,
            follow_redirects=False,
            trust_env=False,  # never through an HTTP proxy of the environment
            limits=httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=32),
        )

    async def aclose(self) -> None:
        await self.client.aclose()

    async def follow(self, stream: StreamInfo, fence: int, spawn: Spawn) -> RelayedFile | None:
        """Start reading the download announced under ``fence``; None if the
        announcement names no usable relay."""
        if stream.relay is None or not stream.token:
            return None
        target, problem = await relay_target(stream.relay)
        if target is None:
            metrics.RELAY_FOLLOWS.labels(result="refused").inc()
            log.warning("ignoring a relay announcement for %r: %s", stream.relay, problem)
            return None
        temp = await self.files.new_temp()
        metrics.RELAY_FOLLOWS.labels(result="started").inc()
        return RelayedFile(self, temp, stream, fence, spawn, target)


class RelayedFile:
    """Another replica's in-flight download, copied here as it arrives from its relay."""

    page_cached = True  # our own file, just written: sendfile may serve it

    def __init__(
        self,
        client: RelayClient,
        temp: TempBlob,
        stream: StreamInfo,
        fence: int,
        spawn: Spawn,
        relay: str,
    ) -> None:
        """``relay``: the relay's URL as vetted (``ssrf.relay_target``: pinned to the
        address that was checked)."""
        assert stream.token is not None
        self.content_type = stream.content_type
        self.total = stream.length
        self.error: BaseException | None = None  # never: a relay that stops is "lost"
        self._client = client
        self._temp = temp
        self._url = f"{relay}{RELAY_PATH}{fence}"
        self._fence = fence
        self._token = stream.token
        self._fd: int | None = temp.reader_fd()
        self._written = 0
        self._complete = False
        self._adopted = False
        self._listeners: list[Callable[[], None]] = []
        self.ended = asyncio.Event()  # the relay said all it will say
        temp.on_progress = self._progressed
        self._spawn = spawn
        self._task: asyncio.Task[None] | None = spawn(f"relayed:{fence}", self._copy())

    @property
    def fd(self) -> int | None:
        return self._fd

    @property
    def received(self) -> int:
        return self._written

    def readable(self) -> int:
        return self.total if self._complete else max(0, min(self._written, self.total) - 1)

    def complete(self) -> bool:
        return self._complete

    def subscribe(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    async def read(self, offset: int, size: int) -> bytes:
        assert self._fd is not None
        return os.pread(self._fd, size, offset)  # just written here: in the page cache

    def prefix_digest(self, length: int) -> str:
        assert self._fd is not None
        return file_digest(self._fd, length)

    async def is_stored(self, blob: StoredBlob) -> bool:
        """The body is stored as ``blob``: once the relay has ended, are our bytes its
        bytes (every one, same sha256)? Then they are this replica's copy of it."""
        await self.ended.wait()
        temp = self._temp
        if self._fd is None or temp.size != self.total or temp.size != blob.size:
            return False
        try:
            await temp.flush()
        except OSError:
            return False
        if temp.sha256 != blob.sha256:
            log.warning(
                "the relayed body of fence %d has sha256 %s, the stored blob %s",
                self._fence,
                temp.sha256,
                blob.sha256,
            )
            return False
        self._complete = True
        self._announce()
        try:
            await self._client.adopt(temp, blob.sha256)
            self._adopted = True
        except OSError as exc:
            log.warning("could not keep the relayed copy of %s: %s", blob.sha256, exc)
        return True

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if not self._adopted:
            try:
                self._spawn(f"relayed-discard:{self._fence}", self._temp.discard())
            except RuntimeError:
                # Stopping: the file is left to the local tier's clean-up at start.
                self._temp.close()

    # -- the copy ------------------------------------------------------------------------

    def _progressed(self, written: int) -> None:
        if written > self._written:
            self._written = written
            self._announce()

    def _announce(self) -> None:
        for listener in self._listeners:
            listener()

    async def _copy(self) -> None:
        settings = self._client.settings
        started = time.monotonic()
        attempts = 0
        try:
            while self._temp.size < self.total:
                attempts += 1
                if attempts > RECONNECTS + 1:
                    return  # however its answers ended: a bounded number of asks
                try:
                    async with asyncio.timeout(
                        settings.transfer_timeout_s - (time.monotonic() - started)
                    ):
                        done = await self._one_request(settings)
                except TimeoutError:
                    log.warning("relay %s: past upstream.transfer_timeout", self._url)
                    return
                except (httpx.HTTPError, OSError, RelayRefused) as exc:
                    log.info("relay %s stopped at %d bytes: %s", self._url, self._temp.size, exc)
                    if isinstance(exc, RelayRefused):
                        return
                    await asyncio.sleep(RECONNECT_PAUSE_S)
                    continue
                if done:
                    return
        finally:
            # However the copy stopped, what was handed to the file is counted before
            # "ended": a reader told the relay has ended must see every byte received.
            with contextlib.suppress(Exception):
                await self._temp.flush()
            self.ended.set()
            self._announce()

    async def _one_request(self, settings: UpstreamSettings) -> bool:
        """One GET from where we are; True if the relay said it has nothing more."""
        offset = self._temp.size
        headers = {"authorization": f"Bearer {self._token}", "range": f"bytes={offset}-"}
        async with self._client.client.stream("GET", self._url, headers=headers) as answer:
            if answer.status_code in (403, 404, 416):
                raise RelayRefused(f"{answer.status_code}: the download is not offered")
            expected = proof(self._token, self._fence, offset, self.total)
            if (
                answer.status_code != 206
                or answer.headers.get("content-range")
                != f"bytes {offset}-{self.total - 1}/{self.total}"
                or not hmac.compare_digest(answer.headers.get(PROOF_HEADER, ""), expected)
            ):
                metrics.RELAY_FOLLOWS.labels(result="unproven").inc()
                raise RelayRefused(
                    f"answered {answer.status_code} without the relay's proof: not a relay"
                )
            window_start, window_bytes = time.monotonic(), 0
            async for chunk in answer.aiter_raw():
                if self._temp.size + len(chunk) > self.total:
                    raise RelayRefused("the relay sent more than the announced length")
                await self._temp.write(chunk)
                window_bytes += len(chunk)
                now = time.monotonic()
                if now - window_start >= settings.min_rate_window_s:
                    if window_bytes < settings.min_rate * (now - window_start):
                        raise RelayRefused("the relay sent under upstream.min_rate")
                    window_start, window_bytes = now, 0
        return self._temp.size >= self.total


class RelayRefused(Exception):
    """The relay will not (or must not) be read any further."""
