"""The Gradle HTTP build cache over raw HTTP: what Gradle sends, and the LRU sweep."""

from __future__ import annotations

import base64
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from proxy.config.load import load
from tests.conftest import ProxyFactory, write_config
from tests.processes import ProxyProcess, metric_value
from tests.rawhttp import raw_get
from tests.upstream import ServerThread

CI = ("ci", "ci-secret")
READER = ("reader", "reader-secret")
ARTIFACT = "application/vnd.gradle.build-cache-artifact.v2"


def cache_config(storage: Path, anonymous: str = "read", extra: str = "", jobs: str = "") -> str:
    return f"""
    [storage]
    path = "{storage}"
    {jobs}
    [[repositories]]
    name = "gradle-cache"
    format = "gradle-build-cache"
    max_entry_size = "1MB"
    anonymous = "{anonymous}"
    {extra}
    [repositories.users.ci]
    password = "${{CI_PASSWORD}}"
    role = "write"
    [repositories.users.reader]
    password = "reader-secret"
    role = "read"
    """


@pytest.fixture
def cache_proxy(tmp_path: Path, start_proxy: ProxyFactory) -> ServerThread:
    config = write_config(tmp_path, cache_config(tmp_path / "data"))
    return start_proxy(load(config, {"CI_PASSWORD": CI[1]}))


def url(proxy: ServerThread, key: str) -> str:
    return f"{proxy.url}/gradle-cache/{key}"


def test_put_then_get_head_and_overwrite(cache_proxy: ServerThread) -> None:
    key = "0a1b2c3d4e5f"
    assert httpx.get(url(cache_proxy, key)).status_code == 404
    assert httpx.head(url(cache_proxy, key)).status_code == 404
    body = os.urandom(50_000)
    put = httpx.put(
        url(cache_proxy, key), content=body, auth=CI, headers={"Content-Type": ARTIFACT}
    )
    assert 200 <= put.status_code < 300
    got = httpx.get(url(cache_proxy, key))
    assert got.status_code == 200 and got.content == body
    assert got.headers["content-type"] == ARTIFACT
    head = httpx.head(url(cache_proxy, key))
    assert head.status_code == 200 and head.headers["content-length"] == str(len(body))
    replaced = os.urandom(10)
    assert httpx.put(url(cache_proxy, key), content=replaced, auth=CI).status_code == 201
    assert httpx.get(url(cache_proxy, key)).content == replaced


def test_put_without_credentials_is_401_with_a_basic_challenge(cache_proxy: ServerThread) -> None:
    response = httpx.put(url(cache_proxy, "k1"), content=b"x")
    assert response.status_code == 401
    assert response.headers["www-authenticate"].startswith("Basic ")
    assert httpx.get(url(cache_proxy, "k1")).status_code == 404


def test_wrong_password_and_unknown_user_are_401(cache_proxy: ServerThread) -> None:
    assert httpx.put(url(cache_proxy, "k1"), content=b"x", auth=("ci", "wrong")).status_code == 401
    assert httpx.put(url(cache_proxy, "k1"), content=b"x", auth=("nobody", "x")).status_code == 401
    assert httpx.get(url(cache_proxy, "k1"), auth=("ci", "wrong")).status_code == 401
    bad = httpx.put(url(cache_proxy, "k1"), content=b"x", headers={"Authorization": "Basic !!!"})
    assert bad.status_code == 401


def test_read_only_user_is_403_on_put(cache_proxy: ServerThread) -> None:
    response = httpx.put(url(cache_proxy, "k1"), content=b"x", auth=READER)
    assert response.status_code == 403
    assert "may only read" in response.text
    assert httpx.get(url(cache_proxy, "k1"), auth=READER).status_code == 404


def test_anonymous_none_needs_credentials_to_read(
    tmp_path: Path, start_proxy: ProxyFactory
) -> None:
    config = write_config(tmp_path, cache_config(tmp_path / "data", anonymous="none"))
    proxy = start_proxy(load(config, {"CI_PASSWORD": CI[1]}))
    assert httpx.put(url(proxy, "k"), content=b"x", auth=CI).status_code == 201
    assert httpx.get(url(proxy, "k")).status_code == 401
    assert httpx.get(url(proxy, "k"), auth=READER).content == b"x"


