"""What a stored blob's file is checked against when it is read (docs/architecture.md,
"Blobs verified when read"): its size at every open, its sha256 whenever the file is not
the one this process last verified.

A ``Stamp`` (size, mtime_ns, inode) says which file was verified: publishing a blob is a
rename of a new file (a new inode), and anything that writes into a file moves its mtime,
so a file whose stamp is unchanged holds the bytes it held when it was hashed (short of
bit rot, which the scrub finds). ``Stamps`` remembers them per process, bounded.

The functions at the bottom block: run them in the I/O pool. They return what they found
wrong as a ``Corruption`` rather than raising it, and raise only ``OSError`` (a file that
is gone is ``FileNotFoundError``, the "blob vanished" path).
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

# Blobs up to this size are served from the in-memory hot LRU, and hashed at every load
# into it: a stamp would never be asked for, so none is kept for them.
SMALL_BLOB_BYTES = 256 * 1024
# Stamps kept per process: each costs about 400 bytes, so 20,000 are 8 MB, and they
# cover 20,000 large blobs hit by this process (one forgotten costs one hash as sent).
STAMPS_CAPACITY = 20_000
READ_CHUNK_BYTES = 1024 * 1024
OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class Stamp(NamedTuple):
    """Which file a path named when it was looked at."""

    size: int
    mtime_ns: int
    inode: int


def stamp_of(stat: os.stat_result) -> Stamp:
    return Stamp(stat.st_size, stat.st_mtime_ns, stat.st_ino)


class Stamps:
    """The blob files this process knows to be good, by sha256, least recently used out.

    Noted when our own download publishes a file, when the local tier keeps a copy, and
    after any full hash that matched; consulted at every open of a large blob."""

    def __init__(self, capacity: int = STAMPS_CAPACITY) -> None:
        self.capacity = capacity
        self._stamps: OrderedDict[str, Stamp] = OrderedDict()

    def __len__(self) -> int:
        return len(self._stamps)

    def known_good(self, sha256: str, stamp: Stamp) -> bool:
        """Is the file just opened the one last verified?"""
        if self._stamps.get(sha256) != stamp:
            return False
        self._stamps.move_to_end(sha256)
        return True

    def note(self, sha256: str, stamp: Stamp) -> None:
        if stamp.size <= SMALL_BLOB_BYTES:
            return
        self._stamps[sha256] = stamp
        self._stamps.move_to_end(sha256)
        if len(self._stamps) > self.capacity:
            self._stamps.popitem(last=False)

    def forget(self, sha256: str) -> None:
        self._stamps.pop(sha256, None)


@dataclass(frozen=True, slots=True)
class Corruption:
    """A stored copy of a blob found not to be its bytes: ``size`` and ``sha256`` are
    what the catalog says, ``found_size`` and ``found_sha256`` what the copy holds (no
    ``found_sha256`` when the size already differs: it was not read). ``stamp``: the
    file found so (None: an object in a bucket)."""

    sha256: str
    size: int
    found_size: int
    found_sha256: str | None = None
    stamp: Stamp | None = None
    kind: str | None = None  # what is at the file's name instead of a file ("a symbolic link")

    @property
    def reason(self) -> str:
        """The label of ``proxy_blobs_quarantined_total``: "type", "size" or "digest"."""
        if self.kind is not None:
            return "type"
        return "size" if self.found_size != self.size else "digest"

    def describe(self) -> str:
        if self.kind is not None:
            found = f"found {self.kind}"
        elif self.found_size != self.size:
            found = f"found {self.found_size} bytes"
        else:
            found = f"found sha256 {self.found_sha256}"
        return f"expected {self.size} bytes with sha256 {self.sha256}, {found}"


# -- blocking: run these in the I/O pool ----------------------------------------------


def open_regular(path: str) -> int:
    """``path`` opened for reading, if it is a regular file of its own: never through a
    symlink, and never blocking on a FIFO. Whoever can write the folder must not make us
    read elsewhere, or hang."""
    fd = os.open(path, OPEN_FLAGS)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_sized(path: str, sha256: str, size: int) -> tuple[int, Stamp] | Corruption:
    """Open a blob file and check its size with one ``fstat`` of the descriptor opened:
    the descriptor (the caller's to close) and the file's stamp, or what is wrong (also
    something at its name that is not a regular file: a symlink, a FIFO)."""
    try:
        fd = os.open(path, OPEN_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return Corruption(sha256, size, -1, kind="a symbolic link")
        raise
    try:
        info = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        return Corruption(sha256, size, -1, kind="not a regular file")
    stamp = stamp_of(info)
    if stamp.size != size:
        os.close(fd)
        return Corruption(sha256, size, stamp.size, stamp=stamp)
    return fd, stamp


def stat_sized(path: str, sha256: str, size: int) -> Corruption | None:
    """A HEAD's check: the file is there (else FileNotFoundError), of the right size."""
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode):
        return Corruption(sha256, size, -1, kind="not a regular file")
    stamp = stamp_of(info)
    return Corruption(sha256, size, stamp.size, stamp=stamp) if stamp.size != size else None


def read_verified(path: str, sha256: str, size: int) -> tuple[bytes, Stamp] | Corruption:
    """A small blob's bytes, read and hashed in one go (the hot LRU's load)."""
    opened = open_sized(path, sha256, size)
    if isinstance(opened, Corruption):
        return opened
    fd, stamp = opened
    try:
        data = _read_upto(fd, size + 1)  # a byte more shows a file that grew meanwhile
    finally:
        os.close(fd)
    if len(data) != size:
        return Corruption(sha256, size, len(data), stamp=stamp)
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        return Corruption(sha256, size, size, digest, stamp)
    return data, stamp


def verify_fd(fd: int, sha256: str, size: int, stamp: Stamp) -> Corruption | None:
    """Hash a whole open blob file (before a byte range of it is sent)."""
    hasher = hashlib.sha256()
    read = 0
    while data := os.pread(fd, READ_CHUNK_BYTES, read):
        hasher.update(data)
        read += len(data)
        if read > size:
            break
    if read != size:
        return Corruption(sha256, size, read, stamp=stamp)
    digest = hasher.hexdigest()
    return None if digest == sha256 else Corruption(sha256, size, size, digest, stamp)


def hash_fd(fd: int, length: int | None = None) -> str:
    """sha256 of a file's first ``length`` bytes (OSError if it is shorter), or of all
    of it."""
    hasher = hashlib.sha256()
    offset = 0
    while length is None or offset < length:
        want = READ_CHUNK_BYTES if length is None else min(READ_CHUNK_BYTES, length - offset)
        data = os.pread(fd, want, offset)
        if not data:
            if length is None:
                break
            raise OSError(f"the file ended at {offset} of {length} bytes")
        hasher.update(data)
        offset += len(data)
    return hasher.hexdigest()


def read_hashed(fd: int, size: int, offset: int, hasher: hashlib._Hash) -> bytes:
    """``pread`` and hash in one thread hop (a body hashed as it is sent)."""
    data = os.pread(fd, size, offset)
    hasher.update(data)
    return data


def _read_upto(fd: int, limit: int) -> bytes:
    chunks = []
    read = 0
    while read < limit and (data := os.read(fd, limit - read)):
        chunks.append(data)
        read += len(data)
    return b"".join(chunks)
