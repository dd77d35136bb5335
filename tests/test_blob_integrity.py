"""Blobs verified when read (docs/architecture.md, "Blobs verified when read"): a stored
blob's file that was truncated, extended or bit-flipped on disk is never served as it
is, on the folder store and on object storage (SeaweedFS: the local tier's copies, and
the objects the scrub reads). Every test damages a real file (or object), then asks for
it over HTTP."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client import REGISTRY

from proxy.config.load import load
from tests.conftest import ProxyFactory, s3_storage, write_config
from tests.seaweed import SeaweedFS
from tests.upstream import FakeUpstream, ServerThread

KiB = 1024
MiB = 1024 * 1024
LARGE = "/releases/tool-1.0.bin"  # a name of no checked kind: random bytes pass
SMALL = "/releases/small-1.0.bin"
LARGE_URL = "/tools/tool-1.0.bin"
SMALL_URL = "/tools/small-1.0.bin"


def counter(name: str, **labels: str) -> float:
    """A counter's value in this process (the in-process proxies count here)."""
    total = 0.0
    for metric in REGISTRY.collect():
        for sample in metric.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


@dataclass
class Store:
    """One kind of storage under test, and how its replicas' blob files are found."""

    kind: str
    tmp_path: Path
    upstream: FakeUpstream
    start_proxy: ProxyFactory
    seaweedfs: SeaweedFS | None = None
    bucket: str | None = None

    def config(self, replica: str, storage_extra: str = "") -> Path:
        if self.kind == "s3":
            assert self.seaweedfs is not None and self.bucket is not None
            storage = s3_storage(
                self.seaweedfs, self.bucket, self.tmp_path / f"local-{replica}",
                storage_extra=storage_extra,
            )  # fmt: skip
        else:
            storage = f'path = "{self.tmp_path / "data"}"\n{storage_extra}'
        return write_config(
            self.tmp_path,
            f"""
            [database]
            url = "sqlite:///{self.tmp_path / "catalog.db"}"
            [storage]
            {storage}
            [upstream]
            connect_timeout = "2s"
            read_timeout = "5s"
            retries = 0
            [[repositories]]
            name = "tools"
            format = "raw"
            upstream = "{self.upstream.base_url}/releases/"
            """,
            name=f"{replica}.toml",
        )

    def start(self, replica: str = "a", storage_extra: str = "") -> ServerThread:
        """A proxy whose start-up jobs are done (the scrub too: it runs at the first
        start), so that nothing but the test's requests reads the blobs."""
        proxy = self.start_proxy(load(self.config(replica, storage_extra), {}))
        deadline = time.monotonic() + 30
        while True:
            with sqlite3.connect(self.tmp_path / "catalog.db") as db:
                done = db.execute(
                    "SELECT count(*) FROM job_runs WHERE name IN ('reclaim', 'evict', 'scrub') "
                    "AND outcome = 'ok'"
                ).fetchone()[0]
            if done == 3:
                return proxy
            assert time.monotonic() < deadline, "the start-up jobs did not run"
            time.sleep(0.02)

    def root(self, replica: str) -> Path:
        """Where replica ``replica`` reads blob files from."""
        return self.tmp_path / (f"local-{replica}" if self.kind == "s3" else "data")

    def file(self, replica: str, body: bytes) -> Path:
        sha = hashlib.sha256(body).hexdigest()
        return self.root(replica) / "blobs" / sha[:2] / sha[2:4] / sha

    def kept(self, replica: str, body: bytes) -> None:
        """Wait until ``replica`` kept its copy: a fill keeps it once the last byte was
        verified, when the client may have it already (never a wait for a time)."""
        path = self.file(replica, body)
        deadline = time.monotonic() + 30
        while not (path.is_file() and path.stat().st_size == len(body)):
            assert time.monotonic() < deadline, f"{replica} kept no copy"
            time.sleep(0.02)

    def fetches_after_a_bad_copy(self) -> int:
        """Upstream GETs once a copy was found corrupt: the folder's file was the only
        copy (quarantined, fetched again); on object storage the object is read instead."""
        return 2 if self.kind == "folder" else 1


@pytest.fixture(params=["folder", "s3"])
def store(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    upstream: FakeUpstream,
    start_proxy: ProxyFactory,
) -> Store:
    if request.param == "s3":
        seaweedfs = request.getfixturevalue("seaweedfs")
        bucket = request.getfixturevalue("s3_bucket")
        return Store("s3", tmp_path, upstream, start_proxy, seaweedfs, bucket)
    return Store("folder", tmp_path, upstream, start_proxy)


