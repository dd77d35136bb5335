"""The format registry: ``format = "..."`` -> the module that implements it.

Adding a format is one new module that defines ``FORMAT = FormatPlugin(...)`` (see
``proxy/contract.py`` and docs/architecture.md, "Adding a format") and one line here.
Modules are imported on first use, so a format's code is not loaded unless configured.
A plugin is checked the first time it is loaded (``verify``): what it declares it
provides must be there, or it is refused with an error naming the format and every
problem, before any repository is built on it (pluggy verifies hook implementations
against their specification the same way).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import re
from collections.abc import Callable, Iterator
from typing import Any, get_args

from proxy.contract import (
    ENGINE_REPOSITORY_KEYS,
    RELEASE_REPOSITORY_KEYS,
    ErrorBodies,
    FormatPlugin,
    InvalidPlugin,
    options_of,
)

REGISTRY: dict[str, str] = {
    "pypi": "proxy.formats.pypi",
    "maven": "proxy.formats.maven",
    "gradle-build-cache": "proxy.formats.gradle_cache",
    "raw": "proxy.formats.raw",
    "npm": "proxy.formats.npm",
}

_PURL_TYPE_RE = re.compile(r"^[a-z][a-z0-9.+-]*$")


@functools.cache
def plugin(name: str) -> FormatPlugin[Any, Any]:
    """The plugin registered as ``name``, verified; KeyError if there is none,
    ``InvalidPlugin`` if it does not provide what it declares."""
    module = importlib.import_module(REGISTRY[name])
    found = getattr(module, "FORMAT", None)
    verify(found, name, where=REGISTRY[name])
    assert isinstance(found, FormatPlugin)
    return found


def verify(candidate: object, name: str, where: str = "") -> None:
    """Refuse a plugin that lacks what it declares: ``InvalidPlugin`` naming the format
    (and its module) and every problem found."""
    problems = list(_problems(candidate, name))
    if problems:
        origin = f" ({where}.FORMAT)" if where else ""
        raise InvalidPlugin(f"format {name!r}{origin}: " + "; ".join(problems))


def _problems(candidate: object, name: str) -> Iterator[str]:
    if not isinstance(candidate, FormatPlugin):
        yield f"FORMAT must be a contract.FormatPlugin, not {type(candidate).__name__}"
        return
    plugin = candidate
    if plugin.name != name:
        yield f"it is registered as {name!r} but names itself {plugin.name!r}"
    yield from _options_problems(plugin)
    serving = [c for c in (plugin.proxying, plugin.hosting) if c is not None]
    if not serving:
        yield (
            "it declares neither proxying nor hosting, so nothing would answer its "
            "repositories' requests (set FormatPlugin.proxying or .hosting)"
        )
    elif len(serving) == 2:
        yield "it declares both proxying and hosting; a repository is served one way"
    for capability in serving:
        what = f"{type(capability).__name__.lower()}.build"
        yield from _callable_problems(capability.build, what, positional=2)
        if isinstance(capability.build, type):  # a function's adapter is checked when built
            yield from (f"{what}: {problem}" for problem in adapter_problems(capability.build))
    if plugin.hosting is not None and plugin.hosting.max_size is not None:
        yield from _callable_problems(plugin.hosting.max_size, "hosting.max_size", positional=1)
    mirroring = plugin.mirroring
    if mirroring is not None:
        if plugin.proxying is None:
            yield "it declares mirroring without proxying: a mirror warms keys fetched upstream"
        if not mirroring.purl_types:
            yield "mirroring.purl_types is empty: it would mirror no package"
        for purl_type in mirroring.purl_types:
            if not isinstance(purl_type, str) or not _PURL_TYPE_RE.match(purl_type):
                yield f"mirroring.purl_types: {purl_type!r} is not a purl type"
        if not inspect.iscoroutinefunction(mirroring.keys):
            yield "mirroring.keys must be an async function (adapter, package, versions)"
        else:
            yield from _callable_problems(mirroring.keys, "mirroring.keys", positional=3)
    if plugin.packages is not None:
        yield from _callable_problems(plugin.packages.of, "packages.of", positional=1)
    yield from _releases_problems(plugin)
    if plugin.proxying is not None:
        limit = plugin.proxying.max_upstreams
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            yield f"proxying.max_upstreams must be a positive number or None, not {limit!r}"
    if plugin.packages is not None:
        yield from _callable_problems(plugin.packages.of, "packages.of", positional=1)
        yield from _callable_problems(plugin.packages.name, "packages.name", positional=1)
    if plugin.error_bodies not in get_args(ErrorBodies):
        yield f"error_bodies must be one of {get_args(ErrorBodies)}, not {plugin.error_bodies!r}"
    default = plugin.default_repository
    if callable(default):
        default = default("127.0.0.1")
    if default is not None and default.get("format") != name:
        yield f"default_repository must say format = {name!r}"


def _releases_problems(plugin: FormatPlugin[Any, Any]) -> Iterator[str]:
    releases = plugin.releases
    if releases is None:
        return
    if plugin.proxying is None:
        yield "it declares releases without proxying: the policy judges what upstreams publish"
    if plugin.packages is None:
        yield "it declares releases without packages: the engine must know a key's version"
    if not isinstance(releases.purl_type, str) or not _PURL_TYPE_RE.match(releases.purl_type):
        yield f"releases.purl_type: {releases.purl_type!r} is not a purl type"
    yield from _callable_problems(releases.purl, "releases.purl", positional=1)
    yield from _callable_problems(releases.package, "releases.package", positional=1)
    yield from _callable_problems(releases.index, "releases.index", positional=2)
    yield from _callable_problems(releases.published, "releases.published", positional=2)
    taken = sorted(set(toml for _, o, _ in options_of(plugin.options) for toml in [o.key]))
    clash = sorted(set(taken) & set(RELEASE_REPOSITORY_KEYS))
    if clash:
        yield (
            f"options declare {', '.join(clash)}, which the engine provides to every "
            "repository whose releases the policy judges"
        )


def _options_problems(plugin: FormatPlugin[Any, Any]) -> Iterator[str]:
    options = plugin.options
    if not (isinstance(options, type) and dataclasses.is_dataclass(options)):
        yield "options must be a dataclass of option(...) fields"
        return
    if not options.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        yield "options must be a frozen dataclass (settings never change)"
    declared = {field_name: option.key for field_name, option, _ in options_of(options)}
    for field in dataclasses.fields(options):
        if field.name not in declared:
            yield f"options.{field.name} is not an option(...) the config layer can fill"
        elif field.default is dataclasses.MISSING:
            yield f"options.{field.name} has no default"
    if plugin.proxying is not None:
        taken = sorted(set(declared.values()) & set(ENGINE_REPOSITORY_KEYS))
        if taken:
            yield (
                f"options declare {', '.join(taken)}, which the engine provides to every "
                "proxying repository (read RepositorySettings.upstreams/.allow_hosts)"
            )


def adapter_problems(adapter: object) -> Iterator[str]:
    """What keeps ``adapter`` (a class, or what a builder built) from answering requests:
    every request is ``await adapter.handle(request)``."""
    name = adapter.__name__ if isinstance(adapter, type) else type(adapter).__name__
    handle = getattr(adapter, "handle", None)
    if handle is None:
        yield f"{name} has no handle(request) method"
    elif not inspect.iscoroutinefunction(handle):
        yield f"{name}.handle must be an async method (async def handle(self, request))"
    else:
        positional = 2 if isinstance(adapter, type) else 1  # (self, request) on the class
        for _problem in _callable_problems(handle, "handle", positional):
            yield f"{name}.handle cannot be called with a request"


def _callable_problems(fn: Callable[..., Any], what: str, positional: int) -> Iterator[str]:
    if not callable(fn):
        yield f"{what} is not callable"
        return
    try:
        inspect.signature(fn).bind(*range(positional))
    except TypeError as exc:
        yield f"{what} cannot be called with {positional} arguments ({exc})"
    except ValueError:
        pass  # no signature to inspect (a builtin): take it on trust
