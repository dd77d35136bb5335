"""Index documents served from their stored model (docs/architecture.md, "Index
documents"): what a stored document lists, what the engine decided for it, and its
renderings, each worked out once.

A format stores an index document (a PyPI project page, maven-metadata.xml, a
packument) once, as its own model, and declares how to read and render it
(``contract.IndexModel``). Serving it takes three steps, each kept by the stored
body's sha256 (content-addressed, so never stale):

1. its **listing** (``IndexModel.listing``, in ``compute``), with the time this fleet
   first saw each file the document gives no publish time for (recorded once, in the
   catalog);
2. its **judgement**: the ``View`` the release policy gives it (what to withhold), kept
   until a hold in it ends or the policy is reloaded;
3. its **rendering** in the representation asked for (``IndexModel.render``, in
   ``compute``), by (sha256, representation, what is withheld).

A rendering is a file of this host's own, named by its sha256 (a cache of derived
bytes, never uploaded to the storage: any replica renders the same bytes again), in
``{storage}/documents/``; it is served as stored entries are (ETag, 304, Range, HEAD;
small ones from memory), and neither the model nor the rendering passes through the
server's memory: ``compute`` reads the model's local copy and writes the rendering in
the child. The renderings kept are bounded (``RENDERINGS_CAPACITY``): one forgotten is
deleted, one found gone is rendered again, and files left by an earlier process are
removed at start once an hour old. A body never stored (TTL 0) is written there too,
to be rendered like a stored one.

A hit on a document costs three dictionary lookups; only what changed is worked out
again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
import uuid
from array import array
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Generic, TypeVar

from proxy.catalog import Catalog
from proxy.clock import Clock
from proxy.contract import BASE_URL_MARK, IndexModel, ListedVersion, Listing, View
from proxy.runtime.blocking import run_blocking
from proxy.storage.blobs import TEMP_SUFFIX, storage_error
from proxy.types import Digests

LISTINGS_CAPACITY = 1024  # documents whose listing is remembered
JUDGEMENTS_CAPACITY = 4096
RENDERINGS_CAPACITY = 4096  # rendering files kept by this process, and their bytes
RENDERINGS_CAPACITY_BYTES = 2 * 2**30
LEFTOVER_AGE_S = 3600.0  # an earlier process's files older than this are removed at start
# Keys whose first sight is recorded in one statement: a document of 100,000 files that
# give no time is recorded in batches, so no statement holds it all at once.
FIRST_SIGHT_BATCH = 10_000
MARK = BASE_URL_MARK.encode()
READ_CHUNK_BYTES = 1024 * 1024

K = TypeVar("K")
V = TypeVar("V")


class _Lru(Generic[K, V]):
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)


@dataclass(frozen=True)
class _Packed:
    """A listing as it travels back from ``compute``: a few flat values, so a document
    of 100,000 versions costs the server a few arrays and strings, not 100,000 objects
    (docs/architecture.md, "The event loop only waits"). ``versions`` is the versions
    joined by newlines (no version holds one); ``published`` the times (-1: unstated);
    version ``i``'s unstated keys are ``keys[offsets[i]:offsets[i + 1]]`` of the keys
    of the JSON arrays ``unstated`` (in batches: see ``FIRST_SIGHT_BATCH``)."""

    versions: str
    published: array[int]
    offsets: array[int]
    unstated: tuple[str, ...]
    time_source: str
    updated_at_ms: int | None


class Listed:
    """What a stored document lists, and when this fleet first saw each file it states
    no publish time for (``seen_json``: key -> Unix ms, as one JSON text, read only when
    a decision needs it; renderings get it as is)."""

    def __init__(self, packed: _Packed, seen_json: str) -> None:
        self.packed = packed
        self.seen_json = seen_json
        self._versions: list[str] | None = None
        self._index: dict[str, int] | None = None
        self._keys: list[str] | None = None
        self._seen: dict[str, int] | None = None

    @property
    def time_source(self) -> str:
        return self.packed.time_source

    @property
    def updated_at_ms(self) -> int | None:
        return self.packed.updated_at_ms

    def _names(self) -> list[str]:
        if self._versions is None:
            text = self.packed.versions
            self._versions = text.split("\n") if text else []
        return self._versions

    def versions(self) -> list[ListedVersion]:
        return [self._at(i) for i in range(len(self._names()))]

    def version(self, version: str) -> ListedVersion | None:
        if self._index is None:
            self._index = {v: i for i, v in enumerate(self._names())}
        i = self._index.get(version)
        return None if i is None else self._at(i)

    def _at(self, i: int) -> ListedVersion:
        packed = self.packed
        start, end = packed.offsets[i], packed.offsets[i + 1]
        unstated: tuple[str, ...] = ()
        if end > start:
            if self._keys is None:
                self._keys = [key for batch in packed.unstated for key in json.loads(batch)]
            unstated = tuple(self._keys[start:end])
        at_ms = packed.published[i]
        return ListedVersion(self._names()[i], at_ms if at_ms >= 0 else None, unstated)

    def first_seen_of(self, listed: ListedVersion) -> int | None:
        """When the version was first seen: its earliest file's first sight."""
        if not listed.unstated:
            return None
        if self._seen is None:
            self._seen = json.loads(self.seen_json)
        times = [self._seen[k] for k in listed.unstated if k in self._seen]
        return min(times) if times else None


