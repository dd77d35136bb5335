"""The hit lane (proxy/http/lane.py) and the shipped balancer (deploy/nginx.conf) under
attack: each test is a way a review found to make either answer otherwise than the full
path would, or to keep a connection, a log write or a count from what the docs say."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.clock import ManualClock
from proxy.config.load import load
from proxy.engine import Seams
from proxy.http.app import create_app
from proxy.http.lane import HitLane
from proxy.http.protocol import GuardedHttpToolsProtocol
from proxy.testing import MemoryCatalog
from proxy.testing.upstream import MockUpstream
from tests.conftest import ProxyFactory, write_config
from tests.rawhttp import read_response
from tests.test_gradle_cache import CI, cache_config
from tests.test_npm import REGISTRY, Upstream
from tests.upstream import ServerThread


def lane_of(proxy: ServerThread) -> HitLane:
    lane = proxy.server.lifespan.state["lane"]
    assert isinstance(lane, HitLane)
    return lane


def next_answer(sock: socket.socket) -> bytes:
    """The next answer on a kept-alive connection, head and body, as sent."""
    head, body, _rest = read_response(sock)
    return head + b"\r\n\r\n" + body


def one_answer(port: int, request: bytes) -> bytes:
    """The answer to one request on a fresh connection (kept alive)."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(10)
        sock.sendall(request)
        return next_answer(sock)


def start_npm(
    tmp_path: Path, upstream: Upstream, clock: ManualClock, policy: str = ""
) -> ServerThread:
    config = write_config(
        tmp_path,
        f"""
        [storage]
        path = "{tmp_path / "data"}"
        {policy}
        [[repositories]]
        name = "npm"
        format = "npm"
        upstream = "{REGISTRY}"
        metadata_ttl = "5m"
        """,
    )
    app = create_app(
        load(config, {}),
        clock,
        seams=Seams(catalog=MemoryCatalog(clock), upstream=MockUpstream(upstream)),
    )
    return ServerThread(app, loop="asyncio", http=GuardedHttpToolsProtocol).start()


@pytest.fixture
def npm_server(tmp_path: Path) -> Any:
    clock = ManualClock()
    upstream = Upstream()
    server = start_npm(tmp_path, upstream, clock)
    yield server, upstream, clock
    server.stop()


def test_npm_version_document_built_with_one_clients_host_is_never_sent_to_another(
    npm_server: Any,
) -> None:
    """``/npm/left-pad/1.0.0`` names the tarball with the client's own base URL (its
    Host): the full path builds it per request. The lane once filed it and sent client
    A's URL to client B: anyone who could send a request with ``Connection: close``
    (always the full path) picked the tarball URL every later client got. Now it is
    never filed, and it says Vary: Host to caches in front."""
    server, _upstream, _clock = npm_server
    lane = lane_of(server)
    path = "/npm/left-pad/1.0.0"
    evil = f"GET {path} HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n".encode()
    one_answer(server.port, evil)  # the miss (the packument is fetched)
    evil_answer = one_answer(server.port, evil)  # a full-path hit: built with its Host
    assert len(lane) == 0, "an answer naming the client's own URL was filed"
    assert b"\r\nvary: host, x-forwarded-proto\r\n" in evil_answer.lower()
    with httpx.Client(base_url=server.url) as client:
        answer = client.get(path, headers={"Host": "good.example"})
    tarball = answer.json()["dist"]["tarball"]
    assert tarball == "http://good.example/npm/left-pad/-/left-pad-1.0.0.tgz", tarball
    assert answer.headers["vary"] == "Host, X-Forwarded-Proto"


