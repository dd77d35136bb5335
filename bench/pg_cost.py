"""What a fleet costs its Postgres, counted in statements with pg_stat_statements, per
event, and a model of a large fleet built from the measured constants.

    .venv/bin/python -m bench.pg_cost [--before ../issue22-before] [--trials 6] [--idle 30]

Starts its own PostgreSQL (pg_stat_statements preloaded, autovacuum off so that only
the fleet writes), a fake upstream, and 3 real `proxy serve` replicas on one fresh
database per run. ``--before CHECKOUT`` runs the same events first with the proxy of
another checkout (its own .venv, e.g. a worktree of the commit a change started from)
and prints both side by side. ``--pgbouncer`` adds a run of this checkout behind a real
PgBouncer in transaction mode (tests/pgbouncer.py), the session connections direct.

Events (each repeated ``--trials`` times on fresh keys; the idle rate, measured first, is
subtracted over each event's window):
- idle: statements per replica per second, nothing asked;
- a file miss asked by 1 replica, then by 3 replicas at once;
- a slow miss (the upstream takes 2 s, then 10 s), asked by 1 and by 3 replicas: the
  difference over the 8 extra seconds is what a waiting replica costs per second;
- an expired index page answered 304, 3 replicas at once;
- a cached hit (100 per replica): statements inside the window of the hits;
- connections per replica: idle, the peak during a burst of 30 misses per replica, and
  65 s after it (``--linger 0`` skips that wait).

"writes" are transaction IDs assigned (each write transaction takes one; a read takes
none). The model extrapolates a miss of D seconds shared by N replicas as
H + (N-1)·J + D·(r + (N-1)·p), with H, J, r, p measured here (docs/architecture.md,
"The cost model").
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import httpx

from bench.common import percentile, workdir
from bench.fleet import lease, wait_lease
from proxy.catalog.queries import parse
from proxy.engine import ACCESS_FLUSH_INTERVAL_S
from tests.pg import PostgresServer, create_database
from tests.pgbouncer import FleetDb, behind
from tests.processes import ProxyProcess, start_replicas
from tests.upstream import FakeUpstream, ProjectFile, start_upstream

ROOT = Path(__file__).resolve().parent.parent
REPLICAS = 3
SETTLE_S = 1.0  # after an event's last answer: releases, notifications, late reads
FILE_BYTES = 256 * 1024
SLOW_FILE_BYTES = 1024 * 1024
SLOW_CHUNKS = 16
SHORT_S, LONG_S = 2.0, 10.0
HITS_PER_REPLICA = 100
BURST_PER_REPLICA = 30
# The four statements of asyncpg's default reset (Connection.get_reset_query).
RESET_STATEMENTS = {"SELECT pg_advisory_unlock_all()", "CLOSE ALL", "UNLISTEN *", "RESET ALL"}


# -- counting ---------------------------------------------------------------------------


@dataclass
class Counts:
    statements: float = 0.0
    reset: float = 0.0
    writes: float = 0.0
    by_statement: dict[str, float] = field(default_factory=dict)

    def minus(self, rate: Counts, seconds: float) -> Counts:
        """These counts without what the idle rate accounts for over ``seconds``."""
        names = set(self.by_statement) | set(rate.by_statement)
        return Counts(
            self.statements - rate.statements * seconds,
            self.reset - rate.reset * seconds,
            self.writes - rate.writes * seconds,
            {n: self.by_statement.get(n, 0) - rate.by_statement.get(n, 0) * seconds for n in names},
        )

    def scaled(self, factor: float) -> Counts:
        return Counts(
            self.statements * factor,
            self.reset * factor,
            self.writes * factor,
            {n: v * factor for n, v in self.by_statement.items()},
        )


def mean(counts: list[Counts]) -> Counts:
    total = Counts()
    for c in counts:
        total.statements += c.statements
        total.reset += c.reset
        total.writes += c.writes
        for name, value in c.by_statement.items():
            total.by_statement[name] = total.by_statement.get(name, 0) + value
    return total.scaled(1 / len(counts))


class StatementNames:
    """Names pg_stat_statements' normalized texts after the catalog's named statements."""

    def __init__(self, checkouts: list[Path]) -> None:
        self.signatures: dict[str, str] = {}
        for checkout in checkouts:
            sql = checkout / "proxy/catalog/sql/postgres.sql"
            for name, statement in parse(sql.read_text()).items():
                self.signatures.setdefault(_signature(statement), name)

    def name(self, query: str) -> str:
        if query in RESET_STATEMENTS:
            return "(reset) " + query
        found = self.signatures.get(_signature(query))
        return found or "(other) " + " ".join(query.split())[:60]


def _signature(sql: str) -> str:
    sql = re.sub(r"--[^\n]*", " ", sql)
    # pg_stat_statements shows every constant as $n: NULL, booleans, extract's field.
    constants = r"\$\d+|'[^']*'|\b\d+(\.\d+)?\b|\b(NULL|true|false|epoch)\b"
    sql = re.sub(constants, "?", sql, flags=re.IGNORECASE)
    return " ".join(sql.split()).rstrip(";")


class Counter:
    """Snapshots of pg_stat_statements for one database; read from another database, so
    the counting itself is never counted."""

    def __init__(self, admin: asyncpg.Connection, database: str, names: StatementNames) -> None:
        self.admin = admin
        self.database = database
        self.names = names

    async def snapshot(self) -> tuple[dict[str, int], int]:
        rows = await self.admin.fetch(
            "SELECT s.query, s.calls FROM pg_stat_statements AS s "
            "JOIN pg_database AS d ON d.oid = s.dbid WHERE d.datname = $1",
            self.database,
        )
        xid = await self.admin.fetchval(
            "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint"
        )
        calls: dict[str, int] = {}
        for row in rows:
            name = self.names.name(row["query"])
            calls[name] = calls.get(name, 0) + int(row["calls"])
        return calls, int(xid)

    @staticmethod
    def between(before: tuple[dict[str, int], int], after: tuple[dict[str, int], int]) -> Counts:
        by_statement = {
            name: float(n - before[0].get(name, 0))
            for name, n in after[0].items()
            if n != before[0].get(name, 0)
        }
        return Counts(
            statements=sum(by_statement.values()),
            reset=sum(v for n, v in by_statement.items() if n.startswith("(reset)")),
            writes=float(after[1] - before[1]),
            by_statement=by_statement,
        )

    async def window(self, action: Callable[[], Awaitable[None]]) -> tuple[Counts, float]:
        before = await self.snapshot()
        started = time.monotonic()
        await action()
        await asyncio.sleep(SETTLE_S)
        elapsed = time.monotonic() - started
        return self.between(before, await self.snapshot()), elapsed


# -- the fleet --------------------------------------------------------------------------


def fleet_config(work: Path, db: FleetDb, upstream: str) -> Path:
    """Only settings every compared checkout knows (session_url only behind PgBouncer);
    everything else at its default."""
    session = f'session_url = "{db.session_url}"' if db.session_url else ""
    path = work / "fleet.toml"
    path.write_text(f"""