@dataclass(frozen=True)
class Judged:
    """What the engine decided for one stored document: the ``View`` to render, what
    tells renderings apart (the versions withheld), until when it holds (a hold ends
    then; None: until the policy changes), and what each request of it counts."""

    view: View
    identity: str
    until_ms: int | None = None
    generation: int = 0
    count: Callable[[int], None] | None = None  # given how many requests


class Rendering:
    """A document as clients get it: a file of this host (base-URL marks still in
    place)."""

    __slots__ = ("_digests", "marks", "path", "sha256", "size")

    def __init__(self, sha256: str, size: int, marks: bool, path: str) -> None:
        self.sha256 = sha256
        self.size = size
        self.marks = marks
        self.path = path
        self._digests: Digests = {}

    async def digests(self, names: Iterable[str]) -> Digests:
        """The digests of the rendering (its sha256 and ``names``), computed once each.
        FileNotFoundError if its file is gone."""
        wanted = [n for n in dict.fromkeys(names) if n != "sha256" and n not in self._digests]
        if wanted:
            self._digests.update(await run_blocking(_digests_of_file, self.path, wanted))
        return {"sha256": self.sha256, **self._digests}

    async def read(self) -> bytes:
        """The whole rendering; FileNotFoundError if its file is gone."""
        return await run_blocking(_read, self.path)


class _Renderings:
    """The renderings this process keeps, least recently used first out (their files
    deleted then), bounded in number and bytes. Two keys may name one file (documents
    that render alike): it is deleted once no key names it."""

    def __init__(self, capacity: int, capacity_bytes: int) -> None:
        self.capacity = capacity
        self.capacity_bytes = capacity_bytes
        self._items: OrderedDict[tuple[str, str, str, str], Rendering] = OrderedDict()
        self._names: dict[str, int] = {}  # path -> keys naming it
        self._bytes = 0

    def get(self, key: tuple[str, str, str, str]) -> Rendering | None:
        found = self._items.get(key)
        if found is not None:
            self._items.move_to_end(key)
        return found

    def put(self, key: tuple[str, str, str, str], rendering: Rendering) -> list[str]:
        """Keep ``rendering``; the files no longer kept (to delete)."""
        gone = self._drop(key)
        self._items[key] = rendering
        if self._names.get(rendering.path, 0) == 0:
            self._bytes += rendering.size
        self._names[rendering.path] = self._names.get(rendering.path, 0) + 1
        gone = [p for p in gone if p != rendering.path]
        while self._items and (
            len(self._items) > self.capacity or self._bytes > self.capacity_bytes
        ):
            gone += self._drop(next(iter(self._items)))
        return gone

    def drop(self, key: tuple[str, str, str, str]) -> None:
        self._drop(key)

    def _drop(self, key: tuple[str, str, str, str]) -> list[str]:
        rendering = self._items.pop(key, None)
        if rendering is None:
            return []
        left = self._names[rendering.path] - 1
        if left:
            self._names[rendering.path] = left
            return []
        del self._names[rendering.path]
        self._bytes -= rendering.size
        return [rendering.path]