def test_npm_dist_tags_show_a_held_version_once_its_hold_ended(tmp_path: Path) -> None:
    """``/npm/-/package/left-pad/dist-tags`` and ``/npm/left-pad/latest`` reflect a
    hold (``latest`` is the newest version not held), but ``_read_document`` never tells
    the ticket the hold's end (``lane.note_until``): after the hold ends the full path
    answers ``latest: 1.1.0``, the lane keeps answering ``1.0.0`` until the packument's
    TTL runs out."""
    from tests.test_release_gate_npm import COOLDOWN, DAY_S, aged

    clock = ManualClock()
    upstream = Upstream()
    # 1.1.0's 3-day cooldown ends 60 s from now; the packument stays fresh for 5 min.
    aged(upstream, clock, {("left-pad", "1.0.0"): 30, ("left-pad", "1.1.0"): 3 - 60 / DAY_S})
    server = start_npm(tmp_path, upstream, clock, COOLDOWN)
    try:
        lane = lane_of(server)
        path = "/npm/-/package/left-pad/dist-tags"
        with httpx.Client(base_url=server.url) as client:
            assert client.get(path).json() == {"latest": "1.0.0"}  # the miss
            assert client.get(path).json() == {"latest": "1.0.0"}  # a full-path hit: filed
            assert len(lane) == 1
            clock.advance(120)  # the hold is over
            laned = client.get(path)
            full = client.get(path, headers={"Connection": "close"})  # the full path
            assert full.json() == {"latest": "1.1.0"}
            assert laned.json() == full.json(), (
                f"lane answered {laned.json()} (answered={lane.answered})"
            )
    finally:
        server.stop()


