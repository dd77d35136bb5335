#!/usr/bin/env python3
"""A fake PyPI upstream for the deploy test: a folder served as a PEP 503 index.

``ROOT/{project}/{file}`` is listed at ``/simple/{project}/`` (with its sha256) and
served from ``/files/{project}/{file}``. ``GET /_counts`` answers a JSON object with
the number of GET requests each path got. Standard library only, so it runs in the
plain python image:

    python3 fake_upstream.py --root DIR --port 8000
"""

from __future__ import annotations

import argparse
import hashlib
import html
import json
import signal
import sys
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


class Index:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()

    def count(self, path: str) -> None:
        with self.lock:
            self.counts[path] += 1

    def page(self, project: str) -> bytes | None:
        folder = self.root / project
        if not project or "/" in project or not folder.is_dir():
            return None
        links = []
        for file in sorted(folder.iterdir()):
            digest = hashlib.sha256(file.read_bytes()).hexdigest()
            name = html.escape(file.name)
            links.append(f'<a href="/files/{project}/{name}#sha256={digest}">{name}</a><br>')
        body = "<!DOCTYPE html><html><body>\n" + "\n".join(links) + "\n</body></html>\n"
        return body.encode()


class Handler(BaseHTTPRequestHandler):
    index: Index
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        path = unquote(urlsplit(self.path).path)
        if path == "/_counts":
            with self.index.lock:
                body = json.dumps(dict(self.index.counts), sort_keys=True).encode()
            return self.send(200, body, "application/json")
        self.index.count(path)
        if path.startswith("/simple/"):
            project = path[len("/simple/") :].strip("/")
            page = self.index.page(project)
            if page is None:
                return self.send(404, b"not found\n", "text/plain")
            return self.send(200, page, "text/html")
        if path.startswith("/files/"):
            parts = path[len("/files/") :].split("/")
            if len(parts) == 2 and all(p and not p.startswith(".") for p in parts):
                file = self.index.root / parts[0] / parts[1]
                if file.is_file():
                    return self.send(200, file.read_bytes(), "application/octet-stream")
        self.send(404, b"not found\n", "text/plain")

    def send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        print(f"upstream: {self.address_string()} {format % args}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True, type=Path)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--host", default="0.0.0.0")
    args = parser.parse_args()
    Handler.index = Index(args.root)
    # PID 1 in its container: without a handler, SIGTERM would be ignored until SIGKILL.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print(f"upstream: serving {args.root} on {args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
