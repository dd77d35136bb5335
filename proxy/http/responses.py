"""Serving bytes: cached blobs (ETag, 304, Range, If-Range, HEAD), downloads in
progress, inline bodies, and plain-text errors.

These are bare ASGI callables rather than Starlette responses: the cache hit is the
hot path, and a small blob is answered from memory in one ``send`` with no thread hop.
A stored blob's bytes come from a ``BlobBody`` (``http/bodies.py``): its file here, or,
on object storage, the object as it arrives into the local tier (``fetch/fill.py``),
checked as they are read (docs/architecture.md, "Blobs verified when read").
"""

from __future__ import annotations

import asyncio
import errno
import functools
import hashlib
import json
import logging
import os
from collections.abc import Awaitable, Callable, Mapping

from proxy.catalog import Entry
from proxy.contract import Request
from proxy.fetch.download import SEND_CHUNK_BYTES
from proxy.fetch.transfer import Transfer
from proxy.http.access_log import note_sent
from proxy.http.bodies import (
    HOT_MAX_BLOB_BYTES,
    MARK,
    BlobBody,
    HotBlobs,
    MarkCounts,
    OpenBlob,
    SendCheck,
)
from proxy.http.protocol import SENDFILE_EXTENSION, SocketFileSender
from proxy.http.semantics import (
    etag_of,
    header_value_ok,
    http_date,
    if_range_holds,
    matches_etag,
    modified_after,
    not_modified_since,
    parse_range,
)
from proxy.redaction import redact
from proxy.runtime import metrics
from proxy.runtime.blocking import run_blocking
from proxy.storage.blobs import storage_error
from proxy.storage.integrity import read_hashed
from proxy.types import Kind, Receive, Scope, Send

log = logging.getLogger("proxy.responses")

# Redirects a format answers on its own (e.g. PEP 503 name normalization) never change.
REDIRECT_MAX_AGE_S = 86400

Headers = list[tuple[bytes, bytes]]

# Bytes of a stored file per sendfile call (each is one hop to the I/O pool).
SENDFILE_CHUNK_BYTES = 8 * 1024 * 1024
# An empty body message: uvicorn's send waits while the connection's buffer is over its
# high-water mark and writes nothing. Sent before each chunk is read, it makes what a
# client that stops reading costs us one buffered chunk, not one more in hand.
_WAIT_WRITABLE = {"type": "http.response.body", "body": b"", "more_body": True}


class BodyResponse:
    """A complete body (or none, for HEAD/304) sent in one message."""

    __slots__ = ("body", "headers", "repository", "status")

    def __init__(self, status: int, headers: Headers, body: bytes, repository: str = "-") -> None:
        self.status = status
        self.headers = headers
        self.body = body
        self.repository = repository

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        await send({"type": "http.response.body", "body": self.body})
        if self.body:
            metrics.BYTES_SERVED.labels(repository=self.repository).inc(len(self.body))


