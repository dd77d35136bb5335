"""Content-addressed blob files: ``{root}/blobs/ab/cd/<sha256>``.

A blob is written to a temp file under ``{root}/tmp/`` (same filesystem), hashed as it
is written, fsynced, then moved into place with ``os.replace``. A crash mid-write leaves
only a temp file (reclaimed later); two writers of the same bytes publish the same name,
so a duplicate store is harmless. A published file is stamped as verified (this process
hashed it as it was written); one found corrupt later is moved aside to
``{root}/quarantine/<sha256>`` (docs/architecture.md, "Blobs verified when read").

``BlobStore`` is the folder ``Storage`` (one volume every replica shares), and also the
folder of the object store's local tier on each replica (``storage/local_tier.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import hashlib
import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path

from proxy.exceptions import StorageError, describe_os_error
from proxy.runtime import metrics
from proxy.runtime.blocking import run_blocking
from proxy.storage.integrity import READ_CHUNK_BYTES, Corruption, Stamp, Stamps, stamp_of
from proxy.storage.integrity import open_regular as open_regular  # where it was first
from proxy.types import Digests
from proxy.units import format_size, human_size

TEMP_SUFFIX = ".part"
WRITE_QUEUE_MAX_BYTES = 8 * 1024 * 1024  # queued behind the batch in flight: then wait
# A blob file no entry refers to is deleted by reclaim only once it is this old: a fetch
# or upload may have just published it and be about to record its entry.
ORPHAN_MIN_AGE_S = 3600.0
CANDIDATE_BATCH = 1000  # names per catalog question of the orphan sweep


class TempBlob:
    """A temp file being written; readable by others (by path) while it grows.

    Writes are batched and pipelined: ``write`` queues a chunk and returns at once; one
    batch at a time is hashed and written in a thread, and whatever arrived meanwhile
    goes out as the next batch. A slow upstream's first bytes reach the file (and the
    clients reading it) straight away; a fast one's 64 KiB reads are written a few MiB
    at a time, with one thread hop per batch instead of one per read. ``write`` waits
    only when ``WRITE_QUEUE_MAX_BYTES`` are queued behind the batch in flight.
    ``written`` counts the bytes already in the file; ``flush`` waits for the rest.
    """

    def __init__(
        self, path: Path, fd: int, digests: Iterable[str], live: set[str] | None = None
    ) -> None:
        """``fd``: ``path`` opened for reading and writing (``BlobStore.new_temp``);
        ``live``: the store's names of the temp files being written, which this one
        leaves when it is published or discarded."""
        self.path = path
        self._live = live if live is not None else set()
        self._live.add(path.name)
        self.size = 0  # bytes handed to write()
        self.written = 0  # bytes in the file
        self._fd = fd
        names = {"sha256", *digests}
        self._hashers = {name: hashlib.new(name) for name in sorted(names)}
        self._pending: asyncio.Future[None] | None = None  # the batch being written
        self._queued: list[bytes] = []
        self._queued_bytes = 0
        self._error: OSError | None = None
        self.on_progress: Callable[[int], None] | None = None  # called with `written`

    def _write_sync(self, chunks: list[bytes]) -> None:
        # One buffer per batch: hashing and writing release the interpreter lock, and
        # every time they take it back they may wait for the event loop to let go of it;
        # once per batch costs little, once per 64 KiB read held a fast download back.
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        for hasher in self._hashers.values():
            hasher.update(data)
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]

    async def write(self, chunk: bytes) -> None:
        if not chunk:
            return
        self._raise_if_failed()
        self.size += len(chunk)
        self._queued.append(chunk)
        self._queued_bytes += len(chunk)
        if self._pending is None:
            self._start_batch()
        elif self._queued_bytes >= WRITE_QUEUE_MAX_BYTES:
            await self._wait_for_batch()

    def _start_batch(self) -> None:
        batch, self._queued, self._queued_bytes = self._queued, [], 0
        pending = asyncio.get_running_loop().run_in_executor(None, self._write_sync, batch)
        # Announce progress the moment the bytes are in the file, not at the next write:
        # readers must not wait for the upstream's next chunk to see this one.
        pending.add_done_callback(
            functools.partial(self._written, n_bytes=sum(len(c) for c in batch))
        )
        self._pending = pending

    def _written(self, future: asyncio.Future[None], *, n_bytes: int) -> None:
        if future.cancelled():
            return
        error = future.exception()
        if error is not None:
            self._error = error if isinstance(error, OSError) else OSError(str(error))
            return
        self.written += n_bytes
        if self._queued and self._error is None:
            self._start_batch()
        else:
            self._pending = None
        if self.on_progress is not None:
            self.on_progress(self.written)

    async def _wait_for_batch(self) -> None:
        pending = self._pending
        if pending is not None and pending.done():
            # Done, but its callback (which starts the next batch) has not run yet:
            # awaiting a done future would not yield, so let the loop run it.
            await asyncio.sleep(0)
        elif pending is not None:
            # Shielded: cancelling the wrapper would not stop the thread, and discard()
            # must not close the descriptor under a write still running.
            with contextlib.suppress(Exception):
                await asyncio.shield(pending)
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise storage_error(f"writing {self.path}", "write", self._error) from self._error

    async def flush(self) -> None:
        """Wait until everything written so far is in the file."""
        while self._pending is not None and self._error is None:
            await self._wait_for_batch()
        self._raise_if_failed()

    def digests(self) -> Digests:
        """The digests of what was written; call after ``flush``."""
        assert self._pending is None and not self._queued, "digests() before flush()"
        return {name: hasher.hexdigest() for name, hasher in self._hashers.items()}

    @property
    def sha256(self) -> str:
        return self._hashers["sha256"].hexdigest()

    async def sync(self) -> None:
        await self.flush()
        try:
            await run_blocking(os.fsync, self._fd)
        except OSError as exc:
            raise storage_error(f"syncing {self.path}", "sync", exc) from exc

    def reader_fd(self) -> int:
        """A descriptor of its own for reading the file as it grows (``pread``,
        ``sendfile``): a duplicate, so no open (a round trip on a network file system)
        on the event loop."""
        return os.dup(self._fd)

    def detach_fd(self) -> int:
        """The descriptor, now the caller's to close (-1 if closed already)."""
        fd, self._fd = self._fd, -1
        return fd

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def finished(self) -> None:
        """No longer being written (published or discarded): reclaim may judge it by age."""
        self._live.discard(self.path.name)

    async def discard(self) -> None:
        self.finished()
        self.on_progress = None
        self._queued, self._queued_bytes = [], 0  # nothing more is written
        if self._pending is not None:
            # A write still in its thread owns the descriptor: close once it is done.
            self._pending.add_done_callback(lambda _f: self.close())
            self._pending = None
        else:
            self.close()
        # Shielded: a second cancellation must not leave the file behind (the unlink
        # goes on in its thread anyway; reclaim removes what a crash leaves).
        with contextlib.suppress(FileNotFoundError):
            await asyncio.shield(run_blocking(os.unlink, self.path))


