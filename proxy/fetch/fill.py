"""Hits on object storage without a local copy (docs/architecture.md, "Object storage"):
one GET per blob per replica fills the local tier, and every client reads the file as
it grows, from the first byte on.

Single flight: concurrent cold hits on one blob share one ``Fill``. Its body is written
to a temp file of the tier, hashed as it is written; the last byte is held back until
its length and sha256 are the blob's (``Download.verify``), then the file becomes the
tier's copy. An object whose bytes are not its name's (corrupt) cuts its clients before
the last byte, is never kept, and is quarantined (every entry naming it is deleted), so
the next request fetches it from the upstream again. A missing object is
FileNotFoundError: the cache's "blob vanished" path forgets the entry and fetches again.

A local copy is read like a folder's file (``http/bodies.py``: its size at every open,
its sha256 unless stamped); one found corrupt is dropped, and the object is read
instead, through a fill (docs/architecture.md, "Blobs verified when read").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

from proxy.catalog import Entry
from proxy.exceptions import ShuttingDown, StorageError
from proxy.fetch.download import Download
from proxy.fetch.transfer import LocalFile, SharedFile, Source, StoredBlob, Transfer
from proxy.http.bodies import BlobBody, BlobFiles, OnCorrupt, OpenBlob, gone
from proxy.runtime import metrics
from proxy.runtime.tasks import TaskSupervisor
from proxy.storage.blobs import TempBlob, storage_error
from proxy.storage.integrity import Corruption
from proxy.storage.objects import ObjectStorage

log = logging.getLogger("proxy.fill")


class CorruptObject(StorageError):
    """The object's bytes are not the blob its key names."""


class Fill:
    """One GET of one blob into the local tier, read by this replica's clients."""

    def __init__(self, fills: TierFills, sha256: str, size: int) -> None:
        self.fills = fills
        self.sha256 = sha256
        self.size = size
        self.download = Download(None, size)
        self.temp: TempBlob | None = None
        self.transfer: Transfer | None = None
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.found: Corruption | None = None  # what a corrupt object holds

    def source(self) -> Source:
        """A source of its own (a descriptor of its own) for one more transfer."""
        assert self.temp is not None
        return LocalFile(self.download, self.temp.reader_fd())

    async def run(self) -> None:
        storage = self.fills.storage
        try:
            stream = await storage.open_object(self.sha256)
        except BaseException as exc:
            self.ready.set_exception(exc)
            raise
        try:
            if stream.size != self.size:
                self.found = Corruption(self.sha256, self.size, stream.size)
                raise CorruptObject(
                    f"the object of {self.sha256} is {stream.size} bytes, not {self.size}"
                )
            temp = self.temp = await storage.files.new_temp()
            temp.on_progress = self.download.advance_to
            self.transfer = Transfer(self.source(), self.fills.tasks.spawn)
            self.ready.set_result(None)
            try:
                async for chunk in stream.chunks():
                    await temp.write(chunk)
                    if temp.size > self.size:
                        break
                await temp.flush()
                if temp.size != self.size or temp.sha256 != self.sha256:
                    self.found = Corruption(self.sha256, self.size, temp.size, temp.sha256)
                    raise CorruptObject(
                        f"the object of {self.sha256} holds {temp.size} bytes with sha256 "
                        f"{temp.sha256}: not the blob"
                    )
                self.download.verify()  # the last byte may go out now
                await storage.tier.adopt(temp, self.sha256)
            except BaseException as exc:
                await temp.discard()
                self.download.fail(exc)
                raise
            self.download.finish()
            blob = self.fills.stored_blob(self.sha256, self.size)
            await self.transfer.stored(blob, None)
        except BaseException as exc:
            if self.transfer is not None:
                self.transfer.fail(
                    exc if isinstance(exc, Exception) else StorageError("the proxy is stopping")
                )
            joiners: BaseException = exc
            if isinstance(exc, CorruptObject) and self.found is not None:
                metrics.STORAGE_ERRORS.labels(operation="get", errno="corrupt").inc()
                # Shielded: its clients (cut already) may all be gone by now.
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.fills.on_corrupt(self.found))
                joiners = gone(self.sha256)  # quarantined: fetched again, like a vanished blob
            if not self.ready.done():
                self.ready.set_exception(joiners)
            raise
        finally:
            stream.close()