class FileResponse:
    """A byte range of an open blob file, read in large chunks off the event loop;
    ``rewrite`` (if any) turns each chunk into what is sent (see ``relocated_blob``).

    With a ``check`` (a whole file not known good), every chunk is hashed in the thread
    hop that reads it and the last one waits for the digest: a mismatch cuts the
    response before its last byte and quarantines the blob, so no client ever gets a
    complete wrong body (docs/architecture.md, "Blobs verified when read")."""

    def __init__(
        self,
        status: int,
        headers: Headers,
        fd: int,
        start: int,
        length: int,
        repository: str,
        rewrite: Callable[[bytes], bytes] | None = None,
        check: SendCheck | None = None,
    ) -> None:
        assert check is None or (start == 0 and length == check.size), "a whole file"
        self.status = status
        self.headers = headers
        self.fd = fd
        self.start = start
        self.length = length
        self.repository = repository
        self.rewrite = rewrite
        self.check = check
        self._sending: asyncio.Future[int] | None = None  # a sendfile in the I/O pool

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        disconnected = asyncio.Event()
        watcher = asyncio.get_running_loop().create_task(_watch_disconnect(receive, disconnected))
        check = self.check
        hasher = hashlib.sha256() if check is not None else None
        # A file known good and sent as is goes from the page cache to the socket
        # (sendfile, in the I/O pool: it may read the disk); a hashed or rewritten one
        # passes through here.
        sender: SocketFileSender | None = None
        if check is None and self.rewrite is None:
            sender = scope.get("extensions", {}).get(SENDFILE_EXTENSION)
        sent = 0
        try:
            await send(
                {"type": "http.response.start", "status": self.status, "headers": self.headers}
            )
            offset, end = self.start, self.start + self.length
            while offset < end and not disconnected.is_set():
                await send(_WAIT_WRITABLE)
                if sender is not None:
                    count = 0
                    pending = sender.start_send(
                        self.fd, offset, min(SENDFILE_CHUNK_BYTES, end - offset)
                    )
                    if pending is not None:
                        self._sending = pending
                        count = await asyncio.shield(pending)
                        self._sending = None
                        sender.sent(count)
                    if count:
                        offset += count
                        sent += count
                        note_sent(count)
                        continue
                    # The socket is full (or broken): one chunk the ordinary way, whose
                    # write waits for the client (or finds out).
                size = min(SEND_CHUNK_BYTES, end - offset)
                try:
                    if hasher is None:
                        data = await run_blocking(os.pread, self.fd, size, offset)
                    else:
                        data = await run_blocking(read_hashed, self.fd, size, offset, hasher)
                except OSError as exc:
                    # A failing disk (EIO) or a vanished volume: end the response short,
                    # so the client sees a broken transfer, never a wrong body.
                    log.error("%s", storage_error("reading a blob for a client", "read", exc))
                    return
                if not data:
                    # The file shrank under us (it never should): end the response short.
                    if check is not None:
                        await _shielded(check.mismatched(offset, None))
                    return
                offset += len(data)
                if check is not None and hasher is not None and offset >= end:
                    digest = hasher.hexdigest()
                    if digest != check.sha256:
                        await _shielded(check.mismatched(check.size, digest))
                        return  # the last chunk never goes out: a cut transfer
                    check.matched()
                if self.rewrite is not None:
                    data = self.rewrite(data)
                sent += len(data)
                await send({"type": "http.response.body", "body": data, "more_body": offset < end})
                if offset >= end:
                    return  # that was the last message
            if offset >= end:  # empty, or its last bytes went by sendfile
                await send({"type": "http.response.body", "body": b""})
        finally:
            watcher.cancel()
            sending = self._sending
            if sending is not None and not sending.done():
                # Cancelled while a sendfile runs in its thread: it reads the file.
                sending.add_done_callback(functools.partial(_close, self.fd))
            else:
                os.close(self.fd)
            metrics.BYTES_SERVED.labels(repository=self.repository).inc(sent)


def _close(fd: int, _done: object) -> None:
    os.close(fd)


async def _shielded(work: Awaitable[None]) -> None:
    # The quarantine goes on if the client leaves (its task is cancelled) meanwhile.
    await asyncio.shield(work)


class DownloadResponse:
    """A body still arriving (from upstream, another replica, or the bucket), or bytes
    ``start`` up to ``start + length`` of it; a failed transfer ends it short."""

    def __init__(
        self,
        headers: Headers,
        download: Transfer,
        repository: str,
        head: bool,
        status: int = 200,
        start: int = 0,
        length: int | None = None,
    ) -> None:
        self.headers = headers
        self.download = download
        self.repository = repository
        self.head = head
        self.status = status
        self.start = start
        self.end = download.total if length is None else start + length

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        if self.head:
            await send({"type": "http.response.body", "body": b""})
            return
        disconnected = asyncio.Event()
        watcher = asyncio.get_running_loop().create_task(_watch_disconnect(receive, disconnected))
        sender: SocketFileSender | None = scope.get("extensions", {}).get(SENDFILE_EXTENSION)
        reader = self.download.reader(self.start)
        end = self.end
        try:
            while reader.offset < end:
                await send(_WAIT_WRITABLE)
                span = await reader.next_span()
                if span is None:
                    break
                if disconnected.is_set():
                    return
                upto = min(span.end, end)
                fd = span.source.fd
                if sender is not None and span.source.page_cached and fd is not None:
                    # Straight from the page cache to the socket, while it takes bytes;
                    # when it is full, one chunk goes the ordinary way and waits.
                    sent = sender.try_send(fd, reader.offset, upto - reader.offset)
                    if sent:
                        reader.sent(sent)
                        note_sent(sent)
                        continue
                data = await reader.read(span, min(SEND_CHUNK_BYTES, upto - reader.offset))
                if data:
                    await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        except Exception:
            # The fetch failed (already logged by the fetcher); returning without the
            # final message makes the server close the connection: a short transfer.
            return
        finally:
            watcher.cancel()
            reader.close()
            metrics.BYTES_SERVED.labels(repository=self.repository).inc(reader.offset - self.start)