def test_an_answer_judged_before_a_policy_reload_is_never_filed_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reload empties the lane, but a full-path GET that passed the release gate
    before the reload and ends after it files its answer anyway (the lane keeps no
    policy generation): the deny rule never reaches that file on this process (an
    immutable file never expires), while the full path answers 403."""
    import asyncio
    import threading

    from proxy.cache.proxied import ProxiedView
    from tests.conftest import pypi_config
    from tests.test_policy_reload import DENY
    from tests.upstream import FakeUpstream, ProjectFile, start_upstream

    upstream = FakeUpstream()
    upstream_server = start_upstream(upstream)
    upstream.add_project("alpha", [ProjectFile("alpha-1.0.tar.gz", b"alpha-bytes")])
    config = write_config(tmp_path, pypi_config(tmp_path / "data", upstream.base_url))
    proxy = ServerThread(
        create_app(load(config, {})), loop="asyncio", http=GuardedHttpToolsProtocol
    ).start()
    try:
        url = proxy.url + "/pypi/files/alpha/alpha-1.0.tar.gz"
        assert httpx.get(url).status_code == 200  # the miss
        hold = threading.Event()
        entered = threading.Event()
        release = threading.Event()
        loops: list[asyncio.AbstractEventLoop] = []
        render = ProxiedView._render

        async def slow_render(self: Any, *args: Any, **kw: Any) -> Any:
            if hold.is_set():
                loops.append(asyncio.get_running_loop())
                entered.set()
                while not release.is_set():  # noqa: ASYNC110 - a thread-safe flag
                    await asyncio.sleep(0.01)
            return await render(self, *args, **kw)

        monkeypatch.setattr(ProxiedView, "_render", slow_render)
        hold.set()
        answers: list[int] = []
        slow = threading.Thread(target=lambda: answers.append(httpx.get(url).status_code))
        slow.start()
        assert entered.wait(10)  # gate checked (no policy yet), answer not yet made
        hold.clear()
        engine = proxy.server.lifespan.state["proxy"]
        denying = write_config(
            tmp_path, pypi_config(tmp_path / "data", upstream.base_url, extra=DENY), "deny.toml"
        )
        done = threading.Event()

        def reload() -> None:
            engine.reload_policy(load(denying, {}))
            done.set()

        loops[0].call_soon_threadsafe(reload)
        assert done.wait(10)
        release.set()
        slow.join(10)
        assert answers == [200]  # judged before the reload: fine
        full = httpx.get(url, headers={"Connection": "close"})  # the full path: denied
        assert full.status_code == 403
        # (that full-path 403 is not filed, nor does it remove the filed 200)
        with httpx.Client() as client:
            laned = client.get(url)
        assert laned.status_code == 403, f"lane answered {laned.status_code} after the deny rule"
    finally:
        proxy.stop()
        upstream.released.set()
        upstream_server.stop()


def test_a_release_decision_made_for_a_while_is_made_again_for_the_lane_too(
    tmp_path: Path,
) -> None:
    """The gate keeps some decisions only for a while (``_Known.until_ms``: a publish
    time the upstream could not give is asked for again after ``RETRY_UNKNOWN_S``), but
    ``ReleaseGate.check`` never tells the ticket (no ``lane.note_until``): a jar allowed
    while its pom could not be read stays answered 200 by the lane after the full path
    has learnt it is held (403)."""
    from proxy.exceptions import UpstreamUnavailable
    from proxy.policy.gate import RETRY_UNKNOWN_S
    from tests.test_release_gate_maven import BASE, M2, Repository

    clock = ManualClock()

    class PomDown(Repository):
        down = True

        def __call__(self, request: Any) -> Any:
            if self.down and request.url.endswith(".pom"):
                raise UpstreamUnavailable("connection refused")
            return super().__call__(request)

    repository = PomDown(clock, {"1.0": 30, "1.2": 1}, "20991231000000")
    config = write_config(
        tmp_path,
        f"""
        [storage]
        path = "{tmp_path / "data"}"
        [policy]
        cooldown = "3d"
        unknown_publish_time = "allow"
        [[repositories]]
        name = "maven"
        format = "maven"
        upstream = "{M2}"
        """,
    )
    app = create_app(
        load(config, {}), clock,
        seams=Seams(catalog=MemoryCatalog(clock), upstream=MockUpstream(repository)),
    )  # fmt: skip
    server = ServerThread(app, loop="asyncio", http=GuardedHttpToolsProtocol).start()
    try:
        lane = lane_of(server)
        path = f"/maven/{BASE}/1.2/lib-1.2.jar"
        with httpx.Client(base_url=server.url) as client:
            assert client.get(path).status_code == 200  # allowed for now; the miss
            assert client.get(path).status_code == 200  # a full-path hit: filed
            assert len(lane) == 1
            repository.down = False
            clock.advance(RETRY_UNKNOWN_S + 1)  # the gate asks again: published 1 day ago
            laned = client.get(path)
            full = client.get(path, headers={"Connection": "close"})
        assert full.status_code == 403, full.text
        assert laned.status_code == 403, (
            f"lane answered {laned.status_code} (answered={lane.answered})"
        )
    finally:
        server.stop()


@pytest.fixture
def pypi_lane(tmp_path: Path, start_proxy: ProxyFactory) -> Any:
    """A PyPI proxy whose lane holds one wheel's answer: (proxy, its path, the file)."""
    from tests.conftest import pypi_config
    from tests.upstream import FakeUpstream, ProjectFile, start_upstream

    upstream = FakeUpstream()
    upstream_server = start_upstream(upstream)
    f = ProjectFile("alpha-1.0-py3-none-any.whl", b"wheel" * 2000)
    upstream.add_project("alpha", [f])
    config = write_config(tmp_path, pypi_config(tmp_path / "data", upstream.base_url))
    proxy = start_proxy(load(config, {}))
    path = f"/pypi/files/alpha/{f.filename}"
    with httpx.Client(base_url=proxy.url) as client:
        for _ in range(3):
            assert client.get(path).status_code == 200
    assert len(lane_of(proxy)) == 1
    yield proxy, path, f
    upstream.released.set()
    upstream_server.stop()


def test_request_headers_over_the_apps_limit_get_its_431_not_a_lane_answer(pypi_lane: Any) -> None:
    """The full path refuses request headers over ``paths.MAX_HEADER_BYTES`` (16 KiB)
    with a 431 (``check_headers``); the protocol lets heads up to 32 KiB through, and
    the lane answers them 200."""
    proxy, path, _f = pypi_lane
    big = "x" * 20_000
    request = f"GET {path} HTTP/1.1\r\nHost: a\r\nX-Big: {big}\r\n"
    full = one_answer(proxy.port, (request + "Connection: close\r\n\r\n").encode())
    assert full.startswith(b"HTTP/1.1 431 ")
    laned = one_answer(proxy.port, (request + "\r\n").encode())
    assert laned.startswith(b"HTTP/1.1 431 "), laned[:40]