Judge = Callable[[str, Listed], Awaitable[Judged]]
"""``judge(document key, listed)``: the release policy's view of a document."""


class Documents:
    """The engine's listings, judgements and renderings, for every repository."""

    def __init__(
        self,
        catalog: Catalog,
        root: Path,
        compute: Callable[..., Awaitable[Any]],
        clock: Clock,
    ) -> None:
        """``root``: this host's storage folder (``Storage.files.root``)."""
        self.catalog = catalog
        self.folder = root / "documents"
        self.temps = root / "tmp"
        self.compute = compute
        self.clock = clock
        self._listings: _Lru[tuple[str, str], Listed] = _Lru(LISTINGS_CAPACITY)
        self._judged: _Lru[tuple[str, str], Judged] = _Lru(JUDGEMENTS_CAPACITY)
        # (repository, document sha256, representation, what is withheld) -> rendering:
        # the repository too, as its first sights are part of what is rendered.
        self._renderings = _Renderings(RENDERINGS_CAPACITY, RENDERINGS_CAPACITY_BYTES)

    async def start(self) -> None:
        """Make the folder, and remove what an earlier process left there."""
        await run_blocking(_prepare, self.folder, time.time() - LEFTOVER_AGE_S)

    def path_of(self, sha256: str) -> str:
        return f"{self.folder}/{sha256}"

    async def keep(self, body: bytes) -> str:
        """Write a body never stored (TTL 0) here, to render it; its sha256."""
        temp = self._temp()
        try:
            sha256 = await run_blocking(_write_synced, temp, body)
            await run_blocking(os.replace, temp, self.path_of(sha256))
        except OSError as exc:
            raise storage_error(f"writing {self.folder}", "write", exc) from exc
        finally:
            await run_blocking(_remove, temp)
        return sha256

    def _temp(self) -> Path:
        return self.temps / f"{uuid.uuid4().hex}{TEMP_SUFFIX}"

    async def listed(
        self,
        repository: str,
        model: IndexModel,
        sha256: str,
        size: int,
        path: Callable[[], Awaitable[str]],
    ) -> Listed:
        """What the stored document ``sha256`` lists (``path``: where a complete copy of
        it is on this host, made on demand). FileNotFoundError if its blob is gone."""
        found = self._listings.get((repository, sha256))
        if found is not None:
            return found
        packed: _Packed = await self.compute(_list_file, model.listing, await path(), weight=size)
        now_ms = self.clock.now_ms()
        seen = [
            await self.catalog.record_first_sight(repository, batch, now_ms)
            for batch in packed.unstated
        ]
        found = Listed(packed, _merged(seen))
        self._listings.put((repository, sha256), found)
        return found

    async def judged(
        self,
        repository: str,
        key: str,
        listed: Listed,
        sha256: str,
        judge: Judge,
        generation: int,
    ) -> Judged:
        """The judgement of a document, worked out again when a hold in it ended or the
        policy was reloaded (``generation``)."""
        found = self._judged.get((repository, sha256))
        now_ms = self.clock.now_ms()
        if (
            found is not None
            and found.generation == generation
            and (found.until_ms is None or now_ms < found.until_ms)
        ):
            return found
        found = await judge(key, listed)
        self._judged.put((repository, sha256), found)
        return found

    def rendered(
        self, repository: str, sha256: str, representation: str, judged: Judged
    ) -> Rendering | None:
        """The rendering already made, if any (its file may be gone since)."""
        return self._renderings.get((repository, sha256, representation, judged.identity))

    async def render(
        self,
        repository: str,
        model: IndexModel,
        sha256: str,
        size: int,
        path: Callable[[], Awaitable[str]],
        listed: Listed,
        judged: Judged,
        representation: str,
    ) -> Rendering:
        """Render the stored document ``sha256`` as ``judged`` says, into a file here.
        FileNotFoundError if the model's blob is gone."""
        temp = self._temp()
        try:
            digest, length, marks = await self.compute(
                _render_file,
                model.render,
                await path(),
                judged.view,
                listed.seen_json,
                representation,
                str(temp),
                weight=size,
            )
            await run_blocking(os.replace, temp, self.path_of(digest))
        except OSError as exc:
            raise storage_error(f"writing {self.folder}", "write", exc) from exc
        finally:
            await run_blocking(_remove, temp)
        found = Rendering(digest, length, marks, self.path_of(digest))
        ident = (repository, sha256, representation, judged.identity)
        for gone in self._renderings.put(ident, found):
            await run_blocking(_remove, Path(gone))
        return found

    def forget(self, repository: str, sha256: str, representation: str, judged: Judged) -> None:
        """A rendering whose file is gone: made again when next asked for."""
        self._renderings.drop((repository, sha256, representation, judged.identity))