async def _watch_disconnect(receive: Receive, disconnected: asyncio.Event) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            disconnected.set()
            return


# -- building responses ----------------------------------------------------------------

# Cache-Control, so a CDN or the load balancer can absorb hits (docs/architecture.md,
# "Caching by others"): immutable files forever; fresh metadata for what is left of its
# TTL; anything computed or stale revalidated; errors and uploads never stored.
IMMUTABLE_CACHE_CONTROL = b"public, max-age=31536000, immutable"
REVALIDATE = b"no-cache"
NEVER_STORE = b"no-store"


def cache_control(kind: Kind, max_age_s: int | None) -> bytes:
    """``max_age_s``: what is left of a metadata answer's TTL (``Entry.max_age_s``)."""
    if kind is Kind.IMMUTABLE:
        return IMMUTABLE_CACHE_CONTROL
    if kind is Kind.METADATA and max_age_s is not None:
        return b"public, max-age=%d" % max_age_s
    return NEVER_STORE  # hosted (build-cache uploads), or anything else


def error(
    status: int, message: str, extra: Mapping[str, str] | None = None, as_json: bool = False
) -> BodyResponse:
    """A plain-text answer, or ``{"error": message}`` ``as_json``; the message is redacted
    (docs/architecture.md, "Secrets never shown"): it may name an upstream URL, and the
    upstream's credentials stay ours."""
    text = redact(message).rstrip("\n")
    if as_json:
        content_type, body = b"application/json", (json.dumps({"error": text}) + "\n").encode()
    else:
        content_type, body = b"text/plain; charset=utf-8", (text + "\n").encode()
    headers = [(b"content-type", content_type), (b"cache-control", NEVER_STORE)]
    for name, value in (extra or {}).items():
        headers.append((name.lower().encode(), value.encode("latin-1")))
    headers.append((b"content-length", str(len(body)).encode()))
    return BodyResponse(status, headers, body)


class FormatResponses:
    """``contract.Responses`` of one repository: the answers its format builds itself
    (bytes served are counted under the repository's name)."""

    def __init__(self, repository: str) -> None:
        self.repository = repository

    def redirect(self, location: str, status: int = 301) -> BodyResponse:
        # Shared caches may keep it (docs/architecture.md, "Caching by others").
        headers = [
            (b"location", location.encode()),
            (b"content-length", b"0"),
            (b"cache-control", b"public, max-age=%d" % REDIRECT_MAX_AGE_S),
        ]
        return BodyResponse(status, headers, b"", self.repository)

    def empty(self, status: int, headers: Mapping[str, str] | None = None) -> BodyResponse:
        given = {k.lower(): v for k, v in (headers or {}).items()}
        given.setdefault("content-length", "0")
        given.setdefault("cache-control", "no-store")
        encoded = [(k.encode(), v.encode("latin-1")) for k, v in given.items()]
        return BodyResponse(status, encoded, b"", self.repository)

    def inline(self, request: Request, body: bytes, content_type: str) -> BodyResponse:
        return inline(request.headers, request.method, body, content_type, {}, self.repository)


def redirect_to_storage(url: str) -> BodyResponse:
    """A hit sent to the storage itself (``[storage.s3] redirect_min_size``): a temporary
    redirect to a short-lived presigned URL, which nobody may keep."""
    body = b"the file is served by the storage; follow the redirect\n"
    headers = [
        (b"location", url.encode("ascii")),
        (b"cache-control", NEVER_STORE),
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", str(len(body)).encode()),
    ]
    return BodyResponse(307, headers, body)


