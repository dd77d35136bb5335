"""The scrub: stored blobs re-hashed in the background, and by ``proxy verify`` on demand
(docs/architecture.md, "Blobs verified when read").

A pass walks the blobs entries name in sha256 order (keyset pages of the catalog), reads
each as the store holds it (``Storage.open_blob``: the file on a folder store, the object
in the bucket, never a replica's local copy), hashes it in the I/O pool, and hands what
is not its name's to the quarantine. The job is paced: it sleeps between reads so that
it reads no more than ``storage.scrub_rate`` bytes a second, one read at a time, and it
records where it has got to in its ``job_runs`` row, so a pass cut off by a restart
resumes there; a pass that reaches the last blob starts the next round from the first.
``proxy verify`` runs the same walk at once, unpaced, from the first blob.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol, TextIO

from proxy.cache.quarantine import Quarantine
from proxy.catalog import Catalog
from proxy.exceptions import StorageError, StorageUnavailable
from proxy.runtime import metrics
from proxy.runtime.blocking import run_blocking
from proxy.runtime.progress import printable, redraw
from proxy.storage.integrity import Corruption
from proxy.storage.store import Storage
from proxy.units import format_size, human_size

log = logging.getLogger("proxy.scrub")

JOB = "scrub"
PAGE_BLOBS = 1000  # blobs per catalog page
CURSOR_SAVE_S = 10.0  # the pass's place is written at most this often (and per page)
ENTRIES_SHOWN = 20  # entries named per corrupt blob in a report


@dataclass
class ScrubSummary:
    checked: int = 0
    bytes: int = 0
    corrupt: int = 0
    missing: int = 0  # an entry names it, but the store has no copy
    unreadable: int = 0  # the store failed reading it (EIO); the next round tries again
    slept_s: float = 0.0

    def line(self) -> str:
        return (
            f"checked {self.checked} blobs ({human_size(self.bytes)}): "
            f"{self.corrupt} corrupt, {self.missing} missing"
            + (f", {self.unreadable} unreadable" if self.unreadable else "")
        )


class ScrubReport(Protocol):
    """What ``proxy verify`` shows as the walk goes (the job logs instead)."""

    def checked(self, sha256: str, size: int) -> None: ...

    def corrupt(self, found: Corruption, entries: list[tuple[str, str]], done: str) -> None: ...

    def missing(self, sha256: str, size: int, entries: list[tuple[str, str]]) -> None: ...


class Pacer:
    """Sleeps so that what was read since the start averages ``rate`` bytes a second at
    most (None: no pace). Waiting is real time, whatever the catalog's clock says."""

    def __init__(self, rate: int | None) -> None:
        self.rate = rate
        self.started = time.monotonic()
        self.read = 0
        self.slept_s = 0.0

    async def spent(self, size: int) -> None:
        if self.rate is None:
            return
        self.read += size
        ahead_s = self.started + self.read / self.rate - time.monotonic()
        if ahead_s > 0:
            await asyncio.sleep(ahead_s)
            self.slept_s += ahead_s
            metrics.SCRUB_SLEEP.inc(ahead_s)