def test_a_pages_max_age_counts_down_on_the_entrys_seconds_not_the_clocks(
    tmp_path: Path, start_proxy: Any
) -> None:
    """``LaneAnswer.heads`` makes the head again when the clock's second changes, but
    ``Entry.max_age_s`` steps down when ``expires_at_ms - now`` crosses a whole second,
    which is at the entry's own millisecond offset: for the rest of that second the
    lane states a max-age one more than the full path does."""
    from tests.conftest import pypi_config
    from tests.upstream import FakeUpstream, ProjectFile, start_upstream

    upstream = FakeUpstream()
    upstream_server = start_upstream(upstream)
    upstream.add_project("alpha", [ProjectFile("alpha-1.0.tar.gz", b"alpha-bytes")])
    clock = ManualClock(1_800_000_000_000 + 500)  # the page is fetched at .500
    config = write_config(tmp_path, pypi_config(tmp_path / "data", upstream.base_url))
    proxy = start_proxy(load(config, {}), clock)
    try:
        lane = lane_of(proxy)
        url = proxy.url + "/pypi/simple/alpha/"
        html = {"Accept": "text/html"}
        with httpx.Client() as client:
            for _ in range(3):
                client.get(url, headers=html)
            assert len(lane) == 1
            clock.advance(249.7)  # .200 of a second: 350.3 s left
            first = client.get(url, headers=html)
            clock.advance(0.6)  # .800 of the same second: 349.7 s left
            laned = client.get(url, headers=html)
            answered = lane.answered
            full = client.get(url, headers={**html, "Connection": "close"})
        assert first.headers["cache-control"] == "public, max-age=350"
        assert full.headers["cache-control"] == "public, max-age=349"
        assert answered >= 2
        assert laned.headers["cache-control"] == full.headers["cache-control"]
    finally:
        upstream.released.set()
        upstream_server.stop()


# -- the load balancer (deploy/nginx.conf through tests/nginx_lb.py) --------------------


def _nginx_or_fail() -> None:
    from tests.nginx_lb import NGINX

    if not Path(NGINX).exists():
        pytest.fail("these tests need Debian's nginx", pytrace=False)


def test_the_balancer_never_gives_one_clients_npm_urls_to_another(
    tmp_path: Path, start_proxy: Any
) -> None:
    """deploy/nginx.conf now keeps every answer the proxy calls public (a packument is
    ``public, max-age=N``) keyed by ``$uri`` alone, while it passes the client's Host on
    because npm's tarball URLs are built from it (deploy/proxy.toml sets no
    public_url): the packument built for one client's Host is given to the next
    client. A request with ``Host: evil.example`` once a second keeps the cached copy
    pointing everyone's tarballs at evil.example."""
    from tests.nginx_lb import running_balancer
    from tests.npm_registry import NpmRegistry, Tarball, start_registry
    from tests.pg import free_port

    _nginx_or_fail()
    registry = NpmRegistry()
    registry.publish(Tarball("left-pad", "1.0.0", b"\x1f\x8b not really a tarball", {}))
    registry_server = start_registry(registry)
    config = write_config(
        tmp_path,
        f"""
        [storage]
        path = "{tmp_path / "data"}"
        [[repositories]]
        name = "npm"
        format = "npm"
        upstream = "{registry.base_url}/"
        """,
    )
    proxy = start_proxy(load(config, {}))
    try:
        with running_balancer(tmp_path / "nginx", free_port(), proxy.port) as lb:
            accept = {"Accept": "application/json"}
            with httpx.Client(timeout=30) as client:
                evil = client.get(f"{lb}/npm/left-pad", headers={**accept, "Host": "evil.example"})
                assert evil.status_code == 200
                mine = client.get(f"{lb}/npm/left-pad", headers=accept)
            tarball = mine.json()["versions"]["1.0.0"]["dist"]["tarball"]
            assert tarball.startswith(f"{lb}/npm/left-pad/-/"), (
                tarball,
                mine.headers.get("x-cache-status"),
            )
    finally:
        registry_server.stop()