def fetched(proxy: ServerThread, url: str, body: bytes) -> None:
    answer = httpx.get(proxy.url + url, timeout=30)
    assert answer.status_code == 200 and answer.content == body
    assert httpx.head(proxy.url + url).status_code == 200  # recorded


def cut_short(proxy: ServerThread, url: str, size: int) -> None:
    """The response ends before its last byte: never a complete wrong body."""
    with pytest.raises(httpx.HTTPError), httpx.stream("GET", proxy.url + url, timeout=30) as r:
        assert r.status_code == 200
        received = b"".join(r.iter_bytes())
        assert len(received) < size
        raise AssertionError("the whole body was sent")


def flip(path: Path, offset: int) -> None:
    """One byte changed in place (the same inode and size)."""
    with path.open("r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0xFF]))


def replaced(path: Path, data: bytes) -> None:
    """The file replaced by another (a new inode), as a restore from backup would."""
    other = path.with_name(path.name + ".new")
    other.write_bytes(data)
    os.replace(other, path)


def no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    for record in caplog.records:
        assert record.exc_info is None, record.getMessage()
        assert record.levelno < logging.CRITICAL


def quarantined_line(caplog: pytest.LogCaptureFixture, sha: str) -> str:
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.ERROR and sha in r.getMessage() and "corrupt" in r.getMessage()
    ]
    assert len(lines) == 1, lines  # logged once
    return lines[0]


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda path, body: path.write_bytes(body[: len(body) // 2]), id="truncated"),
        pytest.param(lambda path, body: path.write_bytes(body + b"\0" * 100), id="extended"),
    ],
)
def test_a_blob_of_the_wrong_size_is_never_served_and_is_fetched_again(
    store: Store,
    upstream: FakeUpstream,
    caplog: pytest.LogCaptureFixture,
    damage: Callable[[Path, bytes], None],
) -> None:
    caplog.set_level(logging.INFO)
    body = os.urandom(2 * MiB)
    upstream.files[LARGE] = body
    a = store.start()
    fetched(a, LARGE_URL, body)
    path = store.file("a", body)
    damage(path, body)
    before = counter("proxy_blobs_quarantined_total", reason="size")
    for _ in range(2):  # never a short 200 (or a long one), and not twice found
        answer = httpx.get(a.url + LARGE_URL, timeout=30)
        assert answer.status_code == 200 and answer.content == body
    assert upstream.count(LARGE) == store.fetches_after_a_bad_copy()
    assert httpx.head(a.url + LARGE_URL).status_code == 200  # stored and recorded again
    assert path.read_bytes() == body  # the good copy took its place
    assert counter("proxy_blobs_quarantined_total", reason="size") == before + 1
    sha = hashlib.sha256(body).hexdigest()
    line = quarantined_line(caplog, sha)
    assert f"expected {len(body)} bytes" in line and "found" in line
    if store.kind == "folder":
        assert (store.root("a") / "quarantine" / sha).stat().st_size != len(body)
    no_traceback(caplog)


