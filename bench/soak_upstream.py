"""The upstream of bench/soak.py: a PEP 503/691 index over a folder, in a process of its
own, whose faults the soak switches at run time.

``ROOT/{project}/{file}`` is listed at ``/simple/{project}/`` (HTML or JSON by Accept,
with sha256 and size) and served from ``/packages/{project}/{file}``. Control:

- ``POST /_fault?mode=none|fail|hang|trickle``: every index and file request from now on
  answers 503 (fail), never answers until the mode changes (hang), or sends its body
  at about 20 KB/s (trickle);
- ``GET /_log``: JSON lines ``[time, path, status, bytes sent, complete]`` of every
  request answered so far (the soak counts downloads per file from it).

    python bench/soak_upstream.py --root DIR --port 8900
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import uvicorn

CHUNK_BYTES = 256 * 1024
TRICKLE_CHUNK_BYTES = 2048
TRICKLE_DELAY_S = 0.1
HANG_POLL_S = 0.05
JSON_V1 = "application/vnd.pypi.simple.v1+json"


class SoakUpstream:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.mode = "none"
        self.log: list[list[Any]] = []  # [time, path, status, bytes sent, complete]
        self.digests: dict[Path, str] = {}

    def _digest(self, path: Path) -> str:
        if path not in self.digests:
            self.digests[path] = hashlib.sha256(path.read_bytes()).hexdigest()
        return self.digests[path]

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/_fault":
            query = dict(
                part.split("=", 1) for part in scope["query_string"].decode().split("&") if part
            )
            self.mode = query.get("mode", "none")
            return await _send(send, 200, f"mode={self.mode}\n".encode(), "text/plain")
        if path == "/_log":
            body = "\n".join(json.dumps(entry) for entry in self.log).encode()
            return await _send(send, 200, body, "application/x-ndjson")
        while self.mode == "hang":  # noqa: ASYNC110 (the mode is switched by /_fault)
            await asyncio.sleep(HANG_POLL_S)
        if self.mode == "fail":
            self.log.append([time.time(), path, 503, 0, False])
            return await _send(send, 503, b"down for the soak\n", "text/plain")
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        if path.startswith("/simple/"):
            await self._index(path, headers, send)
        elif path.startswith("/packages/"):
            await self._file(path, send)
        else:
            await _send(send, 404, b"not found\n", "text/plain")

    async def _index(self, path: str, headers: dict[str, str], send: Any) -> None:
        project = path[len("/simple/") :].strip("/")
        folder = self.root / project
        if not project or "/" in project or not folder.is_dir():
            self.log.append([time.time(), path, 404, 0, True])
            return await _send(send, 404, b"not found\n", "text/plain")
        files = sorted(p for p in folder.iterdir() if p.is_file())
        entries = [
            (p.name, await asyncio.to_thread(self._digest, p), p.stat().st_size) for p in files
        ]
        if JSON_V1 in headers.get("accept", ""):
            body = json.dumps(
                {
                    "meta": {"api-version": "1.1"},
                    "name": project,
                    "files": [
                        {
                            "filename": name,
                            "url": f"/packages/{project}/{name}",
                            "hashes": {"sha256": digest},
                            "size": size,
                        }
                        for name, digest, size in entries
                    ],
                }
            ).encode()
            content_type = JSON_V1
        else:
            links = "\n".join(
                f'<a href="/packages/{project}/{name}#sha256={digest}">{name}</a>'
                for name, digest, _size in entries
            )
            body = f"<html><body>{links}</body></html>".encode()
            content_type = "text/html"
        self.log.append([time.time(), path, 200, len(body), True])
        await _send(send, 200, body, content_type)

    async def _file(self, path: str, send: Any) -> None:
        file = self.root / path[len("/packages/") :]
        if ".." in path.split("/") or not file.is_file():
            self.log.append([time.time(), path, 404, 0, True])
            return await _send(send, 404, b"not found\n", "text/plain")
        entry: list[Any] = [time.time(), path, 200, 0, False]  # from the request on
        data = await asyncio.to_thread(file.read_bytes)
        headers = [
            (b"content-type", b"application/octet-stream"),
            (b"content-length", str(len(data)).encode()),
        ]
        self.log.append(entry)  # its bytes and completion are updated as the body goes out
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        offset = 0
        while offset < len(data):
            if self.mode == "trickle":
                size = TRICKLE_CHUNK_BYTES
                await asyncio.sleep(TRICKLE_DELAY_S)
            else:
                size = CHUNK_BYTES
            chunk = data[offset : offset + size]
            offset += len(chunk)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            entry[3] = offset
        await send({"type": "http.response.body", "body": b""})
        entry[4] = True


async def _send(send: Any, status: int, body: bytes, content_type: str) -> None:
    headers = [(b"content-type", content_type.encode()), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    app = SoakUpstream(args.root)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