[database]
url = "{db.url}"
{session}
[storage]
path = "{work / "shared"}"
[leases]
ttl = "15s"
[[repositories]]
name = "tools"
format = "raw"
upstream = "{upstream}/releases/"
[[repositories]]
name = "pypi"
format = "pypi"
upstream = "{upstream}/simple/"
metadata_ttl = "1s"
""")
    return path


@dataclass
class Setup:
    label: str
    checkout: Path | None  # None: this checkout
    route: str = "direct"  # or "pgbouncer"


@dataclass
class Results:
    idle: Counts
    rows: dict[str, Counts]
    connections: dict[str, float]
    model: dict[str, float]
    wake_ups_ms: list[float]


async def get_all(client: httpx.AsyncClient, urls: list[str]) -> None:
    responses = await asyncio.gather(*(client.get(u) for u in urls))
    bad = [(u, r.status_code) for u, r in zip(urls, responses, strict=True) if r.status_code != 200]
    if bad:
        raise RuntimeError(f"unexpected answers: {bad}")


class Events:
    def __init__(
        self,
        counter: Counter,
        upstream: FakeUpstream,
        replicas: list[ProxyProcess],
        idle: Counts,
        trials: int,
    ) -> None:
        self.counter = counter
        self.upstream = upstream
        self.urls = [r.url for r in replicas]
        self.idle = idle
        self.trials = trials
        self.client = httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=200))

    async def cost(self, prepare: Callable[[], Awaitable[Callable[[], Awaitable[None]]]]) -> Counts:
        """The mean cost of an event over the trials, the idle rate taken out."""
        costs = []
        for _ in range(self.trials):
            action = await prepare()
            counts, elapsed = await self.counter.window(action)
            costs.append(counts.minus(self.idle, elapsed))
        return mean(costs)

    def new_file(self, size: int, duration_s: float = 0.0) -> str:
        name = f"f-{uuid.uuid4().hex[:12]}.bin"
        path = f"/releases/{name}"
        self.upstream.files[path] = os.urandom(size)
        if duration_s:
            chunk = size // SLOW_CHUNKS
            self.upstream.fault(path, chunk_size=chunk, chunk_delay_s=duration_s / SLOW_CHUNKS)
        return f"/tools/{name}"

    async def miss(self, askers: int, duration_s: float = 0.0) -> Counts:
        size = SLOW_FILE_BYTES if duration_s else FILE_BYTES

        async def prepare() -> Callable[[], Awaitable[None]]:
            path = self.new_file(size, duration_s)
            return lambda: get_all(self.client, [u + path for u in self.urls[:askers]])

        return await self.cost(prepare)

    async def page_304(self) -> Counts:
        async def prepare() -> Callable[[], Awaitable[None]]:
            name = f"p{uuid.uuid4().hex[:10]}"
            self.upstream.add_project(name, [ProjectFile(f"{name}-1.0.tar.gz", b"x")])
            path = f"/pypi/simple/{name}/"
            await get_all(self.client, [self.urls[0] + path])
            await asyncio.sleep(1.5)  # metadata_ttl is 1s: expired on every replica
            return lambda: get_all(self.client, [u + path for u in self.urls])

        return await self.cost(prepare)

    async def hits(self) -> tuple[Counts, Counts]:
        """Per hit, the access-time flush aside; and the flush, per replica per flush
        period: the window runs until every access of the hits is written."""
        hits, flushes = [], []
        for _ in range(self.trials):
            path = self.new_file(FILE_BYTES)
            await get_all(self.client, [u + path for u in self.urls])  # cached everywhere
            await asyncio.sleep(ACCESS_FLUSH_INTERVAL_S + SETTLE_S)  # the fill's flushes
            before = await self.counter.snapshot()
            started = time.monotonic()
            for _ in range(HITS_PER_REPLICA // 10):
                await get_all(self.client, [u + path for u in self.urls for _ in range(10)])
            await asyncio.sleep(ACCESS_FLUSH_INTERVAL_S + SETTLE_S)
            elapsed = time.monotonic() - started
            counts = Counter.between(before, await self.counter.snapshot()).minus(
                self.idle, elapsed
            )
            flush = counts.by_statement.pop("touch_entries", 0.0)
            counts.statements -= flush
            counts.writes -= flush
            hits.append(counts.scaled(1 / (HITS_PER_REPLICA * REPLICAS)))
            periods = elapsed / ACCESS_FLUSH_INTERVAL_S
            flushes.append(Counts(flush / REPLICAS / periods, 0, flush / REPLICAS / periods))
        return mean(hits), mean(flushes)

    async def wake_up(self, db_url: str) -> list[float]:
        """ms from the holder's release of the lease (the database's clock) to the last
        byte at a client of a waiting replica, which only the outcome releases."""
        delays = []
        for _ in range(self.trials):
            path = self.new_file(SLOW_FILE_BYTES, SHORT_S)
            key = "tools/" + path.rsplit("/", 1)[1]
            holding = asyncio.ensure_future(get_all(self.client, [self.urls[0] + path]))
            await wait_lease(db_url, key, lambda row: row["state"] == "fetching")
            async with self.client.stream("GET", self.urls[1] + path) as response:
                async for _ in response.aiter_raw():
                    pass
            last = time.time()
            await holding
            row = await lease(db_url, key)
            assert row is not None and row["state"] == "done"
            delays.append((last - float(row["expires"])) * 1000)
        return delays

    async def aclose(self) -> None:
        await self.client.aclose()


async def connections(admin: asyncpg.Connection, database: str) -> int:
    return int(
        await admin.fetchval("SELECT count(*) FROM pg_stat_activity WHERE datname = $1", database)
    )


async def run_setup(
    setup: Setup,
    admin_url: str,
    work: Path,
    names: StatementNames,
    args: argparse.Namespace,
) -> Results:
    db_url = await asyncio.to_thread(create_database, admin_url)
    database = db_url.rpartition("/")[2]
    upstream = FakeUpstream()
    server = start_upstream(upstream)
    replicas: list[ProxyProcess] = []
    admin = await asyncpg.connect(admin_url)
    db, bouncer = await asyncio.to_thread(behind, setup.route, db_url)
    try:
        config = fleet_config(work, db, upstream.base_url)
        start_replicas(replicas, config, work, REPLICAS, checkout=setup.checkout)
        counter = Counter(admin, database, names)
        # Start-up (migrations, the first job passes) is not idle.
        await asyncio.sleep(args.warmup)
        counts, elapsed = await counter.window(lambda: asyncio.sleep(args.idle))
        idle = counts.scaled(1 / elapsed)
        idle_connections = await connections(admin, database)
        print(f"  [{setup.label}] idle: {idle.statements / REPLICAS:.2f} statements/s per replica")
        events = Events(counter, upstream, replicas, idle, args.trials)
        rows: dict[str, Counts] = {}
        try:
            rows["idle, per replica per second"] = idle.scaled(1 / REPLICAS)
            rows["a file miss, 1 replica"] = await events.miss(1)
            rows["a file miss, 3 replicas at once"] = await events.miss(3)
            slow = {
                (askers, d): await events.miss(askers, d)
                for askers in (1, 3)
                for d in (SHORT_S, LONG_S)
            }
            rows[f"a {LONG_S:.0f} s miss, 3 replicas at once"] = slow[(3, LONG_S)]
            per_s = {a: _slope(slow[(a, SHORT_S)], slow[(a, LONG_S)]) for a in (1, 3)}
            waiter_s = _slope_diff(per_s[3], per_s[1], REPLICAS - 1)
            rows["a slow miss, per second: the holder"] = per_s[1]
            rows["a slow miss, per waiting replica per second"] = waiter_s
            rows["an expired page answered 304, 3 replicas at once"] = await events.page_304()
            hit, flush = await events.hits()
            rows["a cached hit (the access-time flush aside)"] = hit
            rows["access-time flush while hits arrive, per replica per 5 s"] = flush
            wake_ups = await events.wake_up(db_url)
            peak = await burst(events, admin, database)
        finally:
            await events.aclose()
        lingering = float("nan")
        if args.linger:
            await asyncio.sleep(args.linger)
            lingering = await connections(admin, database) / REPLICAS
        holder_fixed = rows["a file miss, 1 replica"].statements
        waiter_fixed = (rows["a file miss, 3 replicas at once"].statements - holder_fixed) / 2
        model = {
            "H": holder_fixed,
            "J": waiter_fixed,
            "r": per_s[1].statements,
            "p": waiter_s.statements,
        }
        return Results(
            idle=idle,
            rows=rows,
            connections={
                "idle, per replica": idle_connections / REPLICAS,
                f"peak during a burst of {BURST_PER_REPLICA} misses per replica": peak / REPLICAS,
                f"{args.linger:.0f} s after the burst, per replica": lingering,
            },
            model=model,
            wake_ups_ms=wake_ups,
        )
    finally:
        for replica in replicas:
            replica.stop()
        if bouncer is not None:
            bouncer.stop()
        await admin.close()
        upstream.released.set()
        server.stop()
        shutil.rmtree(work / "shared", ignore_errors=True)


def _slope(short: Counts, long: Counts) -> Counts:
    return Counts(
        (long.statements - short.statements) / (LONG_S - SHORT_S),
        (long.reset - short.reset) / (LONG_S - SHORT_S),
        (long.writes - short.writes) / (LONG_S - SHORT_S),
    )


def _slope_diff(three: Counts, one: Counts, waiters: int) -> Counts:
    return Counts(
        (three.statements - one.statements) / waiters,
        (three.reset - one.reset) / waiters,
        (three.writes - one.writes) / waiters,
    )


async def burst(events: Events, admin: asyncpg.Connection, database: str) -> int:
    """Many different misses on every replica at once; the most connections seen."""
    paths = [events.new_file(FILE_BYTES, 1.0) for _ in range(BURST_PER_REPLICA)]
    peak = 0
    done = asyncio.Event()

    async def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, await connections(admin, database))
            await asyncio.sleep(0.05)

    sampler = asyncio.ensure_future(sample())
    try:
        await get_all(events.client, [u + p for u in events.urls for p in paths])
    finally:
        done.set()
        await sampler
    return peak


# -- printing -----------------------------------------------------------------------------

TARGETS = {
    "idle, per replica per second": 0.3,
    f"a {LONG_S:.0f} s miss, 3 replicas at once": 20,
    "a file miss, 3 replicas at once": 20,
    "a cached hit (the access-time flush aside)": 0,
}


def print_table(labels: list[str], results: list[Results]) -> None:
    head = "| event | " + " | ".join(f"{label}: statements (reset) writes" for label in labels)
    print(head + " | target |")
    print("|---" * (len(labels) + 2) + "|")
    for row in results[0].rows:
        cells = []
        for result in results:
            c = result.rows.get(row)
            cells.append(
                "n/a" if c is None else f"{c.statements:.2f} ({c.reset:.2f}) {c.writes:.2f}"
            )
        target = TARGETS.get(row)
        print(
            f"| {row} | " + " | ".join(cells) + f" | {'' if target is None else f'<= {target}'} |"
        )
    for name in results[0].connections:
        cells = [f"{r.connections[name]:.1f}" for r in results]
        print(f"| connections {name} | " + " | ".join(cells) + " | |")
    cells = [
        f"p50 {percentile(r.wake_ups_ms, 50):.0f} / max {max(r.wake_ups_ms):.0f}" for r in results
    ]
    print(
        "| a waiting replica's last byte after the holder's release, ms | "
        + " | ".join(cells)
        + " | <= 50 |"
    )


def print_model(label: str, result: Results, replicas: int, duration_s: float) -> None:
    m = result.model
    cost = m["H"] + (replicas - 1) * m["J"] + duration_s * (m["r"] + (replicas - 1) * m["p"])
    idle = result.idle.statements / REPLICAS * replicas
    print(
        f"[{label}] model: a miss of D s shared by N replicas = H + (N-1)*J + D*(r + (N-1)*p) "
        f"with H={m['H']:.1f}, J={m['J']:.1f}, r={m['r']:.2f}/s, p={m['p']:.2f}/s; "
        f"N={replicas}, D={duration_s:.0f} s: {cost:,.0f} statements; "
        f"idle fleet of {replicas}: {idle:.1f} statements/s"
    )


def print_breakdown(label: str, result: Results) -> None:
    print(f"\n[{label}] statements by name, per event:")
    for row, counts in result.rows.items():
        named = sorted(
            ((n, v) for n, v in counts.by_statement.items() if abs(v) >= 0.05),
            key=lambda item: -item[1],
        )
        if named:
            print(f"  {row}: " + ", ".join(f"{n} {v:.2f}" for n, v in named))


async def run(args: argparse.Namespace) -> None:
    setups = []
    if args.before:
        setups.append(Setup("before", args.before))
    setups.append(Setup("after", None))
    if args.pgbouncer:
        setups.append(Setup("after, behind PgBouncer", None, route="pgbouncer"))
    names = StatementNames([ROOT] + [s.checkout for s in setups if s.checkout is not None])
    server = PostgresServer({"shared_preload_libraries": "pg_stat_statements", "autovacuum": "off"})
    await asyncio.to_thread(lambda: server.init().start())
    work = workdir("pg-cost")
    try:
        admin = await asyncpg.connect(server.admin_url)
        await admin.execute("CREATE EXTENSION pg_stat_statements")
        await admin.close()
        results = []
        for setup in setups:
            print(f"running {setup.label} ({setup.checkout or ROOT}) ...", flush=True)
            results.append(await run_setup(setup, server.admin_url, work, names, args))
        print(
            f"\n{REPLICAS} replicas, {args.trials} trials per event, load {os.getloadavg()[0]:.2f}"
        )
        print_table([s.label for s in setups], results)
        print()
        for setup, result in zip(setups, results, strict=True):
            print_model(setup.label, result, 100, LONG_S)
        if args.verbose:
            for setup, result in zip(setups, results, strict=True):
                print_breakdown(setup.label, result)
    finally:
        server.destroy()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"logs in {work}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--before", help="a checkout (with its .venv) to compare with")
    parser.add_argument("--pgbouncer", action="store_true", help="also run behind PgBouncer")
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--idle", type=float, default=30.0, help="seconds of idle to count")
    parser.add_argument("--warmup", type=float, default=8.0, help="seconds before counting")
    parser.add_argument("--linger", type=float, default=65.0, help="seconds after the burst")
    parser.add_argument("--verbose", action="store_true", help="statements by name")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs)")
    args = parser.parse_args()
    args.before = Path(args.before).resolve() if args.before else None
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
