"""A follower's transfer lifecycle (proxy/fetch/fetcher.py, proxy/fetch/transfer.py), driven step by
step in one process: real files in a storage folder, a scripted lease coordinator (the
races here are too narrow to hit reliably with real replicas; test_streaming.py covers
the same paths end to end)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import proxy.fetch.transfer as transfer_mod
from proxy.catalog import Entry, StreamInfo
from proxy.clock import SYSTEM_CLOCK
from proxy.contract import Fetched, FetchSpec, Status
from proxy.exceptions import CatalogError, ProxyError, ShuttingDown
from proxy.fetch.fetcher import Fetcher, Miss, Streaming
from proxy.fetch.leases import Verdict, WaitResult
from proxy.fetch.transfer import SharedFile
from proxy.runtime.tasks import TaskSupervisor
from proxy.storage.blobs import BlobStore
from proxy.types import Kind

KEY = "tool-1.0.bin"
TOTAL = 64 * 1024


class NoEntries:
    async def get_entry(self, repository: str, key: str) -> Entry | None:
        return None


class Index:
    def put(self, entry: Entry) -> None:
        pass


class Held:
    fence = 2

    async def release(self, state: str) -> None:
        pass

    async def announce_stream(self, stream: Any) -> None:
        pass


class ScriptedLeases:
    """Grants the lease only once ``grant`` is set; ``wait`` hands on the announced files
    and returns the outcome the test feeds it, in order."""

    def __init__(self) -> None:
        self.results: asyncio.Queue[WaitResult | StreamInfo] = asyncio.Queue()
        self.grant = False
        self.fence = 0

    async def claim(
        self,
        repository: str,
        key: str,
        unless_stored: bool = True,
        unrenewed: tuple[int, float] | None = None,
    ) -> Held | None:
        return Held() if self.grant else None

    async def wait(self, repository: str, key: str, find_entry: Any, on_stream: Any) -> WaitResult:
        while isinstance(item := await self.results.get(), StreamInfo):
            self.fence += 1  # each announcement comes from a holder of its own
            await on_stream(item, self.fence)
        return item


def scripted_fetcher(
    blobs: BlobStore,
    leases: ScriptedLeases,
    tasks: TaskSupervisor,
    catalog: Any = None,
    origin: Any = None,
) -> tuple[Fetcher, Miss]:
    fetcher = Fetcher(catalog or NoEntries(), blobs, Index(), leases, tasks, SYSTEM_CLOCK)  # type: ignore[arg-type]
    miss = Miss("tools", "raw", FetchSpec(KEY, Kind.IMMUTABLE, origin=origin), None)  # type: ignore[arg-type]
    return fetcher, miss


async def follow_half(
    fetcher: Fetcher, miss: Miss, leases: ScriptedLeases, name: str
) -> transfer_mod.Transfer:
    """A client of ours reads holder A's file ``name`` (half the body) up to its end."""
    leases.results.put_nowait(StreamInfo(name, None, TOTAL))
    first = await fetcher.fetch(miss, None)
    assert isinstance(first, Streaming)
    got = bytearray()
    await read_some(first.transfer, TOTAL // 2 - 1, got)
    assert len(got) == TOTAL // 2 - 1
    return first.transfer


async def until(predicate: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


async def read_some(transfer: transfer_mod.Transfer, want: int, into: bytearray) -> None:
    reader = transfer.reader()
    try:
        while len(into) < want:
            span = await reader.next_span()
            if span is None:
                return
            into += await reader.read(span, 4096)
    finally:
        reader.close()


def test_a_successor_handed_on_while_the_blob_opens_is_concluded_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The follower read holder A's file; A died; B's download (a changed body) is being
    proven when B's entry arrives. ``_conclude`` -> ``stored()`` opens the blob in the
    I/O pool; meanwhile the switch to B's file finds the body changed and hands B's file
    on to a successor transfer, which becomes the flight's transfer. Nobody concludes
    the successor: its clients get every byte but the last and wait forever; its file
    stays open and its watcher polls every 10 ms forever."""
    blobs = BlobStore(tmp_path / "shared")
    blobs.prepare()
    body1, body2 = os.urandom(TOTAL), os.urandom(TOTAL)  # the upstream changed it
    name_a, name_b = f"{uuid.uuid4().hex}.part", f"{uuid.uuid4().hex}.part"
    (blobs.tmp_dir / name_a).write_bytes(body1[: TOTAL // 2])  # A died half way
    (blobs.tmp_dir / name_b).write_bytes(body2[:4096])  # B has just started
    sha2 = hashlib.sha256(body2).hexdigest()
    blob = blobs.path(sha2)
    blob.parent.mkdir(parents=True)
    blob.write_bytes(body2)
    entry = Entry("tools", KEY, Kind.IMMUTABLE, sha2, TOTAL, None, 0, None)

    # The blob's open is slow (an NFS round trip, a busy I/O pool): held until released.
    opening, release = threading.Event(), threading.Event()
    real_open = transfer_mod._open_regular

    def slow_open(path: str) -> int:
        if path == str(blob):
            opening.set()
            release.wait(10)
        return real_open(path)

    monkeypatch.setattr(transfer_mod, "_open_regular", slow_open)

    async def scenario() -> None:
        tasks = TaskSupervisor()
        leases = ScriptedLeases()
        fetcher, miss = scripted_fetcher(blobs, leases, tasks)
        old = await follow_half(fetcher, miss, leases, name_a)

        leases.results.put_nowait(WaitResult(Verdict.TAKEOVER, fence=1))  # A is dead
        leases.results.put_nowait(StreamInfo(name_b, None, TOTAL))
        flight = fetcher._flights[("tools", KEY)]
        await until(lambda: old._switch is not None)  # following B, proving it
        leases.results.put_nowait(WaitResult(Verdict.ENTRY, entry=entry))  # B stored it
        await until(opening.is_set)  # _conclude -> stored() is opening the blob

        # B's last bytes land: the switch compares prefixes and hands B's file on.
        (blobs.tmp_dir / name_b).write_bytes(body2)
        await until(lambda: flight.transfer is not old)
        successor = flight.transfer
        assert successor is not None
        # A request that comes now joins the flight and reads the successor.
        joined = await fetcher.fetch(miss, None)
        assert isinstance(joined, Streaming) and joined.transfer is successor

        release.set()
        await until(lambda: ("tools", KEY) not in fetcher._flights)  # the fetch is over

        received = bytearray()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(read_some(successor, TOTAL, received), 3)
        source = successor._source
        watcher = source._watcher if isinstance(source, SharedFile) else None
        try:
            assert successor.concluded(), (
                f"the successor was never concluded: its client got {len(received)} of "
                f"{TOTAL} bytes and waits forever; its file is open, its watcher "
                f"{'polls' if watcher is not None and not watcher.done() else 'stopped'}"
            )
            assert bytes(received) == body2
        finally:
            await tasks.close(1)
            for t in (old, successor):
                if t._source is not None:
                    t._source.close()

    asyncio.run(scenario())


def test_a_switch_that_cannot_compare_cuts_with_a_proxy_error_and_hands_the_body_on(
    tmp_path: Path,
) -> None:
    """The dead holder's file is shorter than what was sent (truncated on the shared
    volume; or unreadable, ESTALE on NFS), so the prefix cannot be compared. Its clients
    are cut with a proxy error (a 502/503, never a 500 with a traceback), and requests
    that come later read the new download to its verified end."""
    blobs = BlobStore(tmp_path / "shared")
    blobs.prepare()
    body = os.urandom(TOTAL)
    name_a, name_b = f"{uuid.uuid4().hex}.part", f"{uuid.uuid4().hex}.part"
    (blobs.tmp_dir / name_a).write_bytes(body[: TOTAL // 2])
    (blobs.tmp_dir / name_b).write_bytes(body[: TOTAL - 1])
    sha = hashlib.sha256(body).hexdigest()
    entry = Entry("tools", KEY, Kind.IMMUTABLE, sha, TOTAL, None, 0, None)

    async def scenario() -> None:
        tasks = TaskSupervisor()
        leases = ScriptedLeases()
        fetcher, miss = scripted_fetcher(blobs, leases, tasks)
        old = await follow_half(fetcher, miss, leases, name_a)
        os.truncate(blobs.tmp_dir / name_a, 100)  # A's file on the shared volume
        leases.results.put_nowait(WaitResult(Verdict.TAKEOVER, fence=1))
        leases.results.put_nowait(StreamInfo(name_b, None, TOTAL))
        try:
            await until(old.concluded)
            with pytest.raises(ProxyError):
                await old.result()
            joined = await fetcher.fetch(miss, None)  # the flight still follows B
            assert isinstance(joined, Streaming) and joined.transfer is not old
            # B finishes: its file is published as the blob (a rename: the same inode).
            (blobs.tmp_dir / name_b).write_bytes(body)
            blob = blobs.path(sha)
            blob.parent.mkdir(parents=True, exist_ok=True)
            os.rename(blobs.tmp_dir / name_b, blob)
            leases.results.put_nowait(WaitResult(Verdict.ENTRY, entry=entry))
            received = bytearray()
            await asyncio.wait_for(read_some(joined.transfer, TOTAL, received), 5)
            assert bytes(received) == body
            assert joined.transfer.concluded() and joined.transfer.error is None
        finally:
            await tasks.close(1)
            joined_transfer = joined.transfer if isinstance(joined, Streaming) else None
            for t in (old, joined_transfer):
                if t is not None and t._source is not None:
                    t._source.close()

    asyncio.run(scenario())


def test_a_read_whose_source_was_switched_under_it_goes_on_from_the_new_source(
    tmp_path: Path,
) -> None:
    """A client's read of the old file is still in flight when the switch to the proven
    new download closes that file: the read gives nothing (its bytes were not proven),
    and the client goes on from the new source instead of being cut."""
    body = os.urandom(TOTAL)
    old_path, new_path = tmp_path / "a.part", tmp_path / "b.part"
    old_path.write_bytes(body[: TOTAL // 2])
    new_path.write_bytes(body)

    async def scenario() -> None:
        tasks = TaskSupervisor()
        spawn = tasks.spawn
        old = await transfer_mod.SharedFile.open(str(old_path), None, TOTAL, spawn, False)
        transfer = transfer_mod.Transfer(old, spawn)
        reader = transfer.reader()
        try:
            first = await reader.next_span()
            assert first is not None
            received = bytearray(await reader.read(first, 4096))
            pending = await reader.next_span()  # taken from the old file...
            assert pending is not None and pending.source is old
            transfer.lost()
            new = await transfer_mod.SharedFile.open(str(new_path), None, TOTAL, spawn, True)
            transfer.replace(new)
            await until(lambda: old.fd is None)  # ...which the switch closed
            assert await reader.read(pending, 4096) == b""  # not a cut
            while (span := await reader.next_span()) is not None:
                received += await reader.read(span, 4096)
            assert bytes(received) == body
        finally:
            reader.close()
            transfer.fail(RuntimeError("test over"))
            await tasks.close(1)

    asyncio.run(scenario())


def test_sources_of_switches_cancelled_before_they_ran_are_closed(tmp_path: Path) -> None:
    """Three downloads replace each other faster than the switches run, then the transfer
    fails: no source is left open (an unlinked temp file holds its disk space)."""
    body = os.urandom(TOTAL)
    paths = [tmp_path / f"{n}.part" for n in range(4)]
    for path in paths:
        path.write_bytes(body[: TOTAL // 2])

    async def scenario() -> None:
        tasks = TaskSupervisor()
        spawn = tasks.spawn
        files = [
            await transfer_mod.SharedFile.open(str(p), None, TOTAL, spawn, False) for p in paths
        ]
        transfer = transfer_mod.Transfer(files[0], spawn)
        transfer.lost()
        for source in files[1:]:
            transfer.replace(source)  # each cancels the switch before it, not yet run
        await asyncio.sleep(0.05)
        transfer.fail(RuntimeError("the fetch failed"))
        try:
            await until(lambda: all(f.fd is None for f in files), 2)
        finally:
            await tasks.close(1)

    asyncio.run(scenario())


class FailingCatalog:
    async def get_entry(self, repository: str, key: str) -> Entry | None:
        return None

    async def put_entry(self, entry: Entry) -> None:
        raise CatalogError("the database is down")


class Origin:
    def __init__(self, body: bytes) -> None:
        self.body = body

    @contextlib.asynccontextmanager
    async def open(self, ctx: Any, stale: Any) -> AsyncIterator[Fetched]:
        async def chunks() -> AsyncIterator[bytes]:
            for i in range(0, len(self.body), 4096):
                yield self.body[i : i + 4096]
                await asyncio.sleep(0.001)

        yield Fetched(Status.OK, chunks(), None, len(self.body))


def test_a_successor_handed_on_when_the_entry_cannot_be_recorded_still_gets_the_body(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """We followed holder A (body1), A died, we took over and downloaded body2 (the
    upstream changed it), and recording our entry fails (CatalogError). While the old
    transfer is being concluded, the switch to our download finds the body changed and
    hands it on to a successor: the successor's clients get our verified, published
    body2, not a cut."""
    blobs = BlobStore(tmp_path / "shared")
    blobs.prepare()
    body1, body2 = os.urandom(TOTAL), os.urandom(TOTAL)
    name_a = f"{uuid.uuid4().hex}.part"
    (blobs.tmp_dir / name_a).write_bytes(body1[: TOTAL // 2])
    blob = str(blobs.path(hashlib.sha256(body2).hexdigest()))

    opening, handed = threading.Event(), threading.Event()
    real_open, real_digest = transfer_mod._open_regular, transfer_mod._digest

    def slow_open(path: str) -> int:
        if path == blob:
            opening.set()
            handed.wait(10)
        return real_open(path)

    def slow_digest(fd: int, length: int) -> str:
        opening.wait(10)  # the switch compares only once stored() opens the blob
        return real_digest(fd, length)

    monkeypatch.setattr(transfer_mod, "_open_regular", slow_open)
    monkeypatch.setattr(transfer_mod, "_digest", slow_digest)

    async def scenario() -> None:
        tasks = TaskSupervisor()
        leases = ScriptedLeases()
        fetcher, miss = scripted_fetcher(blobs, leases, tasks, FailingCatalog(), Origin(body2))
        old = await follow_half(fetcher, miss, leases, name_a)
        flight = fetcher._flights[("tools", KEY)]
        leases.grant = True
        leases.results.put_nowait(WaitResult(Verdict.TAKEOVER, fence=1))  # A is dead
        await until(lambda: flight.transfer is not old, 10)  # handed on
        handed.set()
        successor = flight.transfer
        assert successor is not None
        received = bytearray()
        try:
            await until(lambda: ("tools", KEY) not in fetcher._flights)
            assert successor.concluded()
            # A client of the successor (it joined after the hand-on) reads now: cut.
            await asyncio.wait_for(read_some(successor, TOTAL, received), 5)
            assert bytes(received) == body2, f"got {len(received)} of {TOTAL}"
            assert successor.error is None
        finally:
            handed.set()
            await tasks.close(1)
            for t in (old, successor):
                if t._source is not None:
                    t._source.close()

    asyncio.run(scenario())


def _open_fds() -> set[int]:
    return {int(n) for n in os.listdir("/proc/self/fd")}


def test_a_temp_file_whose_creation_was_cancelled_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled (shutdown) while ``os.open`` runs in the I/O pool: the open still
    happens there, and is undone; no file and no descriptor is left."""
    blobs = BlobStore(tmp_path / "shared")
    blobs.prepare()
    real_open = os.open
    started, release = threading.Event(), threading.Event()

    def slow_open(path: Any, *args: Any, **kw: Any) -> int:
        if str(path).startswith(str(blobs.tmp_dir)):
            started.set()
            release.wait(5)
        return real_open(path, *args, **kw)

    monkeypatch.setattr(os, "open", slow_open)

    async def scenario() -> None:
        before = _open_fds()
        task = asyncio.ensure_future(blobs.new_temp())
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 5)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        release.set()
        await asyncio.sleep(0.2)
        leaked = _open_fds() - before
        left = list(blobs.tmp_dir.iterdir())
        assert not left and not leaked, f"left {left}, fds {leaked}"

    asyncio.run(scenario())


