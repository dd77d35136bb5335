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
  the answer, but at most ``MAX_SKIPPED_BODY_BYTES`` of it, and only while it keeps
  coming: ``HEAD_TIMEOUT_S`` plus a second per ``MIN_SKIPPED_BODY_RATE`` bytes skipped,
  from the answer's end. Past either the connection is closed.

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
from typing import Any

from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from proxy.runtime.blocking import run_blocking

SENDFILE_EXTENSION = "proxy.sendfile"
HEAD_TIMEOUT_S = 10.0
MAX_HEAD_BYTES = 32 * 1024
MAX_SKIPPED_BODY_BYTES = 64 * 1024 * 1024
MIN_SKIPPED_BODY_RATE = 16 * 1024  # bytes per second, on average: 128 kbit/s
_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}
# A connection whose answers are not being read (this much is waiting in the transport)
# is answered by the full path, whose writes wait for the client, not the hit lane.
LANE_WRITE_BUFFER_MAX = 256 * 1024


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    _in_head = True
    _head_bytes = 0
    # When this connection's head must have arrived, or (``_idle``) when it is closed
    # unless a request begins (after a hit lane answer: uvicorn's keep-alive timeout).
    # One timer per connection watches it, moved only when the deadline comes earlier
    # than it is set for: a busy keep-alive connection costs no timer per request.
    _deadline: float | None = None
    _idle = False
    _watch: asyncio.TimerHandle | None = None
    _watch_at = 0.0
    # A refusal for a pipelined head, held until the response being sent is complete.
    _pending_refusal: tuple[int, str] | None = None
    _skipped_body_bytes = 0  # of this request's body, after its answer
    _skip_began: float | None = None  # when the body's skipping began (its answer's end)
    _message_done = True  # the request's whole message (its body too) has arrived
    _began_here = False  # a message began in the chunk being parsed

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._begin_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._deadline = None
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._began_here = False
        super().data_received(data)
        if self._in_head and not self.transport.is_closing():
            # The bytes of a head that began in this chunk are not counted: the chunk
            # also holds the requests before it (pipelined), which are no part of it.
            # So a head may grow one read (uvloop's, 256 KiB) past the limit.
            if not self._began_here:
                self._head_bytes += len(data)
            else:
                self._head_bytes = max(self._head_bytes, 1)  # begun: not an idle line
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse(431, f"the request head is over {MAX_HEAD_BYTES} bytes")

    def on_message_begin(self) -> None:
        # uvicorn's, but for the request's scope, which only the app needs: it is made
        # in on_headers_complete for a request the hit lane does not answer.
        self.url = b""
        self.expect_100_continue = False
        self.headers = []
        self._skipped_body_bytes = 0
        self._skip_began = None
        self._message_done = False
        self._began_here = True
        if not self._in_head:
            self._begin_head()

    def on_message_complete(self) -> None:
        self._message_done = True
        if self.cycle is _ANSWERED:
            # The hit lane answered it and set its idle wait, unless a body followed.
            if self._skip_began is not None and not self.transport.is_closing():
                self._set_deadline(self.timeout_keep_alive, idle=True)
            return
        super().on_message_complete()
        if (
            not self._in_head
            and not self._responding()
            and not self.pipeline
            and not self.transport.is_closing()
        ):
            # Answered before its body had all arrived (a refused upload, read to the
            # end so the client reads the answer): idle from now on.
            self._set_deadline(self.timeout_keep_alive, idle=True)

    def _new_scope(self) -> Any:
        """The request's scope as uvicorn's on_message_begin makes it."""
        return {
            "type": "http",
            "asgi": {"version": self.asgi_version, "spec_version": "2.3"},
            "http_version": "1.1",
            "server": self.server,
            "client": self.client,
            "scheme": self.scheme,
            "root_path": self.root_path,
            "headers": self.headers,
            "state": self.app_state.copy(),
        }

    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        if cycle is not None and cycle.response_complete and not self.transport.is_closing():
            self._skipped_body_bytes += len(body)
            if self._skipped_body_bytes > MAX_SKIPPED_BODY_BYTES:
                self.transport.close()
            else:
                self._skip_body_deadline()
        super().on_body(body)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._deadline = None
        if self._answered_by_lane():
            return
        self.scope = self._new_scope()
        super().on_headers_complete()
        # The app's task has been created, not run yet: it finds the sender in its scope.
        cycle = self.cycle
        if cycle is None or cycle is _ANSWERED or cycle.scope is not self.scope:
            return  # an upgrade request: no cycle of its own
        sender = SocketFileSender.of(self.transport, self.cycle)
        if sender is not None:
            extensions: dict[str, object] = self.scope.setdefault("extensions", {})  # type: ignore[assignment]
            extensions[SENDFILE_EXTENSION] = sender

    def _answered_by_lane(self) -> bool:
        """Answer the request whose head just arrived from the hit lane, if it has its
        answer and nothing is being sent on this connection (``http/lane.py``). The
        request then never reaches the app: no cycle, no task."""
        lane = self.app_state.get("lane")
        cycle = self.cycle
        if lane is None or (cycle is not None and not cycle.response_complete):
            return False
        parser = self.parser
        method = parser.get_method()
        if (
            method not in (b"GET", b"HEAD")
            or parser.get_http_version() != "1.1"
            or not parser.should_keep_alive()
            or self.transport.get_write_buffer_size() > LANE_WRITE_BUFFER_MAX
        ):
            return False
        transport = self.transport
        if not lane.serve(
            transport.write,
            method,
            self.url,
            self.headers,
            self.server_state.default_headers,
            self._client_address,
        ):
            return False
        self.cycle = _ANSWERED
        # What uvicorn does when a response is complete (on_response_complete); its
        # keep-alive timeout is watched by our deadline.
        self.server_state.total_requests += 1
        if not transport.is_closing():
            self._unset_keepalive_if_required()
            self.flow.resume_reading()
            self._set_deadline(self.timeout_keep_alive, idle=True)
        return True

    def _client_address(self) -> str:
        """The client as the access log names it: the peer, or the address a trusted
        proxy forwarded (as uvicorn's ProxyHeadersMiddleware reads it for the app)."""
        host = self.client[0] if self.client else "-"
        app = self.app
        if isinstance(app, ProxyHeadersMiddleware) and host in app.trusted_hosts:
            forwarded = [v for n, v in self.headers if n == b"x-forwarded-for"]
            if forwarded:
                found, _port = app.trusted_hosts.get_trusted_client_address(
                    b", ".join(forwarded).decode("latin-1")
                )
                host = found or host
        return host

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        # Our deadline watches this connection from here: uvicorn's keep-alive timer,
        # armed when no request is queued, would cut a head that is half here.
        self._unset_keepalive_if_required()
        if self._pending_refusal is not None:
            self._refuse(*self._pending_refusal)
        elif self._in_head and self._deadline is None:
            # A pipelined head's clock starts now that our answer before it is sent.
            self._set_deadline(HEAD_TIMEOUT_S, idle=False)
        elif not self._in_head and not self.pipeline:
            # Idle until a request begins: uvicorn's keep-alive timer stopped at any
            # byte, so a client sending bare CRLFs kept the connection for ever. Not
            # while the body of the request just answered still arrives: it is skipped
            # while it keeps coming, and on_message_complete starts the wait after it.
            if self._message_done:
                self._set_deadline(self.timeout_keep_alive, idle=True)
            else:
                self._skip_body_deadline()

    def _skip_body_deadline(self) -> None:
        """The rest of an answered request's body must keep coming: within
        ``HEAD_TIMEOUT_S`` of the answer's end, plus a second per
        ``MIN_SKIPPED_BODY_RATE`` bytes skipped since (a body that never comes, or comes
        a byte at a time, would hold the connection for ever)."""
        now = self.loop.time()
        if self._skip_began is None:
            self._skip_began = now
        allowed = HEAD_TIMEOUT_S + self._skipped_body_bytes / MIN_SKIPPED_BODY_RATE
        self._set_deadline(self._skip_began + allowed - now, idle=True)

    def _responding(self) -> bool:
        """Is a response still being sent on this connection?"""
        cycle = self.cycle
        return cycle is not None and not cycle.response_complete

    def _begin_head(self) -> None:
        self._in_head = True
        self._head_bytes = 0
        self._deadline = None
        if not self._responding():  # else on_response_complete starts it
            self._set_deadline(HEAD_TIMEOUT_S, idle=False)

    def _set_deadline(self, seconds: float, idle: bool) -> None:
        when = self.loop.time() + seconds
        self._deadline, self._idle = when, idle
        if self._watch is None or self._watch_at > when:
            if self._watch is not None:
                self._watch.cancel()
            self._watch, self._watch_at = self.loop.call_at(when, self._watched), when

    def _watched(self) -> None:
        self._watch = None
        deadline = self._deadline
        if deadline is None or self.transport.is_closing():
            return
        if self.loop.time() < deadline:  # moved on since: watch the new one
            self._watch, self._watch_at = self.loop.call_at(deadline, self._watched), deadline
            return
        self._deadline = None
        if self._idle:
            if not self._responding():
                self.transport.close()  # uvicorn's keep-alive timeout
        else:
            self._head_timed_out()

    def _head_timed_out(self) -> None:
        if not self._in_head or self.transport.is_closing():
            return
        if self._head_bytes == 0:
            self.transport.close()  # idle: nothing to answer
        else:
            self._refuse(408, f"the request head did not arrive within {HEAD_TIMEOUT_S:.0f} s")

    def _refuse(self, status: int, message: str) -> None:
        self._deadline = None
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


