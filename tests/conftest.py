"""Shared fixtures: fake upstreams and proxies served over real HTTP on port 0."""

from __future__ import annotations

import asyncio
import os
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Protocol

import pytest

from proxy.catalog import Catalog, open_catalog
from proxy.clock import SYSTEM_CLOCK, Clock, ManualClock
from proxy.config.load import load
from proxy.config.settings import Settings
from proxy.http.app import create_app
from proxy.http.protocol import GuardedHttpToolsProtocol
from proxy.testing import MemoryCatalog
from tests.maven_repo import MissingMavenRepo, copy_with_checksums
from tests.pg import PostgresServer, create_database, drop_database
from tests.seaweed import SeaweedFS
from tests.upstream import FakeUpstream, ServerThread, start_upstream


def write_config(tmp_path: Path, body: str, name: str = "proxy.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def pypi_config(storage: Path, upstream_url: str, extra: str = "", repo_extra: str = "") -> str:
    return f"""
    [storage]
    path = "{storage}"
    [upstream]
    connect_timeout = "2s"
    read_timeout = "5s"
    retries = 1
    [leases]
    ttl = "3s"
    poll_interval = "100ms"
    {extra}
    [[repositories]]
    name = "pypi"
    format = "pypi"
    upstream = "{upstream_url}/simple/"
    metadata_ttl = "10m"
    negative_ttl = "1m"
    {repo_extra}
    """


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A fleet test (one that uses ``fleet_variant``: tests/test_fleet.py's fixtures,
    tests/test_streaming.py) runs with its blobs in a
    shared folder and in a bucket, and, marked ``pgbouncer``, once more with its pool
    behind a real PgBouncer in transaction mode (a shared folder): a subset that covers
    what a pooler can break (claims, notifications, takeovers, job passes, a database
    outage) without running every fleet test a third time. ``PROXY_TEST_PGBOUNCER=all``
    runs every one of them behind PgBouncer too (about 3 minutes more)."""
    if "fleet_variant" not in metafunc.fixturenames:
        return
    variants = ["folder", "s3"]
    marked = metafunc.definition.get_closest_marker("pgbouncer") is not None
    if marked or os.environ.get("PROXY_TEST_PGBOUNCER") == "all":
        variants.append("pgbouncer")
    metafunc.parametrize("fleet_variant", variants)


@pytest.fixture
def upstream() -> Iterator[FakeUpstream]:
    fake = FakeUpstream()
    server = start_upstream(fake)
    yield fake
    fake.released.set()
    server.stop()


class ProxyFactory(Protocol):
    def __call__(self, settings: Settings, clock: Clock = ...) -> ServerThread: ...


@pytest.fixture
def start_proxy() -> Iterator[ProxyFactory]:
    """Start in-process proxies (uvicorn in a thread); all are stopped at teardown.

    Pass a ``ManualClock`` to move time (TTLs, freshness) instead of sleeping.
    """
    started: list[ServerThread] = []

    def start(settings: Settings, clock: Clock = SYSTEM_CLOCK) -> ServerThread:
        app = create_app(settings, clock)
        server = ServerThread(app, loop="asyncio", http=GuardedHttpToolsProtocol).start()
        started.append(server)
        return server

    yield start
    for server in reversed(started):
        server.stop()


@pytest.fixture
def pypi_proxy(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory
) -> Iterator[ServerThread]:
    config = write_config(tmp_path, pypi_config(tmp_path / "data", upstream.base_url))
    yield start_proxy(load(config, {}))


@pytest.fixture
def clean_env() -> dict[str, str]:
    """The environment for subprocesses, without this machine's pip/uv settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_", "PROXY_"))}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


# -- PostgreSQL ----------------------------------------------------------------------


@pytest.fixture(scope="session")
def postgres_admin_url() -> Iterator[str]:
    """A server for the whole session: PROXY_TEST_POSTGRES_URL, or one we start."""
    from_env = os.environ.get("PROXY_TEST_POSTGRES_URL")
    if from_env:
        yield from_env
        return
    server = PostgresServer().init().start()
    yield server.admin_url
    server.destroy()


@pytest.fixture
def pg_url(postgres_admin_url: str) -> Iterator[str]:
    """A fresh empty database for one test."""
    url = create_database(postgres_admin_url)
    yield url
    drop_database(url)


@pytest.fixture
def own_postgres() -> Iterator[PostgresServer]:
    """A server of this test's own, which it may stop and restart."""
    server = PostgresServer().init().start()
    yield server
    server.destroy()


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each catalog backend in turn."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'catalog.db'}"
    url: str = request.getfixturevalue("pg_url")
    return url


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def clock() -> ManualClock:
    """A clock that moves only when the test says (SQLite leases and job runs use it)."""
    return ManualClock()


@pytest.fixture(params=["sqlite", "postgres", "memory"])
def catalog_backend(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A database URL for each catalog backend in turn, or "memory"."""
    if request.param == "memory":
        return "memory"
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'catalog.db'}"
    url: str = request.getfixturevalue("pg_url")
    return url


@pytest.fixture
async def catalog(catalog_backend: str, clock: ManualClock) -> AsyncIterator[Catalog]:
    """Each catalog backend in turn, and the in-memory one of proxy/testing: the same
    tests hold it to what the real ones do."""
    opened: Catalog
    if catalog_backend == "memory":
        opened = MemoryCatalog(clock)
    else:
        opened = open_catalog(catalog_backend, clock)
    await opened.migrate()
    yield opened
    await opened.close()


async def pass_time(catalog: Catalog, clock: ManualClock, seconds: float) -> None:
    """Let ``seconds`` pass for the catalog: the SQLite and in-memory catalogs' clock is
    moved at once; Postgres judges leases by its own clock, so there the test waits."""
    if catalog.backend == "postgres":
        await asyncio.sleep(seconds)
    else:
        clock.advance(seconds)


# -- object storage (SeaweedFS) ---------------------------------------------------------


@pytest.fixture(scope="session")
def seaweedfs() -> Iterator[SeaweedFS]:
    """One S3 server for the whole session; tests that stop or pause it start it again."""
    server = SeaweedFS().start()
    yield server
    server.destroy()


@pytest.fixture
def s3_bucket(seaweedfs: SeaweedFS, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket for one test; the test process gets the server's credentials (the
    standard AWS variables), as proxies started in it read them."""
    if seaweedfs.process is None or seaweedfs.process.poll() is not None:
        seaweedfs.start()
    seaweedfs.resume()
    for name, value in seaweedfs.env.items():
        monkeypatch.setenv(name, value)
    return seaweedfs.new_bucket()


def s3_storage(
    seaweedfs: SeaweedFS,
    bucket: str,
    local_cache: Path,
    extra: str = "",
    storage_extra: str = "",
    endpoint: str | None = None,
) -> str:
    """The [storage] keys of a proxy on ``bucket`` with ``local_cache`` of its own, and
    its [storage.s3] table (``extra`` goes there, ``storage_extra`` into [storage]);
    ``endpoint``: another way to the server (a fault injector), if not the server's."""
    return f"""
    url = "s3://{bucket}/proxy/"
    local_cache = "{local_cache}"
    {storage_extra}
    [storage.s3]
    endpoint = "{endpoint or seaweedfs.endpoint}"
    region = "us-east-1"
    path_style = true
    {extra}
    """


# -- Debian's system Maven repository, as a real upstream ------------------------------


@pytest.fixture(scope="session")
def debian_maven_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of Debian's Maven repository with a .sha1 beside every file."""
    try:
        return copy_with_checksums(tmp_path_factory.mktemp("maven-repo"))
    except MissingMavenRepo as exc:
        pytest.fail(str(exc))


# -- nothing written into the checkout --------------------------------------------------

CHECKOUT_DATA = Path(__file__).resolve().parent.parent / "data"
_DATA_BEFORE = pytest.StashKey[bool]()


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_DATA_BEFORE] = CHECKOUT_DATA.exists()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A test that starts a proxy with default settings in the checkout writes its
    catalog to ./data (a stale one from an older schema then failed later runs): the
    run fails, naming it. Only the main process judges (xdist's workers share it)."""
    if hasattr(session.config, "workerinput"):
        return
    if not session.config.stash.get(_DATA_BEFORE, True) and CHECKOUT_DATA.exists():
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print(f"\na test wrote {CHECKOUT_DATA}: give its proxy a storage.path or a cwd of its own")
