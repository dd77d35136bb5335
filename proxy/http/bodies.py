"""Where a stored blob's bytes come from for one answer, checked as they are read
(docs/architecture.md, "Blobs verified when read").

A ``BlobBody`` is one answer's access to one blob: its file here (``FileBody``), or, on
object storage, the local copy or the object as it arrives (``fetch/fill.py``). Every
open of a file checks its size (one ``fstat`` of the descriptor, in the same thread hop
as the open); a small blob is hashed as it is read into the hot LRU (``HotBlobs``); a
large one is sent as is only if its stamp says it is the file last verified here, and
otherwise hashed as it is sent (``SendCheck``: the last chunk waits for the digest) or,
before a byte range of it, hashed whole first. A copy found wrong is handed to
``on_corrupt`` (the quarantine) and never served again: the caller sees the blob as gone
(``FileNotFoundError``), the path that fetches it once more.
"""

from __future__ import annotations

import errno
import os
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from proxy.contract import BASE_URL_MARK
from proxy.fetch.transfer import Transfer
from proxy.runtime.blocking import run_blocking
from proxy.storage.integrity import (
    SMALL_BLOB_BYTES,
    Corruption,
    Stamp,
    Stamps,
    open_sized,
    read_verified,
    stat_sized,
    verify_fd,
)

HOT_MAX_BLOB_BYTES = SMALL_BLOB_BYTES  # blobs up to this size are kept in memory
HOT_CAPACITY_BYTES = 64 * 1024 * 1024
MARK = BASE_URL_MARK.encode()  # one byte (docs/architecture.md, "Requests")
MARK_COUNTS_CAPACITY = 10_000  # bodies whose count of base-URL marks is remembered
MARK_COUNT_READ_BYTES = 1024 * 1024

# What to do with a copy found wrong: the quarantine (cache/quarantine.py), or, for an
# object store's local copy, dropping it.
OnCorrupt = Callable[[Corruption], Awaitable[None]]


class HotBlobs:
    """Small blob bodies by sha256 (content-addressed, so never stale), LRU-bounded.
    Only verified bytes are put here (``FileBody.read_all`` hashes them)."""

    def __init__(self, capacity_bytes: int = HOT_CAPACITY_BYTES) -> None:
        self.capacity_bytes = capacity_bytes
        self.size_bytes = 0
        self._items: OrderedDict[str, bytes] = OrderedDict()

    def get(self, sha256: str) -> bytes | None:
        body = self._items.get(sha256)
        if body is not None:
            self._items.move_to_end(sha256)
        return body

    def put(self, sha256: str, body: bytes) -> None:
        if sha256 in self._items or len(body) > HOT_MAX_BLOB_BYTES:
            return
        self._items[sha256] = body
        self.size_bytes += len(body)
        while self.size_bytes > self.capacity_bytes:
            _, old = self._items.popitem(last=False)
            self.size_bytes -= len(old)

    def drop(self, sha256: str) -> None:
        body = self._items.pop(sha256, None)
        if body is not None:
            self.size_bytes -= len(body)


@dataclass(slots=True)
class SendCheck:
    """A file sent while it is hashed: the response holds its last chunk back until the
    digest is known, and cuts itself short on a mismatch (``FileResponse``)."""

    sha256: str
    size: int
    stamp: Stamp
    stamps: Stamps
    on_corrupt: OnCorrupt

    def matched(self) -> None:
        self.stamps.note(self.sha256, self.stamp)

    async def mismatched(self, found_size: int, found_sha256: str | None) -> None:
        await self.on_corrupt(
            Corruption(self.sha256, self.size, found_size, found_sha256, self.stamp)
        )


@dataclass(slots=True)
class OpenBlob:
    """A complete blob file opened for one answer (``fd`` is the answer's to close)."""

    fd: int
    check: SendCheck | None  # None: verified already, sent as is


class BlobBody(Protocol):
    """Where the bytes of one stored blob come from, for one answer. Each method raises
    FileNotFoundError if the blob is gone, or was found corrupt (and quarantined)."""

    async def check(self) -> None:
        """A HEAD's check: only what costs nothing remote (the catalog knows the size)."""
        ...

    async def read_all(self) -> bytes:
        """The whole (small) body, verified."""
        ...

    async def open(self, whole_first: bool) -> OpenBlob | Transfer:
        """A descriptor of the complete file, or the body as it arrives (its last byte
        held back until verified). ``whole_first``: a file not known good is hashed
        whole before it is returned (a byte range is about to be sent from it)."""
        ...

    async def complete_path(self) -> str:
        """A complete, verified file of the blob on this host (object storage: once the
        local tier has it)."""
        ...