class _Answered:
    """The cycle of a request the hit lane answered: complete from the start (what
    uvicorn's parser callbacks and shutdown look at)."""

    response_complete = True
    disconnected = False
    keep_alive = True

    class message_event:
        @staticmethod
        def set() -> None:
            pass


_ANSWERED: Any = _Answered()


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

    def _sendable(self, count: int) -> int:
        """How much of ``count`` may go out with sendfile now (0: none)."""
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
        return max(0, min(count, cycle.expected_content_length))

    def try_send(self, fd: int, offset: int, count: int) -> int:
        """Send up to ``count`` bytes of ``fd`` from ``offset``; how many went out. On
        the event loop: for bytes in the page cache (a file being written), which a
        sendfile never waits for."""
        count = self._sendable(count)
        if not count:
            return 0
        try:
            sent = os.sendfile(self._socket_fd, fd, offset, count)
        except OSError:
            # Full (EAGAIN), or broken: the ordinary write path waits or finds out.
            return 0
        self._cycle.expected_content_length -= sent
        return sent

    def start_send(self, fd: int, offset: int, count: int) -> asyncio.Future[int] | None:
        """``try_send`` in the I/O pool, for a stored file whose bytes may have to be
        read from disk first (a network volume's too): the loop never waits for them.
        The future gives how many bytes went out (0: the socket is full, or broken); pass
        it to ``sent`` once done. ``fd`` must stay open until it is done, even if the
        response is cancelled meanwhile: the thread goes on (``FileResponse``). The
        socket is a duplicate of the connection's, so a connection closed meanwhile
        cannot have its descriptor reused under the call. Nothing else writes to the
        socket meanwhile: the response's own task is its only writer, and it awaits
        this (uvicorn writes only when asked)."""
        count = self._sendable(count)
        if not count:
            return None
        out = os.dup(self._socket_fd)
        return asyncio.ensure_future(run_blocking(_send_closing, out, fd, offset, count))

    def sent(self, count: int) -> None:
        self._cycle.expected_content_length -= count


def _send_closing(out: int, fd: int, offset: int, count: int) -> int:
    """sendfile from ``fd`` to ``out``, then close ``out`` (a duplicate); how many bytes
    went out, 0 if none could (EAGAIN: full; anything else: the ordinary write path of
    the response finds it out)."""
    try:
        return os.sendfile(out, fd, offset, count)
    except OSError:
        return 0
    finally:
        os.close(out)
