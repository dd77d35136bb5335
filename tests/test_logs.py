"""What `proxy serve` logs: the start line, one access line per request (text or JSON),
one line per upstream fetch with credentials stripped, and nothing from httpx."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import pypi_config, write_config
from tests.processes import ProxyProcess
from tests.upstream import FakeUpstream, ProjectFile


def wait_for(proxy: ProxyProcess, needle: str, timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        log = proxy.log()
        if needle in log:
            return log
        time.sleep(0.05)
    raise AssertionError(f"{needle!r} not in the log:\n{proxy.log()}")


def test_start_line_access_log_and_one_line_per_fetch(
    tmp_path: Path, upstream: FakeUpstream
) -> None:
    upstream.add_project("alpha", [ProjectFile("alpha-1.0.tar.gz", b"alpha-bytes")])
    # Credentials in the configured upstream must never reach the log.
    with_credentials = upstream.base_url.replace("http://", "http://ops:s3cret@")
    config = write_config(tmp_path, pypi_config(tmp_path / "data", with_credentials))
    proxy = ProxyProcess(config, tmp_path, "logs").start().wait_ready()
    try:
        assert httpx.get(proxy.url + "/pypi/simple/alpha/").status_code == 200
        assert httpx.get(proxy.url + "/pypi/simple/alpha/").status_code == 200
        assert httpx.get(proxy.url + "/pypi/simple/nothing-here/").status_code == 404
        assert httpx.get(proxy.url + "/pypi/simple/alpha/?token=abc").status_code == 200
        log = wait_for(proxy, "token=***")
    finally:
        proxy.stop()
    assert f"listening on http://127.0.0.1:{proxy.port} with 1 worker (access log on)" in log
    access = [line for line in log.splitlines() if " proxy.access " in line]
    assert any(
        '"GET /pypi/simple/alpha/" 200' in line and line.endswith(" miss") for line in access
    )
    assert any('"GET /pypi/simple/alpha/" 200' in line and line.endswith(" hit") for line in access)
    assert any('"GET /pypi/simple/nothing-here/" 404' in line for line in access)
    assert any("/readyz" in line for line in access)  # every request, health checks too
    [hit] = [line for line in access if line.endswith(" hit")][:1]
    size = int(hit.split('" 200 ')[1].split()[0])
    assert size > 0  # bytes sent
    fetches = [
        line for line in log.splitlines() if "fetch repository=pypi key=simple/alpha/" in line
    ]
    # The URL as sent: the configured credentials travel as a header, never in a URL.
    assert len(fetches) == 1 and f"upstream={upstream.base_url}/simple/alpha/" in fetches[0]
    assert "s3cret" not in log
    assert "HTTP Request:" not in log  # httpx's own line
    assert "token=abc" not in log


def test_json_log_format_and_access_log_off(tmp_path: Path, upstream: FakeUpstream) -> None:
    upstream.add_project("alpha", [ProjectFile("alpha-1.0.tar.gz", b"alpha-bytes")])
    config = write_config(
        tmp_path,
        pypi_config(tmp_path / "data", upstream.base_url, extra='[server]\nlog_format = "json"'),
    )
    proxy = ProxyProcess(config, tmp_path, "json").start().wait_ready()
    try:
        httpx.get(proxy.url + "/pypi/simple/alpha/")
        wait_for(proxy, "/pypi/simple/alpha/")
    finally:
        proxy.stop()
    lines = [json.loads(line) for line in proxy.log().splitlines() if line.startswith("{")]
    assert lines, proxy.log()
    assert {"time", "level", "logger", "pid", "message"} <= set(lines[0])
    [access] = [line for line in lines if line.get("path") == "/pypi/simple/alpha/"]
    assert access["logger"] == "proxy.access"
    assert access["method"] == "GET" and access["status"] == 200 and access["cache"] == "miss"
    assert access["bytes"] > 0 and access["duration_ms"] >= 0

    quiet = write_config(
        tmp_path,
        pypi_config(tmp_path / "data", upstream.base_url, extra="[server]\naccess_log = false"),
        "quiet.toml",
    )
    proxy = ProxyProcess(quiet, tmp_path, "quiet").start().wait_ready()
    try:
        httpx.get(proxy.url + "/pypi/simple/alpha/")
    finally:
        proxy.stop()
    assert "(access log off)" in proxy.log()
    assert " proxy.access " not in proxy.log()


def test_a_clients_text_cannot_forge_log_lines(tmp_path: Path, upstream: FakeUpstream) -> None:
    """A failed admin login logs the user name the client sent; a newline in it started
    a line of the client's own choosing ("INFO proxy.admin purged package ..."). Text
    from outside is one line, its control characters escaped."""
    admin = '[admin.users.ops]\npassword = "right"\n'
    config = write_config(tmp_path, pypi_config(tmp_path / "data", upstream.base_url, admin))
    proxy = ProxyProcess(config, tmp_path, "forged").start().wait_ready()
    forged = "evil\nINFO proxy.admin [1] purged package pypi/requests (by ops)\r\x1b[2K"
    try:
        refused = httpx.get(proxy.url + "/api/v1/stats", auth=(forged, "wrong"))
        assert refused.status_code == 401
        log = wait_for(proxy, "admin login failed")
    finally:
        proxy.stop()
    [failed] = [line for line in log.splitlines() if "admin login failed" in line]
    assert "user=evil\\nINFO proxy.admin [1] purged package" in failed
    assert "\\r\\x1b[2K" in failed
    assert not any(line.startswith("INFO proxy.admin") for line in log.splitlines())


def test_access_lines_are_written_in_batches_and_before_any_later_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Access lines are formatted as the handler would and written in batches (at most
    ACCESS_FLUSH_S late, under a pipe's atomic size); any other line is written after
    the access lines that came before it."""
    import io
    import logging
    import sys

    from proxy.runtime import logs

    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        logs.configure_logging("info", "text", access_log=True)
        lines = logs.ACCESS
        assert lines is not None

        async def scenario() -> None:
            lines.write("10.0.0.1", "GET", "/pypi/a", 200, 11, 0.25, "hit")
            assert stream.getvalue() == ""  # waiting for more
            await asyncio.sleep(logs.ACCESS_FLUSH_S * 3)
            assert stream.getvalue().count("\n") == 1
            lines.write("10.0.0.1", "GET", "/pypi/b", 200, 11, 0.25, "hit")
            logging.getLogger("proxy.fetch").warning("after b")
            for i in range(200):  # over a batch: written without waiting
                lines.write("10.0.0.1", "GET", f"/pypi/{i}", 200, 11, 0.25, "hit")

        asyncio.run(scenario())
        text = stream.getvalue().splitlines()
        assert text[0].endswith(
            f' INFO proxy.access [{os.getpid()}] 10.0.0.1 "GET /pypi/a" 200 11 0.2ms hit'
        )
        assert '"GET /pypi/b"' in text[1] and text[2].endswith("after b")
        assert len(text) >= 3 + 150
        stamp = text[0].split(" INFO ")[0]
        assert time.strptime(stamp.split(",")[0], "%Y-%m-%d %H:%M:%S")
        logs.configure_logging("info", "json", access_log=True)
        json_lines = logs.ACCESS
        assert json_lines is not None
        json_lines.write("10.0.0.1", "HEAD", "/pypi/c", 304, 0, 1.5, "hit")
        json_lines.flush()
        record = json.loads(stream.getvalue().splitlines()[-1])
        assert record["logger"] == "proxy.access" and record["level"] == "info"
        assert (record["method"], record["path"], record["status"], record["cache"]) == (
            "HEAD",
            "/pypi/c",
            304,
            "hit",
        )
        assert record["message"] == '10.0.0.1 "HEAD /pypi/c" 304 0 1.5ms hit'
    finally:
        logs.ACCESS = None
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)
