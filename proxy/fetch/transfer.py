"""A body as this process's clients read it while it is downloaded, here or by another
replica, even when the downloader changes (docs/architecture.md, "Streaming across
replicas").

A ``Transfer`` reads from one source at a time:

- ``LocalFile``: our own download (``download.Download``), followed through its
  announcements;
- ``SharedFile``: the temp file another replica is writing on the shared volume (its
  lease row named it), followed by looking at the file's size every few milliseconds.

Every source holds back its last byte until the body is verified: ours when our own
checks pass; another replica's when its entry is recorded and its blob is the very file
we read (same inode). A client therefore never receives a complete body that is wrong.

When the downloader dies, its readers wait (``lost``); when a new download starts
(``replace``), the bytes our clients were already given are compared with the new
download's first bytes (sha256 of the prefix) before anyone continues. If they differ,
every client is cut: two different byte streams are never spliced.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

from proxy.catalog import Entry
from proxy.exceptions import BodyChanged, ProxyError, ShuttingDown, TransferCut
from proxy.fetch.download import Download
from proxy.runtime.blocking import run_blocking
from proxy.storage import blobs

log = logging.getLogger("proxy.transfer")

# A module attribute, so that a test may slow the open down (tests/test_transfer_lifecycle.py).
_open_regular = blobs.open_regular

SHARED_POLL_S = 0.01  # how often a shared file's size is looked at while readers wait
DIGEST_READ_BYTES = 1024 * 1024

Spawn = Callable[[str, Coroutine[Any, Any, Any]], "asyncio.Task[Any]"]


class Source(Protocol):
    content_type: str | None
    total: int
    # Its bytes are in this host's page cache (our own download, just written): they may
    # be sent with sendfile on the event loop without waiting on a disk or a network.
    page_cached: bool

    @property
    def fd(self) -> int | None:
        """The open file, or None once closed."""
        ...

    @property
    def error(self) -> BaseException | None:
        """Why the source cannot go on (a local download's failure), if it cannot."""
        ...

    def readable(self) -> int:
        """How many bytes from the start may be read now."""
        ...

    def complete(self) -> bool:
        """Every byte may be read (the body is verified)."""
        ...

    def subscribe(self, listener: Callable[[], None]) -> None: ...

    async def read(self, offset: int, size: int) -> bytes: ...

    def prefix_digest(self, length: int) -> str:
        """sha256 of the first ``length`` bytes (blocking: run it in a thread)."""
        ...

    async def is_stored(self, blob: StoredBlob) -> bool:
        """Is ``blob`` the very body this source has been giving (so its last byte may
        go out from here)? Called once the body is stored; a source that says yes is
        complete from then on."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class StoredBlob:
    """A stored body, as this host reads it: ``path`` is where its complete file is, or
    will be (the local tier's copy of an object may not be there yet); ``open`` gives a
    source of it from its first byte (the file, or the object as it arrives)."""

    sha256: str
    size: int
    path: str
    open: Callable[[], Awaitable[Source]]


def _digest(fd: int, length: int) -> str:
    hasher = hashlib.sha256()
    offset = 0
    while offset < length:
        data = os.pread(fd, min(DIGEST_READ_BYTES, length - offset), offset)
        if not data:
            raise OSError(f"the file ended at {offset} of {length} bytes")
        hasher.update(data)
        offset += len(data)
    return hasher.hexdigest()


class LocalFile:
    """Our own download, read through a descriptor of our own."""

    page_cached = True

    def __init__(self, download: Download, fd: int) -> None:
        """``fd``: the download's file, ours to close (``TempBlob.reader_fd``)."""
        assert download.total is not None, "only a body of known length is streamed"
        self.download = download
        self.content_type = download.content_type
        self.total = download.total
        self._fd: int | None = fd

    @property
    def error(self) -> BaseException | None:
        return self.download.error

    @property
    def fd(self) -> int | None:
        return self._fd

    def readable(self) -> int:
        written = self.download.written
        return written if self.download.verified else max(0, written - 1)

    def complete(self) -> bool:
        return self.download.verified

    def subscribe(self, listener: Callable[[], None]) -> None:
        self.download.subscribe(listener)

    async def read(self, offset: int, size: int) -> bytes:
        assert self._fd is not None
        # Just written, so in the page cache: a read here is cheaper than a hop to a
        # thread (this runs once per chunk per client).
        return os.pread(self._fd, size, offset)

    def prefix_digest(self, length: int) -> str:
        assert self._fd is not None
        return _digest(self._fd, length)

    async def is_stored(self, blob: StoredBlob) -> bool:
        return False  # our own download is complete once verified, before it is stored

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class SharedFile:
    """A file on the shared volume: another replica's download in progress (its size is
    watched), or a published blob (complete from the start)."""

    page_cached = False  # maybe a network file system: read in the I/O pool

    def __init__(
        self,
        fd: int,
        path: str,
        content_type: str | None,
        total: int,
        spawn: Spawn,
        complete: bool,
    ) -> None:
        self.path = path
        self.content_type = content_type
        self.total = total
        self.error: BaseException | None = None
        self._fd: int | None = fd
        self._size = total if complete else 0
        self._complete = complete
        self._listeners: list[Callable[[], None]] = []
        self._watcher = None if complete else spawn(f"shared-file:{path}", self._watch())

    @classmethod
    async def open(
        cls, path: str, content_type: str | None, total: int, spawn: Spawn, complete: bool
    ) -> SharedFile:
        """Raises OSError if ``path`` is gone, or is not a regular file of its own (a
        symlink, a FIFO: whoever can write the shared folder must not make us read
        elsewhere, or block)."""
        # Off the event loop: the shared volume may be a network file system.
        fd = await run_blocking(_open_regular, path)
        return cls(fd, path, content_type, total, spawn, complete)  # spawns on the loop

    @property
    def fd(self) -> int | None:
        return self._fd

    def readable(self) -> int:
        return self.total if self._complete else max(0, min(self._size, self.total) - 1)

    def complete(self) -> bool:
        return self._complete

    def subscribe(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    async def read(self, offset: int, size: int) -> bytes:
        fd = self._fd
        if fd is None:
            raise TransferCut("the shared download was closed")
        return await run_blocking(os.pread, fd, size, offset)

    def prefix_digest(self, length: int) -> str:
        assert self._fd is not None
        return _digest(self._fd, length)

    async def is_stored(self, blob: StoredBlob) -> bool:
        """Is the published blob the very file we have been reading (same device and
        inode: publishing is a rename)?"""
        fd = self._fd
        if fd is None:
            return False

        def same() -> bool:
            ours, theirs = os.fstat(fd), os.stat(blob.path)
            return (ours.st_dev, ours.st_ino) == (theirs.st_dev, theirs.st_ino)

        try:
            if not await run_blocking(same):
                return False
        except OSError:
            return False
        self.mark_complete()
        return True

    def mark_complete(self) -> None:
        self._complete = True
        self._size = self.total
        self._announce()

    async def _watch(self) -> None:
        while not self._complete and self._fd is not None:
            fd = self._fd
            try:
                size = (await run_blocking(os.fstat, fd)).st_size
            except OSError as exc:
                self.error = exc
                self._announce()
                return
            if size > self._size:
                self._size = size
                self._announce()
            await asyncio.sleep(SHARED_POLL_S)

    def _announce(self) -> None:
        for listener in self._listeners:
            listener()

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class Transfer:
    """One body for this process's clients, whichever source it currently comes from."""

    def __init__(
        self,
        source: Source,
        spawn: Spawn,
        on_changed: Callable[[Transfer], None] | None = None,
    ) -> None:
        self.content_type = source.content_type
        self.total = source.total
        self.error: BaseException | None = None
        self.entry: Entry | None = None
        self._spawn = spawn
        self._source: Source | None = source
        self._blob: StoredBlob | None = None  # the body once it is stored
        self._readers = 0
        self._waiting_for_source = False
        self._served = 0  # the most bytes any client has been given
        self._changed = asyncio.Event()
        self._done = asyncio.Event()
        self._switch_lock = asyncio.Lock()
        self._reopen_lock = asyncio.Lock()
        self._switch: asyncio.Task[None] | None = None
        # Told of the transfer that carries a changed body on for clients that come later.
        self._on_changed = on_changed
        source.subscribe(self._announce)

    # -- the fetcher's side ------------------------------------------------------------

    def lost(self) -> None:
        """The downloader is gone: readers wait for ``replace`` (or ``fail``)."""
        self._waiting_for_source = True
        self._announce()

    def replace(self, source: Source) -> None:
        """Continue from ``source`` once its first bytes are proven the ones already sent."""
        if self._done.is_set():  # nothing more comes of a concluded transfer
            source.close()
            return
        self._waiting_for_source = True
        if self._switch is not None:
            self._switch.cancel()
        switch = self._spawn("transfer-switch", self._switch_to(source))
        switch.add_done_callback(lambda task: self._switch_ended(task, source))
        self._switch = switch

    def _switch_ended(self, switch: asyncio.Task[None], source: Source) -> None:
        # A switch cancelled before it ran (or while it waited for the one before it)
        # never reached its own clean-up: its source is closed here.
        if switch.cancelled() and source is not self._source:
            source.close()
            if switch is self._switch and self._waiting_for_source:
                # Cancelled from outside (the proxy is stopping), not by a newer source
                # or a failure: nothing will continue our clients.
                self.fail(ShuttingDown("the proxy is shutting down"))
        self._maybe_close()

    def concluded(self) -> bool:
        """Stored or failed: nothing more will happen to it."""
        return self._done.is_set()

    async def stored(self, blob: StoredBlob, entry: Entry | None) -> None:
        """The body is stored as ``blob`` (``entry`` None: not recorded). If it is the
        very body our source has (our verified download; another replica's file, now
        renamed to the blob; a relayed copy whose digest is the blob's), the rest is
        released from it; otherwise the blob becomes the source, once proven to begin
        with what was sent."""
        if self._done.is_set():
            return
        source = self._source
        if source is not None and not self._waiting_for_source and blob.size == self.total:
            if source.complete():
                self._finish(entry, blob)
                return
            if (
                await source.is_stored(blob)
                and source is self._source  # still: is_stored waited
                and not self._waiting_for_source
            ):
                self._finish(entry, blob)
                return
        try:
            new = await blob.open()
        except (OSError, ProxyError) as exc:
            self.fail(TransferCut(f"the stored body cannot be read: {exc}"))
            return
        if self._done.is_set():  # failed (maybe handed on) while the blob was opened
            new.close()
            return
        self.replace(new)
        self._finish(entry, blob)

    def _finish(self, entry: Entry | None, blob: StoredBlob) -> None:
        self.entry = entry
        self._blob = blob
        self._done.set()
        self._announce()
        self._maybe_close()

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
            self._done.set()
            switch = self._switch
            if switch is not None and switch is not asyncio.current_task():
                switch.cancel()  # it would wait for a source nobody will read
            self._announce()
            self._maybe_close()

    def _maybe_close(self) -> None:
        """Close the source once nobody reads it and nothing more will come of it: a
        failed download's file, though unlinked, holds its disk space while it is open.
        A stored body is reopened from its blob for a reader that comes later."""
        if (
            self._readers == 0
            and self._done.is_set()
            and self._source is not None
            and (self._switch is None or self._switch.done())
        ):
            self._source.close()
            self._source = None

    # -- the readers' side ---------------------------------------------------------------

    def verified(self) -> bool:
        """Every byte is verified (what remains is storing it, if anything)."""
        return self._done.is_set() or (self._source is not None and self._source.complete())

    async def result(self) -> Entry | None:
        """The stored entry when the body is complete (None if it could not be recorded)."""
        await self._done.wait()
        if self.error is not None:
            raise self.error
        return self.entry

    def reader(self, start: int = 0) -> Reader:
        """A client's position in the body; close it when the client is done."""
        self._readers += 1
        return Reader(self, start)

    async def _span(self, offset: int) -> Span | None:
        while True:
            changed = self._changed
            if self.error is not None:
                raise self.error
            if self._source is None:
                await self._reopen()
            source = self._source
            assert source is not None
            if not self._waiting_for_source:
                if source.error is not None:
                    raise source.error
                readable = source.readable()
                if offset < readable:
                    return Span(source, offset, readable)
                if source.complete() and offset >= self.total:
                    return None
            await changed.wait()

    def _current(self, span: Span) -> bool:
        """Is ``span``'s source still the proven one (so its bytes may be sent)?"""
        return span.source is self._source and not self._waiting_for_source

    def _served_to(self, offset: int) -> None:
        self._served = max(self._served, offset)

    def _reader_closed(self) -> None:
        self._readers -= 1
        self._maybe_close()

    # -- internals -----------------------------------------------------------------------

    async def _reopen(self) -> None:
        async with self._reopen_lock:  # readers that come together share one descriptor
            if self._source is not None:
                return
            if self._blob is None:
                raise TransferCut("the download ended before this reader started")
            self._source = await self._blob.open()

    def _announce(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def _switch_to(self, new: Source) -> None:
        async with self._switch_lock:
            try:
                await self._prove(new)
            except asyncio.CancelledError:
                new.close()  # replaced by a newer source
                raise
            except BodyChanged as exc:
                log.warning("%s", exc)
                self._hand_on(new)
                self.fail(exc)
                return
            except Exception as exc:
                # The old file cannot be compared (truncated, or unreadable: ESTALE on
                # NFS), or the new one failed. Our clients are cut with a proxy error (a
                # 502/503, never a 500); a sound new body still serves later clients.
                log.warning("cannot continue from the new download: %s", exc)
                if new.error is None and self.error is None:
                    self._hand_on(new)
                else:
                    new.close()
                self.fail(
                    exc
                    if isinstance(exc, ProxyError)
                    else TransferCut(f"cannot continue from the new download: {exc}")
                )
                return
            old, self._source = self._source, new
            new.subscribe(self._announce)
            if old is not None:
                old.close()
            self._waiting_for_source = False
            self._announce()

    def _hand_on(self, new: Source) -> None:
        """Our clients are cut (they had headers, maybe bytes, of the old body), but the
        new body is sound: a successor transfer serves it to the clients that come later."""
        if self._on_changed is None:
            new.close()
            return
        successor = Transfer(new, self._spawn, self._on_changed)
        if self._done.is_set() and self.error is None and self._blob is not None:
            successor._finish(self.entry, self._blob)
        self._on_changed(successor)

    async def _prove(self, new: Source) -> None:
        if new.total != self.total:
            raise BodyChanged(
                f"the body is now {new.total} bytes, not {self.total}: the clients that had "
                "part of it are cut"
            )
        needed = self._served
        progressed = asyncio.Event()
        new.subscribe(progressed.set)
        while new.readable() < needed and not new.complete():
            if new.error is not None:
                raise new.error
            if self.error is not None:
                raise self.error
            progressed.clear()
            await progressed.wait()
        if needed:
            old = self._source
            if old is None:
                raise BodyChanged("the bytes already sent can no longer be compared")
            sent = await run_blocking(old.prefix_digest, needed)
            fresh = await run_blocking(new.prefix_digest, needed)
            if sent != fresh:
                raise BodyChanged(
                    f"the new download does not begin with the {needed} bytes already sent "
                    "(the upstream changed the file): the clients that had them are cut"
                )


@dataclass(frozen=True)
class Span:
    """Bytes ``offset`` up to ``end`` of ``source`` may be sent now."""

    source: Source
    offset: int
    end: int


class Reader:
    """One client's position in a transfer. ``next_span`` waits for sendable bytes; the
    client either reads them (``read``) or sends them itself from the span's file
    (``sent``, e.g. with sendfile, on the event loop with no await since ``next_span``,
    so the source cannot have changed in between)."""

    def __init__(self, transfer: Transfer, start: int) -> None:
        self.transfer = transfer
        self.offset = start
        self._closed = False

    async def next_span(self) -> Span | None:
        """What may be sent from here, once there is some; None at the end of the body.
        Raises if the body cannot be completed."""
        return await self.transfer._span(self.offset)

    async def read(self, span: Span, size: int) -> bytes:
        """Up to ``size`` bytes of ``span``; empty if the source changed meanwhile (they
        were not proven: ask for the next span)."""
        try:
            data = await span.source.read(self.offset, min(size, span.end - self.offset))
        except (OSError, TransferCut):
            if self.transfer._current(span):
                raise
            return b""  # closed by a switch to a proven source under our read: go on
        if not self.transfer._current(span):
            return b""
        if not data:
            raise TransferCut(f"the body file ended at {self.offset} bytes")
        self.sent(len(data))
        return data

    def sent(self, count: int) -> None:
        self.offset += count
        self.transfer._served_to(self.offset)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.transfer._reader_closed()