class TierFills:
    """The fills of this process, by sha256; ``files`` opens the local copies, and an
    object found corrupt goes to ``on_corrupt`` (the quarantine)."""

    def __init__(
        self, storage: ObjectStorage, tasks: TaskSupervisor, files: BlobFiles, on_corrupt: OnCorrupt
    ) -> None:
        self.storage = storage
        self.tasks = tasks
        self.files = files
        self.on_corrupt = on_corrupt
        self._fills: dict[str, Fill] = {}

    def body(self, entry: Entry) -> BlobBody:
        assert entry.sha256 is not None
        return TierBody(self, entry.sha256, entry.size)

    def stored_blob(self, sha256: str, size: int) -> StoredBlob:
        async def open_blob() -> Source:
            return await self.source(sha256, size, None)

        return StoredBlob(sha256, size, self.storage.blob_path(sha256), open_blob)

    async def source(self, sha256: str, size: int, content_type: str | None) -> Source:
        """A source of the stored blob from its first byte: the local copy, or the
        object as it arrives (``Fetcher``'s ``open_stored``)."""
        fd = await self.storage.tier.open_copy(sha256, size)
        if fd is not None:
            path = self.storage.blob_path(sha256)
            return SharedFile(fd, path, content_type, size, self.tasks.spawn, True)
        fill = await self.join(sha256, size)
        return fill.source()

    async def join(self, sha256: str, size: int) -> Fill:
        """The fill of ``sha256`` once its GET answered: ours or one running already.
        FileNotFoundError if there is no object; StorageError if the bucket fails."""
        fill = self._fills.get(sha256)
        if fill is None:
            if self.tasks.closing:
                raise ShuttingDown("the proxy is shutting down")
            fill = Fill(self, sha256, size)
            self._fills[sha256] = fill
            self.tasks.spawn(f"fill:{sha256[:12]}", self._run(fill))
        await asyncio.shield(fill.ready)
        return fill

    async def _run(self, fill: Fill) -> None:
        try:
            await fill.run()
        except (StorageError, FileNotFoundError) as exc:
            log.debug("fill of %s ended: %s", fill.sha256, exc)
        except OSError as exc:
            log.error("%s", storage_error(f"filling the local copy of {fill.sha256}", "fill", exc))
        finally:
            if self._fills.get(fill.sha256) is fill:
                del self._fills[fill.sha256]
            if fill.ready.done() and not fill.ready.cancelled():
                fill.ready.exception()  # seen here, even if its joiners all left


class TierBody:
    """``BlobBody`` of one hit on object storage: the local copy, else the object."""

    __slots__ = ("fills", "sha256", "size")

    def __init__(self, fills: TierFills, sha256: str, size: int) -> None:
        self.fills = fills
        self.sha256 = sha256
        self.size = size

    def _local(self) -> str | None:
        return self.fills.storage.local_path(self.sha256)

    def _gone(self) -> None:
        self.fills.storage.tier.forget(self.sha256)

    async def _drop_copy(self, found: Corruption) -> None:
        """The local copy is not the blob: drop it; the object (which a fill verifies)
        is what the next read gets. The blob may well be sound, so no entry goes."""
        self.fills.files.stamps.forget(self.sha256)
        await self.fills.storage.tier.drop([self.sha256])
        metrics.BLOBS_QUARANTINED.labels(reason=found.reason).inc()
        log.error(
            "the local copy of blob %s is corrupt (%s): dropped; its object is read instead",
            self.sha256,
            found.describe(),
        )

    async def check(self) -> None:
        pass  # the catalog knows the size: a HEAD asks the bucket nothing

    async def read_all(self) -> bytes:
        path = self._local()
        if path is not None:
            try:
                found = await self.fills.files.read(path, self.sha256, self.size)
            except FileNotFoundError:
                self._gone()
            else:
                if not isinstance(found, Corruption):
                    return found
                await self._drop_copy(found)
        fill = await self.fills.join(self.sha256, self.size)
        source = fill.source()
        try:
            verified = asyncio.Event()
            source.subscribe(verified.set)
            while not source.complete():
                if source.error is not None:
                    raise source.error
                verified.clear()
                await verified.wait()
            return await source.read(0, self.size)
        finally:
            source.close()

    async def complete_path(self) -> str:
        path = self._local()
        if path is not None:
            try:
                opened = await self.fills.files.open(
                    path, self.sha256, self.size, True, self._drop_copy
                )
            except FileNotFoundError:
                self._gone()
            else:
                if not isinstance(opened, Corruption):
                    os.close(opened.fd)
                    return path
                await self._drop_copy(opened)
        fill = await self.fills.join(self.sha256, self.size)
        assert fill.transfer is not None
        await fill.transfer.result()  # verified and kept (or raises)
        path = self._local()
        if path is None:
            raise FileNotFoundError(f"the local copy of {self.sha256} was not kept")
        return path

    async def open(self, whole_first: bool) -> OpenBlob | Transfer:
        path = self._local()
        if path is not None:
            try:
                opened = await self.fills.files.open(
                    path, self.sha256, self.size, whole_first, self._drop_copy
                )
            except FileNotFoundError:
                self._gone()
            else:
                if not isinstance(opened, Corruption):
                    return opened
                await self._drop_copy(opened)
        fill = await self.fills.join(self.sha256, self.size)
        assert fill.transfer is not None
        return fill.transfer
