"""A fake upstream for tests: a real HTTP server (uvicorn on port 0, own thread) whose
behaviour each test sets.

It serves PyPI projects as PEP 503 HTML or PEP 691 JSON (by Accept), their files and
``.metadata`` sidecars, and any other path from ``files`` (used as a Maven-layout
folder). Faults are set per path: delay before headers, hang, status codes, a
truncated or corrupted body, a slow body, a redirect. Every request is counted.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import html
import io
import json
import os
import socket
import threading
import time
import zipfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote, unquote

import uvicorn

JSON_V1 = "application/vnd.pypi.simple.v1+json"


@dataclass
class Fault:
    delay_s: float = 0.0  # before the response headers
    hang: bool = False  # never answer (until the fault is cleared or the server stops)
    status: int | None = None  # answer this status instead (with a short body)
    times: int | None = None  # apply the fault this many times, then behave (None: always)
    truncate_at: int | None = None  # send Content-Length in full, then stop after N bytes
    corrupt: bool = False  # flip the bytes of the body (same length)
    chunk_size: int = 64 * 1024
    chunk_delay_s: float = 0.0  # sleep between body chunks (a slow upstream)
    redirect_to: str | None = None  # answer 303 with this Location
    retry_after: str | None = None
    chunked: bool = False  # no Content-Length: the body is sent chunked


@dataclass
class ProjectFile:
    filename: str
    body: bytes
    requires_python: str | None = None
    yanked: bool | str = False
    metadata: bytes | None = None  # the PEP 658 sidecar, if advertised
    listed_sha256: str | None = None  # override the hash the index lists
    unhashed: bool = False  # listed with no hash at all (nothing verifies its bytes)
    upload_time: str | None = None  # PEP 700, in the JSON page (e.g. "2026-11-01T00:00:00Z")

    @property
    def sha256(self) -> str:
        return self.listed_sha256 or hashlib.sha256(self.body).hexdigest()


@dataclass
class FakeUpstream:
    """The app; ``UpstreamServer`` runs it."""

    projects: dict[str, list[ProjectFile]] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)  # any other path -> body
    content_types: dict[str, str] = field(default_factory=dict)  # path -> its Content-Type
    last_modified: dict[str, str] = field(default_factory=dict)  # path -> its Last-Modified
    directory_last_modified: str | None = None  # the Last-Modified of every file of it
    directory: Path | None = None  # serve this folder for paths not in `files`
    faults: dict[str, Fault] = field(default_factory=dict)
    requests: Counter[tuple[str, str]] = field(default_factory=Counter)
    completed: Counter[str] = field(default_factory=Counter)  # bodies sent in full, per path
    request_headers: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    absolute_links: bool = False  # index links absolute (http://host/...) or relative
    json_only: bool = False  # answer index pages with JSON whatever the Accept
    html_only: bool = False
    base_url: str = ""
    released: threading.Event = field(default_factory=threading.Event)

    def add_project(self, name: str, files: list[ProjectFile]) -> None:
        self.projects[name] = files

    def count(self, path: str, method: str = "GET") -> int:
        return self.requests[(method, path)]

    def fault(self, path: str, **kwargs: Any) -> Fault:
        fault = Fault(**kwargs)
        self.faults[path] = fault
        return fault

    def clear_faults(self) -> None:
        self.faults.clear()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    self.released.set()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path = scope["path"]
        method = scope["method"]
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        self.requests[(method, path)] += 1
        self.request_headers.append((method, path, headers))

        fault = self.faults.get(path)
        if fault is not None and fault.times is not None:
            times = fault.times
            if times <= 0:
                fault = None
            else:
                fault.times = times - 1
        if fault is not None:
            if fault.delay_s:
                await asyncio.sleep(fault.delay_s)
            if fault.hang:
                # A thread-safe flag set by the test thread, so polled here.
                while not self.released.is_set() and self.faults.get(path) is fault:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
                return
            if fault.redirect_to:
                await _send(send, 303, b"", [(b"location", fault.redirect_to.encode())])
                return
            if fault.status is not None:
                extra = [(b"retry-after", fault.retry_after.encode())] if fault.retry_after else []
                await _send(send, fault.status, f"fault {fault.status}\n".encode(), extra)
                return

        found = self._resolve(path, headers)
        if found is None:
            await _send(send, 404, b"not found\n")
            return
        status, body, content_type, extra_headers = found
        if status == 304:
            await _send(send, 304, b"", extra_headers)
            return
        response_headers = [(b"content-type", content_type.encode()), *extra_headers]
        if path in self.last_modified:
            response_headers.append((b"last-modified", self.last_modified[path].encode()))
        if method == "HEAD":
            if fault is None or not fault.chunked:  # chunked: a GET would not say it either
                response_headers.append((b"content-length", str(len(body)).encode()))
            await send({"type": "http.response.start", "status": 200, "headers": response_headers})
            await send({"type": "http.response.body", "body": b""})
            return
        if await self._send_body(send, body, response_headers, fault):
            self.completed[path] += 1

    async def _send_body(
        self, send: Any, body: bytes, headers: list[tuple[bytes, bytes]], fault: Fault | None
    ) -> bool:
        if fault is not None and fault.corrupt:
            body = bytes(b ^ 0xFF for b in body)
        if fault is None or not fault.chunked:
            headers = [*headers, (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        limit = len(body)
        if fault is not None and fault.truncate_at is not None:
            limit = min(limit, fault.truncate_at)
        chunk_size = fault.chunk_size if fault is not None else 256 * 1024
        delay = fault.chunk_delay_s if fault is not None else 0.0
        offset = 0
        while offset < limit:
            piece = body[offset : min(offset + chunk_size, limit)]
            offset += len(piece)
            more = offset < len(body)
            await send({"type": "http.response.body", "body": piece, "more_body": more})
            if delay and offset < limit:
                await asyncio.sleep(delay)
        if limit < len(body):
            return False  # end the response short: uvicorn closes the connection
        if not body:
            await send({"type": "http.response.body", "body": b""})
        return True

    def _resolve(
        self, path: str, headers: dict[str, str]
    ) -> tuple[int, bytes, str, list[tuple[bytes, bytes]]] | None:
        if path in self.files:
            content_type = self.content_types.get(path) or (
                "application/vnd.pypi.simple.v1+json"
                if path.startswith("/simple/")
                else "application/octet-stream"
            )
            return _with_etag(self.files[path], content_type, headers)
        if path.startswith("/simple/"):
            return self._index(path, headers)
        if path.startswith("/packages/"):
            name = unquote(path[len("/packages/") :])
            for files in self.projects.values():
                for f in files:
                    if name == f.filename:
                        return 200, f.body, "application/octet-stream", []
                    if f.metadata is not None and name == f.filename + ".metadata":
                        return 200, f.metadata, "application/octet-stream", []
            return None
        if path in self.files:
            return 200, self.files[path], "application/octet-stream", []
        if self.directory is not None:
            relative = os.path.normpath(path.lstrip("/"))
            target = self.directory / relative
            # Symlinks are followed (Debian's repository is made of them); '..' is not.
            if not relative.startswith("..") and target.is_file():
                stamp = self.directory_last_modified
                extra = [(b"last-modified", stamp.encode())] if stamp is not None else []
                return 200, target.read_bytes(), "application/octet-stream", extra
        return None

    def _index(
        self, path: str, headers: dict[str, str]
    ) -> tuple[int, bytes, str, list[tuple[bytes, bytes]]] | None:
        accept = headers.get("accept", "")
        want_json = (JSON_V1 in accept.split(",")[0] or self.json_only) and not self.html_only
        if path == "/simple/":
            names = sorted(self.projects)
            if want_json:
                data = {"meta": {"api-version": "1.0"}, "projects": [{"name": n} for n in names]}
                body = json.dumps(data).encode()
            else:
                links = "".join(f'<a href="/simple/{n}/">{n}</a>\n' for n in names)
                body = f"<html><body>{links}</body></html>".encode()
        else:
            name = path[len("/simple/") :].rstrip("/")
            files = self.projects.get(name)
            if files is None:
                return None
            prefix = f"{self.base_url}/packages/" if self.absolute_links else "../../packages/"
            if want_json:
                items = []
                for f in files:
                    item: dict[str, Any] = {
                        "filename": f.filename,
                        "url": prefix + quote(f.filename),
                        "hashes": {} if f.unhashed else {"sha256": f.sha256},
                        "size": len(f.body),
                    }
                    if f.requires_python:
                        item["requires-python"] = f.requires_python
                    if f.yanked:
                        item["yanked"] = f.yanked
                    if f.metadata is not None:
                        item["core-metadata"] = {"sha256": hashlib.sha256(f.metadata).hexdigest()}
                    if f.upload_time is not None:
                        item["upload-time"] = f.upload_time
                    items.append(item)
                data = {
                    "meta": {"api-version": "1.1"},
                    "name": name,
                    "files": items,
                    "versions": sorted({_version_of(f.filename) for f in files}),
                }
                body = json.dumps(data).encode()
            else:
                anchors = []
                for f in files:
                    fragment = "" if f.unhashed else f"#sha256={f.sha256}"
                    href = html.escape(f"{prefix}{quote(f.filename)}{fragment}")
                    attrs = f'href="{href}"'
                    if f.requires_python:
                        attrs += f' data-requires-python="{html.escape(f.requires_python)}"'
                    if f.yanked:
                        reason = f.yanked if isinstance(f.yanked, str) else ""
                        attrs += f' data-yanked="{html.escape(reason)}"'
                    if f.metadata is not None:
                        digest = hashlib.sha256(f.metadata).hexdigest()
                        attrs += f' data-core-metadata="sha256={digest}"'
                    anchors.append(f"<a {attrs}>{html.escape(f.filename)}</a><br/>")
                body = ("<html><body>" + "\n".join(anchors) + "</body></html>").encode()
        etag = '"' + hashlib.sha256(body).hexdigest()[:16] + '"'
        if headers.get("if-none-match") == etag:
            return 304, b"", "", [(b"etag", etag.encode())]
        content_type = JSON_V1 if want_json else "text/html"
        return 200, body, content_type, [(b"etag", etag.encode())]


def _version_of(filename: str) -> str:
    return filename.split("-")[1].removesuffix(".tar.gz") if "-" in filename else "0"


async def _send(
    send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    all_headers = [(b"content-length", str(len(body)).encode()), *(headers or [])]
    await send({"type": "http.response.start", "status": status, "headers": all_headers})
    await send({"type": "http.response.body", "body": body})


def _with_etag(
    body: bytes, content_type: str, headers: dict[str, str]
) -> tuple[int, bytes, str, list[tuple[bytes, bytes]]]:
    """200 with an ETag, or 304 when the request's If-None-Match names it."""
    etag = '"' + hashlib.sha256(body).hexdigest()[:16] + '"'
    if headers.get("if-none-match") == etag:
        return 304, b"", "", [(b"etag", etag.encode())]
    return 200, body, content_type, [(b"etag", etag.encode())]


