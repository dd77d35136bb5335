"""A download in progress: a temp file that clients read while it grows.

The fetch writes upstream chunks to the temp file and announces each advance; every
waiting client reads from the file at its own pace (positional reads on one shared
descriptor). Memory stays flat however many clients there are and however slow they
read. The last byte is held back until the body is verified, so no client ever
receives a complete body that turns out to be wrong: a failed verification ends the
transfer short.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

from proxy.catalog import Entry

# What one send hands the transport: a client that stops reading holds about this much
# of our memory (plus the transport's high-water mark), however large the body.
SEND_CHUNK_BYTES = 256 * 1024


class Download:
    def __init__(self, path: str, content_type: str | None, total: int | None) -> None:
        self.content_type = content_type
        self.total = total  # the upstream's Content-Length, when it gave one
        self.written = 0
        self.finished = False
        self.error: BaseException | None = None
        self.entry: Entry | None = None
        self._changed = asyncio.Event()
        self._fd: int | None = os.open(path, os.O_RDONLY)
        self._final_path: str | None = None
        self._readers = 0

    # -- writer side ---------------------------------------------------------------

    def advance_to(self, written: int) -> None:
        if written > self.written:
            self.written = written
            self._announce()

    def finish(self, entry: Entry | None, final_path: str) -> None:
        """The body is complete, verified and published at ``final_path``.

        ``entry`` is None if it could not be recorded in the catalog.
        """
        self.entry = entry
        self._final_path = final_path
        self.finished = True
        self._announce()
        self._maybe_close()

    def fail(self, error: BaseException) -> None:
        if self.finished or self.error is not None:
            return
        self.error = error
        self._announce()
        self._maybe_close()

    def _announce(self) -> None:
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    # -- reader side ----------------------------------------------------------------

    async def result(self) -> Entry | None:
        """Wait for the end of the download: its entry, or the fetch's error."""
        while True:
            changed = self._changed
            if self.error is not None:
                raise self.error
            if self.finished:
                return self.entry
            await changed.wait()

    async def chunks(self, start: int = 0) -> AsyncIterator[bytes]:
        """The body from ``start`` as it arrives; raises the fetch's error if it fails."""
        if self.error is not None:
            raise self.error
        own_fd = None
        if self._fd is None:
            # Finished and closed before this reader started: read the published blob.
            assert self._final_path is not None
            own_fd = fd = os.open(self._final_path, os.O_RDONLY)
        else:
            fd = self._fd
        self._readers += 1
        offset = start
        try:
            while True:
                changed = self._changed
                if self.error is not None:
                    raise self.error
                readable = self.written if self.finished else self.written - 1
                if offset < readable:
                    size = min(readable - offset, SEND_CHUNK_BYTES)
                    # Just written, so in the page cache: a read here is cheaper than
                    # a hop to a thread (this runs once per chunk per client).
                    data = os.pread(fd, size, offset)
                    if not data:
                        raise OSError(f"download file ended at {offset} of {self.written} bytes")
                    offset += len(data)
                    yield data
                    continue
                if self.finished:
                    return
                await changed.wait()
        finally:
            self._readers -= 1
            if own_fd is not None:
                os.close(own_fd)
            self._maybe_close()

    def _maybe_close(self) -> None:
        if (
            self._readers == 0
            and (self.finished or self.error is not None)
            and self._fd is not None
        ):
            os.close(self._fd)
            self._fd = None
