"""``proxy serve`` reloads ``[policy]`` on SIGHUP (proxy/http/server.py, app.py): the
supervisor passes it to every worker, each reads the file on its own; a rule added so
applies to a file already cached, and a file with errors keeps the policy in force and
logs each error with its key. Real processes, a real upstream."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import httpx

from tests.conftest import pypi_config, write_config
from tests.processes import ProxyProcess
from tests.upstream import FakeUpstream, ProjectFile

FILE = "/pypi/files/alpha/alpha-1.0.tar.gz"
DENY = """
[[policy.rules]]
match = "pkg:pypi/alpha"
action = "deny"
reason = "emergency: compromised, see INC-9"
"""
BROKEN = """
[policy]
mode = "sometimes"
[[policy.rules]]
match = "pkg:pypi/alpha"
action = "deny"
versions = "vers:pypi/>=1.0|<<2"
"""


def wait_for_count(proxy: ProxyProcess, needle: str, count: int, timeout_s: float = 30.0) -> str:
    """The log once ``needle`` is in it ``count`` times (one line per worker)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        log = proxy.log()
        if log.count(needle) >= count:
            return log
        time.sleep(0.05)
    raise AssertionError(f"{needle!r} not {count} times in the log:\n{proxy.log()}")


def test_sighup_reloads_the_policy_in_every_worker_and_keeps_it_on_errors(
    tmp_path: Path, upstream: FakeUpstream
) -> None:
    upstream.add_project("alpha", [ProjectFile("alpha-1.0.tar.gz", b"alpha-bytes")])
    config = tmp_path / "proxy.toml"
    write_config(tmp_path, pypi_config(tmp_path / "data", upstream.base_url))
    proxy = ProxyProcess(config, tmp_path, "reload", workers=2).start().wait_ready()
    try:
        with httpx.Client(base_url=proxy.url, timeout=30) as client:
            assert client.get("/pypi/simple/alpha/").status_code == 200
            assert client.get(FILE).content == b"alpha-bytes"
        fetched = upstream.count("/packages/alpha-1.0.tar.gz")

        # An emergency deny rule, no restart: the cached file is refused by every worker.
        write_config(tmp_path, pypi_config(tmp_path / "data", upstream.base_url, extra=DENY))
        proxy.signal(signal.SIGHUP)
        wait_for_count(proxy, "policy reloaded from", 2)
        for _ in range(6):  # a new connection each: both workers answer some
            refused = httpx.get(proxy.url + FILE, timeout=30)
            assert refused.status_code == 403, refused.text
            assert "emergency: compromised, see INC-9" in refused.text
        assert upstream.count("/packages/alpha-1.0.tar.gz") == fetched

        # A file with errors: each is logged with its key, the deny rule stays.
        write_config(tmp_path, pypi_config(tmp_path / "data", upstream.base_url, extra=BROKEN))
        proxy.signal(signal.SIGHUP)
        log = wait_for_count(proxy, "policy reload failed", 2)
        assert log.count("policy reload: policy.mode:") == 2
        assert log.count("policy reload: policy.rules[0].versions:") == 2
        for _ in range(6):
            assert httpx.get(proxy.url + FILE, timeout=30).status_code == 403
        assert proxy.metric("proxy_policy_reloads_total", outcome="ok") == 2
        assert proxy.metric("proxy_policy_reloads_total", outcome="failed") == 2

        # The exemption lifted again: served from the cache.
        write_config(tmp_path, pypi_config(tmp_path / "data", upstream.base_url))
        proxy.signal(signal.SIGHUP)
        wait_for_count(proxy, "policy reloaded from", 4)
        assert httpx.get(proxy.url + FILE, timeout=30).content == b"alpha-bytes"
        assert upstream.count("/packages/alpha-1.0.tar.gz") == fetched
        # Every worker is still the one that started: none was ended by a signal.
        assert "exited with status" not in proxy.log()
    finally:
        proxy.stop()


def worker_pids(proxy: ProxyProcess) -> list[int]:
    """The workers that said they are ready (the supervisor has other children)."""
    return [int(pid) for pid in re.findall(r" \[(\d+)\] proxy ready", proxy.log())]


def test_a_worker_restarted_after_a_reload_serves_the_reloaded_policy(
    tmp_path: Path, upstream: FakeUpstream
) -> None:
    """A restarted worker starts from the settings the server started with: it must
    read the file again, or it would serve what an emergency rule blocks."""
    upstream.add_project("alpha", [ProjectFile("alpha-1.0.tar.gz", b"alpha-bytes")])
    config = write_config(tmp_path, pypi_config(tmp_path / "data", upstream.base_url))
    proxy = ProxyProcess(config, tmp_path, "restart", workers=2).start().wait_ready()
    try:
        with httpx.Client(base_url=proxy.url, timeout=30) as client:
            assert client.get("/pypi/simple/alpha/").status_code == 200
            assert client.get(FILE).status_code == 200
        write_config(tmp_path, pypi_config(tmp_path / "data", upstream.base_url, extra=DENY))
        proxy.signal(signal.SIGHUP)
        wait_for_count(proxy, "policy reloaded from", 2)
        victim = worker_pids(proxy)[0]
        os.kill(victim, signal.SIGKILL)
        wait_for_count(proxy, f"worker {victim} exited with status", 1)
        # The new worker reads the file once it can handle the signal.
        wait_for_count(proxy, "policy reloaded from", 3)
        for _ in range(8):  # a new connection each: both workers answer some
            assert httpx.get(proxy.url + FILE, timeout=30).status_code == 403
    finally:
        proxy.stop()