class BlobFiles:
    """How this process opens stored blob files for answers: the stamps of the files it
    verified, and ``storage.verify_reads`` (then no stamp is trusted: every read is
    hashed). File calls go to the I/O pool: the storage may be a network volume."""

    def __init__(self, stamps: Stamps, verify_reads: bool = False) -> None:
        self.stamps = stamps
        self.verify_reads = verify_reads

    async def check(self, path: str, sha256: str, size: int) -> Corruption | None:
        return await run_blocking(stat_sized, path, sha256, size)

    async def read(self, path: str, sha256: str, size: int) -> bytes | Corruption:
        found = await run_blocking(read_verified, path, sha256, size)
        if isinstance(found, Corruption):
            return found
        data, stamp = found
        self.stamps.note(sha256, stamp)
        return data

    async def open(
        self, path: str, sha256: str, size: int, whole_first: bool, on_corrupt: OnCorrupt
    ) -> OpenBlob | Corruption:
        opened = await run_blocking(open_sized, path, sha256, size)
        if isinstance(opened, Corruption):
            return opened
        fd, stamp = opened
        if not self.verify_reads and self.stamps.known_good(sha256, stamp):
            return OpenBlob(fd, None)
        if whole_first:
            try:
                found = await run_blocking(verify_fd, fd, sha256, size, stamp)
            except BaseException:
                os.close(fd)
                raise
            if found is not None:
                os.close(fd)
                return found
            self.stamps.note(sha256, stamp)
            return OpenBlob(fd, None)
        return OpenBlob(fd, SendCheck(sha256, size, stamp, self.stamps, on_corrupt))


def gone(sha256: str) -> FileNotFoundError:
    """What a caller sees of a blob found corrupt: it is gone (it was quarantined), so
    the entry is forgotten and fetched again, as when a blob vanished."""
    return FileNotFoundError(errno.ENOENT, f"blob {sha256} was found corrupt")


class FileBody:
    """A blob's complete file on this host (the folder store)."""

    __slots__ = ("files", "on_corrupt", "path", "sha256", "size")

    def __init__(
        self, files: BlobFiles, path: str, sha256: str, size: int, on_corrupt: OnCorrupt
    ) -> None:
        self.files = files
        self.path = path
        self.sha256 = sha256
        self.size = size
        self.on_corrupt = on_corrupt

    async def check(self) -> None:
        found = await self.files.check(self.path, self.sha256, self.size)
        if found is not None:
            await self.on_corrupt(found)
            raise gone(self.sha256)

    async def read_all(self) -> bytes:
        found = await self.files.read(self.path, self.sha256, self.size)
        if isinstance(found, Corruption):
            await self.on_corrupt(found)
            raise gone(self.sha256)
        return found

    async def open(self, whole_first: bool) -> OpenBlob | Transfer:
        opened = await self.files.open(
            self.path, self.sha256, self.size, whole_first, self.on_corrupt
        )
        if isinstance(opened, Corruption):
            await self.on_corrupt(opened)
            raise gone(self.sha256)
        return opened

    async def complete_path(self) -> str:
        # Verified first: what reads it by its path (an index document's parser) must
        # read what a client would get (docs/architecture.md, "Blobs verified when read").
        opened = await self.open(whole_first=True)
        assert isinstance(opened, OpenBlob)
        os.close(opened.fd)
        return self.path


class MarkCounts:
    """How many base-URL marks a stored body holds, by sha256 (content-addressed, so never
    stale; LRU-bounded): a large body is counted once, not at every request. Counted
    from a verified file (``BlobBody.open(whole_first=True)``)."""

    def __init__(self, capacity: int = MARK_COUNTS_CAPACITY) -> None:
        self.capacity = capacity
        self._counts: OrderedDict[str, int] = OrderedDict()

    async def of(self, sha256: str, fd: int) -> int:
        count = self._counts.get(sha256)
        if count is None:
            count = await run_blocking(_count_marks, fd)
            self._counts[sha256] = count
            if len(self._counts) > self.capacity:
                self._counts.popitem(last=False)
        else:
            self._counts.move_to_end(sha256)
        return count

    def forget(self, sha256: str) -> None:
        self._counts.pop(sha256, None)


def _count_marks(fd: int) -> int:
    count = offset = 0
    while chunk := os.pread(fd, MARK_COUNT_READ_BYTES, offset):
        count += chunk.count(MARK)
        offset += len(chunk)
    return count
