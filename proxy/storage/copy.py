"""``proxy storage copy``: a folder store's blobs into a bucket, so an installation moves
to object storage without fetching anything again (docs/architecture.md, "Object
storage"). The catalog stays as it is: entries name blobs by sha256, wherever they are.

Resumable: the bucket is listed once, and blobs already there are skipped; a copy cut
off (Ctrl+C, a crash) is run again. Every file is hashed before its upload and skipped
if its bytes are not its name's, so an object at a final key only ever holds verified
bytes here too. Four uploads run at a time, each with the bucket client's bounded
memory.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from dataclasses import dataclass
from typing import TextIO

from proxy.exceptions import StorageError
from proxy.runtime.blocking import run_blocking
from proxy.runtime.progress import BarProgress, printable
from proxy.storage.blobs import BlobStore, is_sha256, open_regular
from proxy.storage.s3 import Bucket
from proxy.units import human_size

PARALLEL_UPLOADS = 4
HASH_READ_BYTES = 4 * 1024 * 1024


@dataclass
class CopySummary:
    copied: int = 0
    bytes: int = 0
    present: int = 0  # already in the bucket
    corrupt: int = 0  # the file's bytes are not its name's: not copied
    failed: int = 0

    @property
    def done(self) -> int:
        return self.copied + self.present + self.corrupt + self.failed

    def line(self) -> str:
        return (
            f"{self.copied} copied ({human_size(self.bytes)}), {self.present} already there, "
            f"{self.corrupt} corrupt, {self.failed} failed"
        )


class CopyProgress(BarProgress):
    """A bar redrawn in place on a terminal, a line per blob otherwise."""

    def __init__(self, out: TextIO, tty: bool) -> None:
        super().__init__(out, tty)
        self.summary = CopySummary()

    def done(self, sha256: str, outcome: str, size: int, detail: str = "") -> None:
        s = self.summary
        if outcome == "copied":
            s.copied += 1
            s.bytes += size
        elif outcome == "present":
            s.present += 1
        elif outcome == "corrupt":
            s.corrupt += 1
        else:
            s.failed += 1
        if self.tty:
            self.draw(sha256[:12])
            if outcome in ("corrupt", "failed"):
                self.out.write(f"\n{outcome} {sha256}: {printable(detail)}\n")
            return
        extra = f"  {printable(detail)}" if detail else ""
        self.line(f"{outcome:<8} {sha256}  {human_size(size)}{extra}")

    def counted(self) -> int:
        return self.summary.done

    def status(self, label: str) -> str:
        s = self.summary
        return f"copied {s.copied} ({human_size(s.bytes)})  there {s.present}  {label}"


async def copy_folder(source: BlobStore, bucket: Bucket, progress: CopyProgress) -> CopySummary:
    """Upload every blob of ``source`` that ``bucket`` lacks."""
    present: set[str] = set()
    async for page in bucket.list_objects("blobs/"):
        for item in page:
            sha = item.key.rpartition("/")[2]
            if is_sha256(sha) and item.key == bucket.key(sha):
                present.add(sha)

    def local_blobs() -> list[tuple[str, int]]:
        return sorted((sha, size) for sha, size, _mtime in source.iter_blobs() if is_sha256(sha))

    blobs = await run_blocking(local_blobs)
    progress.planned(len(blobs))
    todo = iter(blobs)

    async def worker() -> None:
        for sha256, size in todo:  # shared: each blob goes to one worker
            if sha256 in present:
                progress.done(sha256, "present", size)
                continue
            outcome, detail = await _copy_one(source, bucket, sha256, size)
            progress.done(sha256, outcome, size, detail)

    await asyncio.gather(*(worker() for _ in range(PARALLEL_UPLOADS)))
    return progress.summary


async def _copy_one(source: BlobStore, bucket: Bucket, sha256: str, size: int) -> tuple[str, str]:
    try:
        # Never through a link out of the store, and never waiting on a FIFO (an open
        # that hangs its I/O thread for ever): a regular file of its own, or nothing.
        fd = await run_blocking(open_regular, str(source.path(sha256)))
    except FileNotFoundError:
        return "failed", "the file is gone"
    except OSError as exc:
        return "failed", f"not read: {exc.strerror or exc} (only a regular file is copied)"
    try:
        digest = await run_blocking(_sha256_of, fd)
        if digest != sha256:
            return "corrupt", f"its bytes have sha256 {digest}"
        await bucket.put_file(sha256, fd, size)
    except (StorageError, OSError) as exc:
        return "failed", str(exc)
    finally:
        os.close(fd)
    return "copied", ""


def _sha256_of(fd: int) -> str:
    hasher = hashlib.sha256()
    offset = 0
    while data := os.pread(fd, HASH_READ_BYTES, offset):
        hasher.update(data)
        offset += len(data)
    return hasher.hexdigest()