def test_discard_cancelled_twice_still_removes_the_temp_file(tmp_path: Path) -> None:
    """A store cut by two cancellations in a row still removes its temp file."""
    blobs = BlobStore(tmp_path / "shared")
    blobs.prepare()

    async def scenario() -> None:
        before = _open_fds()
        temp = await blobs.new_temp()

        async def store() -> None:
            try:
                await temp.write(b"x" * 100000)
                await asyncio.sleep(10)
            except BaseException:
                await temp.discard()
                raise

        task = asyncio.ensure_future(store())
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.2)
        assert not list(blobs.tmp_dir.iterdir())
        assert not (_open_fds() - before)

    asyncio.run(scenario())


def test_a_switch_cancelled_by_shutdown_cuts_the_clients_it_would_have_continued(
    tmp_path: Path,
) -> None:
    """The proxy stops while our clients wait for a new download to catch up with what
    they were sent: they are cut at once (a 503's worth of reason), not left waiting."""
    body = os.urandom(TOTAL)
    old_path, new_path = tmp_path / "a.part", tmp_path / "b.part"
    old_path.write_bytes(body[: TOTAL // 2])
    new_path.write_bytes(body[:100])  # far behind what was sent

    async def scenario() -> None:
        tasks = TaskSupervisor()
        spawn = tasks.spawn
        old = await transfer_mod.SharedFile.open(str(old_path), None, TOTAL, spawn, False)
        transfer = transfer_mod.Transfer(old, spawn)
        got = bytearray()
        await read_some(transfer, TOTAL // 2 - 1, got)
        transfer.lost()
        new = await transfer_mod.SharedFile.open(str(new_path), None, TOTAL, spawn, False)
        transfer.replace(new)
        await asyncio.sleep(0.05)
        switch = transfer._switch
        assert switch is not None and not switch.done()
        switch.cancel()  # what TaskSupervisor.close does at shutdown
        try:
            reader = transfer.reader(len(got))
            with pytest.raises(ShuttingDown):
                await asyncio.wait_for(reader.next_span(), 2)
            reader.close()
            await until(lambda: old.fd is None and new.fd is None, 2)
        finally:
            await tasks.close(1)

    asyncio.run(scenario())


def test_a_temp_file_being_written_is_never_stale_whatever_the_clock_says(
    tmp_path: Path,
) -> None:
    """Reclaim judges temp files by their mtime, which the file system's clock stamps;
    a clock ahead of it (a ManualClock moved on, a replica whose clock skews from the
    shared volume's) made a download's own temp file look a day old, and reclaim
    deleted it under the download (a 503 'storage unavailable' in CI). Ours are kept;
    a leftover of the same age is not; a finished one is judged by age again."""
    blobs = BlobStore(tmp_path / "shared")
    blobs.prepare()

    async def scenario() -> None:
        writing = await blobs.new_temp()
        await writing.write(b"x" * 1000)
        await writing.flush()
        leftover = blobs.tmp_dir / "crashed.part"
        leftover.write_bytes(b"y")
        far_ahead = time.time() + 3 * 86400
        assert blobs.remove_stale_temps(far_ahead) == 1
        assert writing.path.exists() and not leftover.exists()
        await writing.flush()
        published = await blobs.publish(writing)
        assert blobs.path(published).exists() and not blobs.live_temps
        discarded = await blobs.new_temp()
        await discarded.discard()
        assert not blobs.live_temps

    asyncio.run(scenario())
