"""The hit lane: answers to fresh hits kept ready, sent by the HTTP protocol itself
without running the app (docs/architecture.md, "The hit lane").

Most requests a resolver sends are hits on small stored bodies: index pages, metadata,
wheels, poms. The full path (router, dispatcher, format, cache view, release gate,
response) answers the first such request; on the way, each part that does something
per hit says so on the request's ``LaneTicket`` (a context variable, like the access
log's ``Exchange``): which entry the answer was made from, until when it holds, and
what else every hit does (counters, the access time). The dispatcher then files the
answer here, keyed by the request target and the request headers its ``Vary`` names:
exactly what a shared cache in front may key it by (docs/architecture.md, "Caching by
others"). ``GuardedHttpToolsProtocol`` answers later requests for it in one write, with
no task, no scope walk and no allocation but the bytes it sends, while

- the ``EntryIndex`` still holds the very entry object the answer was made from: every
  purge, eviction, refetch, quarantine and purge elsewhere in the fleet drops or
  replaces that object, so the answer goes with it;
- the entry is fresh by the clock (its expiry under today's TTLs; the end of a release
  hold the answer reflects);
- the release policy has not been reloaded since (a reload clears the lane).

A request the lane would not answer exactly as the full path does (a Range, an
If-Modified-Since, a body, HTTP/1.0, Connection: close, a second Host, a header sent
twice, a request pipelined behind an answer still being sent) takes the full path.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextvars import ContextVar

from proxy.catalog import CLOCK_STEP_TOLERANCE_MS, Entry
from proxy.clock import Clock
from proxy.fetch.index import EntryIndex
from proxy.http import access_log
from proxy.http.paths import MAX_HEADER_BYTES
from proxy.http.semantics import matches_etag
from proxy.runtime import metrics
from proxy.types import Kind

# What the lane keeps: answers of bodies up to the hot LRU's size, this many bytes of
# them and this many answers in all (oldest filed first out), at most this many
# representations of one target (Vary: Accept).
LANE_MAX_BYTES = 64 * 1024 * 1024
LANE_MAX_ANSWERS = 50_000
LANE_MAX_VARIANTS = 8
# Request headers after which the full path's answer may differ from the one kept (or
# that need its checks): they send the request down the full path.
FULL_PATH_HEADERS = frozenset(
    {
        b"range",
        b"if-range",
        b"if-unmodified-since",
        b"content-length",
        b"transfer-encoding",
        b"expect",
        b"upgrade",
    }
)
# If-Modified-Since is judged by the full path, unless If-None-Match comes with it,
# which then decides alone (RFC 9110, 13.1.3): a revalidating cache sends both.
CONDITIONAL_HEADERS = (b"if-none-match", b"if-modified-since", *FULL_PATH_HEADERS)
MAX_AGE_PREFIX = b"public, max-age="

# What each hit does besides its answer, given how many hits there were since it was
# last told (the lane tells it in batches: see ``HitLane.flush``).
PerHit = Callable[[int], object]
# Counts and access times are handed on at least this often.
FLUSH_INTERVAL_S = 1.0


class LaneTicket:
    """What one request's full path did that its answer depends on, and what each hit
    does. ``spoiled``: the answer may depend on something the lane cannot check (two
    entries, a miss, a body naming the client's own URL): it is not kept."""

    __slots__ = ("epoch", "indexed", "outcome", "per_hit", "served", "spoiled", "until_ms")

    def __init__(self, epoch: int = 0) -> None:
        self.epoch = epoch  # the lane's when the request began (HitLane.clear)
        self.indexed: Entry | None = None  # the EntryIndex's object for the key
        self.served: Entry | None = None  # the entry as judged (today's TTLs)
        self.until_ms: int | None = None  # a release hold the answer reflects ends then
        self.per_hit: list[PerHit] = []
        self.outcome = "hit"
        self.spoiled = False


TICKET: ContextVar[LaneTicket | None] = ContextVar("proxy_lane_ticket", default=None)


def note_hit(indexed: Entry | None, served: Entry, *per_hit: PerHit) -> None:
    """A fresh hit on ``served`` (the index's object for it: ``indexed``), and what else
    this hit did that every later hit must do too."""
    ticket = TICKET.get()
    if ticket is None:
        return
    if ticket.served is not None or indexed is None or indexed.sha256 != served.sha256:
        ticket.spoiled = True  # a second key, or one the index does not hold
        return
    ticket.indexed = indexed
    ticket.served = served
    ticket.per_hit.extend(per_hit)


def note_each_hit(per_hit: PerHit) -> None:
    """Something every hit of this answer does (a release decision counted)."""
    ticket = TICKET.get()
    if ticket is not None:
        ticket.per_hit.append(per_hit)


def note_until(until_ms: int | None) -> None:
    """The answer reflects a release hold that ends at ``until_ms``: it changes then."""
    ticket = TICKET.get()
    if ticket is not None and until_ms is not None:
        ticket.until_ms = until_ms if ticket.until_ms is None else min(ticket.until_ms, until_ms)


def spoil() -> None:
    """This request's answer is not one the lane may keep."""
    ticket = TICKET.get()
    if ticket is not None:
        ticket.spoiled = True


class LaneAnswer:
    """One representation of one target, ready to send."""

    __slots__ = (
        "_date",
        "_head_200",
        "_head_304",
        "_max_age",
        "body",
        "cache_control_at",
        "etag",
        "expires_at_ms",
        "fresh_from_ms",
        "headers",
        "ident",
        "indexed",
        "outcome",
        "pending",
        "per_hit",
        "repository",
        "served",
        "size",
        "until_ms",
    )

    def __init__(
        self,
        ticket: LaneTicket,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        cache_control_at: int | None,
        etag: str | None,
    ) -> None:
        served, indexed = ticket.served, ticket.indexed
        assert served is not None and indexed is not None
        self.served = served
        self.indexed = indexed
        self.ident = (indexed.repository, indexed.key)
        self.repository = indexed.repository
        self.fresh_from_ms = served.fetched_at_ms - CLOCK_STEP_TOLERANCE_MS
        self.expires_at_ms = served.expires_at_ms
        self.until_ms = ticket.until_ms
        self.per_hit = tuple(ticket.per_hit)
        self.pending = 0  # hits not yet told to per_hit
        self.outcome = ticket.outcome
        self.headers = headers
        self.cache_control_at = cache_control_at  # its index, if max-age counts down
        self.etag = etag
        self.body = body
        self.size = len(body) + sum(len(n) + len(v) for n, v in headers)
        self._date: object = None
        self._max_age = -1
        self._head_200 = b""
        self._head_304 = b""

    def fresh(self, now_ms: int) -> bool:
        expires = self.expires_at_ms
        if expires is not None and not (self.fresh_from_ms <= now_ms < expires):
            return False
        return self.until_ms is None or now_ms < self.until_ms

    def max_age_s(self, now_ms: int) -> int:
        """As the full path states it (``Entry.max_age_s``; a hold's end caps it)."""
        max_age = self.served.max_age_s(now_ms)
        if self.until_ms is not None:
            max_age = max(0, min(max_age, (self.until_ms - now_ms) // 1000))
        return max_age

    def heads(self, date: list[tuple[bytes, bytes]], now_ms: int) -> tuple[bytes, bytes]:
        """The 200 and 304 heads (status line to the blank line), made again when the
        server's Date header changes (once a second) or max-age counts down (on the
        entry's own seconds, not the clock's)."""
        max_age = self.max_age_s(now_ms) if self.cache_control_at is not None else 0
        if date is not self._date or max_age != self._max_age:
            lines = [b"".join((n, b": ", v, b"\r\n")) for n, v in date]
            fields = []
            for i, (name, value) in enumerate(self.headers):
                if i == self.cache_control_at:
                    value = MAX_AGE_PREFIX + b"%d" % max_age
                fields.append((name, b"".join((name, b": ", value, b"\r\n"))))
            common = b"".join(lines)
            self._head_200 = b"".join(
                (b"HTTP/1.1 200 OK\r\n", common, *(f for _, f in fields), b"\r\n")
            )
            self._head_304 = b"".join(
                (
                    b"HTTP/1.1 304 Not Modified\r\n",
                    common,
                    *(f for n, f in fields if n != b"content-length"),
                    b"\r\n",
                )
            )
            self._date, self._max_age = date, max_age
        return self._head_200, self._head_304


class _Slot:
    """The answers kept for one request target, by the values of the headers its
    ``Vary`` names."""

    __slots__ = ("answers", "vary")

    def __init__(self, vary: tuple[bytes, ...]) -> None:
        self.vary = vary
        self.answers: dict[tuple[bytes | None, ...], LaneAnswer] = {}


class HitLane:
    """The answers kept, and serving them (see the module's docstring)."""

    def __init__(
        self,
        index: EntryIndex,
        clock: Clock,
        max_bytes: int = LANE_MAX_BYTES,
        max_answers: int = LANE_MAX_ANSWERS,
    ) -> None:
        self.index = index
        self.clock = clock
        self.max_bytes = max_bytes
        self.max_answers = max_answers
        self.size_bytes = 0
        self.count = 0
        self.epoch = 0  # moved on by clear
        self.answered = 0  # requests answered from the lane since the process started
        self._slots: dict[bytes, _Slot] = {}
        self._counters: dict[tuple[str, str, int], metrics.Batched] = {}
        self._dirty: list[LaneAnswer] = []  # answers with pending hits
        self._flush_timer: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return self.count

    def clear(self) -> None:
        """Forget every answer (the release policy was reloaded), and any answer judged
        before now that a request still in flight would file (``epoch``)."""
        self.epoch += 1
        self._slots.clear()
        self.size_bytes = self.count = 0

    def flush(self) -> None:
        """Hand the counts and access times of the hits answered since the last flush
        on: Prometheus's values, each answer's ``per_hit`` (its cache-hit counter, the
        access time, the release decisions counted). Every ``FLUSH_INTERVAL_S`` while
        hits arrive, before ``/metrics`` is rendered, and at shutdown."""
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        dirty, self._dirty = self._dirty, []
        for answer in dirty:
            n, answer.pending = answer.pending, 0
            for per_hit in answer.per_hit:
                per_hit(n)
        for batched in self._counters.values():
            batched.flush()

    # -- filing ---------------------------------------------------------------------------

    def offer(
        self,
        target: bytes,
        request_headers: list[tuple[bytes, bytes]],
        method: str,
        status: int,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        ticket: LaneTicket,
    ) -> bool:
        """Keep the full path's answer to a GET, if it is one the lane can give again
        exactly (see the module's docstring); whether it was kept."""
        served = ticket.served
        if (
            ticket.spoiled
            or ticket.epoch != self.epoch
            or served is None
            or ticket.indexed is None
            or method != "GET"
            or status != 200
            or served.kind not in (Kind.IMMUTABLE, Kind.METADATA)
            or not served.is_fresh(self.clock.now_ms())
        ):
            return False
        names: dict[bytes, int] = {}
        for name, _value in request_headers:
            names[name] = names.get(name, 0) + 1
        if any(name in names for name in CONDITIONAL_HEADERS):
            return False  # the answer to a plain GET is the one kept
        vary: tuple[bytes, ...] = ()
        cache_control_at = None
        etag = None
        length = None
        for i, (name, value) in enumerate(headers):
            if name == b"vary":
                vary = tuple(sorted({v.strip().lower() for v in value.split(b",") if v.strip()}))
            elif name == b"cache-control":
                # A metadata answer's max-age counts down; anything else is stated as is.
                counted = value[len(MAX_AGE_PREFIX) :]
                if value.startswith(MAX_AGE_PREFIX) and counted.isdigit():
                    if served.kind is not Kind.METADATA:
                        return False
                    cache_control_at = i
            elif name == b"etag":
                etag = value.decode("latin-1")
            elif name == b"content-length":
                length = value
            elif name in (b"connection", b"transfer-encoding", b"set-cookie"):
                return False
        if b"*" in vary or length is None or int(length) != len(body):
            return False
        if any(names.get(name, 0) > 1 for name in vary):
            return False  # a header the full path joined: looked up as one line only
        values = dict(request_headers)
        variant = tuple(values.get(name) for name in vary)
        answer = LaneAnswer(ticket, headers, body, cache_control_at, etag)
        if cache_control_at is not None:
            stated = headers[cache_control_at][1]
            if stated != MAX_AGE_PREFIX + b"%d" % answer.max_age_s(self.clock.now_ms()):
                return False  # a max-age the lane would not count down the same way
        self._file(target, vary, variant, answer)
        return True

    def _file(
        self,
        target: bytes,
        vary: tuple[bytes, ...],
        variant: tuple[bytes | None, ...],
        answer: LaneAnswer,
    ) -> None:
        slot = self._slots.get(target)
        if slot is None or slot.vary != vary:
            if slot is not None:
                self._forget(target)
            slot = self._slots[target] = _Slot(vary)
        old = slot.answers.pop(variant, None)
        if old is None and len(slot.answers) >= LANE_MAX_VARIANTS:
            # The oldest filed goes: junk Accept values cannot keep new ones out.
            old = slot.answers.pop(next(iter(slot.answers)))
        if old is not None:
            self.size_bytes -= old.size
            self.count -= 1
        slot.answers[variant] = answer
        self.size_bytes += answer.size
        self.count += 1
        while (self.size_bytes > self.max_bytes or self.count > self.max_answers) and self._slots:
            self._forget(next(iter(self._slots)))

    def _forget(self, target: bytes) -> None:
        slot = self._slots.pop(target)
        for answer in slot.answers.values():
            self.size_bytes -= answer.size
            self.count -= 1

    # -- serving --------------------------------------------------------------------------

    def serve(
        self,
        write: Callable[[bytes], object],
        method: bytes,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        date: list[tuple[bytes, bytes]],
        client: Callable[[], str],
    ) -> bool:
        """Answer a GET or HEAD of ``target`` from the lane with ``write`` (one call), or
        do nothing and say so (the full path answers it)."""
        slot = self._slots.get(target)
        if slot is None:
            return False
        started = time.perf_counter()
        vary = slot.vary
        if_none_match = None
        wanted: list[bytes | None] = [None] * len(vary)
        hosts = 0
        modified_since = False
        size = 0
        for name, value in headers:
            size += len(name) + len(value) + 4
            if name in FULL_PATH_HEADERS:
                return False
            if name == b"if-none-match":
                if if_none_match is not None:
                    return False
                if_none_match = value
            elif name == b"if-modified-since":
                modified_since = True
            elif name == b"host":
                hosts += 1
            if name in vary:
                i = vary.index(name)
                if wanted[i] is not None:
                    return False  # sent twice: the full path joins them
                wanted[i] = value
        if hosts > 1 or size > MAX_HEADER_BYTES or (modified_since and if_none_match is None):
            return False  # (the full path's 400, 431, or its Last-Modified judgement)
        answer = slot.answers.get(tuple(wanted))
        if answer is None:
            return False
        now_ms = self.clock.now_ms()
        if not answer.fresh(now_ms) or self.index.get(*answer.ident) is not answer.indexed:
            return False
        head_200, head_304 = answer.heads(date, now_ms)
        if (
            if_none_match is not None
            and answer.etag is not None
            and matches_etag(if_none_match.decode("latin-1"), answer.etag)
        ):
            status, sent, data = 304, 0, head_304
        elif if_none_match is not None and answer.etag is None:
            return False  # the full path judges it by Last-Modified then
        elif method == b"HEAD":
            status, sent, data = 200, 0, head_200
        else:
            status, sent, data = 200, len(answer.body), head_200 + answer.body
        # Counted before the bytes go: a client that has its answer sees it counted.
        self.answered += 1
        if not answer.pending:
            self._dirty.append(answer)
            if self._flush_timer is None:
                self._flush_timer = asyncio.get_running_loop().call_later(
                    FLUSH_INTERVAL_S, self.flush
                )
        answer.pending += 1
        method_label = "GET" if method == b"GET" else "HEAD"
        batched = self._counters.get((answer.repository, method_label, status))
        if batched is None:
            batched = self._counters[(answer.repository, method_label, status)] = metrics.Batched(
                metrics.REQUESTS.labels(answer.repository, method_label, str(status)),
                metrics.REQUEST_DURATION.labels(answer.repository),
                metrics.BYTES_SERVED.labels(repository=answer.repository),
            )
        write(data)
        seconds = time.perf_counter() - started
        batched.add(seconds, sent)
        if access_log.enabled():
            access_log.write_target(
                client(), method_label, target, status, sent, seconds, answer.outcome
            )
        return True
