"""Protocol adapters: each turns its clients' HTTP requests into cache-layer calls.

Formats know HTTP and their protocol; they never touch SQL or files directly.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from proxy.types import Receive, Scope, Send

ASGIResponse = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Request:
    """What an adapter needs of a request; ``path`` is decoded and validated."""

    method: str
    repository: str
    path: str  # after "/{repository}/", e.g. "simple/requests/"
    headers: Mapping[str, str]  # lower-case names
    scope: Scope
    receive: Receive

    @property
    def base_path(self) -> str:
        return f"{self.scope.get('root_path', '')}/{self.repository}/"


class Adapter(Protocol):
    async def handle(self, request: Request) -> ASGIResponse: ...
