"""Type aliases and small value types shared across modules."""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Digests = dict[str, str]
"""Digest name (``sha256``, ``sha1``, ``md5``, ``sha512``) -> lower-case hex."""

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class Kind(enum.StrEnum):
    """What kind of thing an entry is; decides whether and when it is refetched."""

    IMMUTABLE = "immutable"  # wheels, sdists, release jars: never refetched
    METADATA = "metadata"  # index pages, maven-metadata.xml, SNAPSHOTs: fresh for a TTL
    NEGATIVE = "negative"  # a confirmed upstream 404, for a short TTL
    HOSTED = "hosted"  # written by clients (Gradle build cache)
