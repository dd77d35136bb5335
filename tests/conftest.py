"""Shared fixtures: fake upstreams and proxies served over real HTTP on port 0."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from proxy.app import create_app
from proxy.config import Settings, load
from tests.upstream import FakeUpstream, ServerThread, start_upstream


def write_config(tmp_path: Path, body: str, name: str = "proxy.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def pypi_config(storage: Path, upstream_url: str, extra: str = "", repo_extra: str = "") -> str:
    return f"""
    [storage]
    path = "{storage}"
    [upstream]
    connect_timeout = "2s"
    read_timeout = "5s"
    retries = 1
    [leases]
    ttl = "3s"
    poll_interval = "100ms"
    {extra}
    [[repositories]]
    name = "pypi"
    format = "pypi"
    upstream = "{upstream_url}/simple/"
    metadata_ttl = "10m"
    negative_ttl = "1m"
    {repo_extra}
    """


@pytest.fixture
def upstream() -> Iterator[FakeUpstream]:
    fake = FakeUpstream()
    server = start_upstream(fake)
    yield fake
    fake.released.set()
    server.stop()


ProxyFactory = Callable[[Settings], ServerThread]


@pytest.fixture
def start_proxy() -> Iterator[ProxyFactory]:
    """Start in-process proxies (uvicorn in a thread); all are stopped at teardown."""
    started: list[ServerThread] = []

    def start(settings: Settings) -> ServerThread:
        server = ServerThread(create_app(settings), loop="asyncio", http="httptools").start()
        started.append(server)
        return server

    yield start
    for server in reversed(started):
        server.stop()


@pytest.fixture
def pypi_proxy(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory
) -> Iterator[ServerThread]:
    config = write_config(tmp_path, pypi_config(tmp_path / "data", upstream.base_url))
    yield start_proxy(load(config, {}))


@pytest.fixture
def clean_env() -> dict[str, str]:
    """The environment for subprocesses, without this machine's pip/uv settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_", "PROXY_"))}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env