def test_a_replaced_file_is_hashed_as_sent_and_cut_before_its_last_byte(
    store: Store, upstream: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    body = os.urandom(3 * MiB)
    upstream.files[LARGE] = body
    a = store.start()
    fetched(a, LARGE_URL, body)
    damaged = bytearray(body)
    damaged[len(body) // 2] ^= 0x01  # one bit, same length
    path = store.file("a", body)
    replaced(path, bytes(damaged))  # not the file this process verified
    before = counter("proxy_blobs_quarantined_total", reason="digest")
    cut_short(a, LARGE_URL, len(body))
    assert counter("proxy_blobs_quarantined_total", reason="digest") == before + 1
    again = httpx.get(a.url + LARGE_URL, timeout=30)
    assert again.status_code == 200 and again.content == body
    assert upstream.count(LARGE) == store.fetches_after_a_bad_copy()
    sha = hashlib.sha256(body).hexdigest()
    line = quarantined_line(caplog, sha)
    assert f"found sha256 {hashlib.sha256(damaged).hexdigest()}" in line
    no_traceback(caplog)


def test_a_file_this_process_never_verified_is_hashed_as_sent(
    store: Store, upstream: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    body = os.urandom(2 * MiB)
    upstream.files[LARGE] = body
    a = store.start("a")
    fetched(a, LARGE_URL, body)
    if store.kind == "s3":
        # Replica b's copy comes from the object (verified as it arrives); then it is
        # damaged on b's disk, and a restarted b has never verified it.
        b = store.start("b")
        fetched(b, LARGE_URL, body)
        store.kept("b", body)
        b.stop()
    flip(store.file("b" if store.kind == "s3" else "a", body), len(body) - 1)
    fresh = store.start("b")  # no stamps: every file is read for the first time
    cut_short(fresh, LARGE_URL, len(body))
    again = httpx.get(fresh.url + LARGE_URL, timeout=30)
    assert again.status_code == 200 and again.content == body
    assert upstream.count(LARGE) == store.fetches_after_a_bad_copy()
    no_traceback(caplog)


def test_a_sound_unverified_file_is_stamped_once_hashed(
    store: Store, upstream: FakeUpstream
) -> None:
    body = os.urandom(2 * MiB)
    upstream.files[LARGE] = body
    a = store.start("a")
    fetched(a, LARGE_URL, body)
    if store.kind == "s3":
        b = store.start("b")
        fetched(b, LARGE_URL, body)
        store.kept("b", body)
        b.stop()
    fresh = store.start("b")
    before = counter("proxy_blobs_quarantined_total")
    for _ in range(3):
        answer = httpx.get(fresh.url + LARGE_URL, timeout=30)
        assert answer.status_code == 200 and answer.content == body
    assert upstream.count(LARGE) == 1
    assert counter("proxy_blobs_quarantined_total") == before


@pytest.mark.parametrize("damage", ["flipped", "truncated"])
def test_a_corrupt_small_blob_never_enters_the_hot_cache(
    store: Store, upstream: FakeUpstream, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    caplog.set_level(logging.INFO)
    body = os.urandom(100 * KiB)
    upstream.files[SMALL] = body
    a = store.start("a")
    fetched(a, SMALL_URL, body)
    if store.kind == "s3":
        b = store.start("b")
        fetched(b, SMALL_URL, body)
        store.kept("b", body)
        b.stop()
    path = store.file("b" if store.kind == "s3" else "a", body)
    if damage == "flipped":
        flip(path, 10)
    else:
        path.write_bytes(body[:1000])
    reason = "digest" if damage == "flipped" else "size"
    fresh = store.start("b")  # its hot cache is empty: the first hit loads it
    before = counter("proxy_blobs_quarantined_total", reason=reason)
    for _ in range(3):
        answer = httpx.get(fresh.url + SMALL_URL, timeout=30)
        assert answer.status_code == 200 and answer.content == body
    assert counter("proxy_blobs_quarantined_total", reason=reason) == before + 1
    assert upstream.count(SMALL) == store.fetches_after_a_bad_copy()
    no_traceback(caplog)


def test_a_range_of_an_unverified_file_is_sent_only_once_the_file_is_verified(
    store: Store, upstream: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    body = os.urandom(2 * MiB)
    upstream.files[LARGE] = body
    a = store.start("a")
    fetched(a, LARGE_URL, body)
    if store.kind == "s3":
        b = store.start("b")
        fetched(b, LARGE_URL, body)
        store.kept("b", body)
        b.stop()
    flip(store.file("b" if store.kind == "s3" else "a", body), 50)  # inside the range
    fresh = store.start("b")
    answer = httpx.get(fresh.url + LARGE_URL, headers={"Range": "bytes=0-99"}, timeout=30)
    assert answer.status_code in (200, 206), answer.text
    if answer.status_code == 206:
        assert answer.content == body[:100]
    else:
        assert answer.content == body
    assert upstream.count(LARGE) == store.fetches_after_a_bad_copy()
    ranged = httpx.get(fresh.url + LARGE_URL, headers={"Range": "bytes=100-199"}, timeout=30)
    assert ranged.status_code == 206 and ranged.content == body[100:200]
    no_traceback(caplog)


def test_verify_reads_hashes_even_a_stamped_file(
    store: Store, upstream: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    body = os.urandom(2 * MiB)
    upstream.files[LARGE] = body
    a = store.start("a", storage_extra="verify_reads = true")
    fetched(a, LARGE_URL, body)
    # Bit rot: one byte changes, the stamp (size, mtime, inode) does not.
    path = store.file("a", body)
    stat = path.stat()
    flip(path, 1000)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    cut_short(a, LARGE_URL, len(body))
    again = httpx.get(a.url + LARGE_URL, timeout=30)
    assert again.status_code == 200 and again.content == body
    assert upstream.count(LARGE) == store.fetches_after_a_bad_copy()
    no_traceback(caplog)


# -- the scrub and proxy verify --------------------------------------------------------


def damage_stored(store: Store, body: bytes) -> None:
    """Damage what the scrub reads: the folder's file, or the object in the bucket."""
    if store.kind == "s3":
        assert store.seaweedfs is not None and store.bucket is not None
        sha = hashlib.sha256(body).hexdigest()
        damaged = bytearray(body)
        damaged[7] ^= 0xFF
        store.seaweedfs.put(store.bucket, f"proxy/blobs/{sha[:2]}/{sha[2:4]}/{sha}", bytes(damaged))
    else:
        flip(store.file("a", body), 7)


def three_blobs(store: Store, upstream: FakeUpstream, proxy: ServerThread) -> list[bytes]:
    bodies = [os.urandom(400 * KiB) for _ in range(3)]
    for n, body in enumerate(bodies):
        upstream.files[f"/releases/file-{n}.bin"] = body
        fetched(proxy, f"/tools/file-{n}.bin", body)
    return bodies


def test_the_scrub_paced_finds_and_quarantines_a_corrupt_blob_and_resumes(
    store: Store, upstream: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    from proxy.cache.quarantine import Quarantine
    from proxy.catalog import open_catalog
    from proxy.config.load import SCRUB_RATE_MIN
    from proxy.fetch.index import EntryIndex
    from proxy.http.bodies import HotBlobs, MarkCounts
    from proxy.jobs.scrub import JOB, Scrub
    from proxy.runtime.tasks import TaskSupervisor
    from proxy.storage.store import open_storage

    caplog.set_level(logging.INFO)
    a = store.start()
    bodies = three_blobs(store, upstream, a)
    shas = sorted(hashlib.sha256(b).hexdigest() for b in bodies)
    corrupt = next(b for b in bodies if hashlib.sha256(b).hexdigest() == shas[2])
    damage_stored(store, corrupt)
    settings = load(store.config("scrubber"), {})

    async def scrub(after: str | None) -> tuple[str, int, int, float, str | None]:
        catalog = open_catalog(settings.database_url)
        storage = open_storage(settings)
        tasks = TaskSupervisor()
        await storage.start()
        try:
            await catalog.save_job_cursor(JOB, after)  # as a pass cut off there left it
            quarantine = Quarantine(catalog, storage, EntryIndex(), HotBlobs(), MarkCounts(), tasks)
            job = Scrub(catalog, storage, quarantine, SCRUB_RATE_MIN, resume=True)
            line = await job.run()
            summary = job.summary
            return (
                line,
                summary.checked,
                summary.corrupt,
                summary.slept_s,
                await catalog.job_cursor(JOB),
            )
        finally:
            await tasks.close(10.0)
            await storage.close()
            await catalog.close()

    slept_before = counter("proxy_scrub_sleep_seconds_total")
    line, checked, found, slept_s, cursor = asyncio.run(scrub(shas[0]))
    assert (checked, found) == (2, 1), line  # resumed after the first blob
    assert f"after {shas[0][:12]}" in line
    assert cursor is None  # the round is complete: the next starts from the first blob
    assert slept_s > 0 and counter("proxy_scrub_sleep_seconds_total") > slept_before  # paced
    quarantined_line(caplog, shas[2])
    n = bodies.index(corrupt)
    # A replica with no copy of its own asks (on object storage, a's copy is sound).
    reader = store.start("c") if store.kind == "s3" else a
    fetched(reader, f"/tools/file-{n}.bin", corrupt)
    assert upstream.count(f"/releases/file-{n}.bin") == 2  # fetched again
    line, checked, found, _, _ = asyncio.run(scrub(None))
    assert (checked, found) == (3, 0), line
    no_traceback(caplog)


def verify(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy", "verify", "-c", str(config), *args],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(Path.cwd())},
    )  # fmt: skip


def test_proxy_verify_names_each_corrupt_blob_and_exits_1(
    store: Store, upstream: FakeUpstream
) -> None:
    a = store.start()
    bodies = three_blobs(store, upstream, a)
    damage_stored(store, bodies[1])
    sha = hashlib.sha256(bodies[1]).hexdigest()
    config = store.config("verifier")

    dry = verify(config, "--dry-run")
    assert dry.returncode == 1, dry.stderr
    assert f"corrupt  {sha}" in dry.stdout and "tools/file-1.bin" in dry.stdout
    assert "checked 3 blobs" in dry.stdout and "1 corrupt" in dry.stdout
    assert "dry run" in dry.stdout and "Traceback" not in dry.stderr
    assert httpx.head(a.url + "/tools/file-1.bin").status_code == 200  # still recorded

    real = verify(config)
    assert real.returncode == 1, real.stderr
    assert f"corrupt  {sha}" in real.stdout and "quarantined" in real.stdout
    assert "Traceback" not in real.stderr
    if store.kind == "folder":
        assert (store.root("a") / "quarantine" / sha).is_file()
        assert not store.file("a", bodies[1]).exists()

    clean = verify(config)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "checked 2 blobs" in clean.stdout and "0 corrupt" in clean.stdout
    # The next request fetches it again, and then every blob is sound (on object
    # storage from a replica with no copy of its own: a's is sound).
    reader = store.start("c") if store.kind == "s3" else a
    fetched(reader, "/tools/file-1.bin", bodies[1])
    assert upstream.count("/releases/file-1.bin") == 2
    assert verify(config).returncode == 0


def test_a_symlink_at_a_blobs_name_is_never_followed(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    store = Store("folder", tmp_path, upstream, start_proxy)
    body = os.urandom(2 * MiB)
    upstream.files[LARGE] = body
    a = store.start()
    fetched(a, LARGE_URL, body)
    path = store.file("a", body)
    other = tmp_path / "elsewhere"
    other.write_bytes(os.urandom(len(body)))  # the same size: only the link gives it away
    path.unlink()
    path.symlink_to(other)
    before = counter("proxy_blobs_quarantined_total", reason="type")
    answer = httpx.get(a.url + LARGE_URL, timeout=30)
    assert answer.status_code == 200 and answer.content == body
    assert counter("proxy_blobs_quarantined_total", reason="type") == before + 1
    assert httpx.head(a.url + LARGE_URL).status_code == 200  # stored and recorded again
    assert path.is_file() and not path.is_symlink()  # the fetched copy took its place
    assert len(other.read_bytes()) == len(body), "the link's target is left alone"


def test_proxy_verify_draws_a_progress_line_on_a_terminal() -> None:
    import io

    from proxy.jobs.scrub import VerifyReport
    from proxy.storage.integrity import Corruption

    out = io.StringIO()
    report = VerifyReport(out, tty=True)
    report.planned(2, 3 * MiB)
    report.checked("a" * 64, MiB)
    report.corrupt(Corruption("b" * 64, 2 * MiB, MiB), [("tools", "x.bin")], "quarantined")
    report.checked("b" * 64, 2 * MiB)
    report.finish()
    text = out.getvalue()
    assert "\r[" in text and "1/2" in text and "2/2" in text  # redrawn in place
    assert f"\ncorrupt  {'b' * 64}" in text  # on a line of its own, not over the bar
    assert "tools/x.bin" in text and "corrupt 1" in text
    assert text.endswith("\n")  # the terminal's line is left clean
    quiet = io.StringIO()
    report = VerifyReport(quiet, tty=False)
    report.planned(1, MiB)
    report.checked("a" * 64, MiB)
    report.finish()
    assert quiet.getvalue() == ""  # off a terminal, only what is wrong is printed


def test_a_corrupt_stored_index_page_is_never_parsed_and_is_fetched_again(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    from tests.conftest import pypi_config
    from tests.upstream import ProjectFile

    upstream.add_project("alpha", [ProjectFile("alpha-1.0.tar.gz", b"sdist")])
    config = write_config(tmp_path, pypi_config(tmp_path / "data", upstream.base_url))
    first = start_proxy(load(config, {}))
    page = httpx.get(first.url + "/pypi/simple/alpha/", timeout=30)
    assert page.status_code == 200 and "alpha-1.0.tar.gz" in page.text
    with sqlite3.connect(tmp_path / "data" / "proxy.db") as db:
        [(sha,)] = db.execute(
            "SELECT sha256 FROM entries WHERE kind = 'metadata' AND sha256 IS NOT NULL"
        ).fetchall()
    stored = tmp_path / "data" / "blobs" / sha[:2] / sha[2:4] / sha
    stored.write_bytes(stored.read_bytes().replace(b"alpha-1.0", b"alpha-6.6"))
    before = counter("proxy_blobs_quarantined_total", reason="digest")
    fresh = start_proxy(load(config, {}))  # it parses the stored page to render it
    again = httpx.get(fresh.url + "/pypi/simple/alpha/", timeout=30)
    assert again.status_code == 200, again.text
    assert "alpha-1.0.tar.gz" in again.text and "alpha-6.6" not in again.text
    assert counter("proxy_blobs_quarantined_total", reason="digest") == before + 1
