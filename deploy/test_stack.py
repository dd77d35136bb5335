"""`make deploy-test`: the image and the compose stack on a real Docker engine.

Builds the image, brings up deploy/docker-compose.yml (3 replicas, Postgres, nginx,
Prometheus) plus a fake PyPI upstream under a unique project name, checks it with real
clients, and always tears it down. Then the same with docker-compose.s3.yml added (the
blobs in a bucket of an S3 server built from deploy/s3/, no shared volume), with the
checks that concern storage. One PASS/FAIL/SKIP line per check, with its time; exit
status 1 if any check failed.

    .venv/bin/python deploy/test_stack.py [--keep] [--restart-daemon auto|yes|no] [--image TAG]
        [--variant both|folder|s3]

--restart-daemon: also restart the Docker daemon in check (f); `auto` does it only when
the engine is one docker-standins started (a machine of our own, as in CI).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent / "testing"))

from stack import (
    IMAGE,
    ROOT,
    Stack,
    base_images,
    build_image,
    build_s3_image,
    ensure_engine,
    ensure_images,
    file_url,
    log,
    restart_standins_engine,
    standins_engine_pid,
    stop_standins_engine,
    wait_for,
)

REPLICAS = ("proxy1", "proxy2", "proxy3")
FAILOVER_LIMIT_S = 3.0  # every request while a replica is down answers within this
COME_BACK_S = 150  # bound for the whole stack to serve again after a restart
# nginx never answers a request with credentials from its cache, so requests with this
# header reach a replica (the pypi repository ignores it).
PAST_LB_CACHE = {"Authorization": "Basic ZGVwbG95OnRlc3Q="}


class Skip(Exception):
    pass


class Checks:
    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.client = httpx.Client(timeout=30)
        self.failed: list[str] = []
        self.passed = self.skipped = 0

    @classmethod
    def merged(cls, runs: list[Checks]) -> Checks:
        total = cls.__new__(cls)
        total.failed = [name for run in runs for name in run.failed]
        total.passed = sum(run.passed for run in runs)
        total.skipped = sum(run.skipped for run in runs)
        return total

    def check(self, name: str, body: Callable[[], str]) -> None:
        started = time.monotonic()
        try:
            detail = body()
            status = "PASS"
            self.passed += 1
        except Skip as exc:
            status, detail = "SKIP", str(exc)
            self.skipped += 1
        except Exception as exc:
            status, detail = "FAIL", f"{type(exc).__name__}: {exc}"
            self.failed.append(name)
            if os.environ.get("DEPLOY_TEST_TRACEBACK"):
                traceback.print_exc()
        elapsed = time.monotonic() - started
        log(f"{status} {name} [{elapsed:.1f}s]: {detail}")

    # -------------------------------------------------------------- helpers

    def get(self, url: str, **kwargs: object) -> httpx.Response:
        return self.client.get(url, **kwargs)  # type: ignore[arg-type]

    def lb_serves_index(self) -> bool:
        return self.get(f"{self.stack.lb}/pypi/simple/dt-big/", timeout=5).status_code == 200

    def lb_serves_wheel(self) -> bool:
        """A cached wheel through the LB, answered by a replica (not nginx's cache)."""
        wheel = self.stack.packages["dt-beta"]
        response = self.get(file_url(self.stack.lb, wheel), timeout=5, headers=PAST_LB_CACHE)
        return (
            response.status_code == 200
            and response.content == wheel.read_bytes()
            and response.headers.get("x-cache-status") != "HIT"
        )

    def pip(self, target: Path, *packages: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
        env["PIP_CONFIG_FILE"] = os.devnull  # no machine or user settings (extra indexes...)
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-cache-dir",
             "--disable-pip-version-check", "--target", str(target),
             "--index-url", f"{self.stack.lb}/pypi/simple/", *packages],
            check=True, env=env, timeout=120, capture_output=True, text=True,
        )  # fmt: skip

    # -------------------------------------------------------------- the checks

    def migrations_once(self) -> str:
        """(a) 3 replicas started together on an empty database: migrations applied once."""
        stack = self.stack
        expected = sorted(p.stem for p in (ROOT / "migrations" / "postgres").glob("*.sql"))
        rows = stack.sql("SELECT version || ' ' || name FROM schema_migrations ORDER BY version")
        applied = [line.split(" ", 1)[1] for line in rows.splitlines() if line.strip()]
        if sorted(applied) != expected:
            raise AssertionError(
                f"schema_migrations holds {applied}, expected {expected} once each"
            )
        starts, restarts = [], 0
        for service in REPLICAS:
            state = stack.inspect(service)
            restarts += int(state["RestartCount"])
            started_at = state["State"]["StartedAt"]  # 2026-01-02T03:04:05.123456789Z
            starts.append(float(started_at[17:29].rstrip("Z")) + 60 * int(started_at[14:16]))
            if "Traceback" in stack.logs(service):
                raise AssertionError(f"{service} logged a traceback")
        if restarts:
            raise AssertionError(f"replicas restarted {restarts} times while starting")
        spread = max(starts) - min(starts)
        return (
            f"{len(applied)} migration(s) recorded once; 3 replicas started within "
            f"{spread * 1000:.0f} ms of each other, 0 restarts, no traceback"
        )

    def pip_through_lb(self) -> str:
        """(b) pip through the LB, 3 installs at once then 2 more: 1 upstream GET per file."""
        with tempfile.TemporaryDirectory() as tmp:
            targets = [Path(tmp) / str(i) for i in range(5)]
            started = time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                list(pool.map(lambda t: self.pip(t, "dt-alpha"), targets[:3]))
            first = time.monotonic() - started
            for target in targets[3:]:
                self.pip(target, "dt-alpha")
            for target in targets:
                if not (target / "dt_beta" / "__init__.py").exists():
                    raise AssertionError(f"pip did not install dt-beta into {target}")
        counts = self.stack.upstream_counts()
        files = {path: n for path, n in counts.items() if path.startswith("/files/")}
        expected = {
            f"/files/{name}/{self.stack.packages[name].name}" for name in ("dt-alpha", "dt-beta")
        }
        if set(files) != expected or any(n != 1 for n in files.values()):
            raise AssertionError(
                f"upstream file GETs {files}, expected 1 each of {sorted(expected)}"
            )
        # pip asks for the JSON pages only (another representation is another GET).
        pages = {path: counts.get(path, 0) for path in ("/simple/dt-alpha/", "/simple/dt-beta/")}
        if sorted(pages.values()) != [1, 1]:
            raise AssertionError(f"upstream index page GETs {pages}, expected 1 each")
        return (
            f"5 pip installs (3 concurrent: {first:.1f}s); upstream GETs: 1 per file "
            f"({len(files)} files) and 1 per index page ({len(pages)}) for the fleet"
        )

    def prometheus_targets(self) -> str:
        """(c) Prometheus discovers and scrapes every replica (DNS service discovery)."""
        addresses = {self.stack.address(service) for service in REPLICAS}

        def all_up() -> set[str] | None:
            response = self.get(
                f"{self.stack.prometheus}/api/v1/query",
                params={"query": 'up{job="artifact-proxy"}'},
            )
            series = response.json()["data"]["result"]
            up = {s["metric"]["instance"].rsplit(":", 1)[0] for s in series if s["value"][1] == "1"}
            return up if addresses <= up else None

        up = wait_for("Prometheus scraping all 3 replicas", all_up, 90, every_s=2)
        rules = self.get(f"{self.stack.prometheus}/api/v1/rules").json()["data"]["groups"]
        names = [rule["name"] for group in rules for rule in group["rules"]]
        return f"{len(up)} targets up: {', '.join(sorted(up))}; alert rules loaded: {len(names)}"

    def replica_stopped(self) -> str:
        """(d) Stop a replica under traffic, then recreate it: every request 200, fast."""
        stack = self.stack
        urls = [
            f"{stack.lb}/pypi/simple/dt-alpha/",
            file_url(stack.lb, stack.packages["dt-beta"]),
        ]
        timings: list[float] = []
        errors: list[str] = []

        def burst(count: int, pause_s: float = 0.0) -> None:
            for i in range(count):
                started = time.monotonic()
                try:
                    status = self.get(urls[i % 2], timeout=30, headers=PAST_LB_CACHE).status_code
                    if status != 200:
                        errors.append(f"{urls[i % 2]}: {status}")
                except httpx.HTTPError as exc:
                    errors.append(f"{urls[i % 2]}: {exc!r}")
                timings.append(time.monotonic() - started)
                time.sleep(pause_s)

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            during = pool.submit(burst, 60, 0.05)  # traffic while proxy2 stops
            time.sleep(0.5)
            stop_started = time.monotonic()
            stack.run("stop", "proxy2")
            stop_s = time.monotonic() - stop_started
            during.result()
        burst(30)  # and after: the LB must not wait on the stopped replica
        # Recreated (new container, maybe a new address): the LB finds it again.
        stack.up("--force-recreate", "proxy2")
        stack.wait_healthy(["proxy2"], 90)
        address = stack.address("proxy2")
        since = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(time.time() - 1)) + "Z"

        def reached() -> bool:
            burst(10)
            return f"upstream={address}:8080" in stack.logs("lb", since=since)

        wait_for("the LB sending requests to the recreated proxy2", reached, 30)
        if errors:
            raise AssertionError(f"{len(errors)} failed requests: {errors[:5]}")
        slowest = max(timings)
        if slowest > FAILOVER_LIMIT_S:
            raise AssertionError(f"slowest request {slowest:.2f}s > {FAILOVER_LIMIT_S}s")
        return (
            f"{len(timings)} requests, all 200, slowest {slowest * 1000:.0f} ms "
            f"(docker stop took {stop_s:.1f}s); recreated proxy2 ({address}) reached again"
        )

    def bad_route(self) -> str:
        """(e) A route answering 503 twenty times does not take the fleet down."""
        statuses = [
            self.get(f"{self.stack.lb}/maven/org/example/demo/1.0/demo-1.0.jar").status_code
            for _ in range(20)
        ]
        if set(statuses) != {503}:
            raise AssertionError(f"the route without an upstream answered {sorted(set(statuses))}")
        hits = [self.lb_serves_wheel() for _ in range(20)]
        index = [self.get(f"{self.stack.lb}/pypi/simple/dt-alpha/").status_code for _ in range(10)]
        if not all(hits) or set(index) != {200}:
            raise AssertionError(f"after the 503s: wheel ok {sum(hits)}/20, index pages {index}")
        return "20 x 503 passed through; then 20/20 cached wheels (from replicas) and 10/10 index pages 200"

    def stack_restarts(self, restart_daemon: bool) -> str:
        """(f) The whole stack restarted, three ways: it comes back by itself."""
        stack = self.stack
        times = []

        def restart(how: str, action: Callable[[], object]) -> None:
            started = time.monotonic()
            action()
            wait_for(
                f"the LB serving a cached wheel after {how}", self.lb_serves_wheel, COME_BACK_S, 1
            )
            stack.wait_healthy(["db", *REPLICAS], COME_BACK_S)
            times.append(f"{how} {time.monotonic() - started:.1f}s")

        restart("compose restart", lambda: stack.run("restart", timeout=300))
        if restart_daemon:
            restart("Docker daemon restart", restart_standins_engine)
        else:
            times.append(
                "Docker daemon restart not tried (not asked, or not docker-standins' engine)"
            )
        restart(
            "compose stop + up -d", lambda: (stack.run("stop", timeout=300), stack.up(timeout=300))
        )
        return "back and serving after: " + "; ".join(times)

    def build_cache_writes(self) -> str:
        """(h) The build cache through the LB: anyone reads, only the user `ci` writes."""
        url = f"{self.stack.lb}/gradle-cache/deploy-test-{time.monotonic_ns()}"
        anonymous = self.client.put(url, content=b"poisoned")
        if anonymous.status_code != 401:
            raise AssertionError(f"an anonymous PUT answered {anonymous.status_code}")
        wrong = self.client.put(url, content=b"poisoned", auth=("ci", "change-me"))
        if wrong.status_code != 401:
            raise AssertionError(f"the documented default password was let in: {wrong.status_code}")
        written = self.client.put(url, content=b"output", auth=("ci", self.stack.gradle_password))
        read = self.get(url)
        if written.status_code != 201 or read.content != b"output":
            raise AssertionError(f"ci's PUT {written.status_code}, then GET {read.status_code}")
        return "anonymous PUT 401, ci PUT 201, anonymous GET 200"

    def put_with_expect(self, path: str, length: int, user: str | None) -> tuple[bytes, bool]:
        """A PUT with ``Expect: 100-continue``, on a raw socket: (the first answer's
        status line, whether the body was sent). The body goes only after a 100."""
        import base64
        import socket

        host, port = self.stack.lb.removeprefix("http://").rsplit(":", 1)
        head = f"PUT {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {length}\r\n"
        head += "Expect: 100-continue\r\nConnection: close\r\n"
        if user is not None:
            token = base64.b64encode(f"{user}".encode()).decode()
            head += f"Authorization: Basic {token}\r\n"
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall((head + "\r\n").encode())
            answer = sock.recv(4096)
            sent = False
            if answer.startswith(b"HTTP/1.1 100"):
                sock.sendall(b"x" * length)
                sent = True
                answer = answer.split(b"\r\n\r\n", 1)[1] or sock.recv(4096)
            return answer.split(b"\r\n", 1)[0], sent

    def uploads_decided_before_the_body(self) -> str:
        """(i) nginx answers Expect: 100-continue itself: a PUT with wrong credentials or
        too large an entry is refused before its body is sent; a good one is taken."""
        path = f"/gradle-cache/deploy-test-expect-{time.monotonic_ns()}"
        wrong, wrong_sent = self.put_with_expect(path, 50_000_000, "ci:wrong-password")
        anonymous, anonymous_sent = self.put_with_expect(path, 50_000_000, None)
        password = f"ci:{self.stack.gradle_password}"
        too_big, too_big_sent = self.put_with_expect(path, 150_000_000, password)
        good, good_sent = self.put_with_expect(path, 1000, password)
        if not wrong.startswith(b"HTTP/1.1 401") or wrong_sent:
            raise AssertionError(f"wrong password: {wrong!r}, body sent: {wrong_sent}")
        if not anonymous.startswith(b"HTTP/1.1 401") or anonymous_sent:
            raise AssertionError(f"anonymous: {anonymous!r}, body sent: {anonymous_sent}")
        if not too_big.startswith(b"HTTP/1.1 413") or too_big_sent:
            raise AssertionError(f"150 MB: {too_big!r}, body sent: {too_big_sent}")
        if not good.startswith(b"HTTP/1.1 201") or not good_sent:
            raise AssertionError(f"ci's 1 KB PUT: {good!r}, body sent: {good_sent}")
        return "wrong password 401 and anonymous 401 before the body; 150 MB 413 before it; ci 100 then 201"

    def lb_cache_key(self) -> str:
        """(j) The LB caches a file once, whatever the Host and the query string."""
        stack = self.stack
        wheel = stack.packages["dt-gamma"]
        url = file_url(stack.lb, wheel)
        self.get(f"{stack.lb}/pypi/simple/dt-gamma/").raise_for_status()
        self.get(url).raise_for_status()  # the miss: stored by the replica, then the LB
        statuses = []
        for i in range(12):
            for query in ("", f"?v={i}"):
                response = self.get(url + query, headers={"Host": f"mirror{i}.example"})
                if response.content != wheel.read_bytes():
                    raise AssertionError("the LB answered other bytes than the wheel")
                statuses.append(response.headers.get("x-cache-status", "none"))
        if set(statuses[1:]) != {"HIT"}:
            raise AssertionError(f"X-Cache-Status under 12 hosts x 2 queries: {statuses}")
        return f"{len(statuses)} GETs under 12 Host names and query strings: {statuses.count('HIT')} HITs"

    def object_storage(self) -> str:
        """(s) On the S3 variant: every replica has a folder of its own, the blobs are
        objects in the bucket, and a replica that never fetched a file serves it."""
        stack = self.stack
        sources = {}
        for service in REPLICAS:
            mounts = stack.inspect(service)["Mounts"]
            [local] = [m for m in mounts if m["Destination"] == "/srv/proxy"]
            sources[service] = local.get("Name") or local["Source"]
        if len(set(sources.values())) != len(REPLICAS):
            raise AssertionError(f"replicas share /srv/proxy: {sources}")
        import hashlib

        keys = stack.bucket_keys()
        names = {key.rsplit("/", 1)[-1] for key in keys}
        for name in ("dt-alpha", "dt-beta"):
            digest = hashlib.sha256(stack.packages[name].read_bytes()).hexdigest()
            if digest not in names:
                raise AssertionError(f"{name}'s blob is not in the bucket: {sorted(keys)[:5]}")
        # Each replica directly (not the LB): the ones without a local copy GET it.
        wheel = stack.packages["dt-beta"]
        served = [
            self.get(file_url(stack.lb, wheel), headers=PAST_LB_CACHE).content == wheel.read_bytes()
            for _ in range(9)
        ]
        if not all(served):
            raise AssertionError(f"cached wheel through the LB: {served}")
        return (
            f"{len(REPLICAS)} local volumes ({', '.join(sorted(sources.values()))}); "
            f"{len(keys)} objects in the bucket; 9/9 cached wheels served"
        )

    def lb_cache(self) -> str:
        """(g) The LB caches immutable files (when the proxy marks them so)."""
        stack = self.stack
        wheel = stack.packages["dt-big"]
        self.get(f"{stack.proxy1}/pypi/simple/dt-big/").raise_for_status()
        for _ in range(2):  # a miss, then a hit from the proxy's store
            direct = self.get(file_url(stack.proxy1, wheel))
            direct.raise_for_status()
        cache_control = direct.headers.get("cache-control", "")
        error = self.get(f"{stack.lb}/maven/org/example/demo/1.0/demo-1.0.jar")
        for response in (error, error):  # the 503 route: never cached by the LB
            if response.headers.get("x-cache-status") == "HIT":
                raise AssertionError("the LB served an error answer from its cache")
        if "immutable" not in cache_control:
            raise Skip(f"the proxy sends no immutable Cache-Control yet ({cache_control!r})")
        statuses = []
        for _ in range(3):
            response = self.get(file_url(stack.lb, wheel))
            if response.content != wheel.read_bytes():
                raise AssertionError("the LB answered other bytes than the wheel")
            statuses.append(response.headers.get("x-cache-status", "none"))
        if statuses[-1] != "HIT":
            raise AssertionError(f"X-Cache-Status of 3 GETs: {statuses}")
        authorized = self.get(file_url(stack.lb, wheel), headers={"Authorization": "Basic eDp5"})
        if authorized.headers.get("x-cache-status") == "HIT":
            raise AssertionError("a request with Authorization was answered from the LB cache")
        return f"Cache-Control {cache_control!r}; X-Cache-Status of 3 GETs: {statuses}"


