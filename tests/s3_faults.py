"""A fault injector in front of the real S3 server (tests/seaweed.py): a reverse proxy
on port 0 that forwards every request unchanged (the Host header too, so the client's
signature still holds) and, when the test says so, answers an operation with
``503 SlowDown`` or holds it until released. It never answers in the server's place:
every request that gets through is checked by SeaweedFS."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.upstream import ServerThread

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


def operation(method: str, query: str) -> str:
    """The S3 operation of a request, roughly as the proxy's metrics name them."""
    if "uploadId=" in query and "partNumber=" in query:
        return "upload_part"
    if method == "POST" and "uploads" in query:
        return "create_multipart"
    if method == "POST" and "uploadId=" in query:
        return "complete_multipart"
    if method == "DELETE" and "uploadId=" in query:
        return "abort_multipart"
    if method == "POST" and "delete" in query:
        return "delete"
    if method == "GET" and ("list-type" in query or "uploads" in query):
        return "list"
    return {"GET": "get", "PUT": "put", "HEAD": "head"}.get(method, method.lower())


@dataclass
class S3Faults:
    backend: str  # the real server's endpoint
    slow_down: Counter[str] = field(default_factory=Counter)  # operation -> times left
    held: set[str] = field(default_factory=set)  # operations held until released
    seen: Counter[str] = field(default_factory=Counter)
    lists: list[str] = field(default_factory=list)  # the query of every listing
    released: threading.Event = field(default_factory=threading.Event)

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
        method, query = scope["method"], scope["query_string"].decode()
        op = operation(method, query)
        self.seen[op] += 1
        if op == "list":
            self.lists.append(query)
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        while op in self.held and not self.released.is_set():  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        if self.slow_down[op] > 0:
            self.slow_down[op] -= 1
            headers = [
                (b"content-type", b"application/xml"),
                (b"content-length", b"%d" % len(SLOW_DOWN)),
            ]
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            await send({"type": "http.response.body", "body": SLOW_DOWN})
            return
        url = self.backend + scope["raw_path"].decode() + (f"?{query}" if query else "")
        # Host stays (it is signed); the length is the body's, set again by httpx.
        headers = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in scope["headers"]
            if k.lower() not in (b"content-length", b"transfer-encoding", b"expect", b"connection")
        ]
        async with httpx.AsyncClient(timeout=60) as client:
            request = client.build_request(method, url, headers=headers, content=body)
            answer = await client.send(request, stream=True)
            try:
                out = [
                    (k.encode("latin-1"), v.encode("latin-1"))
                    for k, v in answer.headers.multi_items()
                    if k.lower() not in ("transfer-encoding", "connection")
                ]
                await send(
                    {"type": "http.response.start", "status": answer.status_code, "headers": out}
                )
                async for chunk in answer.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b""})
            finally:
                await answer.aclose()


def start_faults(backend: str) -> tuple[S3Faults, ServerThread]:
    faults = S3Faults(backend)
    server = ServerThread(faults).start()
    return faults, server
