"""Hits at the machine's speed (issue 20): the proxy beside nginx serving the same
files, in one interleaved run, each figure with its ratio to nginx.

    .venv/bin/python -m bench.hits [--duration 8] [--connections 32] [--rounds 3]
        [--before TREE] [--no-lb] [--no-cold] [--only small,page] [--huge]

Rows (targets), each measured once per round; the rounds interleave the rows, and the
best round of each figure is printed:
  nginx static    Debian's nginx serving the very files from disk (sendfile, buffered
                  access log): the limit, ratio 1.00
  bare uvicorn    bench/bare_asgi.py: uvicorn (httptools, uvloop) answering 11 KB from
                  memory and doing nothing else: the ceiling of the proxy's stack
                  (1 process; "bare -w2": 2 workers)
  proxy           `proxy serve`, 1 process, access log on (as shipped)
  proxy -w2       `proxy serve --workers 2`
  LB              deploy/nginx.conf (nginx's cache as shipped) in front of `proxy -w2`
  before ...      the proxy rows again from another checkout with its own .venv
                  (--before TREE): a side-by-side before/after
Columns (figures):
  small           a cached 11 KB wheel, wrk with --connections: req/s and p99
  page            its project page, as pip and uv ask for it (JSON): req/s and p99
  85 MB           a cached 85 MB file, wrk with 8 connections: MB/s
  cold            20 clients at once on an 85 MB file nobody has asked for yet: the
                  slowest client's seconds (nginx static: the file dropped from the page
                  cache first; the proxies: a miss from bench/upstream_server.py)
The machine is shared by everything (wrk included): the figures compare, they do not
size. Needs wrk and curl (apt-get install wrk curl), and nginx for its rows.
``--huge`` adds the old miss-path memory check: 20 clients on one uncached 1 GiB file
through `proxy`, its RSS sampled. ``BENCH_PROXY_ARGS`` adds arguments to every
`proxy serve` (``--no-access-log``: the access log's cost).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.common import (
    PYTHON,
    ROOT,
    Process,
    free_port,
    make_file,
    rss_kib,
    start_upstream,
    wait_http,
    workdir,
    wrk,
)
from tests.nginx_lb import NGINX, running_balancer

PROJECT = "small"
SMALL = "small-1.0-py3-none-any.whl"
LARGE = "large-1.0.tar.gz"
JSON_V1 = "application/vnd.pypi.simple.v1+json"
SMALL_BYTES = 11 * 1024
LARGE_BYTES = 85 * 10**6
COLD_CLIENTS = 20
LARGE_CONNECTIONS = 8
WARM_UP = "warm-up-1.0.tar.gz"
SIBLINGS = 30  # other files the project page lists (a page of a few KB, like a real one)


@dataclass
class Target:
    """One row: where it answers, and how to reach each figure's file there."""

    name: str
    url: str
    small: str
    page: str
    large: str
    cold: Callable[[int], str] | None  # the URL of a never-asked file, per round
    figures: dict[str, list[float]] = field(default_factory=dict)

    def note(self, figure: str, value: float) -> None:
        self.figures.setdefault(figure, []).append(value)

    def best(self, figure: str) -> float | None:
        values = self.figures.get(figure)
        if not values:
            return None
        # Throughput: the highest; latency and time: the lowest.
        return min(values) if figure.endswith(("p99", "cold")) else max(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=int, default=8)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before", type=Path, help="another checkout (with .venv) to compare")
    parser.add_argument("--no-lb", action="store_true", help="no LB row")
    parser.add_argument("--no-cold", action="store_true", help="no cold-miss column")
    parser.add_argument("--only", help="comma-separated rows to run (by name prefix)")
    parser.add_argument("--huge", action="store_true", help="also the 1 GiB miss-path RSS")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    args = parser.parse_args()
    for tool in ("wrk", "curl"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is not installed: apt-get install {tool}")

    work = workdir("hits")
    processes: list[Process] = []
    try:
        targets = setup(args, work, processes)
        if args.only:
            wanted = args.only.split(",")
            targets = [t for t in targets if any(t.name.startswith(w) for w in wanted)]
        if not args.no_cold:
            # The first large write into a VM's fresh page cache is slow (bench/common.py,
            # warm_memory): one cold miss nobody measures goes first.
            cold(f"{next(t for t in targets if t.cold).url}/pypi/files/cold/{WARM_UP}")
        for round_no in range(args.rounds):
            print(f"round {round_no + 1} of {args.rounds}", file=sys.stderr)
            for target in targets:
                measure(target, args, round_no)
        report(targets, args)
        if args.huge:
            huge(targets, processes, work)
    finally:
        for process in reversed(processes):
            process.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def setup(args: argparse.Namespace, work: Path, processes: list[Process]) -> list[Target]:
    root = work / "upstream"
    make_file(root / PROJECT / SMALL, SMALL_BYTES)
    for i in range(SIBLINGS):
        make_file(root / PROJECT / f"small-0.{i}-py3-none-any.whl", 64)
    large = make_file(root / "large" / LARGE, LARGE_BYTES)
    cold_rows = 6 if args.before else 3  # proxy, -w2 and LB rows, per checkout
    if not args.no_cold:
        for round_no in range(args.rounds):
            for row in range(cold_rows):
                path = root / "cold" / cold_name(round_no, row)
                path.parent.mkdir(parents=True, exist_ok=True)
                os.link(large, path)  # the same bytes, a name nobody has asked for
    if not args.no_cold:
        (root / "cold").mkdir(parents=True, exist_ok=True)
        os.link(large, root / "cold" / WARM_UP)
    upstream, upstream_url = start_upstream(root, work)
    processes.append(upstream)

    targets = []
    static = start_nginx_static(work, root)
    if static is not None:
        processes.append(static[0])
    trees = [("", ROOT)] + ([("before ", args.before.resolve())] if args.before else [])
    row = 0
    for label, tree in trees:
        for workers in (1, 2):
            name = f"{label}proxy" + (" -w2" if workers == 2 else "")
            process, url = start_proxy(tree, work, name.replace(" ", "_"), upstream_url, workers)
            processes.append(process)
            targets.append(proxy_target(name, url, row))
            row += 1
    page_body = warm(targets)
    if static is not None:
        (work / "static" / "pypi" / "simple" / PROJECT).mkdir(parents=True)
        (work / "static" / "pypi" / "simple" / PROJECT / "index.json").write_bytes(page_body)
        static_url = static[1]
        targets.insert(
            0,
            Target(
                "nginx static",
                static_url,
                f"{static_url}/pypi/files/{PROJECT}/{SMALL}",
                f"{static_url}/pypi/simple/{PROJECT}/",
                f"{static_url}/pypi/files/large/{LARGE}",
                lambda round_no: static_cold(work, root, round_no, static_url),
            ),
        )
    first = 1 if static is not None else 0
    for workers in (1, 2):
        process, url = start_bare(work, workers)
        processes.append(process)
        name = "bare uvicorn" + (" -w2" if workers == 2 else "")
        targets.insert(first + workers - 1, Target(name, url, url + "/", "", "", None))
    if not args.no_lb and Path(NGINX).exists():
        for label, tree in trees:
            w2 = next(t for t in targets if t.name == f"{label}proxy -w2")
            lb = LoadBalancer(work / f"{label}lb".replace(" ", "-"), port_of(w2), tree)
            processes.append(lb)  # type: ignore[arg-type]
            lb_target = proxy_target(f"{label}LB", lb.start(), row)
            row += 1
            warm([lb_target])
            targets.insert(targets.index(w2) + 1, lb_target)
    if args.no_cold:
        for target in targets:
            target.cold = None
    return targets


def port_of(target: Target) -> int:
    return int(target.url.rsplit(":", 1)[1])


def cold_name(round_no: int, row: int) -> str:
    return f"cold-{round_no}-{row}.tar.gz"


def proxy_target(name: str, url: str, row: int) -> Target:
    return Target(
        name,
        url,
        f"{url}/pypi/files/{PROJECT}/{SMALL}",
        f"{url}/pypi/simple/{PROJECT}/",
        f"{url}/pypi/files/large/{LARGE}",
        lambda round_no: f"{url}/pypi/files/cold/{cold_name(round_no, row)}",
    )


def start_proxy(
    tree: Path, work: Path, name: str, upstream_url: str, workers: int
) -> tuple[Process, str]:
    config = work / f"{name}.toml"
    config.write_text(f"""
[storage]
path = "{work / name}"
[[repositories]]
name = "pypi"
format = "pypi"
upstream = "{upstream_url}/simple/"
""")
    port = free_port()
    argv = [str(tree / ".venv/bin/python"), "-m", "proxy", "serve", "--config", str(config)]
    argv += os.environ.get("BENCH_PROXY_ARGS", "").split()
    argv += ["--listen", f"127.0.0.1:{port}"]
    if workers > 1:
        argv += ["--workers", str(workers)]
    process = Process(argv, work / f"{name}.log", cwd=tree)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/readyz")
    return process, url


def warm(targets: list[Target]) -> bytes:
    """Ask each target for its files until its hits are hits (pages: as JSON); the
    page's body."""
    page = b""
    with httpx.Client(timeout=120) as client:
        for target in targets:
            for _ in range(4):
                client.get(target.page, headers={"Accept": JSON_V1}).raise_for_status()
                for url in (target.small, target.large):
                    client.get(url).raise_for_status()
            page = client.get(target.page, headers={"Accept": JSON_V1}).content
    return page


def start_nginx_static(work: Path, root: Path) -> tuple[Process, str] | None:
    if not Path(NGINX).exists():
        return None
    folder = work / "nginx-static"
    folder.mkdir()
    files = work / "static" / "pypi" / "files"
    files.mkdir(parents=True)
    for project in (PROJECT, "large", "cold"):
        (files / project).symlink_to(root / project)
    port = free_port()
    user = "user root;\n" if os.geteuid() == 0 else ""
    (folder / "nginx.conf").write_text(f"""{user}pid {folder / "nginx.pid"};
error_log {folder / "error.log"};
worker_processes auto;
events {{ worker_connections 4096; }}
http {{
  access_log {folder / "access.log"} combined buffer=64k flush=1s;
  sendfile on;
  tcp_nopush on;
  open_file_cache max=1000 inactive=60s;
  server {{
    listen 127.0.0.1:{port};
    root {work / "static"};
    location /pypi/simple/ {{
      default_type {JSON_V1};
      index index.json;
    }}
    location /pypi/files/ {{
      default_type application/octet-stream;
    }}
  }}
}}
""")
    process = Process(
        [NGINX, "-p", str(folder), "-c", str(folder / "nginx.conf"), "-g", "daemon off;"],
        folder / "stdout.log",
    )
    url = f"http://127.0.0.1:{port}"
    wait_http(url + f"/pypi/files/{PROJECT}/{SMALL}")
    return process, url


def static_cold(work: Path, root: Path, round_no: int, url: str) -> str:
    """A file nginx reads from disk: the large file's bytes under a new name, dropped
    from the page cache (POSIX_FADV_DONTNEED: clean pages go)."""
    path = root / "cold" / f"static-{round_no}.tar.gz"
    if not path.exists():
        shutil.copyfile(root / "large" / LARGE, path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return f"{url}/pypi/files/cold/{path.name}"


def start_bare(work: Path, workers: int) -> tuple[Process, str]:
    port = free_port()
    argv = [PYTHON, "-m", "uvicorn", "bench.bare_asgi:app", "--loop", "uvloop"]
    argv += ["--http", "httptools", "--no-access-log", "--log-level", "warning"]
    argv += ["--port", str(port), "--workers", str(workers)]
    process = Process(argv, work / f"bare-{workers}.log")
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/")
    return process, url


class LoadBalancer:
    """A checkout's deploy/nginx.conf in front of one proxy (tests/nginx_lb.py), as a
    Process."""

    def __init__(self, folder: Path, replica_port: int, tree: Path = ROOT) -> None:
        self.folder = folder
        self.log = folder / "error.log"
        source = tree / "deploy" / "nginx.conf"
        self._context = running_balancer(folder, free_port(), replica_port, source)

    def start(self) -> str:
        return self._context.__enter__()

    def stop(self) -> None:
        self._context.__exit__(None, None, None)


def measure(target: Target, args: argparse.Namespace, round_no: int) -> None:
    small = wrk(target.small, args.connections, args.duration)
    target.note("small", small["requests_s"])
    target.note("small p99", small.get("p99_ms", 0.0))
    if target.page:
        page = wrk(target.page, args.connections, args.duration, headers={"Accept": JSON_V1})
        target.note("page", page["requests_s"])
        target.note("page p99", page.get("p99_ms", 0.0))
    if target.large:
        large = wrk(target.large, LARGE_CONNECTIONS, args.duration)
        target.note("85 MB", large["bytes_s"] / 1e6)
    if target.cold is not None:
        target.note("cold", cold(target.cold(round_no)))
    if small.get("errors"):
        print(f"  {target.name}: errors in wrk's run", file=sys.stderr)


def cold(url: str) -> float:
    """The slowest of COLD_CLIENTS curls started together on ``url``, in seconds."""
    curls = [
        subprocess.Popen(
            [
                "curl",
                "-sS",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code} %{size_download} %{time_total}",
                url,
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(COLD_CLIENTS)
    ]
    slowest = 0.0
    for curl in curls:
        out, _ = curl.communicate(timeout=300)
        status, size, seconds = out.split()
        if status != "200" or int(size) != LARGE_BYTES:
            raise SystemExit(f"{url}: a client got {status} with {size} bytes")
        slowest = max(slowest, float(seconds))
    return slowest


COLUMNS = [
    ("small", "small req/s", "{:,.0f}"),
    ("small p99", "p99 ms", "{:.2f}"),
    ("page", "page req/s", "{:,.0f}"),
    ("page p99", "p99 ms", "{:.2f}"),
    ("85 MB", "85 MB MB/s", "{:,.0f}"),
    ("cold", "cold s", "{:.2f}"),
]


def report(targets: list[Target], args: argparse.Namespace) -> None:
    limit = targets[0] if targets and targets[0].name == "nginx static" else None
    print()
    print(
        f"hits, best of {args.rounds} interleaved rounds, wrk -c{args.connections} "
        f"-d{args.duration}s (85 MB: -c{LARGE_CONNECTIONS}), cold: {COLD_CLIENTS} clients; "
        "(x): ratio to nginx static"
    )
    header = f"{'':<16}" + "".join(f"{title:>20}" for _, title, _ in COLUMNS)
    print(header)
    rows = {}
    for target in targets:
        cells = []
        for figure, _title, fmt in COLUMNS:
            value = target.best(figure)
            if value is None:
                cells.append(f"{'-':>20}")
                continue
            text = fmt.format(value)
            base = limit.best(figure) if limit is not None else None
            if base and "p99" not in figure:
                ratio = base / value if figure == "cold" else value / base
                text += f" ({ratio:.2f})"
            cells.append(f"{text:>20}")
        print(f"{target.name:<16}" + "".join(cells))
        rows[target.name] = {figure: target.best(figure) for figure, _, _ in COLUMNS}
    print(json.dumps(rows))


def huge(targets: list[Target], processes: list[Process], work: Path) -> None:
    """20 clients on one uncached 1 GiB file through the 1-process proxy: how long to
    the last byte, and the proxy's RSS (sampled every 50 ms)."""
    make_file(work / "upstream" / "huge" / "huge-1.0.tar.gz", 2**30)
    target = next(t for t in targets if t.name == "proxy")
    process = next(p for p in processes if p.log.name == "proxy.log")
    url = f"{target.url}/pypi/files/huge/huge-1.0.tar.gz"
    httpx.get(f"{target.url}/pypi/simple/huge/", timeout=60).raise_for_status()
    before, _ = rss_kib(process.pid)
    started = time.monotonic()
    curls = [
        subprocess.Popen(
            ["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code} %{size_download}", url],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(COLD_CLIENTS)
    ]
    peak = before
    while any(c.poll() is None for c in curls):
        peak = max(peak, rss_kib(process.pid)[0])
        time.sleep(0.05)
    elapsed = time.monotonic() - started
    results = sorted({c.communicate()[0] for c in curls})
    print(f"1 GiB miss, {COLD_CLIENTS} clients: {elapsed:.1f} s to the last byte, {results}")
    print(f"  proxy RSS: {before / 1024:.0f} MiB before, {peak / 1024:.0f} MiB peak")


if __name__ == "__main__":
    main()
