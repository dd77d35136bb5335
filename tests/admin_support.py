"""Shared set-up of the console and admin API tests: a proxy with an admin user, over
real HTTP, in front of a fake upstream."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import pypi_config, write_config

PASSWORD = "correct horse battery staple"
TOKEN = "tok-0123456789abcdef"
AUTH = ("ops", PASSWORD)


def admin_config(
    tmp_path: Path, upstream_url: str, admin: str | None = None, extra: str = ""
) -> Path:
    admin = (
        admin
        if admin is not None
        else f"""
    [admin]
    [admin.users.ops]
    password = "{PASSWORD}"
    token = "{TOKEN}"
    [admin.users.viewer]
    password = "viewer-password"
    """
    )
    body = (
        pypi_config(tmp_path / "data", upstream_url, extra=admin + extra)
        + f"""
    [[repositories]]
    name = "maven"
    format = "maven"
    upstream = "{upstream_url}/m2/"
    [[repositories]]
    name = "cache"
    format = "gradle-build-cache"
    anonymous = "write"
    """
    )
    return write_config(tmp_path, body)


def wait_until(what: str, check: Callable[[], Any], timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def client(url: str, auth: tuple[str, str] | None = AUTH) -> httpx.Client:
    return httpx.Client(base_url=url, auth=auth, timeout=30)