def test_the_balancer_never_answers_a_not_ready_replicas_readyz_with_an_old_ready(
    tmp_path: Path, start_proxy: Any
) -> None:
    """``/readyz`` (and ``/healthz``, ``/metrics``) carry no Cache-Control, so nginx
    keeps their 200 a second under ``$uri`` (``/readyz?scope=local`` and ``/readyz``
    share it), and ``proxy_cache_use_stale ... http_503`` then answers a replica's
    503 "not ready" with the old 200 "ready", however old, for a week."""
    from tests.nginx_lb import running_balancer
    from tests.pg import free_port
    from tests.upstream import FakeUpstream, start_upstream

    _nginx_or_fail()
    upstream = FakeUpstream()
    upstream_server = start_upstream(upstream)
    from tests.conftest import pypi_config

    config = write_config(tmp_path, pypi_config(tmp_path / "data", upstream.base_url))
    proxy = start_proxy(load(config, {}))
    try:
        with running_balancer(tmp_path / "nginx", free_port(), proxy.port) as lb:
            assert httpx.get(f"{lb}/readyz").status_code == 200
            engine = proxy.server.lifespan.state["proxy"]

            async def full_disk(min_free: Any) -> list[str]:
                return ["storage: the disk is full"]

            engine.storage.problems = full_disk
            import time

            time.sleep(2.1)  # nginx's second is over: it asks the replica
            direct = httpx.get(f"{proxy.url}/readyz")
            assert direct.status_code == 503
            through = httpx.get(f"{lb}/readyz")
            assert through.status_code == 503, (through.text, through.headers.get("x-cache-status"))
    finally:
        upstream.released.set()
        upstream_server.stop()


def test_access_lines_are_written_at_most_4000_bytes_at_a_time() -> None:
    """``AccessLines`` says "at most 4,000 bytes a write, under a pipe's atomic size:
    workers share stderr", but it writes once the batch has reached 4,000 bytes, with
    the line that crossed it: a write may be up to 4,000 bytes plus a line (a lane
    answer's line carries the whole target, query included, up to the 32 KiB head), so
    two workers' batches can interleave mid-line on a pipe."""
    import asyncio

    from proxy.runtime.logs import ACCESS_BATCH_BYTES, AccessLines

    class Recording:
        def __init__(self) -> None:
            self.writes: list[str] = []

        def write(self, text: str) -> None:
            self.writes.append(text)

        def flush(self) -> None:
            pass

    stream = Recording()

    async def log() -> None:
        lines = AccessLines(stream, "text")  # type: ignore[arg-type]
        for i in range(40):
            lines.write(
                "127.0.0.1", "GET", f"/pypi/files/alpha/{i}-" + "a" * 250, 200, 1, 0.1, "hit"
            )
        lines.flush()

    asyncio.run(log())
    assert "".join(stream.writes).count("\n") == 40
    sizes = [len(w.encode()) for w in stream.writes]
    assert max(sizes) <= ACCESS_BATCH_BYTES, sizes


def test_metrics_include_every_workers_lane_answers_within_a_second(tmp_path: Path) -> None:
    """With ``--workers 2`` the worker that renders /metrics flushes only its own lane;
    the other worker's lane answers reach the scrape within a second, none lost."""
    from tests.conftest import pypi_config
    from tests.processes import ProxyProcess, metric_value
    from tests.upstream import FakeUpstream, ProjectFile, start_upstream

    upstream = FakeUpstream()
    upstream_server = start_upstream(upstream)
    f = ProjectFile("alpha-1.0-py3-none-any.whl", b"wheel" * 200)
    upstream.add_project("alpha", [f])
    config = write_config(tmp_path, pypi_config(tmp_path / "data", upstream.base_url))
    proxy = ProxyProcess(config, tmp_path, "w2", workers=2).start().wait_ready()
    path = f"/pypi/files/alpha/{f.filename}"
    series = {"method": "GET", "repository": "pypi", "status": "200"}
    try:
        for _ in range(20):  # new connections: both workers file it
            with httpx.Client(base_url=proxy.url) as client:
                for _ in range(3):
                    assert client.get(path).status_code == 200
        import time

        time.sleep(1.5)
        before = metric_value(
            httpx.get(proxy.url + "/metrics").text, "proxy_http_requests_total", **series
        )
        for _ in range(20):
            with httpx.Client(base_url=proxy.url) as client:
                for _ in range(5):
                    assert client.get(path).status_code == 200
        # The worker that renders /metrics adds its own lane's counts first; the other's
        # come within a second (docs/architecture.md, "The hit lane").
        deadline = time.monotonic() + 2.5
        while True:
            text = httpx.get(proxy.url + "/metrics").text
            after = metric_value(text, "proxy_http_requests_total", **series)
            if after - before >= 100 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert after - before == 100
    finally:
        proxy.stop()
        upstream.released.set()
        upstream_server.stop()


