"""A fast stand-in upstream for benchmarks: a folder served as a PEP 503 index.

``ROOT/{project}/{file}`` is listed at ``/simple/{project}/`` (with its sha256) and
streamed from ``/packages/{project}/{file}`` in 1 MiB reads, optionally throttled.
Any other path is a file under ROOT (a Maven-layout folder; symlinks followed).
``/_counts`` returns how many requests each path got.

    python bench/upstream_server.py --root DIR --port 8900 [--rate-mbps 50]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
from pathlib import Path
from typing import Any

import uvicorn

CHUNK_BYTES = 1024 * 1024


class FolderIndex:
    def __init__(self, root: Path, rate_bytes_s: float | None) -> None:
        self.root = root
        self.rate_bytes_s = rate_bytes_s
        self.digests: dict[Path, str] = {}
        self.gets: dict[str, int] = {}

    def digest(self, path: Path) -> str:
        if path not in self.digests:
            sidecar = path.with_name(path.name + ".sha256")
            if sidecar.exists() and sidecar.stat().st_mtime >= path.stat().st_mtime:
                self.digests[path] = sidecar.read_text().strip()
            else:
                h = hashlib.sha256()
                with path.open("rb") as fh:
                    while chunk := fh.read(CHUNK_BYTES):
                        h.update(chunk)
                sidecar.write_text(h.hexdigest())
                self.digests[path] = h.hexdigest()
        return self.digests[path]

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        self.gets[path] = self.gets.get(path, 0) + 1
        if path == "/_counts":
            body = repr(self.gets).encode()
            return await _send(send, 200, body, "text/plain")
        if path.startswith("/simple/"):
            project = path[len("/simple/") :].strip("/")
            folder = self.root / project
            if not project or not folder.is_dir():
                return await _send(send, 404, b"not found", "text/plain")
            links = []
            for file in sorted(folder.iterdir()):
                if file.suffix == ".sha256":
                    continue
                digest = await asyncio.to_thread(self.digest, file)
                links.append(
                    f'<a href="/packages/{project}/{file.name}#sha256={digest}">{file.name}</a>'
                )
            body = ("<html><body>" + "\n".join(links) + "</body></html>").encode()
            return await _send(send, 200, body, "text/html")
        file = self.root / (
            path[len("/packages/") :] if path.startswith("/packages/") else path.lstrip("/")
        )
        if ".." not in path.split("/") and file.is_file():
            size = file.stat().st_size
            headers = [
                (b"content-type", b"application/octet-stream"),
                (b"content-length", str(size).encode()),
            ]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            loop = asyncio.get_running_loop()
            started = loop.time()
            sent = 0
            if size == 0:
                await send({"type": "http.response.body", "body": b""})
                return
            fd = os.open(file, os.O_RDONLY)
            try:
                while sent < size:
                    data = await asyncio.to_thread(os.pread, fd, CHUNK_BYTES, sent)
                    sent += len(data)
                    await send(
                        {"type": "http.response.body", "body": data, "more_body": sent < size}
                    )
                    if self.rate_bytes_s:
                        ahead_s = sent / self.rate_bytes_s - (loop.time() - started)
                        if ahead_s > 0:
                            await asyncio.sleep(ahead_s)
            finally:
                os.close(fd)
            return
        await _send(send, 404, b"not found", "text/plain")


async def _send(send: Any, status: int, body: bytes, content_type: str) -> None:
    headers = [
        (b"content-type", content_type.encode()),
        (b"content-length", str(len(body)).encode()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--rate-mbps", type=float, default=None, help="throttle each response")
    args = parser.parse_args()
    rate = args.rate_mbps * 1e6 if args.rate_mbps else None
    app = FolderIndex(args.root, rate)
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        loop="uvloop",
        http="httptools",
        lifespan="off",
    )


if __name__ == "__main__":
    main()
