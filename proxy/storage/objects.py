"""Blobs in an S3-compatible bucket, with a local tier on every replica: the object
``Storage`` (docs/architecture.md, "Object storage").

Publishing uploads the verified temp file to its content-addressed key (an object at a
final key only ever holds verified bytes: one PUT, or a multipart upload completed
after the last part), then keeps the file as this replica's copy. Hits read the copy
(no request); a hit without one reads the object as it arrives (``fetch/fill.py``).
Unreferenced blobs are deleted with DeleteObjects, a thousand keys a request. Nothing
on a request path lists the bucket or asks for an object's head: the catalog knows
what exists and how large it is.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Iterable

from proxy.config.settings import ObjectStorageSettings
from proxy.exceptions import StorageError
from proxy.storage.blobs import BlobStore, TempBlob, is_sha256
from proxy.storage.integrity import Corruption
from proxy.storage.local_tier import LocalTier
from proxy.storage.s3 import Bucket, ObjectStream

log = logging.getLogger("proxy.storage")

# An object no entry or tombstone names is deleted by reclaim only once it is this old:
# a fetch may have just uploaded it and be about to record its entry, and the age an
# object listing shows is its upload's start on some servers.
ORPHAN_MIN_AGE_S = 24 * 3600.0
# A multipart upload started this long ago was left by a crash (a live one completes or
# is aborted within upstream.transfer_timeout of its download's start).
STALE_UPLOAD_S = 24 * 3600.0
READY_CACHE_S = 5.0  # /readyz asks the bucket at most this often
READY_TIMEOUT_S = 2.0


class ObjectStorage:
    shares_temp_files = False
    orphan_min_age_s = ORPHAN_MIN_AGE_S

    def __init__(self, settings: ObjectStorageSettings, processes: int = 1) -> None:
        """``processes``: worker processes sharing this replica's local tier; each
        keeps its share of ``local_cache_max_size``."""
        self.settings = settings
        self.bucket = Bucket(settings)
        self.tier = LocalTier(
            settings.local_cache, settings.local_cache_max_size // max(1, processes)
        )
        self.description = settings.url
        self._ready_at = 0.0
        self._ready_problem: str | None = None
        self._ready_lock = asyncio.Lock()

    @property
    def files(self) -> BlobStore:
        return self.tier.files

    async def start(self) -> None:
        try:
            await self.tier.load(time.time())
        except OSError as exc:
            raise StorageError.from_os_error(
                f"storage.local_cache: cannot use {self.settings.local_cache}", exc
            ) from exc
        await self.bucket.open()
        try:
            await self.bucket.check()
        except BaseException:
            await self.bucket.close()
            raise
        self._ready_at = time.monotonic()

    async def close(self) -> None:
        await self.bucket.close()

    async def publish(self, temp: TempBlob) -> str:
        await temp.flush()
        sha256 = temp.sha256
        fd = temp.reader_fd()
        try:
            # The fsync (for the local copy) runs while the upload goes on.
            results = await asyncio.gather(
                self.bucket.put_file(sha256, fd, temp.size), temp.sync(), return_exceptions=True
            )
        finally:
            os.close(fd)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        try:
            await self.tier.adopt(temp, sha256)
        except (OSError, StorageError) as exc:
            # The object is stored; only this replica's copy is missing (a full local
            # disk): hits here read the object instead.
            log.warning("could not keep a local copy of %s: %s", sha256, exc)
            await temp.discard()
        return sha256

    def local_path(self, sha256: str) -> str | None:
        return self.tier.path(sha256)

    def blob_path(self, sha256: str) -> str:
        return self.tier.files.path_str(sha256)

    async def open_object(self, sha256: str) -> ObjectStream:
        """One GET of the blob's object; FileNotFoundError if there is none."""
        return await self.bucket.get(sha256)

    async def open_blob(self, sha256: str) -> ObjectStream:
        # The scrub checks the objects themselves: they are what every replica's copies
        # come from (docs/architecture.md, "Blobs verified when read").
        return await self.open_object(sha256)

    async def quarantine(self, found: Corruption) -> str:
        # Nothing in the bucket can be moved aside without a copy and a delete of the
        # whole object; once no entry names it, the next fetch's upload replaces it, or
        # the tombstone purge deletes it after jobs.evict_grace.
        await self.tier.drop([found.sha256])
        return (
            "this replica's copy dropped; the object stays until the next fetch's upload "
            "replaces it (or the tombstone purge deletes it)"
        )

    async def delete(self, sha256s: Iterable[str], cutoff_s: float) -> tuple[set[str], set[str]]:
        names = sorted(set(sha256s))
        if not names:
            return set(), set()
        await self.bucket.delete(names)
        await self.tier.drop(names)
        return set(names), set()

    async def candidates(self, cutoff_s: float, since_s: float = 0.0) -> AsyncIterator[list[str]]:
        # Some stores list whole seconds (SeaweedFS): a blob written in the second the
        # catalog was made counts as after it, not before (it would never be swept).
        since_s = math.floor(since_s)
        async for page in self.bucket.list_objects("blobs/"):
            names = []
            for item in page:
                sha = self._blob_named(item.key)
                if sha is not None and since_s <= item.modified_s < cutoff_s:
                    names.append(sha)
            if names:
                yield names

    async def remove_leftovers(self, before_s: float) -> int:
        temps = await self.tier.files.remove_leftovers(before_s)
        aborted = 0
        for upload in await self.bucket.uploads():
            # Only uploads to a blob's key are ours: another writer may stream into the
            # same bucket and prefix.
            if upload.initiated_s < before_s and self._blob_named(upload.key) is not None:
                await self.bucket.abort(upload.key, upload.upload_id)
                aborted += 1
        if aborted:
            log.info("aborted %d multipart uploads left by crashed writers", aborted)
        return temps + aborted

    def _blob_named(self, key: str) -> str | None:
        """The sha256 of the blob whose object ``key`` is, or None: not a key we write."""
        sha = key.rpartition("/")[2]
        return sha if is_sha256(sha) and key == self.bucket.key(sha) else None

    async def make_room(self, nbytes: int) -> int:
        return await self.tier.shed(nbytes)

    async def problems(self, min_free: int) -> list[str]:
        found = await self.tier.files.problems(min_free)
        problem = await self._bucket_problem()
        if problem is not None:
            found.append(problem)
        return found

    async def _bucket_problem(self) -> str | None:
        async with self._ready_lock:  # concurrent probes share one request
            if time.monotonic() - self._ready_at >= READY_CACHE_S:
                try:
                    async with asyncio.timeout(READY_TIMEOUT_S):
                        await self.bucket.check()
                    self._ready_problem = None
                except TimeoutError:
                    self._ready_problem = f"storage: {self.description} did not answer in time"
                except StorageError as exc:
                    self._ready_problem = f"storage: {exc}"
                self._ready_at = time.monotonic()
            return self._ready_problem

    async def redirect(self, sha256: str, size: int) -> str | None:
        return await self.bucket.presign(sha256)