def test_an_idle_keep_alive_connection_cannot_be_held_open_with_bare_crlfs(
    pypi_lane: Any,
) -> None:
    """After a full-path answer, uvicorn's keep-alive timer is cancelled by any data
    (``data_received``) and armed again only when a response completes, and our head
    deadline starts only when a message begins (``on_message_begin``): bare CRLFs
    (which the parser skips between messages) every few seconds keep the connection
    open for ever, past both the 5 s keep-alive and the 10 s head timeout (slowloris).
    After a lane answer the same bytes do not (the idle deadline ignores them)."""
    import time

    proxy, _path, _f = pypi_lane
    with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
        sock.settimeout(5)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")  # the full path
        data = b""
        while not data.endswith(b"ok\n"):
            data += sock.recv(65536)
        started = time.monotonic()
        closed = False
        while time.monotonic() - started < 16:  # past keep-alive (5 s) and head (10 s)
            time.sleep(2.5)
            try:
                sock.sendall(b"\r\n")
            except OSError:
                closed = True
                break
        assert closed, "the connection was kept open for 16 s by 2 bytes every 2.5 s"


# -- a second review's findings ---------------------------------------------------------


# -- 1. the idle deadline cuts an upload whose answer was sent before its body -----------


def test_an_upload_refused_before_its_body_is_not_cut_by_the_keep_alive_deadline(
    tmp_path: Path, start_proxy: ProxyFactory
) -> None:
    """A PUT without credentials is answered 401 before its body is read; the protocol
    skips the rest of the body (up to 64 MiB) "so the client can finish sending and read
    the answer" (http/protocol.py). Since the bare-CRLF fix, ``on_response_complete``
    arms the idle keep-alive deadline (5 s) as soon as the 401 is sent, and nothing the
    body brings moves it: an upload still arriving 5 s after the answer has its
    connection closed under it (uvicorn's own timer was cancelled by every byte)."""
    config = write_config(tmp_path, cache_config(tmp_path / "data"))
    proxy = start_proxy(load(config, {"CI_PASSWORD": CI[1]}))
    keep_alive = proxy.config.timeout_keep_alive
    # Under max_entry_size (1 MB): the answer is the 401. A slow uplink: the body takes
    # keep_alive + 3 s, sent all the while.
    upload_refused_slowly(proxy.port, size=600_000, chunks=8, pause_s=(keep_alive + 3) / 8)