def inline(
    request_headers: Mapping[str, str],
    method: str,
    body: bytes,
    content_type: str | None,
    extra: Mapping[str, str],
    repository: str,
) -> BodyResponse:
    """An in-memory body (never stored) with a computed ETag; revalidated by caches."""
    etag = etag_of(hashlib.sha256(body).hexdigest())
    headers = _base_headers(content_type, extra)
    headers.append((b"etag", etag.encode()))
    headers.append((b"cache-control", REVALIDATE))
    if matches_etag(request_headers.get("if-none-match"), etag):
        return BodyResponse(304, headers, b"", repository)
    headers.append((b"content-length", str(len(body)).encode()))
    return BodyResponse(200, headers, b"" if method == "HEAD" else body, repository)


async def blob(
    request_headers: Mapping[str, str],
    method: str,
    entry: Entry,
    body: BlobBody,
    hot: HotBlobs,
    extra: Mapping[str, str],
    now_ms: int,
) -> BodyResponse | FileResponse | DownloadResponse:
    """Serve a stored entry. Raises FileNotFoundError if its blob is gone."""
    assert entry.sha256 is not None
    etag = etag_of(entry.sha256)
    last_modified = entry.last_modified
    if not last_modified or not header_value_ok(last_modified):
        last_modified = http_date(entry.fetched_at_ms)
    headers = _base_headers(entry.content_type, extra)
    if "cache-control" not in extra:
        headers.append((b"cache-control", cache_control(entry.kind, entry.max_age_s(now_ms))))
    headers.append((b"etag", etag.encode()))
    headers.append((b"last-modified", last_modified.encode("latin-1")))
    headers.append((b"accept-ranges", b"bytes"))
    if_none_match = request_headers.get("if-none-match")
    if matches_etag(if_none_match, etag) or (
        if_none_match is None
        and not_modified_since(last_modified, request_headers.get("if-modified-since"))
    ):
        return BodyResponse(304, headers, b"", entry.repository)
    if modified_after(last_modified, request_headers.get("if-unmodified-since")):
        return error(412, "the entry changed since the given If-Unmodified-Since date")

    size = entry.size
    start, length, status = 0, size, 200
    range_header = request_headers.get("range")
    if range_header and if_range_holds(request_headers.get("if-range"), etag, last_modified):
        parsed = parse_range(range_header, size)
        if isinstance(parsed, str):
            resp = error(416, f"range {range_header!r} is outside the {size} bytes")
            resp.headers.append((b"content-range", f"bytes */{size}".encode()))
            return resp
        if parsed is not None:
            start, end = parsed
            length = end - start + 1
            status = 206
            headers.append((b"content-range", f"bytes {start}-{end}/{size}".encode()))
    headers.append((b"content-length", str(length).encode()))
    if method == "HEAD":
        if hot.get(entry.sha256) is None:  # in memory: served as a GET would be, no stat
            await body.check()  # raises FileNotFoundError if the blob is gone
        return BodyResponse(status, headers, b"", entry.repository)
    if size <= HOT_MAX_BLOB_BYTES:
        data = hot.get(entry.sha256)
        if data is None:
            data = await body.read_all()
            hot.put(entry.sha256, data)
        return BodyResponse(status, headers, data[start : start + length], entry.repository)
    # A range of a file not known good is sent only once the whole file is verified: a
    # range cannot be cut before "its last byte" of the blob.
    opened = await body.open(whole_first=status == 206)
    if isinstance(opened, OpenBlob):
        return FileResponse(
            status, headers, opened.fd, start, length, entry.repository, check=opened.check
        )
    return DownloadResponse(headers, opened, entry.repository, False, status, start, length)