@dataclass
class Scrub:
    """One walk over the stored blobs. ``quarantine``: what a corrupt blob is handed to
    (None: nothing is done, ``proxy verify --dry-run``). ``rate``: bytes per second
    (None: unpaced). ``resume``: start where the job's last pass stopped, and record the
    place as it goes (the job); otherwise from the first blob, recording nothing
    (``proxy verify``)."""

    catalog: Catalog
    storage: Storage
    quarantine: Quarantine | None
    rate: int | None
    resume: bool
    report: ScrubReport | None = None
    summary: ScrubSummary = field(default_factory=ScrubSummary)

    async def run(self) -> str:
        self.summary = ScrubSummary()
        after = (await self.catalog.job_cursor(JOB) or "") if self.resume else ""
        start = f"after {after[:12]}" if after else "from the first blob"
        pacer = Pacer(self.rate)
        saved_at = time.monotonic()
        finished = False
        try:
            while True:
                page = await self.catalog.stored_blobs(after, PAGE_BLOBS)
                for sha256, size in page:
                    await self._check(sha256, size, pacer)
                    after = sha256
                    if self.resume and time.monotonic() - saved_at >= CURSOR_SAVE_S:
                        await self.catalog.save_job_cursor(JOB, after)
                        saved_at = time.monotonic()
                if len(page) < PAGE_BLOBS:
                    break
                if self.resume:
                    await self.catalog.save_job_cursor(JOB, after)
                    saved_at = time.monotonic()
            finished = True
        finally:
            self.summary.slept_s = pacer.slept_s
            if self.resume:
                # Cut off (shutdown, a lost lock): the next pass resumes here. Done: the
                # next round starts from the first blob.
                place = None if finished else (after or None)
                await asyncio.shield(self.catalog.save_job_cursor(JOB, place))
        pace = (
            f"; slept {self.summary.slept_s:.1f}s to keep to {format_size(self.rate)}/s"
            if self.rate is not None
            else ""
        )
        return f"{self.summary.line()} {start}{pace}; the round is complete"

    async def _check(self, sha256: str, size: int, pacer: Pacer) -> None:
        try:
            stream = await self.storage.open_blob(sha256)
        except StorageUnavailable:
            raise  # the bucket is down: the pass stops, and resumes here
        except StorageError as exc:
            self.summary.unreadable += 1
            log.warning("blob %s: could not be read to verify it: %s", sha256, exc)
            return
        except FileNotFoundError:
            # Evicted or quarantined since the page was read, unless an entry still
            # names it: then the store lost it (the hit path fetches it again).
            entries = await self.catalog.blob_entries(sha256, ENTRIES_SHOWN)
            if entries:
                self.summary.missing += 1
                log.warning("blob %s: %d entries name it, but %s has no copy",
                            sha256, len(entries), self.storage.description)  # fmt: skip
                if self.report is not None:
                    self.report.missing(sha256, size, entries)
            return
        try:
            found: Corruption | None = None
            if stream.size != size:
                found = Corruption(sha256, size, stream.size, stamp=stream.stamp)
            else:
                hasher = hashlib.sha256()
                read = 0
                try:
                    async for chunk in stream.chunks():
                        await run_blocking(hasher.update, chunk)
                        read += len(chunk)
                        metrics.SCRUB_BYTES.inc(len(chunk))
                        await pacer.spent(len(chunk))
                except StorageUnavailable:
                    raise  # the bucket is down: the pass stops, and resumes here
                except StorageError as exc:
                    # One bad file (EIO) must not stop every round at the same place.
                    self.summary.unreadable += 1
                    log.warning("blob %s: could not be read to verify it: %s", sha256, exc)
                    return
                digest = hasher.hexdigest()
                if read != size or digest != sha256:
                    found = Corruption(sha256, size, read, digest, stream.stamp)
        finally:
            stream.close()
        self.summary.checked += 1
        self.summary.bytes += size
        if self.report is not None:
            self.report.checked(sha256, size)
        if found is None:
            if stream.stamp is not None:
                self.storage.files.stamps.note(sha256, stream.stamp)
            return
        self.summary.corrupt += 1
        entries = await self.catalog.blob_entries(sha256, ENTRIES_SHOWN)
        if self.quarantine is not None:
            done = "quarantined: " + (await self.quarantine.blob(found)).done
        else:
            done = "left as it is (dry run)"
        if self.report is not None:
            self.report.corrupt(found, entries, done)


class VerifyReport:
    """``proxy verify``'s output: a progress line redrawn in place on a terminal, and
    every corrupt or missing blob named with the entries naming it (on a terminal or
    not; nothing is printed for a sound blob off a terminal)."""

    def __init__(self, out: TextIO, tty: bool) -> None:
        self.out = out
        self.tty = tty
        self.blobs = 0
        self.bytes = 0
        self.done = 0
        self.done_bytes = 0
        self.corrupt_count = 0
        self.missing_count = 0
        self._drawn = False

    def planned(self, blobs: int, size: int) -> None:
        self.blobs, self.bytes = blobs, size
        if self.tty:
            self._draw()

    def checked(self, sha256: str, size: int) -> None:
        self.done += 1
        self.done_bytes += size
        if self.tty:
            self._draw()

    def corrupt(self, found: Corruption, entries: list[tuple[str, str]], done: str) -> None:
        self.corrupt_count += 1
        self._lines(
            f"corrupt  {found.sha256}  {human_size(found.size)}: {found.describe()}",
            entries,
            done,
        )

    def missing(self, sha256: str, size: int, entries: list[tuple[str, str]]) -> None:
        self.missing_count += 1
        self._lines(f"missing  {sha256}  {human_size(size)}: the storage has no copy", entries)

    def finish(self) -> None:
        if self.tty and self._drawn:
            self.out.write("\n")
            self._drawn = False
        self.out.flush()

    def _lines(self, head: str, entries: list[tuple[str, str]], done: str = "") -> None:
        self.finish()
        named = ", ".join(printable(f"{repository}/{key}") for repository, key in entries)
        if len(entries) >= ENTRIES_SHOWN:
            named += ", ..."
        self.out.write(f"{head}\n         named by {named or 'no entry any more'}\n")
        if done:
            self.out.write(f"         {done}\n")
        self.out.flush()
        if self.tty:
            self._draw()

    def _draw(self) -> None:
        text = (
            f"{human_size(self.done_bytes)} of {human_size(self.bytes)}  "
            f"corrupt {self.corrupt_count}  missing {self.missing_count}"
        )
        redraw(self.out, self.done, self.blobs, text)
        self._drawn = True