def _raw_put_headers(
    proxy: ServerThread, key: str, headers: dict[str, str]
) -> tuple[bytes, socket.socket]:
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    lines = [f"PUT /gradle-cache/{key} HTTP/1.1", f"Host: 127.0.0.1:{proxy.port}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    return sock.recv(65536), sock


def test_413_is_decided_from_content_length_before_any_body_byte(cache_proxy: ServerThread) -> None:
    token = base64.b64encode(f"{CI[0]}:{CI[1]}".encode()).decode()
    answer, sock = _raw_put_headers(
        cache_proxy,
        "toolarge",
        {"Authorization": f"Basic {token}", "Content-Length": "2000000", "Expect": "100-continue"},
    )
    sock.close()
    # The answer came although no body byte was sent; no "100 Continue" invited one.
    assert answer.startswith(b"HTTP/1.1 413"), answer
    assert b"100 Continue" not in answer
    assert httpx.get(url(cache_proxy, "toolarge")).status_code == 404


def test_auth_is_checked_before_size(cache_proxy: ServerThread) -> None:
    answer, sock = _raw_put_headers(
        cache_proxy, "k", {"Content-Length": "2000000", "Expect": "100-continue"}
    )
    sock.close()
    assert answer.startswith(b"HTTP/1.1 401"), answer


def test_body_without_content_length_over_the_limit_is_413_and_not_stored(
    cache_proxy: ServerThread, tmp_path: Path
) -> None:
    def chunks() -> object:
        for _ in range(20):
            yield b"x" * 100_000

    response = httpx.put(url(cache_proxy, "streamed"), content=chunks(), auth=CI)  # type: ignore[arg-type]
    assert response.status_code == 413
    assert httpx.get(url(cache_proxy, "streamed")).status_code == 404
    assert list((tmp_path / "data" / "tmp").iterdir()) == []
    small = httpx.put(url(cache_proxy, "small"), content=iter([b"a" * 1000, b"b"]), auth=CI)
    assert small.status_code == 201
    assert httpx.get(url(cache_proxy, "small")).content == b"a" * 1000 + b"b"


@pytest.mark.parametrize(
    "key", ["-starts-with-dash", "has/slash", "a" * 300, "sp%20ace", "..", "%2e%2e", ""]
)
def test_bad_keys_are_400(cache_proxy: ServerThread, key: str) -> None:
    status, body = raw_get(cache_proxy.url, f"/gradle-cache/{key}")
    assert status == 400, body


def test_other_methods_are_405(cache_proxy: ServerThread) -> None:
    response = httpx.delete(url(cache_proxy, "k"), auth=CI)
    assert response.status_code == 405
    assert "PUT" in response.headers["allow"]


def test_sweep_keeps_the_repository_under_max_size_by_last_access(
    tmp_path: Path, start_proxy: ProxyFactory
) -> None:
    config = cache_config(
        tmp_path / "data",
        extra='max_size = "3MB"',
        jobs='[jobs]\nsweep_interval = "1s"',
    )
    proxy = start_proxy(load(write_config(tmp_path, config), {"CI_PASSWORD": CI[1]}))
    keys = [f"entry{i}" for i in range(4)]
    evicted_before = metric_value(
        httpx.get(proxy.url + "/metrics").text,
        "proxy_entries_evicted_total",
        repository="gradle-cache",
    )  # one registry per test process: count the delta
    for key in keys[:3]:  # 2.7MB: within the limit, nothing to evict yet
        assert httpx.put(url(proxy, key), content=os.urandom(900_000), auth=CI).status_code == 201
        time.sleep(0.02)
    # The two oldest writes are read again, so by last access entry2 is the oldest.
    for key in keys[:2]:
        assert httpx.get(url(proxy, key)).status_code == 200
        time.sleep(0.02)
    assert httpx.put(url(proxy, keys[3]), content=os.urandom(900_000), auth=CI).status_code == 201
    deadline = time.monotonic() + 20
    while (
        metric_value(
            httpx.get(proxy.url + "/metrics").text,
            "proxy_entries_evicted_total",
            repository="gradle-cache",
        )
        == evicted_before
    ):
        assert time.monotonic() < deadline, "the sweep never evicted"
        time.sleep(0.2)
    present = {key for key in keys if httpx.head(url(proxy, key)).status_code == 200}
    assert present == {"entry0", "entry1", "entry3"}  # 2.7MB <= 0.9 * 3MB
    evicted = metric_value(
        httpx.get(proxy.url + "/metrics").text,
        "proxy_entries_evicted_total",
        repository="gradle-cache",
    )
    assert evicted - evicted_before == 1


def test_non_ascii_credentials_are_401_not_500(cache_proxy: ServerThread) -> None:
    sock = socket.create_connection(("127.0.0.1", cache_proxy.port), timeout=10)
    sock.sendall(
        b"GET /gradle-cache/k HTTP/1.1\r\nHost: x\r\nAuthorization: Basic \xe9\xe9\r\nConnection: close\r\n\r\n"
    )
    answer = sock.recv(65536)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 401"), answer


@pytest.mark.parametrize("auth", [None, READER])
def test_refused_put_closes_the_connection_so_the_unread_body_is_never_a_request(
    cache_proxy: ServerThread, auth: tuple[str, str] | None
) -> None:
    headers = {"Content-Length": "20", "Expect": "100-continue"}
    if auth is not None:
        headers["Authorization"] = (
            "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
        )
    answer, sock = _raw_put_headers(cache_proxy, "k", headers)
    try:
        assert answer.split(b" ")[1] in (b"401", b"403")
        assert b"connection: close" in answer.lower()
        sock.settimeout(5)
        while sock.recv(65536):  # the rest of the answer, then the server closes
            pass
    finally:
        sock.close()


def test_the_engine_counts_every_upload_stored_or_refused(cache_proxy: ServerThread) -> None:
    """The format only raises; the engine counts each upload by its outcome."""

    def uploads(result: str) -> float:
        text = httpx.get(cache_proxy.url + "/metrics").text
        return metric_value(text, "proxy_uploads_total", repository="gradle-cache", result=result)

    before = {r: uploads(r) for r in ("stored", "unauthorized", "forbidden", "too_large")}
    assert httpx.put(url(cache_proxy, "k1"), content=b"x", auth=CI).status_code == 201
    assert httpx.put(url(cache_proxy, "k2"), content=b"x").status_code == 401
    assert httpx.put(url(cache_proxy, "k3"), content=b"x", auth=READER).status_code == 403
    assert (
        httpx.put(url(cache_proxy, "k4"), content=os.urandom(2_000_000), auth=CI).status_code == 413
    )

    def chunks() -> Iterator[bytes]:  # no Content-Length: cut off at the limit
        for _ in range(20):
            yield os.urandom(100_000)

    assert httpx.put(url(cache_proxy, "k5"), content=chunks(), auth=CI).status_code == 413
    assert httpx.get(url(cache_proxy, "k6")).status_code == 404  # not an upload
    after = {r: uploads(r) for r in before}
    assert {r: after[r] - before[r] for r in before} == {
        "stored": 1,
        "unauthorized": 1,
        "forbidden": 1,
        "too_large": 2,
    }


def test_an_upload_check_answers_what_the_put_would_get_without_a_body(
    cache_proxy: ServerThread,
) -> None:
    # What deploy/nginx.conf asks (auth_request) before it answers Expect: 100-continue.
    key = "checked-key"

    def check(auth: tuple[str, str] | None, length: str | bytes) -> httpx.Response:
        value = length if isinstance(length, bytes) else length.encode()
        return httpx.head(url(cache_proxy, key), auth=auth, headers={b"X-Upload-Check": value})

    anonymous = check(None, "10")
    assert anonymous.status_code == 401 and "basic" in anonymous.headers["www-authenticate"].lower()
    assert check(("ci", "wrong"), "10").status_code == 401
    assert check(READER, "10").status_code == 403
    assert check(CI, "2000000").status_code == 413  # over max_entry_size (1MB)
    assert check(CI, "10").status_code == 204
    assert check(CI, "").status_code == 204  # no length declared: decided as it arrives
    # Headers are Latin-1: "²" and "¹" are digits to str.isdigit(), not to int().
    for odd in (b"\xb2", b"\xb9", b"-1"):
        assert check(CI, odd).status_code == 400, odd
    assert httpx.get(url(cache_proxy, key)).status_code == 404  # a check stores nothing


def test_with_no_configuration_only_loopback_may_push_to_the_build_cache() -> None:
    # Issue 18: the Docker image with no configuration listened on all addresses and
    # took anonymous build-cache writes, with only a warning.
    exposed = load(None, {"PROXY_LISTEN": "0.0.0.0:8080"}).repository("gradle-cache")
    local = load(None, {"PROXY_LISTEN": "127.0.0.1:8080"}).repository("gradle-cache")
    assert exposed is not None and exposed.options.anonymous == "read"
    assert local is not None and local.options.anonymous == "write"


@pytest.mark.slow
def test_an_exposed_build_cache_nobody_may_write_to_says_so_at_start(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.pg import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROXY_")}
    process = subprocess.Popen(
        [sys.executable, "-m", "proxy", "serve", "--listen", f"0.0.0.0:{port}"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        ready = False
        while time.monotonic() < deadline and not ready:
            try:
                ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200
            except httpx.HTTPError:
                time.sleep(0.1)
        assert ready
        put = httpx.put(f"http://127.0.0.1:{port}/gradle-cache/k1", content=b"x")
        assert put.status_code == 401
    finally:
        process.terminate()
        output = process.communicate(timeout=30)[0].decode()
    assert "takes no uploads" in output and 'role = "write"' in output


def test_wrong_passwords_are_throttled_and_logged(
    cache_proxy: ServerThread, caplog: pytest.LogCaptureFixture
) -> None:
    # Issue 18: 300 wrong build-cache passwords in a row met no throttling and no log line.
    key = "guessed-key"
    statuses = [
        httpx.put(url(cache_proxy, key), content=b"x", auth=("ci", f"guess-{i}")).status_code
        for i in range(300)
    ]
    assert statuses[:5] == [401] * 5
    assert set(statuses[5:]) == {429}, "locked out after five wrong passwords"
    locked = httpx.put(url(cache_proxy, key), content=b"x", auth=CI)
    assert locked.status_code == 429 and int(locked.headers["retry-after"]) >= 1
    failures = [r for r in caplog.records if "build cache login failed" in r.getMessage()]
    assert 5 <= len(failures) <= 10 and "user=ci" in failures[0].getMessage()
    # Guesses of unknown names lock the guessing client, never a real user elsewhere.
    for i in range(6):
        httpx.get(url(cache_proxy, key), auth=(f"nobody{i}", "x"))
    assert httpx.get(url(cache_proxy, key), auth=READER).status_code == 404  # not locked


def lb_put(proxy: ProxyProcess, key: str, auth: tuple[str, str], client: str) -> int:
    """A PUT as a load balancer at 127.0.0.2 forwards it for ``client``."""
    transport = httpx.HTTPTransport(local_address="127.0.0.2")
    with httpx.Client(transport=transport) as lb:
        answer = lb.put(
            f"{proxy.url}/gradle-cache/{key}",
            content=b"x",
            auth=auth,
            headers={"x-forwarded-for": client},
        )
    return answer.status_code


@pytest.mark.parametrize("trusted", [False, True])
def test_behind_a_load_balancer_a_strangers_wrong_passwords_lock_only_the_stranger(
    tmp_path: Path, trusted: bool
) -> None:
    """Behind the compose stack's nginx (not on the proxy's loopback address), every
    client had the balancer's address: a stranger's five wrong passwords for 'ci' locked
    the real CI out of the cache. With server.trusted_proxies naming the balancer, the
    client is the one it forwards for; without, its own address (forwarded headers from
    anyone else are never believed)."""
    config = write_config(
        tmp_path,
        f"""
        [server]
        {'trusted_proxies = ["127.0.0.2"]' if trusted else ""}
        [storage]
        path = "{tmp_path / "data"}"
        [[repositories]]
        name = "gradle-cache"
        format = "gradle-build-cache"
        anonymous = "read"
        [repositories.users.ci]
        password = "the-ci-password"
        role = "write"
        """,
    )
    proxy = ProxyProcess(config, tmp_path, "lb").start().wait_ready()
    try:
        stranger, builder = "203.0.113.66", "198.51.100.7"
        for i in range(5):
            assert lb_put(proxy, "k", ("ci", f"guess-{i}"), stranger) == 401
        assert lb_put(proxy, "k", ("ci", "guess-5"), stranger) == 429
        ci = lb_put(proxy, "k", ("ci", "the-ci-password"), builder)
        assert ci == (201 if trusted else 429)
        logged = proxy.log_path.read_text()
        assert f"client={stranger if trusted else '127.0.0.2'}" in logged
        # A client that reaches the proxy itself cannot pick the address it is judged by.
        direct = httpx.HTTPTransport(local_address="127.0.0.3")
        with httpx.Client(transport=direct) as client:
            spoofed = client.put(
                f"{proxy.url}/gradle-cache/k",
                content=b"x",
                auth=("ci", "guess-6"),
                headers={"x-forwarded-for": "192.0.2.1"},
            )
        assert spoofed.status_code in (401, 429)
        logged = proxy.log_path.read_text()
        assert "client=127.0.0.3" in logged and "192.0.2.1" not in logged
    finally:
        proxy.stop()


def test_an_upload_over_the_limit_sent_whole_reads_the_413_not_a_reset(
    cache_proxy: ServerThread,
) -> None:
    # CI: the 413 was answered before the body was read and the connection closed under
    # the client's unread bytes, so the client got "connection reset" instead of the
    # answer. A client that did not ask (no Expect: 100-continue) sends its body anyway:
    # it is skipped and the answer read, on the same connection as the next request.
    with httpx.Client() as client:
        for attempt in range(8):
            body = os.urandom(4_000_000)
            refused = client.put(url(cache_proxy, f"big{attempt}"), content=body, auth=CI)
            assert refused.status_code == 413 and "entry limit" in refused.text
        assert client.put(url(cache_proxy, "small"), content=b"x", auth=CI).status_code == 201
