"""Helpers for the benchmarks: processes on free ports, wrk, RSS sampling."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_http(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not come up")


class Process:
    def __init__(
        self,
        argv: list[str],
        log: Path,
        env: dict[str, str] | None = None,
        cwd: Path = ROOT,
    ) -> None:
        self.log = log
        with log.open("ab") as out:
            self.popen = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                cwd=cwd,
            )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.popen.kill()


def start_upstream(
    root: Path, workdir: Path, rate_mbps: float | None = None
) -> tuple[Process, str]:
    port = free_port()
    argv = [
        PYTHON,
        str(ROOT / "bench/upstream_server.py"),
        "--root",
        str(root),
        "--port",
        str(port),
    ]
    if rate_mbps:
        argv += ["--rate-mbps", str(rate_mbps)]
    process = Process(argv, workdir / f"upstream-{port}.log")
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/_counts")
    return process, url


def upstream_counts(url: str) -> dict[str, int]:
    import ast

    counts: dict[str, int] = ast.literal_eval(httpx.get(url + "/_counts").text)
    return counts


def start_proxy(
    config: Path,
    workdir: Path,
    name: str,
    workers: int = 1,
    env: dict[str, str] | None = None,
) -> tuple[Process, str]:
    """A ``proxy serve``; REPLICA_NAME is its name (a config may give each replica a
    folder of its own with ``${REPLICA_NAME}``)."""
    port = free_port()
    argv = [
        PYTHON,
        "-m",
        "proxy",
        "serve",
        "--config",
        str(config),
        "--listen",
        f"127.0.0.1:{port}",
    ]
    if workers > 1:
        argv += ["--workers", str(workers)]
    process = Process(argv, workdir / f"{name}.log", {"REPLICA_NAME": name, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/readyz")
    return process, url


def workdir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"proxy-bench-{prefix}-"))


def warm_memory(size: int) -> None:
    """Touch ``size`` bytes of fresh memory and give it back. On a VM whose memory the
    host backs only when first touched (Firecracker here), the first write of a page
    costs a host fault: writing 1 GiB into page cache ran at 700 MB/s to 1.2 GB/s, and at
    4-9 GB/s into pages used just before. A server that has run a while reuses its page
    cache; a bench of misses can call this first to measure that rather than the VM
    (2-4 GiB did not do it here; 8 GiB did)."""
    import mmap

    with mmap.mmap(-1, size) as memory:
        for offset in range(0, size, mmap.PAGESIZE):
            memory[offset] = 1


def make_file(path: Path, size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as fh:
        remaining = size
        while remaining:
            n = min(remaining, 16 * 1024 * 1024)
            fh.write(os.urandom(n))
            remaining -= n
    return path


def wrk(
    url: str,
    connections: int,
    duration_s: int,
    threads: int = 2,
    headers: dict[str, str] | None = None,
) -> dict[str, float]:
    """Run wrk; requests/s, bytes/s and latency percentiles (ms)."""
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed: apt-get install wrk")
    header_args = [
        arg for name, value in (headers or {}).items() for arg in ("-H", f"{name}: {value}")
    ]
    out = subprocess.run(
        ["wrk", "--latency", f"-t{threads}", f"-c{connections}", f"-d{duration_s}s", *header_args, url],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    result = {
        "requests_s": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),  # type: ignore[union-attr]
        "bytes_s": _bytes(re.search(r"Transfer/sec:\s+([\d.]+\w+)", out).group(1)),  # type: ignore[union-attr]
    }
    for pct in ("50", "99"):
        match = re.search(rf"\s{pct}%\s+([\d.]+)(us|ms|s)", out)
        if match:
            value, unit = float(match.group(1)), match.group(2)
            result[f"p{pct}_ms"] = (
                value / 1000 if unit == "us" else value * 1000 if unit == "s" else value
            )
    if "Non-2xx" in out or "Socket errors" in out:
        result["errors"] = 1.0
    return result


def _bytes(text: str) -> float:
    match = re.match(r"([\d.]+)(\w+)", text)
    assert match
    value, unit = float(match.group(1)), match.group(2)
    return value * {"B": 1, "KB": 2**10, "MB": 2**20, "GB": 2**30}[unit]


def rss_kib(pid: int) -> tuple[int, int]:
    """(current RSS, peak RSS) of a process, in KiB."""
    fields = dict(
        line.split(":", 1)
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if ":" in line
    )
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(pct / 100 * (len(ordered) - 1))))
    return ordered[index]
