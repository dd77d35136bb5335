"""Real ``proxy serve`` processes for multi-replica tests: start, wait, signal, read logs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.pg import free_port

READY_TIMEOUT_S = 60.0
PORT_RETRIES = 3


class ProxyProcess:
    def __init__(
        self,
        config: Path | None,
        log_dir: Path,
        name: str,
        env: dict[str, str] | None = None,
        workers: int = 1,
        checkout: Path | None = None,
        wrapper: tuple[str, ...] = (),
    ) -> None:
        """``config`` None: the embedded defaults. The runner's own ``PROXY_*`` variables
        are not passed on: a test's proxy gets only the settings the test gives it.
        ``checkout``: run the proxy of another checkout (its ``.venv``), e.g. the commit
        a benchmark compares with."""
        self.config = config
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("PROXY_")}
        # REPLICA_NAME: one config gives each replica a folder of its own with it
        # (local_cache = ".../${REPLICA_NAME}" on object storage).
        self.env = {**inherited, "REPLICA_NAME": name, **(env or {})}
        self.workers = workers
        self.checkout = checkout
        self.wrapper = wrapper  # a command the proxy runs under (e.g. prlimit ...)
        self.process: subprocess.Popen[bytes] | None = None
        self._log_start = 0

    def start(self) -> ProxyProcess:
        self._log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        python = (
            sys.executable if self.checkout is None else str(self.checkout / ".venv/bin/python")
        )
        argv = [*self.wrapper, python, "-m", "proxy", "serve"]
        argv += ["--listen", f"127.0.0.1:{self.port}"]
        if self.config is not None:
            argv += ["--config", str(self.config)]
        if self.workers != 1:
            argv += ["--workers", str(self.workers)]
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.checkout
        )
        log.close()
        return self

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> ProxyProcess:
        deadline = time.monotonic() + timeout_s
        port_retries = PORT_RETRIES
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                if port_retries and "Address already in use" in self.log()[self._log_start :]:
                    # free_port's port was taken before we bound it (by an outgoing
                    # connection's ephemeral port, say): the test is not at fault.
                    port_retries -= 1
                    self.port = free_port()
                    self.url = f"http://127.0.0.1:{self.port}"
                    self.start()
                    continue
                raise RuntimeError(
                    f"{self.name} exited with {self.process.returncode}:\n{self.log()}"
                )
            try:
                if httpx.get(self.url + "/readyz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} not ready within {timeout_s}s:\n{self.log()}")

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def signal(self, sig: signal.Signals) -> None:
        assert self.process is not None
        self.process.send_signal(sig)

    def wait(self, timeout_s: float = 30.0) -> int:
        assert self.process is not None
        return self.process.wait(timeout=timeout_s)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def rss_mib(self) -> float:
        """The process's resident memory now, in MiB."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample from /metrics (0.0 if absent)."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return metric_value(text, name, **labels)


def start_replicas(
    started: list[ProxyProcess],
    config: Path,
    log_dir: Path,
    count: int,
    workers: int = 1,
    env: dict[str, str] | None = None,
    checkout: Path | None = None,
) -> list[ProxyProcess]:
    """Start ``count`` replicas on ``config`` together and wait until each is ready.
    They join ``started`` first, so the caller stops them even if one never gets ready.
    Names go on from the replica logs already in ``log_dir``: two fleets of one test
    never share a log."""
    first = len(list(log_dir.glob("replica-*.log")))
    new = [
        ProxyProcess(
            config, log_dir, f"replica-{first + i}", env=env, workers=workers, checkout=checkout
        )
        for i in range(count)
    ]
    started += new
    for replica in new:
        replica.start()
    for replica in new:
        replica.wait_ready()
    return new


def child_pids(pid: int) -> list[int]:
    """The processes ``pid``'s threads started that are still running (Linux)."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue  # the thread ended meanwhile
    return children


def metric_value(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        metric, _, label_text = series.partition("{")
        if metric != name:
            continue
        if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            total += float(value)
    return total
