"""A local npm registry for tests: a real HTTP server (ServerThread) serving full
packuments and tarballs that ``npm pack`` made, and the npm client set up to reach
nothing but the proxy.

``NpmRegistry`` answers ``GET /{name}``, ``/@scope%2fname`` and ``/@scope/name`` with the
full packument (``time``, ``dist-tags``, ``dist.integrity`` and ``dist.shasum``), and
``/{name}/-/{file}.tgz`` with the tarball; it counts every request, honours
If-None-Match, and can tamper with a tarball (its packument still lists the digests of
the original bytes) or answer a status instead.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from tests.upstream import ServerThread

NPM = shutil.which("npm")


@dataclass(frozen=True)
class Tarball:
    """A package version as ``npm pack`` made it."""

    name: str
    version: str
    body: bytes
    dependencies: dict[str, str]

    @property
    def filename(self) -> str:
        return f"{self.name.rpartition('/')[2]}-{self.version}.tgz"

    @property
    def integrity(self) -> str:
        return "sha512-" + base64.b64encode(hashlib.sha512(self.body).digest()).decode()

    @property
    def shasum(self) -> str:
        return hashlib.sha1(self.body).hexdigest()


def npm_env(home: Path, registry: str | None = None) -> dict[str, str]:
    """An environment in which npm reads no configuration of this machine, keeps its
    cache in ``home``, and asks only ``registry``: no audit, no funding or update checks."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "npmrc").write_text("")
    (home / "global-npmrc").write_text("")
    env = {k: v for k, v in os.environ.items() if not k.lower().startswith("npm_")}
    env.update(
        {
            "HOME": str(home),
            "npm_config_cache": str(home / "cache"),
            "npm_config_userconfig": str(home / "npmrc"),
            "npm_config_globalconfig": str(home / "global-npmrc"),
            "npm_config_audit": "false",
            "npm_config_fund": "false",
            "npm_config_update_notifier": "false",
            "npm_config_loglevel": "warn",
            "npm_config_fetch_retries": "0",
            "npm_config_fetch_timeout": "60000",
        }
    )
    if registry is not None:
        env["npm_config_registry"] = registry
    return env


def npm_pack(
    work: Path, name: str, version: str, dependencies: dict[str, str] | None = None
) -> Tarball:
    """Make a package of ``name@version`` (a module exporting its own id) with ``npm pack``."""
    assert NPM is not None, "npm is not installed (.ci/run installs it)"
    source = work / f"{name.replace('/', '+')}-{version}"
    source.mkdir(parents=True)
    manifest = {
        "name": name,
        "version": version,
        "main": "index.js",
        "license": "MIT",
        "dependencies": dependencies or {},
    }
    (source / "package.json").write_text(json.dumps(manifest, indent=2))
    (source / "index.js").write_text(f"module.exports = {json.dumps(f'{name}@{version}')};\n")
    out = work / "packed"
    out.mkdir(exist_ok=True)
    result = subprocess.run(
        [NPM, "pack", "--json", "--pack-destination", str(out)],
        cwd=source,
        env=npm_env(work / "npm-home"),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    [packed] = json.loads(result.stdout)
    return Tarball(name, version, (out / packed["filename"]).read_bytes(), dependencies or {})


@dataclass
class NpmRegistry:
    """The app; ``start_registry`` runs it."""

    packages: dict[str, list[Tarball]] = field(default_factory=dict)
    latest: dict[str, str] = field(default_factory=dict)  # name -> version, else the last
    tampered: set[tuple[str, str]] = field(default_factory=set)  # (name, version)
    statuses: dict[str, int] = field(default_factory=dict)  # path -> status to answer
    publish_times: dict[tuple[str, str], str] = field(default_factory=dict)  # else in 2024
    requests: Counter[tuple[str, str]] = field(default_factory=Counter)
    base_url: str = ""

    def publish(self, tarball: Tarball) -> None:
        self.packages.setdefault(tarball.name, []).append(tarball)

    def count(self, path: str, method: str = "GET") -> int:
        return self.requests[(method, path)]

    def tarball_path(self, tarball: Tarball) -> str:
        return f"/{tarball.name}/-/{tarball.filename}"

    def packument(self, name: str) -> dict[str, Any]:
        published = self.packages[name]
        versions = {}
        times = {"created": "2024-01-01T00:00:00.000Z"}
        for i, t in enumerate(published):
            versions[t.version] = {
                "name": name,
                "version": t.version,
                "main": "index.js",
                "license": "MIT",
                "description": f"{name} for tests",
                "dependencies": t.dependencies,
                "dist": {
                    "tarball": self.base_url + self.tarball_path(t),
                    "integrity": t.integrity,
                    "shasum": t.shasum,
                },
                "_id": f"{name}@{t.version}",
            }
            times[t.version] = self.publish_times.get(
                (name, t.version), f"2024-01-{i + 2:02d}T00:00:00.000Z"
            )
        times["modified"] = times[published[-1].version]
        return {
            "_id": name,
            "name": name,
            "description": f"{name} for tests",
            "dist-tags": {"latest": self.latest.get(name, published[-1].version)},
            "versions": versions,
            "time": times,
            "readme": "a readme only the full document carries",
        }

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        raw = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
        path = unquote(raw)
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        self.requests[(scope["method"], path)] += 1
        status, body, content_type = self._answer(path, headers)
        extra: list[tuple[bytes, bytes]] = []
        if status == 200:
            etag = '"' + hashlib.sha256(body).hexdigest()[:16] + '"'
            extra.append((b"etag", etag.encode()))
            if headers.get("if-none-match") == etag:
                status, body = 304, b""
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", content_type.encode()),
                    (b"content-length", str(len(body)).encode()),
                    *extra,
                ],
            }
        )
        await send(
            {"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body}
        )

    def _answer(self, path: str, headers: dict[str, str]) -> tuple[int, bytes, str]:
        if path in self.statuses:
            return self.statuses[path], b'{"error": "fault"}', "application/json"
        name, sep, filename = path.lstrip("/").partition("/-/")
        if sep:
            for t in self.packages.get(name, []):
                if t.filename == filename:
                    body = t.body
                    if (t.name, t.version) in self.tampered:
                        body = body[:-1] + bytes([body[-1] ^ 0xFF])
                    return 200, body, "application/octet-stream"
            return 404, b'{"error": "not found"}', "application/json"
        if name in self.packages:
            return 200, json.dumps(self.packument(name)).encode(), "application/json"
        return 404, b'{"error": "not found"}', "application/json"


def start_registry(registry: NpmRegistry) -> ServerThread:
    server = ServerThread(registry).start()
    registry.base_url = server.url
    return server


def run_npm(
    args: list[str], cwd: Path, env: dict[str, str], timeout_s: float = 240
) -> subprocess.CompletedProcess[str]:
    assert NPM is not None, "npm is not installed (.ci/run installs it)"
    return subprocess.run(
        [NPM, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s
    )
