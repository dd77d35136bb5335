"""The HTTP/1.1 server protocol: uvicorn's httptools protocol, with the limits a proxy
facing untrusted clients needs and uvicorn does not set (docs/architecture.md, "Slow
and hostile clients").

- A request head must arrive whole within ``HEAD_TIMEOUT_S`` of the connection (or of
  the end of the previous response): a client that opens connections and never
  finishes its headers (slowloris) is answered 408 and disconnected, and an idle new
  connection is closed. A pipelined head that begins while a response is still being
  sent starts its clock only when that response ends, and no refusal is ever written
  into a response in progress: it waits for the response's end.
- A request head may be at most ``MAX_HEAD_BYTES``: past that the client gets 431 and
  is disconnected before more is buffered (the parser would otherwise keep a header
  line of any length in memory).
- A request body still arriving after its answer was sent (an upload refused with a
  401 or 413 before it was read) is skipped, so the client can finish sending and read
  the answer, but at most ``MAX_SKIPPED_BODY_BYTES`` of it: past that the connection is
  closed.

It also offers responses a zero-copy path (``SocketFileSender``, in the request scope's
extensions as ``SENDFILE_EXTENSION``): bytes of a file go from the page cache to the
client's socket with ``os.sendfile`` instead of being read into Python and written
through the transport (docs/architecture.md, "Streaming across replicas").

It is passed to uvicorn as ``Config(http=GuardedHttpToolsProtocol)``, uvicorn's way of
choosing the protocol class.
"""

from __future__ import annotations

import asyncio
import os

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

SENDFILE_EXTENSION = "proxy.sendfile"
HEAD_TIMEOUT_S = 10.0
MAX_HEAD_BYTES = 32 * 1024
MAX_SKIPPED_BODY_BYTES = 64 * 1024 * 1024
_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    _in_head = True
    _head_bytes = 0
    _head_timer: asyncio.TimerHandle | None = None
    # A refusal for a pipelined head, held until the response being sent is complete.
    _pending_refusal: tuple[int, str] | None = None
    _skipped_body_bytes = 0  # of this request's body, after its answer

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
        self._skipped_body_bytes = 0
        if not self._in_head:
            self._begin_head()

    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        if cycle is not None and cycle.response_complete and not self.transport.is_closing():
            self._skipped_body_bytes += len(body)
            if self._skipped_body_bytes > MAX_SKIPPED_BODY_BYTES:
                self.transport.close()
        super().on_body(body)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._cancel_head_timer()
        super().on_headers_complete()
        # The app's task has been created, not run yet: it finds the sender in its scope.
        if self.cycle is None or self.cycle.scope is not self.scope:
            return  # an upgrade request: no cycle of its own
        sender = SocketFileSender.of(self.transport, self.cycle)
        if sender is not None:
            extensions: dict[str, object] = self.scope.setdefault("extensions", {})  # type: ignore[assignment]
            extensions[SENDFILE_EXTENSION] = sender

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if self._pending_refusal is not None:
            self._refuse(*self._pending_refusal)
        elif self._in_head and self._head_timer is None:
            # A pipelined head's clock starts now that our answer before it is sent.
            self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timed_out)

    def _responding(self) -> bool:
        """Is a response still being sent on this connection?"""
        cycle = self.cycle
        return cycle is not None and not cycle.response_complete

    def _begin_head(self) -> None:
        self._in_head = True
        self._head_bytes = 0
        self._cancel_head_timer()
        if not self._responding():  # else on_response_complete starts it
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
        if self._responding():
            # Never inside the body being sent: after it, and read nothing more meanwhile.
            self._pending_refusal = (status, message)
            self.flow.pause_reading()
            return
        body = (message + "\n").encode()
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s"
            % (status, _REASONS[status], len(body), body)
        )
        self.transport.close()


class SocketFileSender:
    """Writes a response body's next bytes from a file to the client's socket with
    ``os.sendfile``, when that cannot disturb uvicorn's own writing: the head is sent,
    the body has a Content-Length, and nothing is queued in the transport (so the bytes
    go out in order). It never waits: a full socket means "0 sent", and the caller
    writes that chunk the ordinary way, whose flow control then waits for the client.
    Call it on the event loop only, with no await between a check and the call."""

    def __init__(self, transport: asyncio.Transport, socket_fd: int, cycle: RequestResponseCycle):
        self._transport = transport
        self._socket_fd = socket_fd
        self._cycle = cycle

    @classmethod
    def of(
        cls, transport: asyncio.Transport, cycle: RequestResponseCycle
    ) -> SocketFileSender | None:
        sock = transport.get_extra_info("socket")
        if sock is None or transport.get_extra_info("sslcontext") is not None:
            return None
        return cls(transport, sock.fileno(), cycle)

    def try_send(self, fd: int, offset: int, count: int) -> int:
        """Send up to ``count`` bytes of ``fd`` from ``offset``; how many went out."""
        cycle = self._cycle
        if (
            not cycle.response_started
            or cycle.response_complete
            or cycle.disconnected
            or cycle.chunked_encoding is not False  # no Content-Length: not ours to do
            or self._transport.is_closing()
            or self._transport.get_write_buffer_size()
        ):
            return 0
        count = min(count, cycle.expected_content_length)
        if count <= 0:
            return 0
        try:
            sent = os.sendfile(self._socket_fd, fd, offset, count)
        except OSError:
            # Full (EAGAIN), or broken: the ordinary write path waits or finds out.
            return 0
        cycle.expected_content_length -= sent
        return sent
