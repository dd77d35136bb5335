"""What a format sees of a request (contract.Request), over real HTTP: the raw path as
sent (the app no longer refuses ``%2F`` before the format), its segments, the query
string, and absolute URLs back to the proxy from server.public_url or the Host header."""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy import formats
from proxy.config.load import load
from proxy.contract import (
    BadRequest,
    FormatPlugin,
    ProxyContext,
    Proxying,
    RepositorySettings,
    Request,
    Response,
)
from proxy.exceptions import ConfigError
from tests.conftest import ProxyFactory, write_config
from tests.rawhttp import raw_get
from tests.upstream import ServerThread


@dataclass(frozen=True)
class EchoOptions:
    pass


class Echo:
    """Answers with what it was handed, as JSON."""

    def __init__(self, settings: RepositorySettings[EchoOptions], ctx: ProxyContext) -> None:
        self.responses = ctx.responses

    async def handle(self, request: Request) -> Response:
        seen: dict[str, Any] = {
            "raw_path": request.raw_path,
            "segments": list(request.segments),
            "query": request.query,
            "base_path": request.base_path,
            "accept": request.headers.get("accept"),
        }
        for name in ("path", "base_url"):
            try:
                seen[name] = getattr(request, name)
            except BadRequest as exc:
                seen[name] = f"refused: {exc}"
        body = json.dumps(seen).encode()
        return self.responses.inline(request, body, "application/json")


@pytest.fixture
def echo_format(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    module = types.ModuleType("tests.echo_format")
    module.FORMAT = FormatPlugin(name="echo", options=EchoOptions, proxying=Proxying(build=Echo))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tests.echo_format", module)
    monkeypatch.setitem(formats.REGISTRY, "echo", "tests.echo_format")
    yield "echo"
    formats.plugin.cache_clear()


def echo_proxy(
    tmp_path: Path, start_proxy: ProxyFactory, server: str = "", env: dict[str, str] | None = None
) -> ServerThread:
    config = write_config(
        tmp_path,
        f"""
        [server]
        {server}
        [storage]
        path = "{tmp_path / "data"}"
        [[repositories]]
        name = "e"
        format = "echo"
        upstream = "https://upstream.example/e/"
        """,
    )
    return start_proxy(load(config, env or {}))


def seen(proxy: ServerThread, target: str, host: str | None = None) -> dict[str, Any]:
    headers = {"Host": host} if host is not None else {}
    status, body = raw_get(proxy.url, target, headers)
    assert status == 200, body
    found: dict[str, Any] = json.loads(body)
    return found


def test_a_format_sees_the_path_as_sent(
    echo_format: str, tmp_path: Path, start_proxy: ProxyFactory
) -> None:
    proxy = echo_proxy(tmp_path, start_proxy)
    scoped = seen(proxy, "/e/@scope%2fname?write=x&a=%20b")
    assert scoped["raw_path"] == "@scope%2fname"
    assert scoped["segments"] == ["@scope%2fname"]
    assert scoped["query"] == "write=x&a=%20b"
    assert scoped["path"].startswith("refused: ")  # the shared rule still refuses it
    tarball = seen(proxy, "/e/@scope/name/-/name-1.0.0.tgz")
    assert tarball["segments"] == ["@scope", "name", "-", "name-1.0.0.tgz"]
    assert tarball["path"] == "@scope/name/-/name-1.0.0.tgz"
    assert seen(proxy, "/e/a%20b/")["path"] == "a b/"
    assert seen(proxy, "/e")["raw_path"] == ""


def test_absolute_urls_follow_the_host_header_without_public_url(
    echo_format: str, tmp_path: Path, start_proxy: ProxyFactory
) -> None:
    proxy = echo_proxy(tmp_path, start_proxy)
    assert seen(proxy, "/e/x")["base_url"] == f"http://127.0.0.1:{proxy.port}/e/"
    assert seen(proxy, "/e/x", host="mirror.internal:8443")["base_url"] == (
        "http://mirror.internal:8443/e/"
    )
    hostile = seen(proxy, "/e/x", host='x"><script>')
    assert (
        hostile["base_url"].startswith("refused: ") and "server.public_url" in hostile["base_url"]
    )


def test_a_request_with_two_host_headers_is_refused(
    echo_format: str, tmp_path: Path, start_proxy: ProxyFactory
) -> None:
    """RFC 9112, 3.2: more than one Host is a 400. Keeping one of them (the last) built
    URLs from a host that a load balancer or cache in front, routing by the first, never
    saw: an answer cached for one host naming another. Other repeated fields are one
    list (RFC 9110, 5.3), not the last line alone."""
    proxy = echo_proxy(tmp_path, start_proxy)
    status, body = raw_get(proxy.url, "/e/x", [("Host", "a.example"), ("Host", "evil.example")])
    assert status == 400 and b"more than one Host header" in body, body
    status, body = raw_get(
        proxy.url, "/e/x", [("Accept", "application/json;q=0"), ("Accept", "*/*")]
    )
    assert status == 200 and json.loads(body)["accept"] == "application/json;q=0, */*"


def test_public_url_wins_over_any_host_header(
    echo_format: str, tmp_path: Path, start_proxy: ProxyFactory
) -> None:
    proxy = echo_proxy(tmp_path, start_proxy, 'public_url = "https://artifacts.example/base/"')
    for host in ("127.0.0.1", "evil.example", 'x"><script>'):
        assert seen(proxy, "/e/x", host=host)["base_url"] == "https://artifacts.example/base/e/"


def test_public_url_from_the_environment(
    echo_format: str, tmp_path: Path, start_proxy: ProxyFactory
) -> None:
    proxy = echo_proxy(tmp_path, start_proxy, env={"PROXY_PUBLIC_URL": "http://lb.example:9000"})
    assert seen(proxy, "/e/x")["base_url"] == "http://lb.example:9000/e/"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('"ftp://proxy.example"', "is not an http(s) URL"),
        ('"https://"', "is not an http(s) URL"),
        ('"https://u:p@proxy.example"', "must not hold credentials"),
        ('"https://proxy.example/?a=b"', "must not have a query or fragment"),
        ('"https://proxy.example/#x"', "must not have a query or fragment"),
        ('"https://proxy.example/a b"', "cannot carry as is"),
        ('"https://proxy.example/a\\"b"', "cannot carry as is"),
        ('"https://proxy.example:99999"', "is not a valid URL"),
        ("42", "is not a URL"),
    ],
)
def test_public_url_is_validated_naming_the_key(tmp_path: Path, value: str, message: str) -> None:
    config = write_config(tmp_path, f"[server]\npublic_url = {value}\n")
    with pytest.raises(ConfigError) as raised:
        load(config, {})
    assert len(raised.value.errors) == 1
    assert raised.value.errors[0].startswith("server.public_url: ")
    assert message in raised.value.errors[0]