def upload_refused_slowly(port: int, size: int, chunks: int, pause_s: float) -> None:
    """PUT ``size`` bytes without credentials in ``chunks``, ``pause_s`` apart: the
    connection must stay open to the body's end, the 401 be read after it, and a GET
    on the same connection be answered."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(10)
        sock.sendall(
            b"PUT /gradle-cache/k HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % size
        )
        try:
            for _ in range(chunks):
                time.sleep(pause_s)
                sock.sendall(b"x" * (size // chunks))
            answer = next_answer(sock)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            after = next_answer(sock)
        except OSError as exc:
            pytest.fail(f"the connection was closed under the upload: {exc!r}")
    assert answer.startswith(b"HTTP/1.1 401 ")
    assert after.startswith(b"HTTP/1.1 200 ")


# -- 2. a copy per spelling: percent-escapes do what the query string did ---------------


def test_percent_escaped_spellings_of_one_target_do_not_each_file_a_copy(
    pypi_lane: Any,
) -> None:
    """2ea3131 stopped filing targets with a query string: "a query of anyone's choosing
    filed a copy per spelling, pushing the answers that matter out". A path spelled
    with escapes does the same: ``/pypi/files/alpha/alpha%2D1.0-...`` is the same file
    to the full path (``decode_path``), but the lane keys the target as sent, so every
    escaped spelling (2 per character: 2^n of them) files another copy of the body,
    and the oldest-filed targets (the answers that matter) are pushed out."""
    proxy, path, f = pypi_lane
    lane = lane_of(proxy)
    spellings = []
    name = f.filename
    for i, char in enumerate(name[:12]):
        spellings.append(path[: -len(name)] + name[:i] + f"%{ord(char):02X}" + name[i + 1 :])
    for spelled in spellings:
        request = f"GET {spelled} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
        for _ in range(2):
            answer = one_answer(proxy.port, request)
            assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(f.body)
    assert len(lane) == 1, f"{len(lane)} copies of one answer, {lane.size_bytes} bytes"


# -- 3. pipelined hits counted as one request head ----------------------------------------


def test_pipelined_lane_hits_are_not_counted_as_one_oversized_head(pypi_lane: Any) -> None:
    """``data_received`` adds the whole chunk read to ``_head_bytes`` when a head is
    still incomplete after it, also the bytes of the complete requests before that
    head in the chunk (which the lane has just answered): a client that pipelines 40 KB
    of small GETs gets a 431 and is disconnected, for heads of 100 bytes each. (Older
    than the lane: the protocol before 346198a fails it too; the lane invites the
    pipelining.)"""
    proxy, path, _f = pypi_lane
    one = f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    count = 40_000 // len(one)
    with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
        sock.settimeout(10)
        sock.sendall(one * count + b"GET /healthz HTTP/1.1\r\nHo")
        time.sleep(0.5)
        sock.sendall(b"st: x\r\n\r\n")
        data = b""
        try:
            while not data.endswith(b"ok\n"):
                chunk = sock.recv(1 << 20)
                if not chunk:
                    break
                data += chunk
        except ConnectionResetError:
            pass  # closed with our bytes unread: after a 431, if it got to us first
    assert b" 431 " not in data, data[data.find(b" 431 ") - 20 :][:200]
    assert data.count(b"HTTP/1.1 200 OK") == count + 1


# -- a third review's findings ------------------------------------------------------------


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Has the server closed ``sock`` (reading whatever it still sends) in time?"""
    sock.settimeout(0.5)
    ends = time.monotonic() + seconds
    while time.monotonic() < ends:
        try:
            if not sock.recv(65536):
                return True
        except TimeoutError:
            continue
        except OSError:
            return True
    return False


