"""The real npm client through the proxy: ``npm install`` and ``npm ci`` (from a lock
file), cold, warm and with the upstream stopped; scoped packages; a tampered tarball;
refusals npm neither retries nor hides; three replicas on Postgres fetching each
tarball once, and one of them killed mid-packument. The upstream is a local registry
(tests/npm_registry.py) serving packages made with ``npm pack``; npm reaches nothing
but the proxy (its own cache, config and registry set per run, audit and funding off).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import shutil
import signal
import subprocess
import textwrap
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from proxy.config.load import load
from proxy.storage.blobs import BlobStore
from tests.conftest import ProxyFactory, write_config
from tests.npm_registry import NpmRegistry, Tarball, npm_env, npm_pack, run_npm, start_registry
from tests.processes import ProxyProcess, start_replicas
from tests.test_fleet import wait_for_holder
from tests.upstream import FakeUpstream, ServerThread

pytestmark = pytest.mark.slow

# hello -> @acme/util -> left-pad ^1.1.0, beside the project's own left-pad 1.0.0.
DEPENDENCIES = {"hello": "1.0.0", "left-pad": "1.0.0"}


@pytest.fixture(scope="session")
def packed(tmp_path_factory: pytest.TempPathFactory) -> list[Tarball]:
    work = tmp_path_factory.mktemp("npm-pack")
    return [
        npm_pack(work, "left-pad", "1.0.0"),
        npm_pack(work, "left-pad", "1.1.0"),
        npm_pack(work, "@acme/util", "2.0.0", {"left-pad": "^1.1.0"}),
        npm_pack(work, "hello", "1.0.0", {"@acme/util": "^2.0.0"}),
        npm_pack(work, "tampered", "1.0.0"),
    ]


@pytest.fixture
def registry(packed: list[Tarball]) -> Iterator[tuple[NpmRegistry, ServerThread]]:
    fake = NpmRegistry()
    for tarball in packed:
        fake.publish(tarball)
    server = start_registry(fake)
    yield fake, server
    server.stop()


def npm_config(storage: Path, registry_url: str, database: str = "") -> str:
    return f"""
    {database}
    [storage]
    path = "{storage}"
    [upstream]
    connect_timeout = "2s"
    read_timeout = "10s"
    retries = 0
    [leases]
    ttl = "5s"
    poll_interval = "100ms"
    [[repositories]]
    name = "npm"
    format = "npm"
    upstream = "{registry_url}/"
    metadata_ttl = "10m"
    """


def project(folder: Path, dependencies: dict[str, str]) -> Path:
    folder.mkdir(parents=True)
    manifest = {"name": "app", "version": "1.0.0", "private": True, "dependencies": dependencies}
    (folder / "package.json").write_text(json.dumps(manifest, indent=2))
    return folder


def install(
    folder: Path, proxy_url: str, home: Path, command: str = "install"
) -> subprocess.CompletedProcess[str]:
    result = run_npm([command, "--registry", f"{proxy_url}/npm/"], folder, npm_env(home))
    return result


def installed(folder: Path) -> dict[str, str]:
    """What is under node_modules: package -> version."""
    found = {}
    for manifest in folder.glob("node_modules/**/package.json"):
        data = json.loads(manifest.read_text())
        if manifest.parent.parent.name == "node_modules" or manifest.parent.parent.name.startswith(
            "@"
        ):
            found[f"{manifest.relative_to(folder / 'node_modules').parent}"] = data["version"]
    return found


EXPECTED = {
    "hello": "1.0.0",
    "@acme/util": "2.0.0",
    "left-pad": "1.0.0",
    "@acme/util/node_modules/left-pad": "1.1.0",
}


def tarball_paths(registry: NpmRegistry, *names: str) -> list[str]:
    return [
        registry.tarball_path(t) for ts in registry.packages.values() for t in ts if t.name in names
    ]


def test_npm_install_cold_warm_and_with_the_upstream_stopped(
    tmp_path: Path, registry: tuple[NpmRegistry, ServerThread], start_proxy: ProxyFactory
) -> None:
    fake, server = registry
    config = write_config(tmp_path, npm_config(tmp_path / "data", fake.base_url))
    proxy = start_proxy(load(config, {}))

    cold = project(tmp_path / "cold", DEPENDENCIES)
    result = install(cold, proxy.url, tmp_path / "home-cold")
    assert result.returncode == 0, result.stderr
    assert installed(cold) == EXPECTED
    used = tarball_paths(fake, "hello", "@acme/util", "left-pad")
    assert [fake.count(path) for path in used] == [1] * len(used)
    for name in ("hello", "@acme/util", "left-pad"):
        assert fake.count(f"/{name}") == 1  # the abbreviated form, from one full document
    lock = json.loads((cold / "package-lock.json").read_text())
    resolved = lock["packages"]["node_modules/@acme/util"]["resolved"]
    assert resolved == f"{proxy.url}/npm/@acme/util/-/util-2.0.0.tgz"
    before = sum(fake.requests.values())

    warm = project(tmp_path / "warm", DEPENDENCIES)
    result = install(warm, proxy.url, tmp_path / "home-warm")  # a fresh npm cache
    assert result.returncode == 0, result.stderr
    assert installed(warm) == EXPECTED
    assert sum(fake.requests.values()) == before  # all from the proxy's cache

    server.stop()
    offline = project(tmp_path / "offline", DEPENDENCIES)
    result = install(offline, proxy.url, tmp_path / "home-offline")
    assert result.returncode == 0, result.stderr
    assert installed(offline) == EXPECTED


def test_npm_ci_from_a_lock_file_cold_warm_and_with_the_upstream_stopped(
    tmp_path: Path, registry: tuple[NpmRegistry, ServerThread], start_proxy: ProxyFactory
) -> None:
    fake, server = registry
    first = start_proxy(
        load(write_config(tmp_path, npm_config(tmp_path / "a", fake.base_url), "a.toml"), {})
    )
    locked = project(tmp_path / "locked", DEPENDENCIES)
    assert install(locked, first.url, tmp_path / "home-lock").returncode == 0
    lock_text = (locked / "package-lock.json").read_text()

    # A second proxy with an empty cache; the lock file is moved to it as a team would
    # (its resolved URLs rewritten). npm ci asks for the tarballs only: the proxy must
    # learn their upstream URLs from the packuments itself.
    second = start_proxy(
        load(write_config(tmp_path, npm_config(tmp_path / "b", fake.base_url), "b.toml"), {})
    )
    fake.requests.clear()
    for run, home in enumerate(("home-ci-cold", "home-ci-warm", "home-ci-offline")):
        if run == 2:
            server.stop()
        folder = project(tmp_path / f"ci-{run}", DEPENDENCIES)
        (folder / "package-lock.json").write_text(lock_text.replace(first.url, second.url))
        result = install(folder, second.url, tmp_path / home, command="ci")
        assert result.returncode == 0, result.stderr
        assert installed(folder) == EXPECTED
        if run == 0:
            used = tarball_paths(fake, "hello", "@acme/util", "left-pad")
            assert [fake.count(path) for path in used] == [1] * len(used)
            cold_requests = sum(fake.requests.values())
        else:
            assert sum(fake.requests.values()) == cold_requests


def test_a_tampered_tarball_is_refused_and_never_stored(
    tmp_path: Path, registry: tuple[NpmRegistry, ServerThread], start_proxy: ProxyFactory
) -> None:
    fake, _server = registry
    fake.tampered.add(("tampered", "1.0.0"))
    proxy = start_proxy(
        load(write_config(tmp_path, npm_config(tmp_path / "data", fake.base_url)), {})
    )
    folder = project(tmp_path / "app", {"tampered": "1.0.0"})
    result = install(folder, proxy.url, tmp_path / "home")
    assert result.returncode != 0
    assert "502" in result.stderr or "Bad Gateway" in result.stderr, result.stderr
    assert not (folder / "node_modules" / "tampered").exists()
    [tarball] = fake.packages["tampered"]
    served = tarball.body[:-1] + bytes([tarball.body[-1] ^ 0xFF])
    assert not BlobStore(tmp_path / "data").path(hashlib.sha256(served).hexdigest()).exists()
    # The refusal is not remembered as a miss: once the upstream is sound, it installs.
    fake.tampered.clear()
    assert install(folder, proxy.url, tmp_path / "home-2").returncode == 0
    assert installed(folder) == {"tampered": "1.0.0"}


def test_what_the_proxy_does_not_offer_fails_at_once_saying_why(
    tmp_path: Path, registry: tuple[NpmRegistry, ServerThread], start_proxy: ProxyFactory
) -> None:
    """With npm's retries on (as they are by default), a refusal is not retried (npm
    retries 5xx answers, for minutes at its default back-off) and npm shows the proxy's
    reason (it prints a JSON error's ``error``, and nothing of a plain-text body)."""
    fake, _server = registry
    proxy = start_proxy(
        load(write_config(tmp_path, npm_config(tmp_path / "data", fake.base_url)), {})
    )
    env = npm_env(tmp_path / "home", f"{proxy.url}/npm/") | {
        "npm_config_fetch_retries": "2",
        "npm_config_fetch_retry_mintimeout": "100",
        "npm_config_fetch_retry_maxtimeout": "200",
        "npm_config_loglevel": "http",
    }
    search = run_npm(["search", "left-pad"], tmp_path, env)
    assert search.returncode != 0
    assert "search is not offered by this proxy" in search.stderr, search.stderr
    assert "attempt 2" not in search.stderr, search.stderr  # npm did not ask again

    package = tmp_path / "mine"
    package.mkdir()
    (package / "package.json").write_text(json.dumps({"name": "mine", "version": "1.0.0"}))
    (package / ".npmrc").write_text(f"//{proxy.url.removeprefix('http://')}/npm/:_authToken=t\n")
    publish = run_npm(["publish"], package, env)
    assert publish.returncode != 0
    assert "405" in publish.stderr and "publishing and unpublishing are not offered" in (
        publish.stderr
    ), publish.stderr
    assert "attempt 2" not in publish.stderr, publish.stderr


@pytest.mark.postgres
def test_three_replicas_on_postgres_fetch_each_tarball_once(
    tmp_path: Path, registry: tuple[NpmRegistry, ServerThread], pg_url: str
) -> None:
    fake, _server = registry
    config = tmp_path / "fleet.toml"
    config.write_text(
        textwrap.dedent(
            npm_config(tmp_path / "shared", fake.base_url, f'[database]\n    url = "{pg_url}"')
        )
    )
    started: list[ProxyProcess] = []
    try:
        replicas = start_replicas(started, config, tmp_path, 3)

        def one(i: int) -> subprocess.CompletedProcess[str]:
            folder = project(tmp_path / f"app-{i}", DEPENDENCIES)
            return install(folder, replicas[i].url, tmp_path / f"home-{i}")

        with ThreadPoolExecutor(3) as pool:
            results = list(pool.map(one, range(3)))
        for i, result in enumerate(results):
            assert result.returncode == 0, (i, result.stderr, replicas[i].log()[-3000:])
            assert installed(tmp_path / f"app-{i}") == EXPECTED
        used = tarball_paths(fake, "hello", "@acme/util", "left-pad")
        assert {path: fake.count(path) for path in used} == dict.fromkeys(used, 1)
        for name in ("hello", "@acme/util", "left-pad"):
            assert fake.count(f"/{name}") == 1, (name, fake.requests)
    finally:
        for replica in started:
            replica.stop()
        shutil.rmtree(tmp_path / "shared", ignore_errors=True)


@pytest.mark.postgres
def test_sigkill_of_a_packument_holder_leaves_every_waiter_its_own_urls(
    tmp_path: Path, upstream: FakeUpstream, pg_url: str
) -> None:
    """A packument is never streamed half-filled (its tarball URLs are filled in per
    request, once it is stored): when the replica downloading it is killed, the
    waiting replicas take over after one lease TTL and each client gets the whole
    document with the URLs of the replica it asked, and nothing half-written is kept."""
    tarball = b"\x1f\x8b\x08\x00" + b"a tarball"
    sri = "sha512-" + base64.b64encode(hashlib.sha512(tarball).digest()).decode()
    versions = {
        f"1.0.{i}": {
            "name": "slow",
            "version": f"1.0.{i}",
            "description": "x" * 2000,
            "dist": {"tarball": f"{upstream.base_url}/files/slow.tgz", "integrity": sri},
        }
        for i in range(2000)
    }
    document = {"name": "slow", "dist-tags": {"latest": "1.0.0"}, "versions": versions}
    upstream.files["/registry/slow"] = json.dumps(document).encode()
    upstream.content_types["/registry/slow"] = "application/json"
    upstream.files["/files/slow.tgz"] = tarball
    # About 4 MB in 256 KiB pieces 0.3 s apart: the holder is killed well before the end.
    upstream.fault("/registry/slow", chunk_size=256 * 1024, chunk_delay_s=0.3)
    config = tmp_path / "fleet.toml"
    database = f'[database]\n    url = "{pg_url}"'
    config.write_text(
        textwrap.dedent(
            npm_config(tmp_path / "shared", upstream.base_url + "/registry", database)
        ).replace('ttl = "5s"', 'ttl = "2s"')
    )
    started: list[ProxyProcess] = []
    try:
        replicas = start_replicas(started, config, tmp_path, 3)

        async def scenario() -> list[tuple[int, bytes]]:
            async with httpx.AsyncClient(timeout=120) as client:

                async def get(replica: ProxyProcess) -> tuple[int, bytes]:
                    answer = await client.get(replica.url + "/npm/slow")
                    return answer.status_code, answer.content

                holders = asyncio.ensure_future(get(replicas[0]))
                await asyncio.to_thread(wait_for_holder, pg_url, "npm/packument/slow")
                waiting = [asyncio.ensure_future(get(r)) for r in replicas[1:] for _ in range(2)]
                await asyncio.sleep(0.8)  # the holder is mid-download
                replicas[0].signal(signal.SIGKILL)
                with pytest.raises(httpx.HTTPError):
                    await holders
                return list(await asyncio.gather(*waiting))

        results = asyncio.run(scenario())
        asked = [r for r in replicas[1:] for _ in range(2)]
        for (status, body), replica in zip(results, asked, strict=True):
            assert status == 200, body[:300]
            served = json.loads(body)
            assert len(served["versions"]) == 2000
            urls = {v["dist"]["tarball"] for v in served["versions"].values()}
            assert urls == {f"{replica.url}/npm/slow/-/slow-{v}.tgz" for v in versions}
        assert upstream.count("/registry/slow") == 2  # the killed download, the takeover
        assert httpx.get(replicas[1].url + "/npm/slow/-/slow-1.0.7.tgz").content == tarball
        blobs = [p for p in (tmp_path / "shared" / "blobs").rglob("*") if p.is_file()]
        assert len(blobs) >= 2  # the packument and the tarball; each holds what it names
        assert all(hashlib.sha256(p.read_bytes()).hexdigest() == p.name for p in blobs)
    finally:
        for replica in started:
            replica.stop()
        shutil.rmtree(tmp_path / "shared", ignore_errors=True)


def test_npm_under_a_cooldown_installs_the_newest_allowed_version_and_ci_of_a_held_one_fails(
    tmp_path: Path, registry: tuple[NpmRegistry, ServerThread], start_proxy: ProxyFactory
) -> None:
    """left-pad 1.1.0 was published a day ago: through a 3-day cooldown ``^1.0.0``
    resolves to 1.0.0, and a lock file made elsewhere that names 1.1.0's tarball fails
    with the proxy's 403, its reason shown by npm."""
    fake, _server = registry
    yesterday = datetime.now(UTC) - timedelta(days=1)
    fake.publish_times[("left-pad", "1.1.0")] = yesterday.strftime("%Y-%m-%dT%H:%M:%S.000Z")
    plain = start_proxy(
        load(write_config(tmp_path, npm_config(tmp_path / "a", fake.base_url), "a.toml"), {})
    )
    held_config = npm_config(tmp_path / "b", fake.base_url) + '\n[policy]\ncooldown = "3d"\n'
    held = start_proxy(load(write_config(tmp_path, held_config, "b.toml"), {}))

    newest = project(tmp_path / "newest", {"left-pad": "^1.0.0"})
    assert install(newest, plain.url, tmp_path / "home-plain").returncode == 0
    assert installed(newest) == {"left-pad": "1.1.0"}
    allowed = project(tmp_path / "allowed", {"left-pad": "^1.0.0"})
    result = install(allowed, held.url, tmp_path / "home-held")
    assert result.returncode == 0, result.stderr
    assert installed(allowed) == {"left-pad": "1.0.0"}

    locked = project(tmp_path / "locked", {"left-pad": "^1.0.0"})
    lock_text = (newest / "package-lock.json").read_text().replace(plain.url, held.url)
    (locked / "package-lock.json").write_text(lock_text)
    result = install(locked, held.url, tmp_path / "home-ci", command="ci")
    assert result.returncode != 0
    assert "403" in result.stderr and "pkg:npm/left-pad@1.1.0 is held back until" in (
        result.stderr
    ), result.stderr