def test_check_config_shows_public_url(tmp_path: Path) -> None:
    config = write_config(tmp_path, '[server]\npublic_url = "https://artifacts.example/"\n')
    assert 'public_url = "https://artifacts.example"' in load(config, {}).describe()
    assert "# public_url is not set" in load(None, {}).describe()


def test_every_format_refuses_escaped_slashes_and_traversals_itself(
    tmp_path: Path, start_proxy: ProxyFactory
) -> None:
    config = write_config(
        tmp_path,
        f"""
        [storage]
        path = "{tmp_path / "data"}"
        [[repositories]]
        name = "pypi"
        format = "pypi"
        upstream = "https://upstream.example/simple/"
        [[repositories]]
        name = "maven"
        format = "maven"
        upstream = "https://upstream.example/m2/"
        [[repositories]]
        name = "raw"
        format = "raw"
        upstream = "https://upstream.example/files/"
        [[repositories]]
        name = "cache"
        format = "gradle-build-cache"
        anonymous = "write"
        """,
    )
    proxy = start_proxy(load(config, {}))
    for repository in ("pypi", "maven", "raw", "cache"):
        for rest in ("a%2Fb", "a%2fb", "a/%2e%2e/b", "a%5Cb", "a//b", "%00"):
            status, body = raw_get(proxy.url, f"/{repository}/{rest}")
            assert status == 400, (repository, rest, body)
    put = httpx.put(f"{proxy.url}/cache/a%2Fb", content=b"x")
    assert put.status_code == 400
