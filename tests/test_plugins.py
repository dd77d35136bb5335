"""Declared capabilities (proxy/formats/__init__.py ``verify``): a format's plugin says
what it provides, and the registry refuses one that lacks what it declares, naming
the format and every problem, before any repository is built on it."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from proxy import formats
from proxy.config.load import load
from proxy.contract import (
    Duration,
    FetchSpec,
    FormatPlugin,
    HostedContext,
    Hosting,
    Mirroring,
    MirrorVersions,
    PackageRef,
    ProxyContext,
    Proxying,
    RepositorySettings,
    Request,
    Response,
    Urls,
    option,
)
from proxy.exceptions import ConfigError, InvalidPlugin
from proxy.testing import InMemoryProxy, MockResponse
from tests.conftest import write_config


@dataclass(frozen=True)
class Options:
    ttl_s: float = option(Duration(), 60.0, key="ttl")


class Adapter:
    def __init__(self, settings: RepositorySettings[Options], ctx: ProxyContext) -> None:
        self.settings = settings

    async def handle(self, request: Request) -> Response:
        raise NotImplementedError

    async def mirror(self, package: PackageRef, versions: MirrorVersions) -> list[FetchSpec]:
        return []

    def sync_mirror(self, package: PackageRef, versions: MirrorVersions) -> list[FetchSpec]:
        return []


class HostedAdapter:
    def __init__(self, settings: RepositorySettings[Options], ctx: HostedContext) -> None:
        self.settings = settings

    async def handle(self, request: Request) -> Response:
        raise NotImplementedError


def broken(**declared: Any) -> FormatPlugin[Any, Any]:
    """A plugin as a careless author writes it: its types are not checked here."""
    declared.setdefault("name", "demo")
    declared.setdefault("options", Options)
    return FormatPlugin(**declared)


def problems(plugin: object, name: str = "demo") -> str:
    with pytest.raises(InvalidPlugin) as raised:
        formats.verify(plugin, name, where="tests.demo")
    message = str(raised.value)
    assert message.startswith(f"format {name!r} (tests.demo.FORMAT): ")
    return message


def test_a_complete_plugin_passes() -> None:
    formats.verify(
        FormatPlugin(
            name="demo",
            options=Options,
            proxying=Proxying(build=Adapter, max_upstreams=1),
            mirroring=Mirroring(purl_types=("demo",), keys=Adapter.mirror),
            default_repository={"name": "demo", "format": "demo"},
        ),
        "demo",
    )
    formats.verify(
        FormatPlugin(name="demo", options=Options, hosting=Hosting(build=HostedAdapter)), "demo"
    )


def test_a_plugin_that_serves_nothing_is_refused() -> None:
    assert "declares neither proxying nor hosting" in problems(broken())


def test_mirroring_needs_proxying_purl_types_and_an_async_keys_function() -> None:
    found = problems(
        broken(
            hosting=Hosting(build=HostedAdapter),
            mirroring=Mirroring(purl_types=(), keys=Adapter.sync_mirror),  # type: ignore[arg-type]
        )
    )
    assert "mirroring without proxying" in found
    assert "mirroring.purl_types is empty" in found
    assert "mirroring.keys must be an async function" in found
    wrong_type = problems(
        broken(
            proxying=Proxying(build=Adapter),
            mirroring=Mirroring(purl_types=("Not A Type",), keys=Adapter.mirror),
        )
    )
    assert "'Not A Type' is not a purl type" in wrong_type


def test_builders_must_take_what_the_engine_passes() -> None:
    def build_nothing() -> Adapter:
        raise AssertionError

    found = problems(broken(options=Options, proxying=Proxying(build=build_nothing)))  # type: ignore[arg-type]
    assert "proxying.build cannot be called with 2 arguments" in found
    both = problems(broken(proxying=Proxying(build=Adapter), hosting=Hosting(build=HostedAdapter)))
    assert "both proxying and hosting" in both


def test_options_are_a_frozen_dataclass_of_options_with_defaults() -> None:
    @dataclass
    class Mutable:
        ttl_s: float = option(Duration(), 60.0)

    @dataclass(frozen=True)
    class Incomplete:
        needed: float = field(metadata={"option": (Duration(), None)})
        plain: int = 3

    assert "frozen dataclass" in problems(broken(options=Mutable, proxying=Proxying(build=Adapter)))
    found = problems(broken(options=Incomplete, proxying=Proxying(build=Adapter)))
    assert "options.plain is not an option(...)" in found
    assert "options.needed has no default" in found
    not_a_class = problems(broken(options=dict, proxying=Proxying(build=Adapter)))
    assert "options must be a dataclass" in not_a_class


def test_a_proxying_format_does_not_declare_the_engine_keys() -> None:
    @dataclass(frozen=True)
    class OldStyle:
        upstream: tuple[str, ...] = option(Urls(), ())

    found = problems(broken(options=OldStyle, proxying=Proxying(build=Adapter)))
    assert "options declare upstream, which the engine provides" in found


def test_the_name_and_the_default_repository_agree_with_the_registry() -> None:
    found = problems(
        broken(
            name="other",
            proxying=Proxying(build=Adapter),
            default_repository={"name": "x", "format": "other"},
        )
    )
    assert "registered as 'demo' but names itself 'other'" in found
    assert "default_repository must say format = 'demo'" in found
    assert "FORMAT must be a contract.FormatPlugin, not NoneType" in problems(None)


class NoHandle:
    def __init__(self, settings: RepositorySettings[Options], ctx: ProxyContext) -> None:
        pass


class SyncHandle(NoHandle):
    def handle(self, request: Request) -> Response:
        raise NotImplementedError


class HandleTakingNothing(NoHandle):
    async def handle(self) -> Response:
        raise NotImplementedError


def test_an_adapter_class_must_answer_requests() -> None:
    """Every request goes to ``adapter.handle(request)``: an adapter without one was a
    500 on every request instead of an error at registration."""
    for adapter, says in (
        (NoHandle, "NoHandle has no handle"),
        (SyncHandle, "SyncHandle.handle must be an async method"),
        (HandleTakingNothing, "HandleTakingNothing.handle cannot be called with a request"),
    ):
        found = problems(broken(proxying=Proxying(build=adapter)))
        assert f"proxying.build: {says}" in found, found
    hosted = problems(broken(hosting=Hosting(build=NoHandle)))  # type: ignore[arg-type]
    assert "hosting.build: NoHandle has no handle" in hosted


@pytest.mark.anyio
async def test_an_adapter_built_by_a_function_is_checked_when_built(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def build(settings: RepositorySettings[Options], ctx: ProxyContext) -> Any:
        return NoHandle(settings, ctx)

    module = types.ModuleType("tests.handleless_format")
    module.FORMAT = broken(name="handleless", proxying=Proxying(build=build))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tests.handleless_format", module)
    monkeypatch.setitem(formats.REGISTRY, "handleless", "tests.handleless_format")
    try:
        config = write_config(
            tmp_path,
            f"""
            [storage]
            path = "{tmp_path / "data"}"
            [[repositories]]
            name = "h"
            format = "handleless"
            upstream = "https://upstream.example/"
            """,
        )
        with pytest.raises(InvalidPlugin, match=r"format 'handleless': .*NoHandle has no handle"):
            async with InMemoryProxy(load(config, {}), lambda request: MockResponse(404)):
                pass
    finally:
        formats.plugin.cache_clear()


def test_error_bodies_are_text_or_json() -> None:
    found = problems(broken(proxying=Proxying(build=Adapter), error_bodies="xml"))
    assert "error_bodies must be one of ('text', 'json'), not 'xml'" in found


@pytest.fixture
def broken_format(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A registered format whose plugin declares mirroring but cannot provide it."""
    module = types.ModuleType("tests.broken_format")
    module.FORMAT = broken(  # type: ignore[attr-defined]
        name="broken",
        proxying=Proxying(build=Adapter),
        mirroring=Mirroring(purl_types=("broken",), keys=Adapter.sync_mirror),  # type: ignore[arg-type]
    )
    monkeypatch.setitem(sys.modules, "tests.broken_format", module)
    monkeypatch.setitem(formats.REGISTRY, "broken", "tests.broken_format")
    yield "broken"
    formats.plugin.cache_clear()


def test_the_registry_refuses_an_incomplete_plugin_when_it_is_loaded(broken_format: str) -> None:
    with pytest.raises(
        InvalidPlugin, match=r"format 'broken' \(tests.broken_format.FORMAT\): mirroring.keys"
    ):
        formats.plugin(broken_format)


def test_a_repository_of_an_incomplete_format_is_a_config_error(
    broken_format: str, tmp_path: Path
) -> None:
    config = write_config(
        tmp_path,
        f"""
        [[repositories]]
        name = "b"
        format = "{broken_format}"
        """,
    )
    with pytest.raises(ConfigError) as raised:
        load(config, {})
    assert raised.value.errors == [
        "repositories.b.format: cannot be used: format 'broken' (tests.broken_format.FORMAT): "
        "mirroring.keys must be an async function (adapter, package, versions)"
    ]


@pytest.mark.parametrize("name", sorted(formats.REGISTRY))
def test_every_registered_format_declares_what_it_provides(name: str) -> None:
    plugin: FormatPlugin[Any, Any] = formats.plugin(name)
    assert (plugin.proxying is None) != (plugin.hosting is None)
    if plugin.mirroring is not None:
        assert plugin.proxying is not None and plugin.mirroring.purl_types
