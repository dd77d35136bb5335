"""A download in progress, as its writer sees it: a temp file and how far it has got.

The fetch writes upstream chunks to the temp file and announces each advance; readers
(``transfer.LocalFile``) follow those announcements. ``verify`` releases the last byte,
held back until the body's length and digests are checked, so no client ever
receives a complete body that turns out to be wrong; ``finish`` records what was
stored. A download that fails ends its readers' transfers short.
"""

from __future__ import annotations

from collections.abc import Callable

# What one send hands the transport: a client that stops reading holds about this much
# of our memory (plus the transport's high-water mark), however large the body.
SEND_CHUNK_BYTES = 256 * 1024


class Download:
    def __init__(self, content_type: str | None, total: int | None) -> None:
        self.content_type = content_type
        self.total = total  # the upstream's Content-Length, when it gave one
        self.written = 0
        self.verified = False  # every byte may be read: length and digests checked
        self.finished = False  # published and recorded (or recording failed)
        self.error: BaseException | None = None
        self._listeners: list[Callable[[], None]] = []

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` at every advance and change of state."""
        self._listeners.append(listener)

    def advance_to(self, written: int) -> None:
        if written > self.written:
            self.written = written
            self._announce()

    def verify(self) -> None:
        """The body is complete and checked: its last byte may go out (before it is even
        published: a client need not wait for our fsync)."""
        self.verified = True
        self._announce()

    def finish(self) -> None:
        """Published (recorded in the catalog or not): nothing more will change."""
        self.verified = self.finished = True
        self._announce()

    def fail(self, error: BaseException) -> None:
        if self.finished or self.error is not None:
            return
        if self.verified:
            # The bytes were checked and readers may have them all: only storing them
            # failed (say, the disk filled up at fsync). Readers finish; nothing is kept.
            self.finish()
            return
        self.error = error
        self._announce()

    def _announce(self) -> None:
        for listener in self._listeners:
            listener()