class BlobStore:
    """Blob files under one root, shared by every replica (the folder ``Storage``)."""

    shares_temp_files = True
    orphan_min_age_s = ORPHAN_MIN_AGE_S

    def __init__(self, root: Path) -> None:
        self.root = root
        self.blobs_dir = root / "blobs"
        self.tmp_dir = root / "tmp"
        self.quarantine_dir = root / "quarantine"
        self._blobs_prefix = f"{self.blobs_dir}/"
        self.description = f"folder {root}"
        # The files this process knows good (this folder's; per process, bounded).
        self.stamps = Stamps()
        # The names of the temp files this process is writing: never stale, whatever
        # their mtime says (the file system's clock, not ours; "Time").
        self.live_temps: set[str] = set()

    @property
    def files(self) -> BlobStore:
        return self

    def prepare(self) -> None:
        self.blobs_dir.mkdir(parents=True, exist_ok=True)
        self.tmp_dir.mkdir(parents=True, exist_ok=True)

    async def start(self) -> None:
        try:
            await run_blocking(self.prepare)
        except OSError as exc:
            raise StorageError.from_os_error(f"storage.path: cannot use {self.root}", exc) from exc

    async def close(self) -> None:
        pass

    def local_path(self, sha256: str) -> str | None:
        return self.path_str(sha256)

    def blob_path(self, sha256: str) -> str:
        return self.path_str(sha256)

    async def delete(self, sha256s: Iterable[str], cutoff_s: float) -> tuple[set[str], set[str]]:
        return await run_blocking(self.delete_older, list(sha256s), cutoff_s)

    async def candidates(self, cutoff_s: float, since_s: float = 0.0) -> AsyncIterator[list[str]]:
        def older() -> list[str]:
            return [
                sha
                for sha, _size, mtime in self.iter_blobs()
                if since_s <= mtime < cutoff_s and is_sha256(sha)
            ]

        names = await run_blocking(older)
        for start in range(0, len(names), CANDIDATE_BATCH):
            yield names[start : start + CANDIDATE_BATCH]

    async def remove_leftovers(self, before_s: float) -> int:
        return await run_blocking(self.remove_stale_temps, before_s)

    async def problems(self, min_free: int) -> list[str]:
        try:
            await run_blocking(self.check_writable)
            free = await run_blocking(self.free_bytes)
        except OSError as exc:
            return [f"storage: cannot write ({describe_os_error(exc)})"]
        return [room_problem(free, 0, min_free)] if free < min_free else []

    async def free_space(self) -> int | None:
        """``free_bytes``, off the event loop; None if it cannot be read (a write will
        then say what is wrong)."""
        try:
            return await run_blocking(self.free_bytes)
        except OSError:
            return None

    async def make_room(self, nbytes: int) -> int:
        return 0  # every file is the only copy

    async def redirect(self, sha256: str, size: int) -> str | None:
        return None

    def path(self, sha256: str) -> Path:
        return self.blobs_dir / sha256[:2] / sha256[2:4] / sha256

    def path_str(self, sha256: str) -> str:
        """``path`` as a string, built without pathlib: it runs on every cache hit."""
        return f"{self._blobs_prefix}{sha256[:2]}/{sha256[2:4]}/{sha256}"

    async def new_temp(self, digests: Iterable[str] = ()) -> TempBlob:
        path = self.tmp_dir / f"{uuid.uuid4().hex}{TEMP_SUFFIX}"
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        # Off the loop: the shared volume may be a network file system. Shielded: if we
        # are cancelled meanwhile, the open still happens in its thread, and is undone.
        opening = asyncio.ensure_future(run_blocking(os.open, path, flags, 0o644))
        try:
            fd = await asyncio.shield(opening)
        except asyncio.CancelledError:
            opening.add_done_callback(functools.partial(_undo_open, path))
            raise
        except OSError as exc:
            raise storage_error(f"creating a temp file in {self.tmp_dir}", "create", exc) from exc
        return TempBlob(path, fd, digests, self.live_temps)

    async def publish(self, temp: TempBlob) -> str:
        """fsync the temp file and move it to its content address; returns the sha256."""
        await temp.sync()  # first: the last pending write is hashed too
        sha256 = temp.sha256
        target = self.path(sha256)
        fd = temp.detach_fd()

        def close_and_move() -> Stamp:
            # Stamped as the file we hashed as it was written (a rename keeps the inode
            # and the mtime), so its first hit here is sent as is.
            if fd < 0:
                _move_into_place(temp.path, target)
                return stamp_of(os.stat(target))
            try:
                stamp = stamp_of(os.fstat(fd))
            finally:
                os.close(fd)
            _move_into_place(temp.path, target)
            return stamp

        try:
            stamp = await run_blocking(close_and_move)
        except OSError as exc:
            raise storage_error(f"publishing {target}", "publish", exc) from exc
        finally:
            temp.finished()
        self.stamps.note(sha256, stamp)
        return sha256

    async def open_blob(self, sha256: str) -> FileStream:
        """A published blob's file read from its first byte (the scrub's reads);
        FileNotFoundError if there is none."""
        try:
            fd, stamp = await run_blocking(_open_stamped, self.path_str(sha256))
        except FileNotFoundError:
            raise
        except OSError as exc:  # EIO, or not a regular file (a link, a FIFO)
            raise storage_error(f"opening blob {sha256} to verify it", "read", exc) from exc
        return FileStream(fd, stamp)

    async def quarantine(self, found: Corruption) -> str:
        """Move a blob file found corrupt aside, unless the file there is no longer the
        one found so (a fetch published a verified copy since); what was done."""
        try:
            return await run_blocking(self.move_aside, found)
        except OSError as exc:
            error = storage_error(f"moving {found.sha256} aside", "quarantine", exc)
            return f"its file could not be moved aside ({error})"

    def move_aside(self, found: Corruption) -> str:
        """``quarantine``'s work (blocking)."""
        source = self.path(found.sha256)
        try:
            now = os.lstat(source)  # a link found at its name is moved, never its target
        except FileNotFoundError:
            return "its file was gone already"
        if found.stamp is not None and now.st_ino != found.stamp.inode:
            return "its file was replaced by a verified copy meanwhile (kept)"
        self.quarantine_dir.mkdir(parents=True, exist_ok=True)
        target = self.quarantine_dir / found.sha256
        os.replace(source, target)
        return f"its file moved to {target}"

    def delete_older(self, sha256s: Iterable[str], cutoff_s: float) -> tuple[set[str], set[str]]:
        """Delete the blobs whose file was last modified before ``cutoff_s`` (blocking:
        run it in the I/O pool). Returns the ones deleted now and the ones that had no
        file; a file modified since (just published again) is in neither and stays."""
        deleted, absent = set(), set()
        for sha256 in sha256s:
            path = self.path(sha256)
            try:
                if os.stat(path).st_mtime >= cutoff_s:
                    continue  # published again just now: its entry is being recorded
                os.unlink(path)
            except FileNotFoundError:
                absent.add(sha256)
                continue
            deleted.add(sha256)
        return deleted, absent

    def check_writable(self) -> None:
        """Raise OSError unless a temp file can be created, written and removed (/readyz)."""
        probe = self.tmp_dir / f".ready-{uuid.uuid4().hex}"
        try:
            probe.write_bytes(b"ready")
        finally:
            with contextlib.suppress(FileNotFoundError):
                probe.unlink()

    def free_bytes(self) -> int:
        """Bytes available to us on the storage's filesystem."""
        stat = os.statvfs(self.root)
        return stat.f_bavail * stat.f_frsize

    def remove_stale_temps(self, cutoff_s: float) -> int:
        """Delete temp files last modified before ``cutoff_s`` (Unix time), but for the
        ones this process is writing; how many."""
        removed = 0
        try:
            entries = list(os.scandir(self.tmp_dir))
        except FileNotFoundError:
            return 0
        live = set(self.live_temps)
        for entry in entries:
            if entry.name in live:
                continue
            try:
                if entry.is_file() and entry.stat().st_mtime < cutoff_s:
                    os.unlink(entry.path)
                    removed += 1
            except FileNotFoundError:
                continue
        return removed

    def iter_blobs(self) -> Iterable[tuple[str, int, float]]:
        """(sha256, size, mtime) of every blob file, for reclaim."""
        for top in _scandir_dirs(self.blobs_dir):
            for mid in _scandir_dirs(Path(top)):
                try:
                    files = list(os.scandir(mid))
                except FileNotFoundError:
                    continue
                for entry in files:
                    try:
                        stat = entry.stat()
                    except FileNotFoundError:
                        continue
                    yield entry.name, stat.st_size, stat.st_mtime