async def relocated_blob(
    request_headers: Mapping[str, str],
    method: str,
    entry: Entry,
    blob_body: BlobBody,
    hot: HotBlobs,
    marks: MarkCounts,
    extra: Mapping[str, str],
    now_ms: int,
    base_url: str,
) -> BodyResponse | FileResponse:
    """Serve a stored entry whose body holds base-URL marks (``FetchSpec.base_url_marks``),
    each one replaced by ``base_url``: the bytes differ by the URL clients reach us at, so
    the ETag names both the blob and that URL, and there are no byte ranges. A small body
    is rewritten in memory; a large one chunk by chunk as it is read (the mark is one
    byte, so no chunk boundary splits one), its length from a count made once. Raises
    FileNotFoundError if the blob is gone."""
    assert entry.sha256 is not None
    base = base_url.encode("ascii")
    etag = etag_of(f"{entry.sha256}-{hashlib.sha256(base).hexdigest()[:16]}")
    last_modified = entry.last_modified
    if not last_modified or not header_value_ok(last_modified):
        last_modified = http_date(entry.fetched_at_ms)
    headers = _base_headers(entry.content_type, extra)
    if "cache-control" not in extra:
        headers.append((b"cache-control", cache_control(entry.kind, entry.max_age_s(now_ms))))
    headers.append((b"etag", etag.encode()))
    headers.append((b"last-modified", last_modified.encode("latin-1")))
    if_none_match = request_headers.get("if-none-match")
    if matches_etag(if_none_match, etag) or (
        if_none_match is None
        and not_modified_since(last_modified, request_headers.get("if-modified-since"))
    ):
        return BodyResponse(304, headers, b"", entry.repository)
    if entry.size <= HOT_MAX_BLOB_BYTES:
        body = hot.get(entry.sha256)
        if body is None:
            body = await blob_body.read_all()
            hot.put(entry.sha256, body)
        served = body.replace(MARK, base)
        headers.append((b"content-length", str(len(served)).encode()))
        return BodyResponse(200, headers, b"" if method == "HEAD" else served, entry.repository)
    fd = await _open_verified(blob_body, entry.sha256)  # counted, then read, whole
    try:
        count = await marks.of(entry.sha256, fd)
    except BaseException:
        os.close(fd)
        raise
    length = entry.size + count * (len(base) - len(MARK))
    headers.append((b"content-length", str(length).encode()))
    if method == "HEAD":
        os.close(fd)
        return BodyResponse(200, headers, b"", entry.repository)

    def rewrite(chunk: bytes) -> bytes:
        return chunk.replace(MARK, base)

    return FileResponse(200, headers, fd, 0, entry.size, entry.repository, rewrite)


async def _open_verified(blob_body: BlobBody, sha256: str) -> int:
    """A descriptor of the blob's complete, verified file on this host: its marks are
    counted before anything is sent. On object storage the local tier fills first; a
    copy that goes (or is found corrupt and dropped) meanwhile is filled once more."""
    for _attempt in (1, 2):
        await blob_body.complete_path()
        opened = await blob_body.open(whole_first=True)
        if isinstance(opened, OpenBlob):
            return opened.fd
    raise FileNotFoundError(errno.ENOENT, f"no complete copy of blob {sha256} here")


def downloading(
    method: str,
    download: Transfer,
    extra: Mapping[str, str],
    repository: str,
    cache_control_value: bytes,
) -> DownloadResponse:
    headers = _base_headers(download.content_type, extra)
    headers.append((b"cache-control", cache_control_value))
    # A load balancer in front (deploy/nginx.conf) passes a download in progress on as
    # it comes, and keeps no copy of it: its clients share our single download.
    headers.append((b"x-accel-buffering", b"no"))
    if download.total is not None:
        headers.append((b"content-length", str(download.total).encode()))
    return DownloadResponse(headers, download, repository, head=method == "HEAD")


def vary_on(response: object, names: tuple[str, ...]) -> None:
    """Add ``names`` to the Vary header of an answer built by this module (a list of
    headers); any other answer is left as it is."""
    headers = getattr(response, "headers", None)
    if not isinstance(headers, list):
        return
    for i, (name, value) in enumerate(headers):
        if name == b"vary":
            have = {v.strip().lower() for v in value.decode("latin-1").split(",")}
            more = [n for n in names if n.lower() not in have]
            if more:
                headers[i] = (name, value + b", " + ", ".join(more).encode())
            return
    headers.append((b"vary", ", ".join(names).encode()))


def _base_headers(content_type: str | None, extra: Mapping[str, str]) -> Headers:
    """Content-Type (the adapter's choice in ``extra`` wins over the stored one) and extras."""
    headers: Headers = []
    if "content-type" not in extra:
        # A stored value that is not valid HTTP (kept before upstream headers were
        # checked) is left out rather than failing every answer for this entry.
        if not content_type or not header_value_ok(content_type):
            content_type = "application/octet-stream"
        headers.append((b"content-type", content_type.encode("ascii")))
    for name, value in extra.items():
        headers.append((name.lower().encode(), value.encode("latin-1")))
    return headers
