"""The catalog's eviction, retention, tombstone and schedule operations, on both backends
(docs/architecture.md, "Eviction and retention", "Jobs")."""

from __future__ import annotations

import pytest

from proxy.catalog import Catalog, Entry
from proxy.clock import ManualClock
from proxy.types import Kind
from tests.conftest import pass_time

pytestmark = pytest.mark.anyio


def _sha(n: int) -> str:
    return f"{n:064x}"


def _entry(
    key: str, sha: str | None, size: int, accessed_ms: int, repository: str = "r", **kw: object
) -> Entry:
    fields: dict[str, object] = dict(
        repository=repository,
        key=key,
        kind=Kind.IMMUTABLE,
        sha256=sha,
        size=size,
        content_type=None,
        fetched_at_ms=accessed_ms,
        expires_at_ms=None,
        digests={},
        last_access_ms=accessed_ms,
    )
    fields.update(kw)
    return Entry(**fields)  # type: ignore[arg-type]


async def _keys(catalog: Catalog, repository: str, keys: list[str]) -> list[str]:
    return [k for k in keys if await catalog.get_entry(repository, k) is not None]


async def test_evict_lru_frees_exactly_the_overshoot_in_access_order(catalog: Catalog) -> None:
    # Ten entries of 100 bytes accessed at t=1..10, one hosted and one negative entry
    # that the pass must never touch, whatever their age.
    for i in range(10):
        await catalog.put_entry(_entry(f"k{i}", _sha(i), 100, accessed_ms=1000 + i))
    await catalog.put_entry(_entry("hosted", _sha(50), 500, 1, kind=Kind.HOSTED))
    await catalog.put_entry(_entry("neg", None, 0, 1, kind=Kind.NEGATIVE, expires_at_ms=10**15))
    usage = await catalog.storage_usage()
    assert (usage.proxied_entries, usage.proxied_bytes, usage.hosted_bytes) == (10, 1000, 500)

    removed = await catalog.evict_lru(250, limit=100)  # 250 bytes: three entries
    assert [r.key for r in removed] == ["k0", "k1", "k2"]
    assert sum(r.size for r in removed) == 300
    removed = await catalog.evict_lru(10**9, limit=2)  # the batch limit holds
    assert [r.key for r in removed] == ["k3", "k4"]
    keys = [f"k{i}" for i in range(10)] + ["hosted", "neg"]
    assert await _keys(catalog, "r", keys) == ["k5", "k6", "k7", "k8", "k9", "hosted", "neg"]
    usage = await catalog.storage_usage()
    assert (usage.proxied_bytes, usage.hosted_bytes, usage.tombstoned_bytes) == (500, 500, 500)


async def test_a_blob_another_entry_still_uses_is_kept(
    catalog: Catalog, clock: ManualClock
) -> None:
    shared = _sha(7)
    await catalog.put_entry(_entry("old", shared, 100, 1000))
    await catalog.put_entry(_entry("new", shared, 100, 2000, repository="other"))
    assert [r.key for r in await catalog.evict_lru(1, 10)] == ["old"]
    assert await catalog.unreferenced_blobs([shared]) == set()
    assert await catalog.drop_referenced_tombstones() == 1  # tombstoned, but still in use
    await pass_time(catalog, clock, 0.3)
    assert await catalog.due_tombstones(0.1, "", 10) == []


async def test_tombstones_wait_out_the_grace_and_a_restored_blob_is_spared(
    catalog: Catalog, clock: ManualClock
) -> None:
    await catalog.put_entry(_entry("a", _sha(1), 10, 1000))
    await catalog.put_entry(_entry("b", _sha(2), 20, 1001))
    assert len(await catalog.evict_lru(30, 10)) == 2
    assert await catalog.due_tombstones(1.0, "", 10) == []  # within the grace
    await catalog.put_entry(_entry("b", _sha(2), 20, 5000))  # fetched again meanwhile
    await pass_time(catalog, clock, 1.2)
    assert await catalog.due_tombstones(1.0, "", 10) == [(_sha(1), 10)]
    # Reading them takes nothing: a tombstone stays until its file is gone.
    assert await catalog.due_tombstones(1.0, "", 10) == [(_sha(1), 10)]
    assert await catalog.due_tombstones(1.0, _sha(1), 10) == []  # keyset: after _sha(1)
    assert await catalog.forget_tombstones([_sha(1)]) == 1
    assert await catalog.due_tombstones(1.0, "", 10) == []
    assert await catalog.drop_referenced_tombstones() == 1
    assert (await catalog.storage_usage()).tombstoned_bytes == 0