# -- what runs in compute (a child process for all but small documents) --------------------


def _list_file(listing: Callable[[bytes], Listing], path: str) -> _Packed:
    with open(path, "rb") as fh:
        found = listing(fh.read())
    keys: list[str] = []
    offsets = array("q", [0])
    versions = [v for v in found.versions if "\n" not in v.version]
    for version in versions:
        keys.extend(version.unstated)
        offsets.append(len(keys))
    stated = (v.published_at_ms for v in versions)
    return _Packed(
        versions="\n".join(v.version for v in versions),
        published=array("q", (-1 if at_ms is None else at_ms for at_ms in stated)),
        offsets=offsets,
        unstated=tuple(
            json.dumps(keys[i : i + FIRST_SIGHT_BATCH])
            for i in range(0, len(keys), FIRST_SIGHT_BATCH)
        ),
        time_source=found.time_source,
        updated_at_ms=found.updated_at_ms,
    )


def _merged(objects: list[str]) -> str:
    """JSON objects with distinct keys, merged as text (never parsed in the server)."""
    inner = [text.strip()[1:-1] for text in objects]
    return "{" + ",".join(part for part in inner if part.strip()) + "}"


def _render_file(
    render: Callable[[bytes, View, str], bytes],
    path: str,
    view: View,
    seen_json: str,
    representation: str,
    out: str,
) -> tuple[str, int, bool]:
    """Render the model at ``path`` into ``out``, fsynced (it is then moved to its
    content address: a torn file must never be published under a sha256); its
    (sha256, size, whether it holds base-URL marks). The first sights the view shows
    arrive as the catalog's JSON text and are read here, not in the server."""
    if seen_json != "{}":
        view = replace(view, published=json.loads(seen_json))
    with open(path, "rb") as fh:
        body = render(fh.read(), view, representation)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        view_of = memoryview(body)
        written = 0
        while written < len(body):
            written += os.write(fd, view_of[written:])
        os.fsync(fd)
    finally:
        os.close(fd)
    return hashlib.sha256(body).hexdigest(), len(body), MARK in body


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _read(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def _write_synced(path: Path, body: bytes) -> str:
    """Write ``body`` to a new file, fsynced (it is then named by its sha256)."""
    with open(path, "xb") as fh:
        fh.write(body)
        fh.flush()
        os.fsync(fh.fileno())
    return hashlib.sha256(body).hexdigest()


def _prepare(folder: Path, before_s: float) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for entry in os.scandir(folder):
        with contextlib.suppress(FileNotFoundError):
            if entry.is_file() and entry.stat().st_mtime < before_s:
                os.unlink(entry.path)


def _digests_of_file(path: str, names: list[str]) -> Digests:
    hashes = [hashlib.new(name) for name in names]
    with open(path, "rb") as fh:
        while chunk := fh.read(READ_CHUNK_BYTES):
            for h in hashes:
                h.update(chunk)
    return {name: h.hexdigest() for name, h in zip(names, hashes, strict=True)}
