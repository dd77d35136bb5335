"""Secrets never shown (docs/architecture.md, "Secrets never shown"): an upstream's
credentials and the database password stay out of pages, error bodies, logs and
``check-config``; a configured upstream's credentials reach every URL of its origin and
no other (issue 18)."""

from __future__ import annotations

import base64
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.config.load import load
from proxy.redaction import redact, redact_url
from tests.conftest import ProxyFactory, pypi_config, write_config
from tests.processes import ProxyProcess
from tests.upstream import FakeUpstream, ProjectFile, ServerThread

TOKEN = "s3cr3t-t0ken-9f2b"
USER = "deploy"


def test_redact_masks_user_info_secret_parameters_and_authorization() -> None:
    assert (
        redact_url(f"https://{USER}:{TOKEN}@h.example/simple/") == "https://***@h.example/simple/"
    )
    assert redact_url(f"https://{TOKEN}@h.example/x") == "https://***@h.example/x"
    assert (
        redact_url(f"postgresql://db.example/proxy?sslmode=require&password={TOKEN}")
        == "postgresql://db.example/proxy?sslmode=require&password=***"
    )
    assert redact_url("https://h.example/f.whl?X-Amz-Signature=abc&a=1") == (
        "https://h.example/f.whl?X-Amz-Signature=***&a=1"
    )
    assert redact_url("https://h.example/simple/?page=2") == "https://h.example/simple/?page=2"
    said = f"upstream h answered 502 for https://{USER}:{TOKEN}@h.example/simple/x/"
    assert TOKEN not in redact(said) and "h.example/simple/x/" in redact(said)
    assert redact(f"Authorization: Bearer {TOKEN}") == "Authorization: Bearer ***"
    assert redact("sent Basic ZGVwbG95OnMzY3IzdC10MGtlbg==") == "sent Basic ***"
    assert redact(f"host=db user=proxy password={TOKEN}") == "host=db user=proxy password=***"
    assert redact(f'password = "{TOKEN}"') == 'password = "***"'
    # Messages about a setting name it and stay readable; prose is left alone.
    for text in (
        "repositories[2].users.ci.password: must not be empty",
        "Basic auth with read and write roles",
        "nothing to hide here",
    ):
        assert redact(text) == text


def _authenticating(app: FakeUpstream) -> Any:
    """``app`` behind Basic auth (user:token) for every path, like a private index."""
    expected = "Basic " + base64.b64encode(f"{USER}:{TOKEN}".encode()).decode()

    async def guarded(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"").decode()
            if given != expected:
                app.requests[("unauthorized", scope["path"])] += 1
                await send({"type": "http.response.start", "status": 401, "headers": []})
                await send({"type": "http.response.body", "body": b"who are you?\n"})
                return
        await app(scope, receive, send)

    return guarded


@pytest.fixture
def private_upstream() -> Iterator[FakeUpstream]:
    fake = FakeUpstream(absolute_links=True)  # files at /packages/: outside /simple/
    server = ServerThread(_authenticating(fake)).start()
    fake.base_url = server.url
    fake.add_project("pkg", [ProjectFile("pkg-1.0.tar.gz", b"private bytes" * 100)])
    yield fake
    fake.released.set()
    server.stop()


def _authenticated_url(upstream: FakeUpstream) -> str:
    return upstream.base_url.replace("http://", f"http://{USER}:{TOKEN}@")


def test_files_beside_an_authenticated_index_get_its_credentials_and_nothing_leaks(
    tmp_path: Path, private_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    body = pypi_config(tmp_path / "data", _authenticated_url(private_upstream))
    proxy = start_proxy(load(write_config(tmp_path, body), {}))
    with httpx.Client(base_url=proxy.url, timeout=30) as client:
        page = client.get("/pypi/simple/pkg/")
        assert page.status_code == 200, page.text
        assert TOKEN not in page.text
        # The file is on the index's host, outside its path: it needs the credentials.
        got = client.get("/pypi/files/pkg/pkg-1.0.tar.gz")
        assert got.status_code == 200, got.text
        assert got.content == b"private bytes" * 100
        assert private_upstream.count("/packages/pkg-1.0.tar.gz", "unauthorized") == 0
        landing = client.get("/")
        assert "127.0.0.1" in landing.text and TOKEN not in landing.text
        # An outage names the upstream in its 502 body, never its credentials.
        private_upstream.fault("/simple/gone/", status=500)
        failed = client.get("/pypi/simple/gone/")
        assert failed.status_code == 502 and "simple/gone" in failed.text
        assert TOKEN not in failed.text and USER not in failed.text


def test_credentials_go_to_their_origin_only(private_upstream: FakeUpstream) -> None:
    from proxy.upstream.ssrf import AddressPolicy

    upstream = _authenticated_url(private_upstream) + "/simple/"
    policy = AddressPolicy("pypi", (upstream,))
    origin = private_upstream.base_url
    assert policy.authorization(origin + "/packages/x.whl") is not None
    assert policy.authorization(origin.replace("127.0.0.1", "localhost") + "/x") is None
    assert policy.authorization("https://elsewhere.example/x.whl") is None
    assert policy.without_credentials(upstream) == origin + "/simple/"
    listed = "https://other:creds@elsewhere.example/x.whl"
    assert policy.without_credentials(listed) == "https://elsewhere.example/x.whl"


@pytest.mark.slow
def test_logs_and_check_config_show_no_secret(
    tmp_path: Path, private_upstream: FakeUpstream
) -> None:
    db_url = f"sqlite:///{tmp_path / 'proxy.db'}"
    body = pypi_config(tmp_path / "data", _authenticated_url(private_upstream))
    config = write_config(
        tmp_path, body.replace("[storage]", f'[database]\nurl = "{db_url}"\n[storage]', 1)
    )
    proxy = ProxyProcess(config, tmp_path, "proxy").start().wait_ready()
    try:
        with httpx.Client(base_url=proxy.url, timeout=30) as client:
            assert client.get("/pypi/simple/pkg/").status_code == 200
            assert client.get("/pypi/files/pkg/pkg-1.0.tar.gz").status_code == 200
            private_upstream.fault("/simple/gone/", status=500)
            assert client.get("/pypi/simple/gone/").status_code == 502
    finally:
        proxy.stop()
    log = proxy.log()
    assert "fetch failed" in log and "simple/gone" in log  # the lines we look for are there
    assert TOKEN not in log and f"{USER}:" not in log
    assert "HTTP Request:" not in log  # httpx's own line, which repeated ours with the URL

    pg_config = write_config(
        tmp_path,
        body.replace(
            "[storage]",
            f'[database]\nurl = "postgresql://proxy:{TOKEN}@db.example/proxy?password={TOKEN}"\n[storage]',
            1,
        ),
        name="pg.toml",
    )
    for path in (config, pg_config):
        shown = subprocess.run(
            [sys.executable, "-m", "proxy", "check-config", "--config", str(path)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "upstream" in shown and TOKEN not in shown, shown
