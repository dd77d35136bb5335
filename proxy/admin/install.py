"""The install guide: each client's configuration for each repository, filled in with
the address the console was reached at (so behind a load balancer, the LB's).

Plain HTTP needs a word to some clients: Gradle refuses ``http://`` repositories and
build caches unless ``allowInsecureProtocol = true`` (Gradle 7; HttpBuildCache since
6.0), and pip wants the host as ``trusted-host``. Over HTTPS (``server.tls_cert``, or a
load balancer that terminates TLS) those lines go away.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from proxy.config.settings import Settings


@dataclass(frozen=True)
class Snippet:
    label: str
    text: str


@dataclass(frozen=True)
class Guide:
    repository: str
    format: str
    snippets: tuple[Snippet, ...]


def client_guides(settings: Settings, base: str) -> list[Guide]:
    """``base``: ``scheme://host[:port]`` as clients reach this proxy."""
    insecure = base.startswith("http://")
    host = urlsplit(base).hostname or "localhost"
    guides = []
    for repo in settings.repositories:
        url = f"{base}/{repo.name}/"
        maker = _GUIDES.get(repo.format, _raw)
        guides.append(Guide(repo.name, repo.format, maker(url, insecure, host, repo.name)))
    return guides


def _pypi(url: str, insecure: bool, host: str, name: str) -> tuple[Snippet, ...]:
    index = f"{url}simple/"
    trusted = f" --trusted-host {host}" if insecure else ""
    conf = f"[global]\nindex-url = {index}\n" + (f"trusted-host = {host}\n" if insecure else "")
    return (
        Snippet("pip", f"pip install --index-url {index}{trusted} requests"),
        Snippet("pip.conf (or pip.ini)", conf),
        Snippet(
            "uv", f"uv pip install --index-url {index} requests\n# or: export UV_INDEX_URL={index}"
        ),
        Snippet(
            "pyproject.toml (uv): default = true, so uv never falls through to another index",
            f'[[tool.uv.index]]\nname = "proxy"\nurl = "{index}"\ndefault = true\n',
        ),
    )


def _maven(url: str, insecure: bool, host: str, name: str) -> tuple[Snippet, ...]:
    settings_xml = (
        "<settings>\n  <mirrors>\n    <mirror>\n      <id>proxy</id>\n"
        f"      <mirrorOf>*</mirrorOf>\n      <url>{url}</url>\n    </mirror>\n"
        "  </mirrors>\n</settings>\n"
    )
    insecure_groovy = "; allowInsecureProtocol = true" if insecure else ""
    insecure_kotlin = "; isAllowInsecureProtocol = true" if insecure else ""
    return (
        Snippet("Maven: ~/.m2/settings.xml", settings_xml),
        Snippet(
            "Gradle: build.gradle (settings.gradle's dependencyResolutionManagement too)",
            f"repositories {{\n  maven {{ url = '{url}'{insecure_groovy} }}\n}}\n",
        ),
        Snippet(
            "Gradle: build.gradle.kts",
            f'repositories {{\n  maven {{ url = uri("{url}"){insecure_kotlin} }}\n}}\n',
        ),
    )


def _build_cache(url: str, insecure: bool, host: str, name: str) -> tuple[Snippet, ...]:
    insecure_line = "    allowInsecureProtocol = true   // plain HTTP\n" if insecure else ""
    return (
        Snippet(
            "Gradle: settings.gradle; run with --build-cache (or org.gradle.caching=true)",
            "buildCache {\n  remote(HttpBuildCache) {\n"
            f"    url = '{url}'\n{insecure_line}"
            "    push = true            // typically only on CI\n"
            "    credentials {\n      username = 'ci'\n"
            "      password = System.getenv('GRADLE_CACHE_PASSWORD')\n    }\n"
            "  }\n}\n",
        ),
    )


def _npm(url: str, insecure: bool, host: str, name: str) -> tuple[Snippet, ...]:
    return (
        Snippet("npm", f"npm config set registry {url}"),
        Snippet(".npmrc", f"registry={url}\n"),
    )


def _raw(url: str, insecure: bool, host: str, name: str) -> tuple[Snippet, ...]:
    return (
        Snippet(
            "any file under the upstream's prefix",
            f"curl -fO {url}PATH/TO/FILE\npip install {url}PATH/TO/package.tar.gz",
        ),
    )


_GUIDES = {
    "pypi": _pypi,
    "maven": _maven,
    "gradle-build-cache": _build_cache,
    "npm": _npm,
    "raw": _raw,
}