class ServerThread:
    """Run an ASGI app with uvicorn on 127.0.0.1:<free port> in a thread."""

    def __init__(
        self, app: Any, lifespan: Literal["auto", "on", "off"] = "on", **config: Any
    ) -> None:
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = uvicorn.Config(
            app,
            lifespan=lifespan,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=2,
            **config,
        )
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        except BaseException as exc:  # surfaced by start()
            self.error = exc

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if self.error is not None or not self.thread.is_alive():
                # Its socket goes too: left open, it would surface as an unraisable
                # ResourceWarning in whichever test runs next (warnings are errors).
                self.sock.close()
                raise RuntimeError(f"server failed to start: {self.error!r}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("server did not start within 30s")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


def start_upstream(upstream: FakeUpstream) -> ServerThread:
    server = ServerThread(upstream).start()
    upstream.base_url = server.url
    return server


# -- building wheels ------------------------------------------------------------------


def zip_bytes(payload: bytes, name: str = "payload.txt") -> bytes:
    """A small valid zip archive holding ``payload``: what a jar or a wheel looks like to
    the proxy's content check (docs/architecture.md, "Content checks before storing")."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        # The entry's time is fixed, not the clock's: two calls a second apart must be
        # the same archive.
        archive.writestr(zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0)), payload)
    return buffer.getvalue()


def make_wheel(
    name: str, version: str, requires: list[str] | None = None
) -> tuple[str, bytes, bytes]:
    """A minimal pure-Python wheel: (filename, wheel bytes, METADATA bytes)."""
    dist = name.replace("-", "_")
    dist_info = f"{dist}-{version}.dist-info"
    metadata_lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    metadata_lines += [f"Requires-Dist: {r}" for r in requires or []]
    metadata = ("\n".join(metadata_lines) + "\n").encode()
    files = {
        f"{dist}/__init__.py": f"VERSION = {version!r}\n".encode(),
        f"{dist_info}/METADATA": metadata,
        f"{dist_info}/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record_lines = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record_lines.append(f"{path},sha256={digest},{len(data)}")
    record_lines.append(f"{dist_info}/RECORD,,")
    files[f"{dist_info}/RECORD"] = ("\n".join(record_lines) + "\n").encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as zf:
        for path, data in files.items():
            zf.writestr(zipfile.ZipInfo(path, date_time=(2024, 1, 1, 0, 0, 0)), data)
    return f"{dist}-{version}-py3-none-any.whl", buffer.getvalue(), metadata


# -- building source distributions ------------------------------------------------------

# A PEP 517 build backend inside the sdist itself (backend-path = ["."]): pip builds the
# wheel with no build dependency at all, so installing the tarball needs no index.
_IN_TREE_BACKEND = """
import base64, hashlib, os, zipfile

NAME, VERSION = {name!r}, {version!r}


def _metadata():
    return f"Metadata-Version: 2.1\\nName: {{NAME}}\\nVersion: {{VERSION}}\\n".encode()


def get_requires_for_build_wheel(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    dist = NAME.replace("-", "_")
    info = f"{{dist}}-{{VERSION}}.dist-info"
    with open(os.path.join(os.path.dirname(__file__), f"{{dist}}.py"), "rb") as fh:
        module = fh.read()
    files = {{
        f"{{dist}}.py": module,
        f"{{info}}/METADATA": _metadata(),
        f"{{info}}/WHEEL": b"Wheel-Version: 1.0\\nGenerator: tests\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n",
    }}
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{{path}},sha256={{digest}},{{len(data)}}")
    record.append(f"{{info}}/RECORD,,")
    files[f"{{info}}/RECORD"] = ("\\n".join(record) + "\\n").encode()
    filename = f"{{dist}}-{{VERSION}}-py3-none-any.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, filename), "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return filename
"""


def make_sdist(name: str, version: str) -> tuple[str, bytes]:
    """A source tarball ``name-version.tar.gz`` that pip installs offline."""
    import tarfile

    dist = name.replace("-", "_")
    top = f"{dist}-{version}"
    members = {
        f"{top}/pyproject.toml": (
            '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n'
            f'[project]\nname = "{name}"\nversion = "{version}"\n'
        ).encode(),
        f"{top}/backend.py": _IN_TREE_BACKEND.format(name=name, version=version).encode(),
        f"{top}/{dist}.py": f"VERSION = {version!r}\n".encode(),
        f"{top}/PKG-INFO": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
    }
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for path, data in members.items():
            info = tarfile.TarInfo(path)
            info.size = len(data)
            info.mtime = 1_700_000_000
            tar.addfile(info, io.BytesIO(data))
    return f"{top}.tar.gz", buffer.getvalue()
