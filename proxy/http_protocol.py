"""The HTTP/1.1 server protocol: uvicorn's httptools protocol, with the limits a proxy
facing untrusted clients needs and uvicorn does not set (docs/architecture.md, "Slow
and hostile clients").

- A request head must arrive whole within ``HEAD_TIMEOUT_S`` of the connection (or of
  the previous response): a client that opens connections and never finishes its
  headers (slowloris) is answered 408 and disconnected, and an idle new connection is
  closed.
- A request head may be at most ``MAX_HEAD_BYTES``: past that the client gets 431 and
  is disconnected before more is buffered (the parser would otherwise keep a header
  line of any length in memory).

It is passed to uvicorn as ``Config(http=GuardedHttpToolsProtocol)``, uvicorn's way of
choosing the protocol class.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

HEAD_TIMEOUT_S = 10.0
MAX_HEAD_BYTES = 32 * 1024
_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    _in_head = True
    _head_bytes = 0
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._begin_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_head and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse(431, f"the request head is over {MAX_HEAD_BYTES} bytes")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._in_head:
            self._begin_head()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._cancel_head_timer()
        super().on_headers_complete()

    def _begin_head(self) -> None:
        self._in_head = True
        self._head_bytes = 0
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._in_head or self.transport.is_closing():
            return
        if self._head_bytes == 0:
            self.transport.close()  # idle: nothing to answer
        else:
            self._refuse(408, f"the request head did not arrive within {HEAD_TIMEOUT_S:.0f} s")

    def _refuse(self, status: int, message: str) -> None:
        self._cancel_head_timer()
        body = (message + "\n").encode()
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s"
            % (status, _REASONS[status], len(body), body)
        )
        self.transport.close()