class FileStream:
    """A blob file read chunk by chunk in the I/O pool (``Storage.open_blob``)."""

    def __init__(self, fd: int, stamp: Stamp) -> None:
        self._fd = fd
        self.size = stamp.size
        self.stamp: Stamp | None = stamp

    async def chunks(self) -> AsyncIterator[bytes]:
        offset = 0
        while True:
            try:
                data = await run_blocking(os.pread, self._fd, READ_CHUNK_BYTES, offset)
            except OSError as exc:  # EIO: named and counted, as every storage fault
                raise storage_error("reading a blob to verify it", "read", exc) from exc
            if not data:
                return
            offset += len(data)
            yield data

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _open_stamped(path: str) -> tuple[int, Stamp]:
    fd = open_regular(path)
    try:
        return fd, stamp_of(os.fstat(fd))
    except BaseException:
        os.close(fd)
        raise


def _undo_open(path: Path, opening: asyncio.Future[int]) -> None:
    if opening.cancelled() or opening.exception() is not None:
        return
    fd = opening.result()

    def undo() -> None:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    asyncio.get_running_loop().run_in_executor(None, undo)


def room_problem(free: int, incoming: int, min_free: int) -> str:
    """Why a download of ``incoming`` bytes (0: size not known) may not start with
    ``free`` bytes free: it would leave less than ``min_free``."""
    floor = format_size(min_free)
    if incoming == 0 or free < min_free:
        return f"storage: {human_size(free)} free, under storage.min_free ({floor})"
    return (
        f"storage: {human_size(free)} free; a {human_size(incoming)} download would leave "
        f"less than storage.min_free ({floor})"
    )


def storage_error(what: str, operation: str, exc: OSError) -> StorageError:
    """A StorageError naming the errno, counted; the caller raises it."""
    error = StorageError.from_os_error(what, exc)
    code = errno.errorcode.get(exc.errno or 0, "other")
    metrics.STORAGE_ERRORS.labels(operation=operation, errno=code).inc()
    return error


def is_sha256(name: str) -> bool:
    return len(name) == 64 and all(c in "0123456789abcdef" for c in name)


def _scandir_dirs(path: Path) -> list[str]:
    try:
        return [e.path for e in os.scandir(path) if e.is_dir()]
    except FileNotFoundError:
        return []


def _move_into_place(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(source, target)
    # The rename is durable only once the directory entry is on disk.
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