def run_variant(
    stack: Stack, args: argparse.Namespace, restart_daemon: bool, object_storage: bool
) -> Checks:
    checks = Checks(stack)
    variant = "the S3 variant (docker-compose.s3.yml)" if object_storage else "the stack"
    log(
        f"deploy test: {variant}: compose project {stack.project}, LB {stack.lb}, "
        f"Prometheus {stack.prometheus}"
    )
    try:
        started = time.monotonic()
        stack.up()
        log(
            f"stack up (db healthy -> 3 replicas ready -> lb, prometheus) in {time.monotonic() - started:.1f}s"
        )
        wait_for("the LB answering", checks.lb_serves_index, 60)
        checks.check("(a) migrations applied once", checks.migrations_once)
        checks.check("(b) pip through the LB, 1 upstream GET per file", checks.pip_through_lb)
        if object_storage:
            checks.check("(s) blobs in the bucket, a folder per replica", checks.object_storage)
            checks.check(
                "(h) the build cache takes writes from its user only", checks.build_cache_writes
            )
            checks.check("(d) a replica stopped: the LB keeps serving", checks.replica_stopped)
        else:
            checks.check("(e) a 503 route does not take the fleet down", checks.bad_route)
            checks.check("(g) the LB caches immutable files", checks.lb_cache)
            checks.check(
                "(h) the build cache takes writes from its user only", checks.build_cache_writes
            )
            checks.check(
                "(i) uploads are decided before their body", checks.uploads_decided_before_the_body
            )
            checks.check("(j) the LB caches a file once by its path", checks.lb_cache_key)
            checks.check("(c) Prometheus sees every replica", checks.prometheus_targets)
            checks.check("(d) a replica stopped: the LB keeps serving", checks.replica_stopped)
            checks.check(
                "(f) the whole stack restarted comes back alone",
                lambda: checks.stack_restarts(restart_daemon),
            )
    except Exception as exc:
        checks.failed.append(f"stack{' (s3)' if object_storage else ''}")
        log(f"FAIL the stack: {type(exc).__name__}: {exc}")
    finally:
        services = ("lb", *REPLICAS, *(("s3",) if object_storage else ()))
        if checks.failed or os.environ.get("DEPLOY_TEST_LOGS"):
            for service in services:
                with contextlib.suppress(Exception):
                    tail = "\n".join(stack.logs(service).splitlines()[-15:])
                    log(f"--- last log lines of {service} ---\n{tail}")
        if args.keep:
            log(
                f"kept: project {stack.project} (tear down: docker compose -p {stack.project} down -v)"
            )
        else:
            started = time.monotonic()
            stack.down()
            log(f"torn down in {time.monotonic() - started:.1f}s")
    if object_storage:
        checks.failed = [f"{name} (s3)" for name in checks.failed]
    return checks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keep", action="store_true", help="leave the stack running")
    parser.add_argument("--restart-daemon", choices=["auto", "yes", "no"], default="auto")
    parser.add_argument("--image", help="test this proxy image instead of building one")
    parser.add_argument("--variant", choices=["both", "folder", "s3"], default="both")
    args = parser.parse_args()
    total = time.monotonic()

    log("deploy test: Docker engine and base images")
    started_engine = ensure_engine()
    restart_daemon = args.restart_daemon == "yes" or (
        args.restart_daemon == "auto" and standins_engine_pid() is not None
    )
    ensure_images(base_images())
    if args.image:
        log(f"deploy test: image {args.image} (not built)")
    else:
        log(f"deploy test: image built in {build_image():.1f}s")

    image = args.image or IMAGE
    results = []
    if args.variant in ("both", "folder"):
        results.append(run_variant(Stack(image=image), args, restart_daemon, object_storage=False))
    if args.variant in ("both", "s3"):
        log(f"deploy test: S3 server image built in {build_s3_image():.1f}s")
        stack = Stack(image=image, object_storage=True)
        results.append(run_variant(stack, args, restart_daemon, object_storage=True))
    if started_engine and not args.keep:
        stop_standins_engine()  # this run started it: leave the machine as it was
    checks = Checks.merged(results)
    log(
        f"deploy test: {time.monotonic() - total:.0f}s; failed: {', '.join(checks.failed) or 'none'}"
    )
    log(
        f"deploy-test: {checks.passed} passed, {len(checks.failed)} failed, {checks.skipped} skipped"
    )
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
