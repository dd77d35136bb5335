"""Where published blobs live: the storage seam (docs/architecture.md, "Object storage").

``Storage`` is the seam: the folder store (``blobs.BlobStore``: one shared POSIX volume,
the default) and the object store (``objects.ObjectStorage``: a bucket, with a local
tier of its own on every replica) implement it. Downloads in progress are always local
temp files (``Storage.files``); a store decides only what publishing means, where a hit
finds a complete copy on this host, and how unreferenced blobs are deleted.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from proxy.config.settings import Settings
    from proxy.storage.blobs import BlobStore, TempBlob
    from proxy.storage.integrity import Corruption, Stamp


class BlobStream(Protocol):
    """A stored blob read from its first byte, as the store holds it (a file here, an
    object in the bucket). Close it when done."""

    size: int  # as the store says (the file's size, the object's Content-Length)
    stamp: Stamp | None  # the file's (None: an object)

    def chunks(self) -> AsyncIterator[bytes]:
        """The bytes; ``StorageError`` if the store fails on the way."""
        ...

    def close(self) -> None: ...


class Storage(Protocol):
    # For logs and messages: "folder ./data", "s3://artifacts/proxy/".
    description: str

    @property
    def files(self) -> BlobStore:
        """This process's folder: temp files of downloads in progress, and complete
        copies of blobs (all of them on a shared volume; the local tier's on object
        storage)."""
        ...

    # Other replicas can open our temp files by name (a shared volume): streaming across
    # replicas follows those files; otherwise it goes through the holder's relay.
    shares_temp_files: bool
    # Reclaim deletes an unreferenced blob only once it is this old (a fetch or upload
    # may be about to record it).
    orphan_min_age_s: float

    async def start(self) -> None:
        """Prepare the folders and check the store (a bucket: once, at start-up);
        ``StorageError`` naming the setting if it cannot be used."""
        ...

    async def close(self) -> None: ...

    async def publish(self, temp: TempBlob) -> str:
        """Store a verified temp file under its sha256, which is returned. On return the
        blob can be read by every replica, and ``local_path`` names a copy here."""
        ...

    def local_path(self, sha256: str) -> str | None:
        """A complete file of the blob on this host, or None if there is none to read
        (object storage: not in the local tier). The file may still vanish before it
        is opened (evicted, deleted)."""
        ...

    def blob_path(self, sha256: str) -> str:
        """Where a complete copy of the blob is, or will be once stored, on this host."""
        ...

    async def delete(self, sha256s: Iterable[str], cutoff_s: float) -> tuple[set[str], set[str]]:
        """Delete unreferenced blobs (the tombstone purge, the orphan sweep): those
        deleted now, and those that were already gone. The folder store keeps a file
        modified since ``cutoff_s`` (Unix time: just published again); the object store
        cannot tell without a request per object and deletes them all."""
        ...

    def candidates(self, cutoff_s: float, since_s: float = 0.0) -> AsyncIterator[list[str]]:
        """The sha256 of stored blobs last written from ``since_s`` to before ``cutoff_s``,
        in batches (the orphan sweep asks the catalog about each batch)."""
        ...

    async def remove_leftovers(self, before_s: float) -> int:
        """Remove what crashed writes left, started before ``before_s``: temp files,
        unfinished uploads. How many."""
        ...

    async def problems(self, min_free: int) -> list[str]:
        """Why the storage is not ready (``/readyz``), if it is not: cheap, cached."""
        ...

    async def make_room(self, nbytes: int) -> int:
        """Free about ``nbytes`` on the disk of ``files`` (it is under ``storage.min_free``)
        by dropping what can be fetched again without the upstream: local copies of
        objects, least recently used first. The bytes freed; 0 from the folder store,
        whose every file is the only copy (``storage.max_size`` bounds it)."""
        ...

    async def redirect(self, sha256: str, size: int) -> str | None:
        """A short-lived URL clients may fetch the blob from directly, or None."""
        ...

    async def open_blob(self, sha256: str) -> BlobStream:
        """The blob as the store holds it, where every replica's copies come from (the
        scrub's reads); FileNotFoundError if it has none."""
        ...

    async def quarantine(self, found: Corruption) -> str:
        """A copy of the blob was found corrupt: move the file aside (a folder), drop this
        replica's copy (object storage); what was done, for the log ("its file moved
        to ...")."""
        ...


def open_storage(settings: Settings) -> Storage:
    """The storage ``settings`` name: a folder (``storage.path``, or a path or file://
    URL in ``storage.url``), or a bucket (an s3:// ``storage.url``). Not started yet."""
    from proxy.storage.blobs import BlobStore

    if settings.object_storage is not None:
        from proxy.storage.objects import ObjectStorage

        return ObjectStorage(settings.object_storage, processes=settings.workers)
    return BlobStore(settings.storage_path)
