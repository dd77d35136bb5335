"""deploy/nginx.conf run by a real nginx in front of a real proxy: what the balancer
passes on must leave the proxy's answers right for the clients behind it.

The compose stack's config is used as shipped, with only what ties it to Docker
replaced (the DNS resolver and the replicas' name become this machine's proxy, the
listen port a free one, the paths a temp folder). nginx is Debian's package, installed
by .ci/run.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from proxy.config.load import load
from tests.admin_support import AUTH, admin_config
from tests.conftest import ProxyFactory, pypi_config, write_config
from tests.nginx_lb import NGINX, running_balancer
from tests.npm_registry import NpmRegistry, Tarball, start_registry
from tests.pg import free_port
from tests.upstream import FakeUpstream, ProjectFile


@pytest.fixture
def balanced(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory
) -> Iterator[tuple[str, NpmRegistry]]:
    """The URL of nginx in front of one proxy (with an admin user and an npm repository)."""
    if not Path(NGINX).exists():
        pytest.fail("these tests need Debian's nginx (.ci/run installs it)", pytrace=False)
    registry = NpmRegistry()
    registry.publish(Tarball("left-pad", "1.0.0", b"\x1f\x8b not really a tarball", {}))
    registry_server = start_registry(registry)
    npm = f"""
    [[repositories]]
    name = "npm"
    format = "npm"
    upstream = "{registry.base_url}/"
    """
    proxy = start_proxy(load(admin_config(tmp_path, upstream.base_url, extra=npm), {}))
    replica_port = int(proxy.url.rsplit(":", 1)[1])
    try:
        with running_balancer(tmp_path / "nginx", free_port(), replica_port) as url:
            yield url, registry
    finally:
        registry_server.stop()


def test_the_console_works_through_the_balancer(balanced: tuple[str, NpmRegistry]) -> None:
    """A browser on the balancer's address sends its Origin with the port: the Host the
    replica sees must keep it, or every form and API write is refused as cross-origin
    (nginx's $host drops the port), and the install guide names an address without it."""
    url, _registry = balanced
    origin = {"origin": url}
    page = httpx.get(f"{url}/ui/jobs", auth=AUTH).text
    token = re.search(r'name="csrf_token" value="([0-9a-f]+)"', page)
    assert token is not None
    form = {"repository": "pypi", "package": "alpha", "csrf_token": token.group(1)}
    done = httpx.post(f"{url}/ui/purge-package", auth=AUTH, data=form, headers=origin)
    assert done.status_code == 303, done.text
    api = httpx.delete(f"{url}/api/v1/packages/pypi/alpha", auth=AUTH, headers=origin)
    assert api.status_code == 200, api.text
    guide = httpx.get(f"{url}/ui/install", auth=AUTH).text
    assert f'<code id="base-url">{url}</code>' in guide


def test_npm_tarball_urls_name_the_balancer_with_its_port(
    balanced: tuple[str, NpmRegistry],
) -> None:
    url, _registry = balanced
    packument = httpx.get(f"{url}/npm/left-pad", headers={"accept": "application/json"})
    assert packument.status_code == 200, packument.text
    tarball = packument.json()["versions"]["1.0.0"]["dist"]["tarball"]
    assert tarball.startswith(f"{url}/npm/left-pad/-/"), tarball


def test_a_strangers_wrong_build_cache_passwords_through_the_balancer_lock_only_the_stranger(
    tmp_path: Path, start_proxy: ProxyFactory
) -> None:
    """nginx asks the replica about a PUT first (/_upload_check, a subrequest whose
    headers are its own): without the client's address in it, every upload check came
    from nginx, so a stranger's five wrong passwords for 'ci' locked the real CI's
    uploads out. And nginx turned a check's 429 or 413 into a 500."""
    if not Path(NGINX).exists():
        pytest.fail("these tests need Debian's nginx (.ci/run installs it)", pytrace=False)
    config = tmp_path / "proxy.toml"
    config.write_text(
        f"""
[storage]
path = "{tmp_path / "data"}"
[[repositories]]
name = "gradle-cache"
format = "gradle-build-cache"
anonymous = "read"
max_entry_size = "10B"
[repositories.users.ci]
password = "the-ci-password"
role = "write"
"""
    )
    proxy = start_proxy(load(config, {}))
    replica_port = int(proxy.url.rsplit(":", 1)[1])

    def put(url: str, source: str, password: str) -> httpx.Response:
        transport = httpx.HTTPTransport(local_address=source)
        with httpx.Client(transport=transport) as client:
            return client.put(url, content=b"entry", auth=("ci", password))

    with running_balancer(tmp_path / "nginx", free_port(), replica_port) as balancer:
        url = f"{balancer}/gradle-cache/key-1"
        for i in range(5):
            assert put(url, "127.0.0.2", f"guess-{i}").status_code == 401
        # Refused as the replica refused it, not as nginx's 500 for a check it did not
        # expect to fail that way.
        locked = put(url, "127.0.0.2", "guess-5")
        assert locked.status_code == 429, locked.text
        assert int(locked.headers["retry-after"]) >= 1
        ci_put = put(url, "127.0.0.3", "the-ci-password")
        assert ci_put.status_code == 201, "the CI is not locked out"
        assert httpx.get(url).content == b"entry"
        with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.3")) as ci:
            large = ci.put(url, content=b"x" * 20, auth=("ci", "the-ci-password"))
        assert large.status_code == 413, large.text  # under nginx's own limit, over ours


DENY = """
[[policy.rules]]
match = "pkg:pypi/alpha"
action = "deny"
reason = "emergency: compromised"
"""


def test_the_balancer_answers_hits_itself_and_a_deny_rule_within_two_seconds(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """deploy/nginx.conf keeps files and pages a second (nginx counts whole seconds: up
    to two) and then revalidates them (a 304 from the replica's hit lane): hits are
    answered by nginx, and an emergency deny rule added on the replicas reaches the
    clients behind it within two seconds (it cached
    immutable files for a week: a rule added later never reached them). A download in
    progress passes through, stored nowhere."""
    wheel = ProjectFile("alpha-1.0-py3-none-any.whl", os.urandom(300_000))
    upstream.add_project("alpha", [wheel])
    upstream.fault(f"/packages/{wheel.filename}", chunk_size=64 * 1024, chunk_delay_s=0.05)
    config = write_config(tmp_path, pypi_config(tmp_path / "data", upstream.base_url))
    proxy = start_proxy(load(config, {}))
    replica_port = int(proxy.url.rsplit(":", 1)[1])
    with running_balancer(tmp_path / "nginx", free_port(), replica_port) as lb:
        page, file = f"{lb}/pypi/simple/alpha/", f"{lb}/pypi/files/alpha/{wheel.filename}"
        accept = {"Accept": "application/vnd.pypi.simple.v1+json"}
        with httpx.Client(timeout=30) as client:
            miss = client.get(file)  # streamed while it downloads: not stored by nginx
            assert miss.status_code == 200 and miss.content == wheel.body
            assert "x-accel-buffering" not in miss.headers  # nginx's own: taken off
            assert miss.headers["x-cache-status"] == "MISS"
            stored = client.get(file)
            assert stored.headers["x-cache-status"] == "MISS"  # the hit: stored now
            assert client.get(file).headers["x-cache-status"] == "HIT"
            assert client.get(page, headers=accept).status_code == 200
            cached_page = client.get(page, headers=accept)
            assert cached_page.headers["x-cache-status"] == "HIT"
            assert cached_page.headers["vary"] == "Accept"
            html = client.get(page, headers={"Accept": "text/html"})  # another variant
            assert html.headers["content-type"].startswith("text/html")
            time.sleep(2.1)  # nginx counts whole seconds: "1s" lasts up to two
            revalidated = client.get(file)  # the second is over: asked again, 304
            assert revalidated.headers["x-cache-status"] == "REVALIDATED"
            assert revalidated.content == wheel.body
            engine = proxy.server.lifespan.state["proxy"]
            deny = write_config(
                tmp_path, pypi_config(tmp_path / "data", upstream.base_url, DENY), "deny.toml"
            )
            engine.reload_policy(load(deny, {}))
            deadline = time.monotonic() + 2.5
            while client.get(file).status_code == 200:
                assert time.monotonic() < deadline, "the balancer kept serving a denied file"
                time.sleep(0.05)
            refused = client.get(file)
            assert refused.status_code == 403 and "emergency: compromised" in refused.text
    assert upstream.count(f"/packages/{wheel.filename}") == 1
    leftovers = [p for p in (tmp_path / "nginx" / "cache").rglob("*") if p.is_file()]
    assert len(leftovers) <= 3  # the file and the page's two variants, no spooled copy
