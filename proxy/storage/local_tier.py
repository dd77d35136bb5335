"""This replica's own copies of blobs kept in a bucket (docs/architecture.md, "Object
storage"): files in a folder that no other replica shares (``storage.local_cache``),
least recently used first out, bounded by ``storage.local_cache_max_size``.

The order lives in memory and is rebuilt from the folder at start (off the event loop:
the folder may hold millions of files), by each file's last access or change as the
file system recorded it. A hit on a copy costs no request to the bucket and no disk
write here; eviction unlinks files, which a response still reading one does not notice
(its descriptor keeps the bytes). Several worker processes of one replica share the
folder, each with its own order and an equal share of the bound; a copy one of them
evicted is fetched again by another that still listed it.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections import OrderedDict
from pathlib import Path

from proxy.exceptions import describe_os_error
from proxy.runtime.blocking import run_blocking
from proxy.storage.blobs import BlobStore, TempBlob, is_sha256, open_regular

log = logging.getLogger("proxy.storage.tier")

# A temp file in the tier's tmp/ not written for this long is left by a crash (or a
# download that stopped): removed at start. A live download writes far more often.
STALE_TEMP_S = 3600.0


class LocalTier:
    def __init__(self, root: Path, max_bytes: int) -> None:
        self.files = BlobStore(root)
        self.max_bytes = max_bytes
        self.size_bytes = 0
        self._sizes: OrderedDict[str, int] = OrderedDict()  # least recently used first

    async def load(self, now_s: float) -> None:
        """Create the folders, forget crashed downloads, and list the copies (off the
        event loop)."""
        files = self.files

        def scan() -> tuple[list[tuple[float, str, int]], int]:
            files.prepare()
            removed = files.remove_stale_temps(now_s - STALE_TEMP_S)
            found = []
            for sha, _size, _mtime in files.iter_blobs():
                if not is_sha256(sha):
                    continue
                try:
                    info = os.lstat(files.path(sha))
                except FileNotFoundError:
                    continue
                if not stat.S_ISREG(info.st_mode):
                    continue  # never ours (a link, a FIFO): a fill replaces it
                found.append((max(info.st_atime, info.st_mtime), sha, info.st_size))
            found.sort()
            return found, removed

        found, removed = await run_blocking(scan)
        for _when, sha, size in found:
            self._sizes[sha] = size
            self.size_bytes += size
        log.info(
            "local tier %s: %d copies, %d bytes; %d stale temp files removed",
            files.root,
            len(found),
            self.size_bytes,
            removed,
        )
        await self._evict()

    def path(self, sha256: str) -> str | None:
        """The copy's file, noting the access; None if there is no copy here."""
        if sha256 not in self._sizes:
            return None
        self._sizes.move_to_end(sha256)
        return self.files.path_str(sha256)

    async def open_copy(self, sha256: str, size: int) -> int | None:
        """A descriptor of the copy (the caller's to close), noting the access; None if
        there is none here to serve. The copy must still be a regular file of the
        blob's ``size``: one truncated, or replaced by a link or a FIFO, since it was
        kept is dropped, and the object read again, rather than served short, from
        elsewhere, or never (the bucket holds the blob; this is only a copy)."""
        if sha256 not in self._sizes:
            return None
        self._sizes.move_to_end(sha256)
        path = self.files.path_str(sha256)
        try:
            fd: int = await run_blocking(_open_copy, path, size)
            return fd
        except FileNotFoundError:
            self.forget(sha256)  # evicted by another worker, or removed by hand
        except OSError as exc:
            log.warning(
                "local tier: dropped %s, not a copy of the blob: %s", path, describe_os_error(exc)
            )
            await self.drop([sha256])
        return None

    async def adopt(self, temp: TempBlob, sha256: str) -> None:
        """Keep a verified temp file as the copy of ``sha256`` (fsync, rename)."""
        await self.files.publish(temp)
        self.add(sha256, temp.size)
        await self._evict()

    def add(self, sha256: str, size: int) -> None:
        if sha256 in self._sizes:
            self._sizes.move_to_end(sha256)
            return
        self._sizes[sha256] = size
        self.size_bytes += size

    def forget(self, sha256: str) -> None:
        """The copy is gone (another worker evicted it, or it was removed by hand)."""
        size = self._sizes.pop(sha256, None)
        if size is not None:
            self.size_bytes -= size

    async def drop(self, sha256s: list[str]) -> None:
        """Delete these copies (their blobs were deleted, or a copy was found corrupt)."""
        for sha in sha256s:
            self.forget(sha)
        paths = [self.files.path(sha) for sha in sha256s]
        await run_blocking(_unlink_all, paths)

    async def shed(self, nbytes: int) -> int:
        """Evict copies, least recently used first, until ``nbytes`` are freed (the disk
        is under ``storage.min_free``: ``local_cache_max_size`` is more than it holds).
        Nothing if this process's copies are fewer bytes: they would all go, and the disk
        would still be short. The bytes freed."""
        if nbytes > self.size_bytes:
            return 0
        freed = await self._evict(nbytes)
        if freed:
            log.warning(
                "local tier: evicted %d bytes of copies, the disk being under storage.min_free",
                freed,
            )
        return freed

    async def _evict(self, at_least: int = 0) -> int:
        """Evict beyond ``max_bytes``, and ``at_least`` bytes: the bytes evicted."""
        victims = []
        freed = 0
        while self._sizes and (self.size_bytes > self.max_bytes or freed < at_least):
            sha, size = self._sizes.popitem(last=False)
            self.size_bytes -= size
            freed += size
            victims.append(self.files.path(sha))
        if victims:
            await run_blocking(_unlink_all, victims)
            log.debug("local tier: evicted %d copies", len(victims))
        return freed


def _open_copy(path: str, size: int) -> int:
    fd = open_regular(path)
    try:
        found = os.fstat(fd).st_size
        if found != size:
            raise OSError(errno.EINVAL, f"{found} bytes, the blob has {size}", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _unlink_all(paths: list[Path]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("local tier: cannot remove %s: %s", path, exc)