def test_a_body_that_never_comes_or_trickles_after_its_answer_does_not_hold_the_connection(
    pypi_lane: Any,
) -> None:
    """The keep-alive wait starts once an answered request's body has all arrived (so a
    refused upload is not cut while it is sent, above); a body that never comes held its
    connection for ever, as did one trickled a byte at a time: one cheap request per
    connection could hold them all. The rest of a skipped body must keep coming."""
    from proxy.http.protocol import HEAD_TIMEOUT_S

    proxy, path, _f = pypi_lane
    heads = {
        "a refused upload, no body": b"PUT /pypi/simple/alpha/ HTTP/1.1\r\nHost: x\r\n"
        b"Content-Length: 1000000\r\n\r\n",
        "a refused chunked upload, one chunk": b"PUT /pypi/simple/alpha/ HTTP/1.1\r\n"
        b"Host: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
        "a lane hit with a body announced": f"GET {path} HTTP/1.1\r\nHost: x\r\n"
        "Content-Length: 1000\r\n\r\n".encode(),
        "a full-path answer with Expect": b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
        b"Expect: 100-continue\r\nContent-Length: 10\r\n\r\n",
        "a refused upload, trickled": b"PUT /pypi/simple/alpha/ HTTP/1.1\r\nHost: x\r\n"
        b"Content-Length: 1000000\r\n\r\n",
    }
    socks = {}
    try:
        for name, head in heads.items():
            sock = socket.create_connection(("127.0.0.1", proxy.port))
            sock.sendall(head)
            socks[name] = sock
        time.sleep(1)
        for sock in socks.values():
            sock.settimeout(5)
            assert sock.recv(65536).startswith(b"HTTP/1.1 "), "no answer"
        trickled = socks["a refused upload, trickled"]
        started = time.monotonic()
        for _ in range(int(HEAD_TIMEOUT_S) + 6):  # a byte a second, past the allowance
            try:
                trickled.sendall(b"x")
            except OSError:
                break
            time.sleep(1)
        left = HEAD_TIMEOUT_S + 8 - (time.monotonic() - started)
        still_open = [name for name, sock in socks.items() if not _closed_within(sock, left)]
        assert not still_open, f"still open {HEAD_TIMEOUT_S + 8:.0f} s on: {still_open}"
    finally:
        for sock in socks.values():
            sock.close()


def test_a_websocket_upgrade_after_a_lane_answer_gets_what_it_gets_alone(
    pypi_lane: Any,
) -> None:
    """After a lane answer the connection's cycle is the lane's marker, which uvicorn
    leaves in place for an upgrade request (it makes no cycle of its own): reading its
    scope raised in the parser callback, and the client got 400 "Invalid HTTP request"
    instead of the answer it gets on a fresh connection."""
    proxy, path, f = pypi_lane
    upgrade = (
        b"GET /pypi/simple/alpha/ HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
        b"Upgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        b"Sec-WebSocket-Version: 13\r\n\r\n"
    )

    def status_line(data: bytes) -> bytes:
        return data.split(b"\r\n", 1)[0]

    alone = one_answer(proxy.port, upgrade)
    with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
        sock.settimeout(10)
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        first = next_answer(sock)
        sock.sendall(upgrade)
        data = b""
        while b"\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    assert first.startswith(b"HTTP/1.1 200 ") and first.endswith(f.body)
    assert status_line(data) == status_line(alone), (data[:200], alone[:200])


def test_a_head_half_sent_behind_a_full_path_answer_gets_its_408(pypi_lane: Any) -> None:
    """A head that began in the same read as the request before it starts its 10 s when
    that request's answer ends, and is then answered 408 (docs/architecture.md, "Slow
    and hostile clients"). Behind a full-path answer, uvicorn's keep-alive timer (5 s),
    armed as that answer ended, closed the connection first with no answer."""
    from proxy.http.protocol import HEAD_TIMEOUT_S

    proxy, path, _f = pypi_lane
    with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
        sock.settimeout(HEAD_TIMEOUT_S + 5)
        started = time.monotonic()
        sock.sendall(
            b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" + f"GET {path} HTTP/1.1\r\nHo".encode()
        )
        data = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        waited = time.monotonic() - started
    assert data.startswith(b"HTTP/1.1 200 "), data[:200]
    assert b"HTTP/1.1 408 " in data, (round(waited, 1), data[-200:])


def test_a_refused_upload_from_a_slow_uplink_is_still_read_to_its_end(
    tmp_path: Path, start_proxy: ProxyFactory
) -> None:
    """The skipped body's pace (``MIN_SKIPPED_BODY_RATE``) is a floor an attacker must
    pay, not one a slow client falls under: at 20 KB/s (160 kbit/s) a refused upload of
    18 s is read to its end and its 401 read after it (at 64 KiB/s, the first floor,
    it was cut at 14 s and the client saw a broken pipe instead)."""
    config = write_config(tmp_path, cache_config(tmp_path / "data"))
    proxy = start_proxy(load(config, {"CI_PASSWORD": CI[1]}))
    upload_refused_slowly(proxy.port, size=360_000, chunks=18, pause_s=1.0)  # 20 KB/s