async def test_due_tombstones_come_in_keyset_pages(catalog: Catalog, clock: ManualClock) -> None:
    for i in range(5):
        await catalog.put_entry(_entry(f"k{i}", _sha(i), 10, 1000 + i))
    assert len(await catalog.evict_lru(10**9, 10)) == 5
    await pass_time(catalog, clock, 0.3)
    first = await catalog.due_tombstones(0.1, "", 2)
    second = await catalog.due_tombstones(0.1, first[-1][0], 2)
    third = await catalog.due_tombstones(0.1, second[-1][0], 2)
    assert [sha for sha, _ in first + second + third] == [_sha(i) for i in range(5)]
    assert await catalog.unreferenced_blobs([_sha(0), _sha(9)]) == {_sha(9)}  # tombstoned


async def test_a_replaced_blob_is_tombstoned_too(catalog: Catalog, clock: ManualClock) -> None:
    await catalog.put_entry(_entry("page", _sha(1), 10, 1000, kind=Kind.METADATA))
    await catalog.put_entry(_entry("page", _sha(2), 12, 2000, kind=Kind.METADATA))
    await catalog.touch_entries([("r", "page", 3000)])  # no new tombstone for a touch
    await pass_time(catalog, clock, 0.3)
    assert await catalog.due_tombstones(0.1, "", 10) == [(_sha(1), 10)]
    assert await catalog.forget_tombstones([_sha(1)]) == 1
    assert await catalog.unreferenced_blobs([_sha(1)]) == {_sha(1)}


async def test_expire_unused_is_per_repository_and_by_last_access(catalog: Catalog) -> None:
    for i in range(5):
        await catalog.put_entry(_entry(f"k{i}", _sha(i), 10, accessed_ms=1000 * (i + 1)))
    await catalog.put_entry(_entry("k0", _sha(9), 10, 1000, repository="other"))
    await catalog.put_entry(_entry("up", _sha(8), 10, 1, kind=Kind.HOSTED))
    await catalog.touch_entries([("r", "k0", 10_000)])  # read since: kept
    removed = await catalog.expire_unused("r", before_ms=3500, limit=1)
    assert len(removed) == 1
    removed += await catalog.expire_unused("r", before_ms=3500, limit=100)
    assert sorted(r.key for r in removed) == ["k1", "k2"]
    keys = ["k0", "k1", "k2", "k3", "k4", "up"]
    assert await _keys(catalog, "r", keys) == ["k0", "k3", "k4", "up"]
    assert await catalog.get_entry("other", "k0") is not None


async def test_job_runs_record_outcome_and_give_back(catalog: Catalog, clock: ManualClock) -> None:
    runs, now_ms = await catalog.job_runs()
    assert runs == [] and now_ms > 0
    run_id = await catalog.claim_job_run("evict", 3600, "me")
    assert run_id is not None
    [run], _ = await catalog.job_runs()
    assert (run.name, run.outcome, run.holder, run.finished_at_ms) == (
        "evict",
        "running",
        "me",
        None,
    )
    await catalog.finish_job_run("evict", run_id, "ok")
    [run], now_ms = await catalog.job_runs()
    assert run.outcome == "ok" and run.finished_at_ms is not None
    assert run.started_at_ms is not None and run.started_at_ms <= run.finished_at_ms <= now_ms
    # A run given back: its start is undone, so the schedule is due again at once.
    run_id = await catalog.claim_job_run("mirror:x", 3600, "me")
    assert run_id is not None
    await catalog.give_back_job_run("mirror:x", run_id)
    runs, _ = await catalog.job_runs()
    given_back = next(r for r in runs if r.name == "mirror:x")
    assert (given_back.outcome, given_back.started_at_ms) == ("cancelled", None)
    assert await catalog.claim_job_run("mirror:x", 3600, "other") is not None
